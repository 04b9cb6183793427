"""No timing: what the GPU must issue in the routed experts' MXFP4 decode GEMMs, read from their machine code.

The decode GEMMs (kernels/dsv4_kernels/fp4_moe.py) read ~13 MB of weights per expert, and on one H200 a batch-1
call took 2-9x longer than its bytes need (bench/RESULTS.md, the second GPU session). This builds each K-loop
form as the decode launches it (the registry's compile configs, sm_90 / sm_120, on this CPU), disassembles the
cubin (cuobjdump -sass, from the triton wheel), finds the main loop (the longest backward branch's body) and
counts its instructions per warp: per weight value they are the work that does not shrink with bandwidth.

From that count, the batch-1 call's issue bound on an H200 (DeepSeek-V4-Flash: D 4096, I 2048, 6 experts; the
decode tiles and the split each config launches): warp instructions = programs x warps x loop trips x loop
instructions, over 132 SMs x 4 schedulers x 1.98 GHz. A floor, not a prediction: it assumes one instruction per
scheduler per cycle and no imbalance. The measured column is the joined form's graph-timed call on that card.

    python bench/sass_loops.py [--json PATH]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # bench.report
sys.path.insert(0, str(REPO / "kernels"))

from bench.report import format_table  # noqa: E402

D, I, EXPERTS = 4096, 2048, 6  # DeepSeek-V4-Flash's dims; one token's routed experts
H200_ISSUE = 132 * 4 * 1.98e9  # SMs x schedulers x boost clock: warp instructions a second
# graph-timed batch-1 calls of the joined form, split 2, on one H200 (bench/RESULTS.md, 2026-12-04b)
MEASURED_US = {"gate_up": 108.6, "down": 42.9}
CONFIGS = {  # (gemm, form) -> the registry's compile config (fp4_moe_configs.py)
    ("gate_up", "joined"): "gate_up_decode_split2",
    ("gate_up", "late_scale"): "gate_up_decode_late_split2",
    ("down", "joined"): "down_decode_split2",
    ("down", "late_scale"): "down_decode_late_split2",
}
ADDRESS = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);")
BRANCH = re.compile(r"\bBRA\b.*?0x([0-9a-f]+)")


def sass(config: str, arch: int) -> tuple[str, dict, dict]:
    """(the cubin's SASS, the config's constexprs, its launch options), built here without the interpreter."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from dsv4_kernels.registry import KERNELS_BY_NAME

    spec = KERNELS_BY_NAME["fp4_moe_gemm"]
    signature, constexprs = {c: (s, cx) for c, s, cx in spec.load_compile_configs()}[config]
    options = spec.launch_options(config, arch)
    source = ASTSource(fn=spec.load_kernel(), signature=signature, constexprs=constexprs,
                       attrs=spec.compile_attrs(signature))  # fmt: skip
    built = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(built.asm["cubin"])
        cubin.flush()
        text = subprocess.run([str(cuobjdump), "-sass", cubin.name], capture_output=True, text=True, check=True)
    return text.stdout, dict(constexprs), dict(options)


def main_loop(text: str) -> collections.Counter:
    """Opcode counts of the longest loop body (the K loop): from a backward branch's target to the branch."""
    code = [(int(m.group(1), 16), m.group(2).strip()) for m in map(ADDRESS.match, text.splitlines()) if m]
    best: list[str] = []
    for at, ins in code:
        hit = BRANCH.search(ins)
        if hit and int(hit.group(1), 16) < at:
            body = [i for a, i in code if int(hit.group(1), 16) <= a <= at]
            best = max(best, body, key=len)
    return collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", i).split()[0].split(".")[0] for i in best)


def census(gemm: str, form: str, arch: int) -> dict:
    text, cx, options = sass(CONFIGS[gemm, form], arch)
    ops = main_loop(text)
    n_out, k = (I, D) if gemm == "gate_up" else (D, I)
    warps = options["num_warps"]
    per_trip = cx["BLOCK_N"] * cx["BLOCK_K"] * (2 if gemm == "gate_up" else 1)  # weight values a loop trip
    loop = sum(ops.values())
    programs = EXPERTS * (n_out // cx["BLOCK_N"]) * cx["SPLIT_K"]
    trips = k // cx["BLOCK_K"] // cx["SPLIT_K"]
    floor_us = programs * warps * trips * loop / H200_ISSUE * 1e6
    return {
        "gemm": gemm,
        "form": form,
        "arch": f"sm_{arch}",
        "warps": warps,
        "loop_instructions": loop,
        "per_weight": loop * 32 * warps / per_trip,  # a warp's instructions x its 32 threads / the values
        "top_ops": dict(ops.most_common(6)),
        "h200_issue_floor_us": floor_us if arch == 90 else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the rows here")
    opts = parser.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)  # (set before import, it makes @triton.jit uncompilable)
    rows = [census(g, f, arch) for arch in (90, 120) for g in ("gate_up", "down") for f in ("joined", "late_scale")]
    table = []
    for r in rows:
        floor = r["h200_issue_floor_us"]
        measured = MEASURED_US[r["gemm"]] if r["form"] == "joined" and r["arch"] == "sm_90" else None
        table.append({
            "GEMM": r["gemm"], "form": r["form"], "arch": r["arch"], "warps": str(r["warps"]),
            "loop instr / warp": str(r["loop_instructions"]), "instr / weight": f"{r['per_weight']:.1f}",
            "H200 issue floor us": "" if floor is None else f"{floor:.1f}",
            "H200 measured us": "" if measured is None else f"{measured:.1f}",
            "most issued": ", ".join(f"{k} {v}" for k, v in r["top_ops"].items()),
        })  # fmt: skip
    print(format_table(list(table[0]), [list(row.values()) for row in table]))
    for arch in ("sm_90", "sm_120"):
        for gemm in ("gate_up", "down"):
            joined, late = (next(r for r in rows if (r["arch"], r["gemm"], r["form"]) == (arch, gemm, f))
                            for f in ("joined", "late_scale"))  # fmt: skip
            print(f"{arch} {gemm}: late_scale issues {late['loop_instructions'] / joined['loop_instructions']:.2f}x "
                  "the joined form's loop instructions per weight")  # fmt: skip
    if opts.json:
        opts.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
