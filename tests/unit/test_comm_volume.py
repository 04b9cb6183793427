"""Communication per decode step (dsv4serve/parallel/comm_volume.py) against hand-computed cases for
DeepSeek-V4-Flash (dim 4096, 43 layers, top-6 of 256 experts, vocab 129280)."""

from __future__ import annotations

import pytest

from dsv4serve.model.args import read_model_args
from dsv4serve.parallel.comm_volume import Link, decode_collectives, step_comm


@pytest.fixture(scope="module")
def args(real_model_dir):
    return read_model_args(real_model_dir)


def test_tp_batch_one_on_two_gpus(args):
    c = {x.name: x for x in decode_collectives(args, 1, 2, "tp")}
    attn = c["attention output (after wo_b)"]
    assert (attn.per_step, attn.message_bytes) == (43, 4096 * 2)  # one token's hidden, bf16
    assert attn.sent_bytes == 8192  # ring: 2 (T-1)/T x 8 KiB = 8 KiB
    assert c["MoE output (routed + shared)"].per_step == 43 and c["embedding (vocab-parallel)"].per_step == 1
    assert c["logits to rank 0"].sent_bytes == 64640 * 4  # rank 1's half of the vocabulary, fp32
    step = step_comm(list(c.values()), Link(400.0, 10.0, "test"))
    assert step.calls == 88
    sent = 87 * 8192 + 64640 * 4
    assert step.sent_bytes == sent
    assert step.seconds == pytest.approx(88 * 10e-6 + sent / 400e9)
    assert step.latency_seconds == pytest.approx(880e-6)


def test_tp_all_reduce_bytes_grow_with_batch_and_ranks(args):
    ar = decode_collectives(args, 64, 8, "tp")[0]
    assert ar.message_bytes == 64 * 8192 and ar.sent_bytes == 2 * 7 * 64 * 8192 // 8


def test_dp_ep_dispatch_and_combine(args):
    c = decode_collectives(args, 64, 4, "dp_ep")
    dispatch, combine = c
    # 16 tokens a rank x 6 copies; 3/4 of the copies leave; FP8 4096 + 32 scale bytes, bf16 back
    assert dispatch.message_bytes == 16 * 6 * (4096 + 32) and dispatch.sent_bytes == 16 * 6 * 4128 * 3 // 4
    assert combine.message_bytes == 16 * 6 * 8192 and combine.sent_bytes == 16 * 6 * 8192 * 3 // 4
    assert dispatch.per_step == combine.per_step == 43
    ag, rs = decode_collectives(args, 64, 4, "dp_ep", all_to_all=False)
    assert ag.sent_bytes == 3 * 16 * 4128 and rs.sent_bytes == 3 * 16 * 8192  # (T-1)/T of all 64 tokens


def test_one_gpu_sends_nothing(args):
    assert decode_collectives(args, 8, 1, "tp") == [] and step_comm([], Link(1.0, 1.0, "")).seconds == 0
