"""bench/bench_engine_vs_hf.py's summary: ratios are taken per repeat against the base path."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "bench_engine_vs_hf.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_engine_vs_hf", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_summary_ratios_pair_each_repeat_with_the_same_repeat_of_the_base(bench) -> None:
    rates = {"hf": {"decode": [10.0, 20.0, 40.0]}, "ours": {"decode": [12.0, 20.0, 20.0]}}
    summary, rows = bench.summarize(rates, "hf")
    ours = summary["ours"]["decode"]
    assert ours["tokens_per_s"] == {"min": 12.0, "median": 20.0, "max": 20.0}
    assert ours["ratio_to_hf"] == {"min": 0.5, "median": 1.0, "max": 1.2}  # 1.2, 1.0, 0.5: not 20/20
    assert summary["hf"]["decode"]["ratio_to_hf"]["median"] == 1.0
    assert rows[1][:2] == ["ours", "decode"] and rows[1][-1] == "0.50 / 1.00 / 1.20"


def test_table_lines_have_equal_width_header_and_rule(bench) -> None:
    text = bench.format_table(["path", "tok/s"], [["transformers", "21.9"], ["ours", "123.4"]])
    header, rule, *body = text.splitlines()
    assert len(header) == len(rule) and len(body) == 2 and body[1].endswith("123.4")
