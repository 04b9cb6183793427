"""dsv4-tiny with its routed experts in a host bank behind a few "device" slots (8 experts a layer,
3 or 12 slots in all, some layers left in the mmapped shards), on the torch expert path: the logits
and generated tokens must be bitwise those of the all-resident model, and the cache's counts must
match the routing the gates produced. (The Triton path with the cache: tests/kernels/test_packed_load.py.)"""

from __future__ import annotations

import pytest
import torch

from dsv4serve.checkpoint.loader import iter_dense, open_checkpoint
from dsv4serve.experts.attach import attach_expert_cache, iter_resident_dense
from dsv4serve.model.numerics import NUMERICS_ON
from dsv4serve.model.transformer import BatchRow, Transformer

PROMPT_TOKENS, CHUNK, DECODE_STEPS = 40, 24, 4


@pytest.fixture(scope="module")
def ckpt(tiny_dir):
    c = open_checkpoint(tiny_dir)
    yield c
    c.source.close()


def resident(ckpt) -> Transformer:
    model = Transformer(ckpt.args, include_mtp=True).eval()
    model.load_state_dict(dict(iter_dense(ckpt, progress=False)), strict=True)
    return model


def offloaded(ckpt, slots: int, ram_bytes: int | None = None):
    model = Transformer(ckpt.args, include_mtp=True).eval()
    cache = attach_expert_cache(model, ckpt, slots, torch.device("cpu"), ram_bytes=ram_bytes)
    model.load_state_dict(dict(iter_resident_dense(ckpt, progress=False)), strict=True)
    return model, cache


def generate(model: Transformer) -> tuple[torch.Tensor, list[int]]:
    """Chunked prefill of a seeded prompt, then greedy decode: (every logit row, generated tokens)."""
    ids = torch.randint(0, model.args.vocab_size, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(7))
    state, rows = model.new_state(NUMERICS_ON), []
    for begin in range(0, PROMPT_TOKENS, CHUNK):
        rows.append(model([BatchRow(ids[begin : begin + CHUNK], state)], NUMERICS_ON, all_logits=True).logits[0])
    tokens = [int(rows[-1][-1].argmax())]
    for _ in range(DECODE_STEPS):
        logits = model([BatchRow(torch.tensor(tokens[-1:]), state)], NUMERICS_ON).logits[0]
        rows.append(logits[None])
        tokens.append(int(logits.argmax()))
    return torch.cat(rows), tokens


@pytest.fixture(scope="module")
def reference(ckpt):
    return generate(resident(ckpt))


def count_expert_uses(model: Transformer) -> list[int]:
    """A running count of (forward, layer, expert) uses, from the gates' own outputs."""
    uses = [0]

    def hook(_module, _inputs, output):
        uses[0] += int(output[1].unique().numel())

    for block in model.layers:
        block.ffn.gate.register_forward_hook(hook)
    return uses


@pytest.mark.parametrize(("slots", "ram_layers"), [(3, None), (12, 2)])
def test_offloaded_experts_give_identical_logits_and_tokens(ckpt, reference, slots, ram_layers):
    a = ckpt.args
    layer_bytes = sum(s.nbytes for s in ckpt.specs if s.group == "routed_experts" and s.layer == 0)
    model, cache = offloaded(ckpt, slots, None if ram_layers is None else ram_layers * layer_bytes)
    assert all(len(block.ffn.experts) == 0 for block in model.layers)  # no dense routed experts left
    in_ram = a.n_layers + a.n_mtp_layers if ram_layers is None else ram_layers
    assert len(cache.bank.layers) == in_ram and len(cache.bank.mapped) == a.n_layers + a.n_mtp_layers - in_ram
    uses = count_expert_uses(model)
    logits, tokens = generate(model)
    assert torch.equal(logits, reference[0]) and tokens == reference[1]
    cache.collect_usage()  # the last step's uses (a step boundary would read them)
    s = cache.stats
    assert s.queries == uses[0] and 0 < s.hits < s.queries
    assert len(cache.resident) == slots and s.prefetches > 0
    assert s.evictions == s.prefetches  # the slots were full from the start
    assert s.h2d_bytes == s.prefetches * cache.bank.expert_bytes  # the CPU torch path reads the bank in place
    assert 0 < s.stalls <= 2 + DECODE_STEPS  # CPU: one per step boundary that promoted


def test_the_bank_holds_the_checkpoint_bytes_packed(ckpt):
    _, cache = offloaded(ckpt, 3)
    bank, a = cache.bank, ckpt.args
    assert sorted(bank.layers) == list(range(a.n_layers + a.n_mtp_layers))
    spec_bytes = sum(s.nbytes for s in ckpt.specs if s.group == "routed_experts")
    assert bank.report.bank_bytes == spec_bytes == bank.expert_bytes * len(bank.layers) * a.n_routed_experts
    assert bank.report.mode == "pageable (no CUDA)" or torch.cuda.is_available()
    packed = ckpt.source.read("layers.2.ffn.experts.5.w2.weight")
    scale = ckpt.source.read("layers.2.ffn.experts.5.w2.scale")
    assert bank.layers[2]["w2"].dtype == torch.int8 and torch.equal(bank.layers[2]["w2"][5], packed)
    assert torch.equal(bank.layers[2]["w2_scale"][5], scale.view(torch.uint8))
