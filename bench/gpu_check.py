"""The one GPU check: the card's ceilings, then every case in bench/gpu_cases/, checked and timed.

1. Ceilings, measured here: a large device-to-device copy (GB/s, read + write) and a large bf16
   matmul (TFLOP/s).
2. Every module in bench/gpu_cases/ (found by listing the folder, so new modules join by being
   there) builds its cases with `cases(device)`. Each case's `run()` is checked against its
   `reference()` (|run - ref| <= atol + rtol |ref|), then `run` and `baseline` are timed (CUDA
   events; warm-up, then the median of --repeats), and turned into GB/s or TFLOP/s, % of the
   measured ceiling (the case's `bound` picks which) and the baseline's time / run's time.
3. A module that fails to import or build, or a case that raises, is a row of the table: the run
   goes on. A module may define `notes(times_ms, ceilings) -> list[str]` (projections from its
   medians); those lines print before the table. Cases past --budget-s are reported as skipped.
   A case may carry `notes() -> list[str]` (what it saw besides its time) and `max_warmup` /
   `max_repeats` (caps on its timing, for a case whose every call is costly).

`--cpu-smoke` runs the same code path on the CPU with Triton's interpreter, calling each module's
`smoke_cases(device)` (tiny shapes); it checks discovery, checking, timing and the table here
(tests/unit/test_bench_gpu_check.py runs it), and measures nothing worth keeping. The exit status is
1 when any row is not OK.

    python bench/gpu_check.py [--repeats 20] [--budget-s 420] [--only SUBSTR] [--module NAME] [--json PATH]
    python bench/gpu_check.py --cpu-smoke
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import pkgutil
import re
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

CASES_DIR = Path(__file__).resolve().parent / "gpu_cases"


@dataclass
class Row:
    """One line of the table: a case's result, or why a module or case produced none."""

    case: str
    ok: str = ""  # "OK", "FAIL (max err ...)", "ERROR: ...", "skipped: ..."
    time_ms: float | None = None
    rate: str = ""  # "1234 GB/s" or "456.7 TFLOP/s"
    pct_of_ceiling: float | None = None
    baseline: str = ""
    speedup: float | None = None  # baseline time / run time


