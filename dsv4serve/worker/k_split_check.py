"""The start-up check of the kernels' K splits and tuned K-loop forms, on the device, before the weights load.

kernel_check.py runs every kernel on the tiny model, whose K of 128 is one block: every launch there is the
unsplit built-in form. The decode launches of a real model take other code paths: K split over programs in one
launch (fp8_gemm, fp8_swiglu and head_logits by their rules or the card's tuning file; fp4_moe's tuned split),
the last program adding the parts (split_k.py), and fp4_moe's late-scale loop. Each runs here at a small shape
with 4 K blocks on exact inputs (integer activations, weights on a coarse grid: every product and every partial
sum is exact in fp32, so the order of the sums is moot) in each form and unsplit, and must give the same bits.

A failure switches the splits and tuned loop forms off for this process (`split_k.allow_k_splits(False)`): every
launch then takes the unsplit built-in form the tiny model's check covers, slower but right; the worker logs
which form failed and why. Nothing here stops the start.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from dsv4serve.worker.kernel_check import Verdict

if TYPE_CHECKING:
    from dsv4_kernels.fp4_moe import LoopForm

log = logging.getLogger(__name__)

K = 512  # 4 blocks of 128: split 4 gives each program one
N = 256
ROWS = 3


def _ints(rows: int, cols: int, gen: torch.Generator, device: torch.device, high: int = 8) -> torch.Tensor:
    return torch.randint(-high, high + 1, (rows, cols), generator=gen).float().to(device)


def _fp8_weight(rows: int, gen: torch.Generator, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    from dsv4_kernels.formats import quant_fp8_block

    return quant_fp8_block(_ints(rows, K, gen, device) * 2.0**-5)  # integers x 2^-5: e4m3 values, exact


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t  # e4m3 outputs compared as bytes


def _same(*pairs: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return all(torch.equal(_bits(a), _bits(b)) for a, b in pairs)


def _fp8_gemm(device: torch.device, gen: torch.Generator) -> Callable[[int], tuple[torch.Tensor, ...]]:
    from dsv4_kernels.fp8_gemm import fp8_linear

    x, (w, s) = _ints(ROWS, K, gen, device).bfloat16(), _fp8_weight(N, gen, device)
    return lambda split: (fp8_linear(x, w, s, split_k=split),)


def _fp8_swiglu(device: torch.device, gen: torch.Generator) -> Callable[[int], tuple[torch.Tensor, ...]]:
    from dsv4_kernels.fp8_swiglu import fp8_swiglu

    x = _ints(ROWS, K, gen, device).bfloat16()
    (w1, s1), (w3, s3) = _fp8_weight(N, gen, device), _fp8_weight(N, gen, device)
    return lambda split: fp8_swiglu(x, w1, s1, w3, s3, 10.0, split_k=split)


def _head_logits(device: torch.device, gen: torch.Generator) -> Callable[[int], tuple[torch.Tensor, ...]]:
    from dsv4_kernels.head_logits import Tail, head_logits

    y, w = _ints(ROWS, K, gen, device), (_ints(N, K, gen, device) * 2.0**-5).bfloat16()
    tail = Tail(N // 2, 0.125, round_bf16=True)  # the CSA indexer's head weights under its compressor's rows
    return lambda split: (head_logits(y, w, split_k=split), head_logits(y, w, split_k=split, tail=tail))


def _fp4_moe(device: torch.device, gen: torch.Generator) -> Callable[[LoopForm], tuple[torch.Tensor, ...]]:
    """Both decode GEMMs of 3 tokens x top-2 of 4 experts, each over K = 512 (gate / up 512 -> 256, down 512 ->
    256 on its own stored input). gate / up: integer activations, which the kernel quantizes at block scale 2^-5
    to e4m3 integers x 32; down: e4m3 integers x 32 at scale 2^-5. Weights: random e2m1 codes at scale 2^-4
    (gate stays well inside exp's range). Every product is a multiple of 2^-1 x 2^-4 and every sum stays below
    2^24 of those: exact."""
    from dsv4_kernels.fp4_moe import fp4_moe_gemm
    from dsv4_kernels.moe_align import moe_align

    experts, topk = 4, 2

    def weight(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        packed = torch.randint(0, 256, (experts, rows, K // 2), generator=gen, dtype=torch.int64).to(torch.uint8)
        return packed.to(device), torch.full((experts, rows, K // 32), 123, dtype=torch.uint8, device=device)

    (w1, s1), (w3, s3), (w2, s2) = weight(N), weight(N), weight(N)
    x = _ints(ROWS, K, gen, device).bfloat16()
    ids = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(ROWS)]).to(device)
    sorted_ids, expert_ids = moe_align(ids, experts, 16)
    routes = ROWS * topk
    ones = torch.ones(routes, dtype=torch.float32, device=device)
    a_q = (_ints(routes, K, gen, device) * 32.0).to(torch.float8_e4m3fn)
    a_s = torch.full((routes, K // 128), 2.0**-5, dtype=torch.float32, device=device)

    def run(loop: LoopForm) -> tuple[torch.Tensor, ...]:
        act_q, act_s = fp4_moe_gemm(
            x, None, w1, s1, sorted_ids, expert_ids, routes, topk, w3=w3, w3_scale=s3, topk_weights=ones,
            limit=10.0, block_m=16, block_n=128, block_k=64, quant_out=True, loop=loop,
        )  # fmt: skip
        y = fp4_moe_gemm(a_q, a_s, w2, s2, sorted_ids, expert_ids, routes, 1, block_m=16, block_k=128, loop=loop)
        assert isinstance(y, torch.Tensor)  # the down GEMM (no quant_out) returns one tensor
        return act_q, act_s, y

    return run


KERNELS = ("fp8_gemm", "fp8_swiglu", "head_logits", "fp4_moe")


def check_k_splits(device: torch.device, kernels: tuple[str, ...] = KERNELS) -> list[Verdict]:
    """Each split form of `kernels` against its kernel's unsplit launch (module doc); one Verdict per form."""
    from dsv4_kernels.fp4_moe import LoopForm
    from dsv4_kernels.split_k import split_counters

    gen = torch.Generator().manual_seed(11)
    forms: list[tuple[str, Callable[[Any], tuple[torch.Tensor, ...]], Any, Any]] = []
    for name, build in (("fp8_gemm", _fp8_gemm), ("fp8_swiglu", _fp8_swiglu), ("head_logits", _head_logits)):
        if name in kernels:
            forms.append((f"{name} split 4", build(device, gen), 4, 1))  # one split each: the same code for any
    if "fp4_moe" in kernels:
        fp4 = _fp4_moe(device, gen)
        for loop in (LoopForm(split_k=2), LoopForm(late_scale=True), LoopForm(split_k=2, late_scale=True)):
            forms.append((f"fp4_moe {loop.name}", fp4, loop, LoopForm()))
    verdicts = []
    for label, run, form, plain in forms:
        try:
            same = _same(*zip(run(form), run(plain)))
            detail = "the unsplit launch's bits" if same else "differs from the unsplit launch on exact sums"
        except Exception as exc:  # a compile or launch error: the form is not usable here
            same, detail = False, f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
        verdicts.append(Verdict(label, same, detail))
    if int(split_counters(1, device).abs().sum()):
        verdicts.append(Verdict("split counters", False, "left non-zero after the launches"))
    return verdicts


def check_and_apply(device: torch.device) -> bool:
    """Run the check; on any failure switch the K splits and tuned forms off (logged). True when all passed."""
    from dsv4_kernels.split_k import allow_k_splits

    verdicts = check_k_splits(device)
    failed = [v for v in verdicts if not v.ok]
    for v in failed:
        log.warning("K-split check %s: FAILED (%s)", v.kernel, v.detail)
    if failed:
        allow_k_splits(False)
        log.warning("K splits and tuned K-loop forms are off for this worker: every launch takes its unsplit form")
    else:
        log.info("K-split check: %d forms give the unsplit launches' bits", len(verdicts))
    return not failed
