"""What CUDA-graph capture of the speculative steps needs, checked by the census (bench/census) on the CUDA
worker's code path (every kernel on Triton, interpreted): within one (bucket, n) the verify forward issues the
same op sequence at every position and whatever the rows accepted before, so does the MTP chain's application
within its bucket, and the draft chain reads the host once, after its last draft (before item 5: once per draft).

Acceptance is forced to cycle through 0..n (a census of op sequences, not of tokens), so that rows keep
different numbers of positions, roll back different tails and catch up over different lengths."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported

import inspect
import itertools
import sys
from pathlib import Path
from unittest import mock

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: `bench.*`

from bench.bench_spec_step import build, load_models, run, start, steady, watch
from bench.census.counter import fingerprint
from bench.census.stand_ins import stand_ins
from dsv4serve.worker.sampler_inputs import HostReader

READ_LINE = inspect.getsourcelines(HostReader.read)
READ_SITE = "dsv4serve/worker/sampler_inputs.py:" + str(
    READ_LINE[1] + next(i for i, t in enumerate(READ_LINE[0]) if "packed.tolist()" in t)
)


@pytest.fixture(scope="module")
def models(tiny_dir):
    return load_models(tiny_dir)


@pytest.mark.slow  # the Triton interpreter: about 6 minutes on 2 cores
def test_spec_steps_have_one_op_sequence_per_bucket_and_the_chain_reads_once(models):
    batch, n_spec = 3, 2  # three rows in the bucket of 4: one padding row
    e = build(models, batch, n_spec, static=True, max_len=104)
    start(e, batch, prompt_tokens=40, max_tokens=40)
    accepted = itertools.cycle([0, 2, 1, 0, 1, 2, 2, 0])
    forced = lambda drafts, sampled: min(next(accepted), len(drafts))  # noqa: E731
    watch(e)
    steps = 0
    with stand_ins(), mock.patch("dsv4serve.worker.runner.accepted_drafts", forced):
        for _ in range(6):  # a prefill, then 5 verify steps: 4 compared after the first (about 25 s a step)
            plan = e.scheduler.schedule(4096)
            steps += steady(plan, n_spec, batch)
            run(e, plan)
    key = f"verify B={batch} n={n_spec}"
    # the first forward on the real path builds per-process caches (the compressors' fused weights): a capture
    # warms up once before it records, so the op sequences compared are the later ones
    verifies = e.pieces.get(key, [])[1:]
    assert steps >= 4 and len(verifies) >= 4, (steps, sorted(e.pieces))
    prints = {fingerprint(s)[1] for s in verifies}
    assert len(prints) == 1, "the verify forward's op sequence changed within its bucket"
    assert all(not s.syncs for s in verifies)  # nothing in the forward reads the host: capturable
    applies = e.pieces[f"chain apply B={batch}"]
    assert len(applies) >= 4 and len({fingerprint(s)[1] for s in applies}) == 1
    assert all(not s.syncs for s in applies)
    chains = e.pieces["chain"]
    assert chains and all([x.site for x in s.syncs] == [READ_SITE] for s in chains)
