"""The fp32 output head on the CPU's torch path: MKL for one row, oneDNN's blocked weight for more.

The head [vocab, dim] is the largest product of a CPU decode step (dsv4-tiny: 129,280 x 128 fp32, 66 MB).
One row reads the whole weight for 2 x 129,280 x 128 FLOPs: memory-bound, and MKL's sgemm on the
K-major weight (`Linear.hold_k_major`) streams it fastest (~2.8 ms, one thread). From a few rows on the
product is compute-bound, and there MKL's sgemm on that layout runs far below the core's peak (16 rows:
12.5 ms, ~42 GFLOP/s of ~80 a square sgemm reaches here) while oneDNN's matmul on a weight reordered
once into its blocked layout runs 7.6 ms (64 rows: 32.3 -> 22.6). oneDNN's one- and two-row forms are
slower than its four-row one (4.4 / 5.6 against 4.0 ms), so two or three rows are padded to four.
Measured side by side: `python bench/bench_cpu_head.py`.

The price is a second copy of the head (the blocked one; the K-major weight stays for one row and for
every other reader). The oneDNN calls (`torch.ops.mkldnn._reorder_linear_weight` / `_linear_pointwise`,
what inductor's CPU freezing pass emits) are internal API of the pinned torch (pyproject), so `build`
probes them once against MKL's product and returns None (MKL for every row, as before) when they are
missing or disagree. Batch invariance keeps MKL (the caller runs its rows one at a time)."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

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
    """logits = y @ weight^T in fp32 for y [M, dim]: `weight` as given (K-major, MKL) below
    MIN_ONEDNN_ROWS rows, the blocked copy from there. `source` is the weight it was built from: a
    caller checks it is still the head's before using it (a reload replaces the parameter)."""

    def __init__(self, source: torch.Tensor, blocked: torch.Tensor):
        self.source = source
        self._blocked = blocked

    @classmethod
    def build(cls, weight: torch.Tensor) -> CpuHead | None:
        """The blocked copy of an fp32 CPU weight [vocab, dim], checked against MKL on PROBE_ROWS random
        rows; None (with the reason logged) when oneDNN cannot serve it."""
        if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
            return None
        if not onednn_available():
            log.info("head: oneDNN's blocked matmul is not in this torch build; MKL runs every batch")
            return None
        with torch.inference_mode(False), torch.no_grad():
            try:
                blocked = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)
                head = cls(weight, blocked)
                probe = torch.randn(PROBE_ROWS, weight.shape[1], generator=torch.Generator().manual_seed(0))
                got, want = head._onednn(probe), F.linear(probe, weight)
            except RuntimeError as exc:  # an op this build's oneDNN cannot run for the shape
                log.warning("head: oneDNN's blocked matmul failed its probe (%s); MKL runs every batch", exc)
                return None
        err = float((got - want).abs().max())
        bound = PROBE_RTOL * float(want.abs().max())
        if not err <= bound:
            log.warning("head: oneDNN's product is off MKL's by %.3g (bound %.3g); MKL runs every batch", err, bound)
            return None
        log.info(
            "head: batches of %d+ rows through oneDNN's blocked copy of the fp32 head (%.1f MiB more host memory)",
            MIN_ONEDNN_ROWS,
            weight.numel() * weight.element_size() / 2**20,
        )
        return head

    def __call__(self, y: torch.Tensor) -> torch.Tensor:
        """y [M, dim] fp32 -> [M, vocab] fp32."""
        rows = y.shape[0]
        if rows < MIN_ONEDNN_ROWS:
            return F.linear(y, self.source)
        if rows >= PAD_ROWS:
            return self._onednn(y)
        padded = y.new_zeros(PAD_ROWS, y.shape[1])
        padded[:rows] = y
        return self._onednn(padded)[:rows]

    def _onednn(self, y: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(y.contiguous(), self._blocked, None, "none", [], "")
