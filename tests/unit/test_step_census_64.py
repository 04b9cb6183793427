"""The step census ratchets at the largest bucket the issue names (#16): a decode step of 64 rows waits for the
device once (the read of its packed results) and launches, layer by layer, exactly what a 1-row step
launches: nothing in a decode step grows with the batch. Its own file, so that the test runner can run it
beside tests/unit/test_step_census.py (each 64-row step is ~100 s of Triton interpreter)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # read when @triton.jit decorates: before any kernel module

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: `bench.census`, as the script does
sys.path.insert(0, str(Path(__file__).resolve().parent))  # test_step_census: its ratchet and sampling

from test_step_census import PROMPT_TOKENS, RATCHET_SAMPLING, READ_SITE, _check_launches_per_layer


def _step(tiny_dir: Path, batch: int, twin=None):
    """The first real decode step of a fresh engine: unsettled, it must launch what every later step does
    (Transformer.use_kernels prepares what a first forward would otherwise build)."""
    from bench.census.engine import build_census_engine
    from bench.census.steps import decode_census

    engine = build_census_engine(tiny_dir, batch, 64, None, twin, graph_sizes=(batch,))
    (step,) = decode_census(engine, batch, PROMPT_TOKENS, RATCHET_SAMPLING, settle_steps=0, compare_gap=None)
    assert step.num_rows == batch
    return engine, step


@pytest.mark.slow  # ~100 s of CPU: one counted decode step of 64 rows in the interpreter
def test_a_64_row_decode_step_syncs_once_and_launches_per_layer_what_one_row_does(tiny_dir) -> None:
    from bench.census.summary import summarize

    engine, one = _step(tiny_dir, 1)
    _, big = _step(tiny_dir, 64, engine.twin)
    assert [(s.what, s.site) for s in big.seen.syncs] == [("tolist", READ_SITE)]
    small_layers = summarize(one, engine.args)["layers"]
    big_layers = summarize(big, engine.args)["layers"]
    assert [x["launches"] for x in big_layers] == [x["launches"] for x in small_layers]
    _check_launches_per_layer(big, engine.args)
