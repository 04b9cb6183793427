"""kt-kernel's CPU builds against each other and against the torch MXFP4 reference, at DeepSeek-V4-Flash's
expert dimensions (D 4096, I 2048): does the build this CPU loads (AMX on a Xeon that has it) compute the
same experts as the others?

kt-kernel picks its build at import (AMX, AVX-512 flavours, AVX2; `KT_KERNEL_CPU_VARIANT` overrides), so each
`--variants` entry runs in its own process on the same seeded experts and routes (random MXFP4 codes,
`bench_cpu_experts.random_experts`; top-6 over `--experts`) and hands its outputs back in a file. This
process then compares every build with the first one named (bitwise, relative L2, elements that differ) and
with `kt_check.kt_reference` (the start-up check's oracle: what `--moe-backend hybrid` refuses a build
against, past `kt_check.MAX_RELATIVE_ERROR`). A build this CPU cannot run fails its own row, not the run.
No timing.

    PYTHONPATH=/tmp/ktsite python bench/kt_builds.py [--variants amx avx512_bf16 avx2] [--tokens 1 2 4 16]
        [--experts 16] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: `bench.*`
from bench.bench_cpu_experts import LIMIT, TOPK, D, I, random_experts, routing
from bench.report import format_table
from dsv4serve.experts.kt_backend import KtGeometry, KtThreads, kt_kernel_available
from dsv4serve.experts.kt_check import MAX_RELATIVE_ERROR, kt_reference, relative_error

SEED = 5


def inputs(tokens: list[int], n_experts: int) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The same routes in every process: token count -> (x, ids, weights)."""
    g = torch.Generator().manual_seed(SEED)
    return {n: routing(n, n_experts, g) for n in tokens}


def child(out: Path, tokens: list[int], n_experts: int) -> None:
    """Runs in a process whose KT_KERNEL_CPU_VARIANT is set: this build's outputs, saved to `out`."""
    from dsv4serve.experts.kt_experts import KtExperts

    g = KtGeometry(n_experts=n_experts, topk=TOPK, dim=D, inter_dim=I, swiglu_limit=LIMIT)
    kt = KtExperts({0: random_experts(n_experts, SEED)}, g, KtThreads((0,), (1,)), max_tokens=max(tokens))
    got = {n: kt.forward(0, x, ids, w) for n, (x, ids, w) in inputs(tokens, n_experts).items()}
    torch.save({"variant": kt.variant, "out": got}, out)


def run_build(variant: str, tokens: list[int], n_experts: int, tmp: Path) -> dict | str:
    """One build's outputs, or why it did not run."""
    out = tmp / f"{variant}.pt"
    cmd = [sys.executable, __file__, "--child", str(out), "--tokens", *map(str, tokens), "--experts", str(n_experts)]
    env = dict(os.environ, KT_KERNEL_CPU_VARIANT=variant)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0 or not out.exists():
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return f"failed (exit {done.returncode}): {tail[0][:120]}"
    saved = torch.load(out)
    if saved["variant"] != variant:  # kt-kernel ignored the override (unknown name): say so, do not compare
        return f"asked for {variant}, kt-kernel loaded {saved['variant']}"
    return saved["out"]


def compare(got: torch.Tensor, want: torch.Tensor) -> dict:
    d = got.float() - want.float()
    return {
        "equal": bool(torch.equal(got, want)),
        "relative_l2": relative_error(got, want),
        "differing": int((d != 0).sum()),
        "elements": d.numel(),
        "max_abs": float(d.abs().max()),
        "scale": float(want.float().abs().max()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=["amx", "avx512_bf16", "avx2"])
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 2, 4, 16])
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.child:
        return child(opts.child, opts.tokens, opts.experts)
    ok, why = kt_kernel_available()
    if not ok:
        sys.exit(f"kt-kernel is not importable: {why}")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        builds = {v: run_build(v, opts.tokens, opts.experts, Path(tmp)) for v in opts.variants}
    parts = random_experts(opts.experts, SEED)
    routes = inputs(opts.tokens, opts.experts)
    refs = {n: kt_reference(x, ids, w, parts, LIMIT) for n, (x, ids, w) in routes.items()}
    first = opts.variants[0]
    results, rows = {}, []
    for v, out in builds.items():
        if isinstance(out, str):
            results[v] = out
            rows.append([v, "-", out, "", ""])
            continue
        results[v] = {}
        for n in opts.tokens:
            vs_ref = compare(out[n], refs[n])
            vs_first = compare(out[n], builds[first][n]) if not isinstance(builds[first], str) else None
            results[v][n] = {"vs_reference": vs_ref, f"vs_{first}": vs_first}
            rows.append(
                [
                    v,
                    str(n),
                    f"{vs_ref['relative_l2']:.2e} ({vs_ref['differing']}/{vs_ref['elements']} differ, "
                    f"max {vs_ref['max_abs']:.3g} at scale {vs_ref['scale']:.3g})",
                    "-" if vs_first is None else ("equal" if vs_first["equal"] else f"{vs_first['relative_l2']:.2e}"),
                    "yes" if vs_ref["relative_l2"] <= MAX_RELATIVE_ERROR else "NO",
                ]
            )
    if opts.json:
        opts.json.write_text(json.dumps({"experts": opts.experts, "tokens": opts.tokens, "builds": results}, indent=2))
    print(
        f"kt-kernel builds at D {D}, I {I}, top-{TOPK} of {opts.experts} random MXFP4 experts, one thread; "
        f"relative L2 against kt_check.kt_reference and against the {first} build"
    )
    print(
        format_table(
            ["build", "tokens", "vs torch reference", f"vs {first}", f"within start-up bound {MAX_RELATIVE_ERROR:.3g}"],
            rows,
        )
    )


if __name__ == "__main__":
    main()
