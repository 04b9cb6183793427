"""The CPU torch path's per-layer glue at decode sizes, old form against new, side by side, bit for bit.

Seven pieces a dsv4-tiny decode step runs once or several times a layer, each timed in both forms in alternation on one
torch thread (microseconds per call, median), with the largest difference of their outputs (0: bit for bit):
- mHC's Sinkhorn rounds ([rows, 4, 4] fp32, 20 iterations; 2 sites a layer): what the CPU ran before (the same
  rounds as ~120 numpy calls up to 32 rows, `numpy_rounds` below as it was in model/hc.py; torch's ~120 tiny ops,
  `hc.sinkhorn_rounds`, the reference, beyond) against one call of the numba-compiled loops
  (`model/sinkhorn_cpu.py`);
- mHC's gates and stream mix after the mixes (hc_pre: 2 sites a layer; [rows, 24] mixes, [rows, 4, 128] bf16
  streams): its torch ops, the Sinkhorn rounds compiled in both (`hc.hc_pre`'s path with `hc_cpu` off) against the
  one numba-compiled call (`model/hc_cpu.py`);
- RoPE on a [rows, heads, 128] tensor's last 64 channels (~5 a layer: q, kv, the inverse on the output, the
  indexer's q, the compressors' entries): the pairwise form (`dsv4_kernels.token_ops_ref.apply_rope_ref`, what
  `model/rope.apply_rope` was) against `Rotation.apply`, per-channel tables made once a layer (`rope.rotate`);
- the 128-point Hadamard transform of the QAT simulation (the indexer's queries and its compressor's entries,
  ~7 a step with numerics on) on [rows, heads, 128] bf16: its torch butterflies
  (`dsv4_kernels.token_ops_ref.hadamard_ref`, what `numerics.hadamard` ran) against `numerics.hadamard` now
  (numba-compiled, `model/hadamard_cpu.py`);
- the FP8 activation simulation (numerics.fp8_quant_dequant, before every FP8 / FP4 projection and on the KV's nope
  dims, ~25 a step) on [rows, 128] bf16: its torch ops (`numerics.fp8_quant_dequant_torch`) against the one
  numba-compiled call (`model/fp8_cpu.py`);
- a layer's routed experts (`MoE._routed_torch`, 8 experts, top-2, MXFP4-valued weights, the FP8 simulation on, no
  batch invariance: the server's CPU default): its torch ops (the per-expert loop, or the stacks' padded `bmm`
  where most experts are busy) against the one numba-compiled call (`model/moe_cpu.py`);
- a CSA compressor's decode update up to its pooled windows (ratio 4, overlapping, d = 128; 5 compressors a step:
  CSA's and its indexer's, HCA's): its torch ops (`Compressor._carry_pool_torch`) against the one numba-compiled
  call (`model/compressor_cpu.py`), from the same carry.

    python bench/bench_cpu_glue.py [--rows 1 16 64] [--repeats 400] [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: `bench.report`
from bench.report import format_table
from dsv4_kernels.token_ops_ref import apply_rope_ref, hadamard_ref
from dsv4serve.model import compressor_cpu, hc_cpu, moe_cpu, sinkhorn_cpu
from dsv4serve.model.args import args_from_dicts
from dsv4serve.model.compressor import Compressor
from dsv4serve.model.hc import hc_pre, sinkhorn_rounds
from dsv4serve.model.kv_pool import CompressedCache
from dsv4serve.model.moe import MoE
from dsv4serve.model.numerics import (
    ACT_BLOCK,
    NUMERICS_ON,
    act_quant,
    fp4_quant_dequant,
    fp8_quant_dequant,
    fp8_quant_dequant_torch,
    hadamard,
)
from dsv4serve.model.rope import Rotation, rope_cos_sin
from dsv4serve.tiny.spec import TINY_CONFIG, inference_config

ITERS, EPS, HEADS, HEAD_DIM, ROPE_DIM = 20, 1e-6, 4, 128, 64  # dsv4-tiny's
NUMPY_ROWS_MAX = 32  # the most rows the numpy rounds took before
CARRY = ("pending_kv", "pending_score", "prev_kv", "prev_score")  # what a compressor's decode update writes


def numpy_rounds(comb: np.ndarray, n_iters: int, eps: float) -> None:
    """The rounds as model/hc.py ran them on the CPU before the compiled ones: in place on [N, 4, 4] float32."""
    e = np.float32(eps)
    rows = np.empty(comb.shape[:-1] + (1,), np.float32)
    cols = np.empty(comb.shape[:-2] + (1, comb.shape[-1]), np.float32)
    np.add.reduce(comb, axis=-2, keepdims=True, out=cols)
    np.divide(comb, np.add(cols, e, out=cols), out=comb)
    for _ in range(n_iters - 1):
        np.add.reduce(comb, axis=-1, keepdims=True, out=rows)
        np.divide(comb, np.add(rows, e, out=rows), out=comb)
        np.add.reduce(comb, axis=-2, keepdims=True, out=cols)
        np.divide(comb, np.add(cols, e, out=cols), out=comb)


def _timed(paths: dict[str, Callable[[], torch.Tensor]], repeats: int) -> dict[str, float]:
    """Median microseconds per call of each path, the paths called in turn (load hits them alike)."""
    times: dict[str, list[float]] = {name: [] for name in paths}
    for fn in paths.values():
        fn()  # warm-up (numba's compile or cache load)
    for _ in range(repeats):
        for name, fn in paths.items():
            t0 = time.process_time()
            fn()
            times[name].append(1e6 * (time.process_time() - t0))
    return {name: statistics.median(t) for name, t in times.items()}


def _sinkhorn_paths(rows: int, gen: torch.Generator) -> dict[str, Callable[[], torch.Tensor]]:
    start = torch.softmax(torch.randn(rows, 4, 4, generator=gen) * 3, dim=-1) + EPS

    def before() -> torch.Tensor:
        comb = start.clone()
        if rows <= NUMPY_ROWS_MAX:
            numpy_rounds(comb.numpy(), ITERS, EPS)
        else:
            sinkhorn_rounds(comb, ITERS, EPS)
        return comb

    def compiled() -> torch.Tensor:
        comb = start.clone()
        sinkhorn_cpu.sinkhorn_rounds_cpu(comb.numpy(), ITERS, EPS)
        return comb

    return {"old": before, "new": compiled}


def _hc_paths(rows: int, gen: torch.Generator) -> dict[str, Callable[[], torch.Tensor]]:
    h = torch.randn(rows, 4, HEAD_DIM, generator=gen).to(torch.bfloat16)
    fn, scale, base = torch.randn(24, 4 * HEAD_DIM, generator=gen) * 0.05, torch.rand(3, generator=gen), torch.randn(24)
    compiled = hc_cpu.compiled

    def run() -> torch.Tensor:
        x, post, comb = hc_pre(h, fn, scale, base, ITERS, EPS, EPS, NUMERICS_ON)
        return torch.cat((x.float().flatten(), post.flatten(), comb.flatten()))

    def torch_ops() -> torch.Tensor:
        hc_cpu.compiled = lambda: None  # type: ignore[assignment]  # as where numba cannot compile
        try:
            return run()
        finally:
            hc_cpu.compiled = compiled  # type: ignore[assignment]

    return {"old": torch_ops, "new": run}


def _rope_paths(rows: int, gen: torch.Generator) -> dict[str, Callable[[], torch.Tensor]]:
    x = torch.randn(rows, HEADS, HEAD_DIM, generator=gen)
    cos, sin = rope_cos_sin(torch.rand(ROPE_DIM // 2, generator=gen), torch.arange(100, 100 + rows))
    rot = Rotation.from_tables(cos, sin)  # its tables made once, as a layer makes them
    return {"old": lambda: apply_rope_ref(x, cos, sin), "new": lambda: rot.apply(x)}


def _hadamard_paths(rows: int, gen: torch.Generator) -> dict[str, Callable[[], torch.Tensor]]:
    x = torch.randn(rows, HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
    return {"old": lambda: hadamard_ref(x).float(), "new": lambda: hadamard(x).float()}


def _fp8_paths(rows: int, gen: torch.Generator) -> dict[str, Callable[[], torch.Tensor]]:
    x = (torch.randn(rows, HEADS * 32, generator=gen) * 3).to(torch.bfloat16)  # dsv4-tiny's dim, 128
    return {
        "old": lambda: fp8_quant_dequant_torch(x, ACT_BLOCK).float(),
        "new": lambda: fp8_quant_dequant(x, ACT_BLOCK).float(),
    }


def _routed_paths(rows: int, gen: torch.Generator) -> dict[str, Callable[[], torch.Tensor]]:
    args = args_from_dicts(TINY_CONFIG, inference_config(TINY_CONFIG))
    num = dataclasses.replace(NUMERICS_ON, batch_invariant=False)
    moe = MoE(args.n_hash_layers, args).eval()  # a scored layer
    with torch.no_grad():
        for name, p in moe.named_parameters():
            value = torch.randn(p.shape, generator=gen) * 0.05
            p.copy_(fp4_quant_dequant(value) if name.startswith("experts.") else value)
    moe.stack_experts()  # as Transformer.use_kernels holds them (K-major stacks; compiles the loop)
    x = torch.randn(rows, args.dim, generator=gen).to(num.compute_dtype)
    with torch.inference_mode():
        weights, ids = moe.gate(x, torch.zeros(rows, dtype=torch.long), num, None)
    xq = act_quant(x, num)
    compiled = moe_cpu.compiled

    def torch_ops() -> torch.Tensor:
        moe_cpu.compiled = lambda: None  # type: ignore[assignment]  # as where numba cannot compile
        try:
            return moe._routed_torch(xq, weights, ids, num)
        finally:
            moe_cpu.compiled = compiled  # type: ignore[assignment]

    return {"old": torch_ops, "new": lambda: moe._routed_torch(xq, weights, ids, num)}


def _compressor_paths(rows: int, gen: torch.Generator) -> dict[str, Callable[[], torch.Tensor]]:
    args = args_from_dicts(TINY_CONFIG, inference_config(TINY_CONFIG))
    num = dataclasses.replace(NUMERICS_ON, batch_invariant=False)
    comp = Compressor(args, 4, HEAD_DIM, rotate=False)
    with torch.no_grad():
        comp.ape.copy_(torch.randn(comp.ape.shape, generator=gen))
    kv, gate = torch.randn(2, rows, 2 * HEAD_DIM, generator=gen)
    start = CompressedCache.empty(4, 64, HEAD_DIM, 4 * rows, rows, torch.bfloat16, torch.device("cpu"))
    for t in start.tensors():
        t.copy_(torch.randn(t.shape, generator=gen))
    pos = torch.arange(rows) * 7 + 30  # rows at different window offsets, every one past its first window
    layout = SimpleNamespace(positions64=pos, slots64=torch.arange(rows))

    def fresh() -> CompressedCache:
        return dataclasses.replace(start, **{f: getattr(start, f).clone() for f in CARRY})

    def torch_ops() -> torch.Tensor:
        return comp._carry_pool_torch(kv, gate, layout, fresh(), num)  # type: ignore[arg-type]

    def compiled() -> torch.Tensor:
        c = fresh()
        carry = (c.pending_kv, c.pending_score, c.prev_kv, c.prev_score)
        pooled = compressor_cpu.carry_and_pool(kv, gate, comp.ape, pos, layout.slots64, carry, HEAD_DIM)
        assert pooled is not None, "numba did not compile the compressor's update"
        return pooled

    return {"old": torch_ops, "new": compiled}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--repeats", type=int, default=400)
    parser.add_argument("--json", type=Path)
    opts = parser.parse_args()
    torch.set_num_threads(1)
    results: dict[str, dict[int, dict[str, float]]] = {}
    table = []
    pieces = (
        ("Sinkhorn rounds", _sinkhorn_paths),
        ("mHC gates + mix", _hc_paths),
        ("RoPE", _rope_paths),
        ("Hadamard", _hadamard_paths),
        ("FP8 simulation", _fp8_paths),
        ("routed experts", _routed_paths),
        ("compressor update", _compressor_paths),
    )
    for piece, make in pieces:
        results[piece] = {}
        for rows in opts.rows:
            paths = make(rows, torch.Generator().manual_seed(rows))
            with torch.inference_mode():
                diff = float((paths["old"]() - paths["new"]()).abs().max())
                us = _timed(paths, opts.repeats)
            results[piece][rows] = {**{f"{k}_us": v for k, v in us.items()}, "max_abs_diff": diff}
            table.append([piece, str(rows), f"{us['old']:.1f}", f"{us['new']:.1f}", f"{us['old'] / us['new']:.1f}x"])
            table[-1].append(f"{diff:.1e}")
    print(f"\nCPU, 1 thread, us per call (median of {opts.repeats}, CPU clock), old / new form in alternation")
    print(format_table(["piece", "rows", "old", "new", "speed-up", "max |diff|"], table))
    if opts.json:
        opts.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
