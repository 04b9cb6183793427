"""bench/bench_serving.py's pure parts: reading aiperf's JSON export, the batching gain, the table."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "bench_serving.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_serving", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


# the keys and shapes of a real aiperf 0.13.0 export (values from a run of 16 requests at concurrency 4)
EXPORT = {
    "schema_version": "1.4",
    "aiperf_version": "0.13.0",
    "request_throughput": {"unit": "requests/sec", "avg": 0.96},
    "request_count": {"unit": "requests", "avg": 16.0},
    "time_to_first_token": {"unit": "ms", "avg": 2062.4, "p50": 2042.1, "p90": 3310.1, "min": 999.2},
    "inter_token_latency": {"unit": "ms", "avg": 294.8, "p50": 336.3, "p90": 347.6},
    "output_token_throughput": {"unit": "tokens/sec", "avg": 7.80},
    "request_error_rate": {"unit": "%", "avg": 0.0},
    "completed_request_count": {"unit": "requests", "avg": 16.0},
    "error_summary": [],
}


def test_parse_export_reads_the_percentiles(bench) -> None:
    r = bench.parse_export(EXPORT, concurrency=4)
    assert (r.concurrency, r.requests, r.completed, r.error_rate_pct) == (4, 16, 16, 0.0)
    assert (r.ttft_p50_ms, r.ttft_p90_ms, r.itl_p50_ms, r.itl_p90_ms) == (2042.1, 3310.1, 336.3, 347.6)
    assert (r.output_tokens_per_s, r.requests_per_s) == (7.80, 0.96)


def test_parse_export_with_errors_and_no_latencies(bench) -> None:
    data = {
        "completed_request_count": {"avg": 6.0},
        "output_token_throughput": {"avg": 3.0},
        "error_summary": [{"error_details": {"code": 503}, "count": 2}],
    }
    r = bench.parse_export(data, concurrency=8)
    assert (r.requests, r.completed) == (8, 6)
    assert r.error_rate_pct == pytest.approx(25.0)
    assert math.isnan(r.ttft_p50_ms) and math.isnan(r.itl_p90_ms)


def test_batching_gain_uses_the_medians_over_rounds(bench) -> None:
    def run(c: int, rate: float):
        return bench.LevelResult(c, 8, 8, 0.0, 1, 1, 1, 1, rate, 1)

    results = [run(1, 2.0), run(1, 4.0), run(1, 100.0), run(16, 30.0), run(16, 36.0)]
    assert bench.batching_gain(results) == pytest.approx(33.0 / 4.0)
    assert bench.batching_gain([run(1, 2.0)]) is None


def test_table_has_one_row_per_level_and_aligned_columns(bench) -> None:
    results = [bench.LevelResult(c, 8, 8, 0.0, 10.0 * c, 20.0 * c, 5.0, 6.0, 1.5 * c, 0.1) for c in (1, 16, 1)]
    text = bench.format_table(
        ["concurrency", "runs", "completed", "a", "b", "c", "d", "out", "err"], bench.level_rows(results)
    )
    lines = text.splitlines()
    assert len(lines) == 2 + 2  # header, rule, levels 1 and 16
    assert lines[2].split()[:3] == ["1", "2", "16/16"]
    assert len({len(line) for line in lines[:2]}) == 1
