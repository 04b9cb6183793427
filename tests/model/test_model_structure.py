"""The module tree carries exactly the official checkpoint names (dsv4-model.md §3.2), for the
real dsv4-tiny geometry with its MTP block, and runs that geometry in both numerics modes."""

from __future__ import annotations

import torch

from dsv4serve.model.args import args_from_dicts
from dsv4serve.model.numerics import NUMERICS_OFF, NUMERICS_ON
from dsv4serve.model.random_init import random_dense_state
from dsv4serve.model.schema import checkpoint_schema
from dsv4serve.model.transformer import BatchRow, Transformer

# the reference `inference/config.json` of dsv4-tiny (FP8 linears, FP4 experts, one MTP layer)
DSV4_TINY = dict(
    vocab_size=129280,
    dim=128,
    moe_inter_dim=128,
    n_layers=4,
    n_hash_layers=2,
    n_mtp_layers=1,
    n_heads=4,
    n_routed_experts=8,
    n_shared_experts=1,
    n_activated_experts=2,
    score_func="sqrtsoftplus",
    route_scale=1.5,
    swiglu_limit=10.0,
    q_lora_rank=128,
    head_dim=128,
    rope_head_dim=64,
    norm_eps=1e-6,
    o_groups=2,
    o_lora_rank=64,
    window_size=16,
    compress_ratios=[0, 4, 16, 4, 0],
    compress_rope_theta=160000.0,
    original_seq_len=65536,
    rope_theta=10000.0,
    rope_factor=16,
    beta_fast=32,
    beta_slow=1,
    index_n_heads=4,
    index_head_dim=128,
    index_topk=4,
    hc_mult=4,
    hc_sinkhorn_iters=20,
    hc_eps=1e-6,
    dtype="fp8",
    expert_dtype="fp4",
    scale_fmt="ue8m0",
)


def _weight_names(args, include_mtp: bool) -> set[str]:
    return {
        s.name for s in checkpoint_schema(args, include_mtp=include_mtp) if s.role not in ("fp8_scale", "fp4_scale")
    }


def test_state_dict_names_are_the_official_names_with_mtp():
    args = args_from_dicts({}, DSV4_TINY)
    assert args.n_mtp_layers == 1 and args.dtype == "fp8" and args.expert_dtype == "fp4"
    model = Transformer(args)
    assert set(model.state_dict()) == _weight_names(args, include_mtp=True)
    assert any(n.startswith("mtp.0.") for n in model.state_dict())


def test_state_dict_names_without_mtp(tiny_case):
    args = tiny_case.args
    model = Transformer(args, include_mtp=False)
    assert set(model.state_dict()) == _weight_names(args, include_mtp=False)
    shapes = {s.name: s.shape for s in checkpoint_schema(args, include_mtp=False)}
    for name, tensor in model.state_dict().items():
        assert tuple(tensor.shape) == shapes[name], name


def test_dsv4_tiny_geometry_runs_prefill_decode_and_mtp():
    args = args_from_dicts({}, DSV4_TINY)
    model = Transformer(args).eval()
    model.load_state_dict(random_dense_state(args, seed=5), strict=True)
    ids = torch.randint(0, args.vocab_size, (40,), generator=torch.Generator().manual_seed(5))
    for num in (NUMERICS_OFF, NUMERICS_ON):
        state = model.new_state(num)
        out = model([BatchRow(ids[:36], state)], num, return_hidden=True)
        assert out.logits[0].shape == (args.vocab_size,) and torch.isfinite(out.logits[0]).all()
        step = model([BatchRow(ids[36:37], state)], num).logits[0]
        assert torch.isfinite(step).all() and state.num_tokens == 37
        # 37 tokens in 16-token pages: 3 pages; CSA (ratio 4) closed 9 entries, HCA (ratio 16) 2
        layers, pages = state.pool.layers, torch.tensor(state.pages)
        assert len(state.pages) == 3 and layers[1].comp.per_page == 4 and layers[2].comp.per_page == 1
        assert layers[1].idx.read(pages, 9).shape == (9, args.index_head_dim)
        assert layers[1].comp.read(pages, 9).abs().sum(-1).gt(0).all()  # written entries are not the zero fill
        assert layers[2].comp.read(pages, 2).abs().sum(-1).gt(0).all()
        # MTP drafts token t+2 from the streams at t and token t+1
        draft = model.forward_mtp([BatchRow(ids[1:37], state)], out.hidden, num)
        assert draft.logits[0].shape == (args.vocab_size,) and torch.isfinite(draft.logits[0]).all()
        assert state.mtp_num_tokens == 36