def time_ms(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> float:
    """Median milliseconds of `fn` over `repeats` calls after `warmup` (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(samples)


def measure_ceilings(device: torch.device, warmup: int, repeats: int, smoke: bool) -> dict[str, float]:
    """{"copy_GBps": device-to-device copy (bytes read + written), "matmul_TFLOPs": bf16 n^3 matmul}."""
    nbytes = (64 if smoke else 4096) << 20
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy = time_ms(functools.partial(dst.copy_, src), device, warmup, repeats)
    n = 256 if smoke else 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    mm = time_ms(functools.partial(torch.matmul, a, b), device, warmup, repeats)
    del src, dst, a, b
    return {"copy_GBps": 2 * nbytes / copy / 1e6, "matmul_TFLOPs": 2 * n**3 / mm / 1e9}


def discover(cases_dir: Path) -> list[str]:
    """Module names in the cases folder (not starting with '_'), sorted."""
    return sorted(m.name for m in pkgutil.iter_modules([str(cases_dir)]) if not m.name.startswith("_"))


def check(out: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float) -> str:
    out, ref = out.float(), ref.float().to(out.device)
    if out.shape != ref.shape:
        return f"FAIL (shape {tuple(out.shape)} vs {tuple(ref.shape)})"
    err = (out - ref).abs()
    bad = ~(err <= atol + rtol * ref.abs())  # NaN anywhere fails too
    max_err = float(err.nan_to_num(float("inf")).max()) if err.numel() else 0.0
    return f"FAIL (max err {max_err:.3g})" if bool(bad.any()) else f"OK (max err {max_err:.2g})"


def run_case(case, device: torch.device, ceilings: dict[str, float], warmup: int, repeats: int) -> Row:
    # a case whose every call costs much device time (a decode step on shared state) caps its own timing
    warmup = min(warmup, getattr(case, "max_warmup", warmup))
    repeats = min(repeats, getattr(case, "max_repeats", repeats))
    row = Row(case.name, ok=check(case.run(), case.reference(), case.atol, case.rtol))
    row.time_ms = time_ms(case.run, device, warmup, repeats)
    seconds = row.time_ms / 1e3
    if case.bound == "compute" and case.flops:
        tflops = case.flops / seconds / 1e12
        row.rate, row.pct_of_ceiling = f"{tflops:.3g} TFLOP/s", 100 * tflops / ceilings["matmul_TFLOPs"]
    else:
        gbps = case.bytes_moved / seconds / 1e9
        row.rate, row.pct_of_ceiling = f"{gbps:.4g} GB/s", 100 * gbps / ceilings["copy_GBps"]
    if case.baseline is not None:
        row.baseline = case.baseline_name or "baseline"
        row.speedup = time_ms(case.baseline, device, warmup, repeats) / row.time_ms
    return row


def error_text(exc: BaseException) -> str:
    return f"ERROR: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:160]


def case_notes(case) -> list[str]:
    """What a case saw besides its time (host syncs, a graph capture), when it says: `case.notes()`."""
    fn = getattr(case, "notes", None)
    if fn is None:
        return []
    try:
        return list(fn())
    except Exception as exc:
        return [f"{case.name}: notes failed: {error_text(exc)}"]


def run_module(
    name: str, device: torch.device, ceilings: dict[str, float], opts, deadline: float, notes: list[str]
) -> list[Row]:
    """Rows of one module's cases; every failure becomes a row."""
    try:
        module = importlib.import_module(f"bench.gpu_cases.{name}")
        build = getattr(module, "smoke_cases" if opts.cpu_smoke else "cases", None)
        if build is None:
            return [Row(name, ok="skipped: no smoke_cases (needs CUDA)")]
        cases = build(device)
    except Exception as exc:  # a broken module is a row, never the end of the run
        traceback.print_exc()
        return [Row(name, ok=error_text(exc))]
    rows, times = [], {}
    for case in cases:
        if opts.only and not selected(opts.only, case.name):
            continue
        if time.monotonic() > deadline:
            rows.append(Row(case.name, ok="skipped: over --budget-s"))
            continue
        try:
            rows.append(run_case(case, device, ceilings, opts.warmup, opts.repeats))
            times[case.name] = rows[-1].time_ms
        except Exception as exc:
            traceback.print_exc()
            rows.append(Row(case.name, ok=error_text(exc)))
        notes += case_notes(case)
    if hasattr(module, "notes") and times:
        try:
            notes += module.notes(times, ceilings)
        except Exception as exc:
            notes.append(f"{name}: notes failed: {error_text(exc)}")
    del cases
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def format_rows(rows: list[Row]) -> str:
    headers = ["case", "time ms", "rate", "% ceiling", "vs baseline", "check"]
    body = [
        [
            r.case,
            "" if r.time_ms is None else f"{r.time_ms:.3f}",
            r.rate,
            "" if r.pct_of_ceiling is None else f"{r.pct_of_ceiling:.0f}%",
            "" if r.speedup is None else f"{r.speedup:.2f}x {r.baseline}",
            r.ok,
        ]
        for r in rows
    ]
    widths = [max(len(x[i]) for x in [headers, *body]) for i in range(len(headers))]
    lines = [
        "  ".join(c.ljust(w) if i in (0, 4, 5) else c.rjust(w) for i, (c, w) in enumerate(zip(x, widths)))
        for x in [headers, *body]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines)


def write_json(path: Path, title: str, ceilings: dict[str, float], rows: list[Row], per_module, notes) -> None:
    payload = {
        "device": title,
        "ceilings": ceilings,
        "rows": [asdict(r) for r in rows],
        "rows_per_module": per_module,
        "notes": notes,
    }
    path.write_text(json.dumps(payload, indent=2))


def selected(only: str, name: str) -> bool:
    """--only: a substring of the case name (names hold brackets: "[resident"), or a regular expression
    ("resident|hybrid")."""
    if only in name:
        return True
    try:
        return re.search(only, name) is not None
    except re.error:
        return False


def main() -> int:
    """Exit status 1 when any case is not OK (a failed check, an error or a skip)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (Triton interpreter)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=420.0, help="skip the cases that would start later")
    parser.add_argument("--only", help="run only the cases whose name contains this, or that it matches as a regex")
    parser.add_argument("--module", action="append", help="run only this module of gpu_cases/ (repeatable)")
    parser.add_argument("--json", type=Path, help="write the numbers here")
    opts = parser.parse_args()
    if opts.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
        opts.repeats, opts.warmup = min(opts.repeats, 3), 1
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        sys.exit("no CUDA device: run on a GPU machine, or pass --cpu-smoke to check the code path")
    else:
        device = torch.device("cuda")
    sys.path.insert(0, str(CASES_DIR.parents[1]))  # the repo root: cases import `bench.gpu_cases`
    deadline = time.monotonic() + opts.budget_s
    ceilings = measure_ceilings(device, opts.warmup, opts.repeats, opts.cpu_smoke)
    rows: list[Row] = []
    notes: list[str] = []
    rows_per_module: dict[str, int] = {}
    title = torch.cuda.get_device_name() if device.type == "cuda" else "CPU smoke run (numbers mean nothing)"
    print(f"{title}: ceilings {ceilings}", flush=True)
    for name in discover(CASES_DIR):
        if opts.module and name not in opts.module:
            continue
        t0, seen = time.monotonic(), len(notes)
        module_rows = run_module(name, device, ceilings, opts, deadline, notes)
        rows += module_rows
        rows_per_module[name] = len(module_rows)
        # each module's rows and notes as soon as they exist: a run cut off by its limit keeps what it did
        print(f"\n[{name}: {time.monotonic() - t0:.0f} s]", *notes[seen:], format_rows(module_rows), sep="\n")
        if opts.json:
            write_json(opts.json, title, ceilings, rows, rows_per_module, notes)
    print(
        f"\n{title}: copy {ceilings['copy_GBps']:.0f} GB/s, bf16 matmul {ceilings['matmul_TFLOPs']:.1f} TFLOP/s "
        f"(measured ceilings); times are medians of {opts.repeats}; 'vs baseline' = baseline time / run time"
    )
    for line in notes:
        print(line)
    print(format_rows(rows))
    return int(any(not r.ok.startswith("OK") for r in rows))


if __name__ == "__main__":
    sys.exit(main())
