"""The fp32 output head on the CPU's torch path: a bf16 copy through compiled kernels for a checkpoint's head,
oneDNN's blocked weight for a head that is not exact in bf16, MKL where neither serves.

The head [vocab, dim] is the largest product of a CPU decode step (dsv4-tiny: 129,280 x 128 fp32, 66 MB).
A checkpoint's head is exact in bf16: it gets a bf16 copy (half the bytes) that every batch size streams through
model/head_bf16_cpu.py's kernels (from bf16 rows of y: one row 0.9 ms against MKL's 2.7, sixteen 2.4-3.5 ms
against oneDNN's 5.2-6.1; bench/bench_cpu_head.py), and no other copy: the blocked one below is built only without it.

Otherwise: one row is memory-bound, and MKL's sgemm on the K-major weight (`Linear.hold_k_major`) streams it
fastest (~2.8 ms, one thread). From a few rows on the product is compute-bound, and there MKL's sgemm on that
layout runs far below the core's peak (16 rows: 12.5 ms) while oneDNN's matmul on a weight reordered once into
its blocked layout runs 7.6 ms (64 rows: 32.3 -> 22.6). oneDNN's one- and two-row forms are slower than its
four-row one (4.4 / 5.6 against 4.0 ms), so two or three rows are padded to four. The oneDNN calls
(`torch.ops.mkldnn._reorder_linear_weight` / `_linear_pointwise`, what inductor's CPU freezing pass emits) are
internal API of the pinned torch (pyproject), so `build` probes them once against MKL's product and leaves them
out when they are missing or disagree. Under batch invariance only the bf16 copy serves (its rows are summed each
alone, in one order): without it the caller runs MKL a row at a time.

`build` probes the bf16 copy against MKL too (fp32 and bf16 rows) and leaves it out (logged) when it disagrees
or cannot compile."""

from __future__ import annotations

import logging

import numpy as np
import torch
import torch.nn.functional as F

from dsv4serve.model import head_bf16_cpu

log = logging.getLogger(__name__)

MIN_ONEDNN_ROWS = 2  # fewer rows take MKL on the K-major weight (bench_cpu_head: 2.8 ms against 4.4)
PAD_ROWS = 4  # two or three rows are padded to four: oneDNN's four-row form is its fastest small one
PACK_ROWS_HINT = 8  # the batch size oneDNN's reorder picks its blocking for (2 / 8 / 64 within 5% here)
PROBE_ROWS = 5  # the start-up probe: past PAD_ROWS, so it runs the blocked kernel unpadded
PROBE_RTOL = 1e-4  # fp32 sums over dim in another order: ~1e-6 relative; a wrong layout is off by O(1)


def onednn_available() -> bool:
    ops = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


class CpuHead:
    """logits = y @ weight^T in fp32 for y [M, dim]: the bf16 copy (`packed`) for every M when built; without it
    `weight` as given (K-major, MKL) below MIN_ONEDNN_ROWS rows and the blocked copy from there, when built.
    `source` is the weight it was built from: a caller checks it is still the head's before using it (a reload
    replaces the parameter)."""

    def __init__(self, source: torch.Tensor, blocked: torch.Tensor | None, packed: np.ndarray | None = None):
        self.source = source
        self._blocked = blocked
        self._packed = packed

    @classmethod
    def build(cls, weight: torch.Tensor) -> CpuHead | None:
        """The blocked copy of an fp32 CPU weight [vocab, dim] and, when its values are bf16, the bf16 copy, each
        checked against MKL on random rows; None (with the reasons logged) when neither serves."""
        if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
            return None
        with torch.inference_mode(False), torch.no_grad():
            packed = _bf16_copy(weight.detach())
            blocked = _blocked_copy(weight.detach()) if packed is None else None
        if blocked is None and packed is None:
            return None
        if blocked is not None:
            log.info(
                "head: batches of %d+ rows through oneDNN's blocked copy of the fp32 head (%.1f MiB more host memory)",
                MIN_ONEDNN_ROWS,
                weight.numel() * weight.element_size() / 2**20,
            )
        return cls(weight, blocked, packed)

    @property
    def batch_invariant(self) -> bool:
        """Whether a row's logits are the same whatever rows share its call: the bf16 copy's (head_bf16_ir.py)."""
        return self._packed is not None

    def __call__(self, y: torch.Tensor) -> torch.Tensor:
        """y [M, dim] fp32 or bf16 -> [M, vocab] fp32 (a bf16 y's values exactly)."""
        rows = y.shape[0]
        if self._packed is not None and rows >= 1:
            return head_bf16_cpu.logits(y, self._packed, self.source.shape[0])
        y = y.float()
        if rows < MIN_ONEDNN_ROWS or self._blocked is None:
            return F.linear(y, self.source)
        if rows >= PAD_ROWS:
            return _onednn(y, self._blocked)
        padded = y.new_zeros(PAD_ROWS, y.shape[1])
        padded[:rows] = y
        return _onednn(padded, self._blocked)[:rows]


