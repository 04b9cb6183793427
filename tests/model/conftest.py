"""Tiny seeded DeepSeek-V4 configs shared by the model tests, built through transformers' own
`DeepseekV4Config` so that transformers can serve as an independent oracle."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from dsv4serve.model.args import ModelArgs, args_from_dicts
from dsv4serve.model.random_init import random_dense_state
from dsv4serve.model.transformer import BatchRow, Transformer

YARN = {"type": "yarn", "factor": 16, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1}

# Every config holds all three layer kinds with windows that fill, compressed entries that exist and
# an indexer top-k smaller than the number of visible entries. Indexer heads are >= 4 so that an
# all-zero ReLU score (a tie top-k could break either way) is rare; seeds are fixed.
HF_CONFIGS = {
    "mixed4": dict(
        vocab_size=256,
        hidden_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        head_dim=32,
        qk_rope_head_dim=8,
        q_lora_rank=32,
        o_groups=2,
        o_lora_rank=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        layer_types=[
            "sliding_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
            "compressed_sparse_attention",
        ],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        sliding_window=8,
        hc_mult=4,
        hc_sinkhorn_iters=20,
        index_n_heads=8,
        index_head_dim=16,
        index_topk=2,
        num_hash_layers=2,
        rope_scaling=YARN,
    ),
    "hca_first": dict(
        vocab_size=192,
        hidden_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=2,
        head_dim=32,
        qk_rope_head_dim=16,
        q_lora_rank=16,
        o_groups=1,
        o_lora_rank=16,
        n_routed_experts=6,
        num_experts_per_tok=3,
        layer_types=["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        sliding_window=6,
        hc_mult=2,
        hc_sinkhorn_iters=3,
        index_n_heads=4,
        index_head_dim=32,
        index_topk=3,
        num_hash_layers=1,
        rope_scaling=YARN,
    ),
    "wide": dict(
        vocab_size=160,
        hidden_size=96,
        moe_intermediate_size=64,
        num_hidden_layers=5,
        num_attention_heads=8,
        head_dim=64,
        qk_rope_head_dim=16,
        q_lora_rank=48,
        o_groups=4,
        o_lora_rank=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        layer_types=[
            "compressed_sparse_attention",
            "sliding_attention",
            "heavily_compressed_attention",
            "compressed_sparse_attention",
            "sliding_attention",
        ],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        sliding_window=16,
        hc_mult=3,
        hc_sinkhorn_iters=20,
        index_n_heads=8,
        index_head_dim=16,
        index_topk=4,
        num_hash_layers=0,
        rope_scaling=YARN,
    ),
}
SEQ_TOKENS = {"mixed4": 64, "hca_first": 48, "wide": 80}


@dataclass
class TinyCase:
    name: str
    hf_config: object  # transformers DeepseekV4Config
    args: ModelArgs
    state: dict[str, torch.Tensor]  # official names, dense fp32
    model: Transformer
    token_ids: torch.Tensor  # [S] int64 prompt

    def hf_model(self):
        from transformers import DeepseekV4ForCausalLM

        from dsv4serve.checkpoint.hf_names import official_state_dict_to_hf

        hf = DeepseekV4ForCausalLM(self.hf_config).eval()
        hf.load_state_dict(official_state_dict_to_hf(self.state, self.args.n_layers), strict=True)
        return hf


def hf_config(name: str):
    from transformers import DeepseekV4Config

    return DeepseekV4Config(**HF_CONFIGS[name])


def build_case(name: str, seed: int = 0) -> TinyCase:
    cfg = hf_config(name)
    args = args_from_dicts(cfg.to_dict())
    state = random_dense_state(args, seed)
    model = Transformer(args).eval()
    model.load_state_dict(state, strict=True)
    g = torch.Generator().manual_seed(seed + 1000)
    ids = torch.randint(0, args.vocab_size, (SEQ_TOKENS[name],), generator=g)
    return TinyCase(name, cfg, args, state, model, ids)


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    # small ops are dominated by thread hand-offs on 2 busy cores; one thread is faster and steadier
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session", params=sorted(HF_CONFIGS))
def tiny_case(request) -> TinyCase:
    from transformers.utils import logging

    logging.set_verbosity_error()  # the tiny YaRN configs trip a harmless factor warning
    return build_case(request.param)


@pytest.fixture(scope="session")
def mixed_case() -> TinyCase:
    return build_case("mixed4")


def run_chunks(model: Transformer, ids: torch.Tensor, sizes: list[int], num) -> torch.Tensor:
    """Logits [S, vocab] of `ids` fed in chunks of `sizes` through one fresh state."""
    assert sum(sizes) == ids.shape[0]
    state, outs, begin = model.new_state(num), [], 0
    for n in sizes:
        outs.append(model([BatchRow(ids[begin : begin + n], state)], num, all_logits=True).logits[0])
        begin += n
    return torch.cat(outs)


@pytest.fixture(scope="session")
def helpers():
    """Plain helper functions (test modules cannot import conftest under --import-mode=importlib)."""
    from types import SimpleNamespace

    return SimpleNamespace(run_chunks=run_chunks, build_case=build_case, hf_config=hf_config)
