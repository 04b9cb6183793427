"""Build every launched kernel configuration for the GPUs we ship to, on this CPU, and report what
the compiler made of it: the tensor-core instructions in the PTX and the cubin's registers, spill
stack and shared memory. tests/kernels/test_compile.py holds the builds to their limits; this module
also prints the table (`python -m dsv4_kernels.build_report`).

A build is (kernel, config, arch), exactly as the wrapper launches it (registry.KernelSpec:
launch_options, compile_attrs). Builds run in child processes without TRITON_INTERPRET (under the
interpreter @triton.jit yields functions that cannot be compiled); ptxas and cuobjdump ship in the
triton wheel (triton/backends/nvidia/bin).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator, Mapping

MMA = re.compile(r"\b(wgmma\.mma_async\.sync\.aligned\.\w+\.\w+\.\w+\.\w+|mma\.sync\.aligned\.[\w.]+)")
RES_USAGE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")
Build = tuple[str, str, int]  # (kernel, config, arch)


def launched_builds() -> Iterator[Build]:
    """Every (kernel, config, arch) some wrapper launches."""
    from dsv4_kernels.registry import ARCHS, KERNELS

    for spec in KERNELS:
        for config, _, _ in spec.load_compile_configs():
            for arch in ARCHS:
                if spec.launch_options(config, arch) is not None:
                    yield spec.name, config, arch


def build_key(build: Build) -> str:
    return "|".join(map(str, build))


def _build_in_this_process(keys: list[str]) -> dict:
    """Build each "kernel|config|arch" here (TRITON_INTERPRET unset); a failure is reported per build."""
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from dsv4_kernels.registry import KERNELS_BY_NAME

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    results = {}
    for key in keys:
        name, config, arch = key.split("|")
        spec = KERNELS_BY_NAME[name]
        signature, constexprs = {c: (sig, cx) for c, sig, cx in spec.load_compile_configs()}[config]
        try:
            source = ASTSource(
                fn=spec.load_kernel(), signature=signature, constexprs=constexprs, attrs=spec.compile_attrs(signature)
            )
            built = triton.compile(
                source, target=GPUTarget("cuda", int(arch), 32), options=spec.launch_options(config, int(arch))
            )
            ptx = built.asm["ptx"]
            with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
                cubin.write(built.asm["cubin"])
                cubin.flush()
                usage = subprocess.run([cuobjdump, "-res-usage", cubin.name], capture_output=True, text=True)
            res_usage = RES_USAGE.search(usage.stdout)
            target = re.search(r"\.target\s+(\w+)", ptx)
            if res_usage is None or target is None:  # reported as this build's error, like any other failure
                raise RuntimeError(f"no resource usage or .target: {usage.stdout[:200]!r} {usage.stderr[:200]!r}")
            regs, stack, _, _ = map(int, res_usage.groups())
            results[key] = {
                "mma": sorted(set(MMA.findall(ptx))),
                "cubin_bytes": len(built.asm["cubin"]),
                "target": target.group(1),
                "shared": built.metadata.shared,
                "regs": regs,
                "stack": stack,
            }
        except Exception as exc:
            results[key] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
    return results


def build_all(builds: list[Build], workers: int = 2, cost: Mapping[Build, float] | None = None) -> dict:
    """Build in `workers` child processes, jobs dealt longest first by `cost` (seconds; default 3):
    {"kernel|config|arch": {"mma", "cubin_bytes", "target", "shared", "regs", "stack"} or {"error"}}.
    A cold build of everything takes about a minute on one core; the Triton cache makes reruns quick."""
    cost = cost or {}
    shares: list[list[str]] = [[] for _ in range(workers)]
    loads = [0.0] * workers
    for build in sorted(builds, key=lambda b: -cost.get(b, 3)):
        child = loads.index(min(loads))
        shares[child].append(build_key(build))
        loads[child] += cost.get(build, 3)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "dsv4_kernels.build_report", "--child", json.dumps(share)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for share in shares
        if share
    ]
    results = {}
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"kernel build process failed:\n{err[-4000:]}")
        results.update(json.loads(out.strip().splitlines()[-1]))
    return results


def table(results: dict) -> str:
    """A markdown table, one row a build."""
    rows = [
        "| kernel | config | arch | regs | stack B | shared B | tensor-core instructions |",
        "| --- | --- | --- | ---: | ---: | ---: | --- |",
    ]
    for key in sorted(results, key=lambda k: (k.split("|")[0], int(k.split("|")[2]), k.split("|")[1])):
        name, config, arch = key.split("|")
        r = results[key]
        if "error" in r:
            rows.append(f"| {name} | {config} | sm_{arch} | | | | error: {r['error'][:80]} |")
            continue
        mma = ", ".join(m.split(".sync.aligned.")[-1] for m in r["mma"]) or "none"
        rows.append(f"| {name} | {config} | sm_{arch} | {r['regs']} | {r['stack']} | {r['shared']:,} | {mma} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help="print the raw results as JSON")
    args = parser.parse_args(argv)
    if args.child is not None:
        print(json.dumps(_build_in_this_process(json.loads(args.child))))
        return 0
    results = build_all(list(launched_builds()))
    print(json.dumps(results, indent=1) if args.json else table(results))
    return int(any("error" in r for r in results.values()))


if __name__ == "__main__":
    sys.exit(main())