def _onednn(y: torch.Tensor, blocked: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(y.contiguous(), blocked, None, "none", [], "")


def _agrees(got: torch.Tensor, want: torch.Tensor) -> tuple[bool, float, float]:
    err = float((got - want).abs().max())
    bound = PROBE_RTOL * float(want.abs().max())
    return err <= bound, err, bound


def _probe(weight: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(rows))


def _blocked_copy(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked copy, checked against MKL on PROBE_ROWS rows; None when it cannot serve (logged)."""
    if not onednn_available():
        log.info("head: oneDNN's blocked matmul is not in this torch build; MKL runs batches of rows")
        return None
    try:
        blocked = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT)
        probe = _probe(weight, PROBE_ROWS)
        ok, err, bound = _agrees(_onednn(probe, blocked), F.linear(probe, weight))
    except RuntimeError as exc:  # an op this build's oneDNN cannot run for the shape
        log.warning("head: oneDNN's blocked matmul failed its probe (%s); MKL runs batches of rows", exc)
        return None
    if not ok:
        log.warning("head: oneDNN's product is off MKL's by %.3g (bound %.3g); MKL runs batches of rows", err, bound)
        return None
    return blocked


def _bf16_copy(weight: torch.Tensor) -> np.ndarray | None:
    """The bf16 copy of a head whose values are bf16, checked against MKL on fp32 and bf16 rows (one, and a tile
    and a rest); None when the values are not bf16 or the kernels disagree or fail (logged)."""
    if not head_bf16_cpu.exact_in_bf16(weight) or weight.shape[1] % 2:
        log.info("head: the fp32 head is not exact in bf16 (not a checkpoint's?) or has an odd dim; no bf16 copy")
        return None
    packed = head_bf16_cpu.pack(weight)
    try:
        fma_rows, dot_rows = head_bf16_cpu.FMA_TILE + 1, head_bf16_cpu.DOT_TILE + 1  # a whole tile and a rest
        for rows, dtype in (
            (1, torch.float32),
            (fma_rows, torch.float32),
            (1, torch.bfloat16),
            (dot_rows, torch.bfloat16),
        ):
            probe = _probe(weight, rows).to(dtype)
            got = head_bf16_cpu.logits(probe, packed, weight.shape[0])
            ok, err, bound = _agrees(got, F.linear(probe.float(), weight))
            if not ok:
                log.warning("head: the bf16 copy's product is off MKL's by %.3g (bound %.3g); not used", err, bound)
                return None
    except Exception as exc:  # llvmlite failing to compile on this machine: the fp32 paths serve
        log.warning("head: the bf16 copy's kernels failed (%s: %s); not used", type(exc).__name__, exc)
        return None
    log.info("head: every batch through a bf16 copy of the head (%.1f MiB more host memory)", packed.nbytes / 2**20)
    return packed
