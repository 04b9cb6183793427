"""`dsv4serve doctor`: the CPU-side backends. The optional CPU expert backend (kt-kernel, --moe-backend hybrid):
installed or not (and how to install it), its version against the one checked here, the CPU build it loads
(AVX2, AVX-512 or AMX, from this CPU's flags), and the threads and NUMA nodes the worker would give it. The
CPU torch path's compiled loops (numba: mHC's Sinkhorn rounds, the Hadamard transform, ...; llvmlite: the head's
bf16 copy): whether they compile here.
"""

from __future__ import annotations

import sys

from dsv4serve.doctor_check import Check
from dsv4serve.experts.kt_backend import KT_VERSION, kt_kernel_available, kt_threads, kt_version

WHEEL_PYTHONS = ((3, 11), (3, 12))  # kt-kernel 0.7.2 ships wheels for CPython 3.11 / 3.12, glibc >= 2.35


def check_cpu_loops() -> Check:
    """The CPU torch path's compiled loops (numba's, loaded from its cache after the first time; the bf16 head's
    kernels, llvmlite's) here: without them the CPU path runs torch's Sinkhorn rounds, mHC gates, Hadamard
    butterflies, FP8 simulation, routed-expert and compressor ops and the fp32 head instead (slower)."""
    from dsv4serve.model import compressor_cpu, fp8_cpu, hadamard_cpu, hc_cpu, head_bf16_cpu, moe_cpu, sinkhorn_cpu
    from dsv4serve.model.numba_loops import failure

    reasons = []
    try:
        import numba

        version = numba.__version__
    except Exception as exc:  # a declared dependency missing or broken: report, never crash doctor
        version = None
        reasons.append(f"{type(exc).__name__}: {exc}")
    data = {
        "numba": version,
        "sinkhorn": sinkhorn_cpu.compiled() is not None,
        "hc_gates": hc_cpu.compiled() is not None,
        "hadamard": hadamard_cpu.compiled() is not None,
        "routed_experts": moe_cpu.compiled() is not None,
        "compressor": compressor_cpu.compiled() is not None,
        "fp8": fp8_cpu.compiled() is not None,
        "head_bf16": False,
    }
    try:
        head_bf16_cpu.warm_up()
        data["head_bf16"] = True
    except Exception as exc:  # llvmlite (numba's compiler) failing on this machine
        reasons.append(f"{type(exc).__name__}: {exc}")
    loops = {
        "sinkhorn": sinkhorn_cpu.WHAT,
        "hc_gates": hc_cpu.WHAT,
        "hadamard": hadamard_cpu.WHAT,
        "routed_experts": moe_cpu.WHAT,
        "compressor": compressor_cpu.WHAT,
        "fp8": fp8_cpu.WHAT,
        "head_bf16": head_bf16_cpu.WHAT,
    }
    missing = [what for key, what in loops.items() if not data[key]]
    if not missing:
        value = (
            f"numba {version}: mHC's Sinkhorn rounds and gates, the Hadamard transform, the FP8 simulation, the "
            "routed experts and the compressors' decode update compile; llvmlite compiles the bf16 head"
        )
        return Check("CPU loops", "ok", value, data=data)
    reasons += [f"{what}: {failure(what)}" for what in missing if failure(what) and what != head_bf16_cpu.WHAT]
    why = "; ".join(reasons) or "the worker's log says why"
    value = f"numba {version or 'missing'}: no compiled {', '.join(missing)}; torch's ops run instead ({why})"
    return Check("CPU loops", "warn", value, "pip install --force-reinstall numba (a dependency of dsv4serve)", data)


def check_kt_kernel() -> Check:
    ok, why = kt_kernel_available()
    threads = kt_threads()
    data = {"installed": ok, "version": kt_version(), "build": None, "threads": threads.total}
    if not ok:
        if sys.version_info[:2] not in WHEEL_PYTHONS:
            why += f"; its wheels need CPython 3.11 or 3.12 (this is {sys.version_info[0]}.{sys.version_info[1]})"
        return Check("kt-kernel", "ok", f"not installed: --moe-backend hybrid unavailable ({why})", data=data)
    try:
        from dsv4serve.experts.kt_backend import load_kt

        _, build = load_kt()
    except Exception as exc:  # an incomplete install fails in its own imports: report, never crash doctor
        return Check(
            "kt-kernel",
            "warn",
            f"{data['version']} installed but does not load: {type(exc).__name__}: {exc}",
            f"pip install --no-deps kt-kernel=={KT_VERSION} gguf",
            data,
        )
    data["build"] = build
    value = f"{data['version']} ({build} build), hybrid CPU experts on {threads.describe()}"
    if data["version"] != KT_VERSION:
        return Check("kt-kernel", "warn", value, f"the hybrid path was checked with {KT_VERSION}", data)
    return Check("kt-kernel", "ok", value, data=data)
