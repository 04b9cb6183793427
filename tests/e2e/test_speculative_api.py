"""--speculative-tokens through a real worker process: greedy tokens are the model's alone (computed in this
process without speculation), and the Stats message carries the speculative-decoding counters."""

from __future__ import annotations

import time

import pytest
import torch

from dsv4serve.checkpoint.loader import load_dense_state_dict
from dsv4serve.ipc.sampling import SamplingParams
from dsv4serve.model.numerics import NUMERICS_ON
from dsv4serve.model.transformer import BatchRow, Transformer

from .conftest import launch_for, start_client

PROMPT = [128803] + list(range(1000, 1037)) + [128804]


def _alone(tiny_dir, prompt: list[int], n: int) -> list[int]:
    args, state = load_dense_state_dict(tiny_dir)
    model = Transformer(args)
    model.load_state_dict(state)
    seq = model.new_state(NUMERICS_ON)
    logits = model.forward([BatchRow(torch.tensor(prompt), seq)], NUMERICS_ON).logits[0]
    out: list[int] = []
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = model.forward([BatchRow(torch.tensor(out[-1:]), seq)], NUMERICS_ON).logits[0]
    return out


@pytest.mark.slow  # a worker process on dsv4-tiny (about 15 s)
def test_a_speculating_worker_gives_the_models_tokens_and_counts_its_drafts(loop_thread, tiny_dir):
    want = _alone(tiny_dir, PROMPT, 8)
    client = start_client(loop_thread, launch_for(tiny_dir, speculative_tokens=2))
    try:

        async def collect():
            params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
            return [t.token_id async for out in client.generate("spec", PROMPT, params) for t in out.tokens]

        assert loop_thread.run(collect()) == want
        assert "--speculative-tokens 2" in client.ready_info.decode_graphs
        time.sleep(1.5)  # the next Stats message carries the counters
        stats = client.stats
        assert stats.spec_decode_num_drafts_total > 0
        assert stats.spec_decode_num_draft_tokens_total <= 2 * stats.spec_decode_num_drafts_total
        assert 0 <= stats.spec_decode_num_accepted_tokens_total <= stats.spec_decode_num_draft_tokens_total
    finally:
        loop_thread.run(client.shutdown())
