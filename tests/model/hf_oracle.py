"""transformers' DeepseekV4ForCausalLM as an oracle whose lightning indexer breaks score ties like ours.

The indexer keeps each query's top `index_topk` compressed entries by score. Exact ties are common:
score = sum_h w_h * ReLU(q_h . k) is exactly 0.0 whenever every head's dot product is negative (1 in
2**H_I (query, entry) pairs for H_I index heads, so 1 in 16 on dsv4-tiny). DeepSeek's reference leaves
tie order to `topk`'s backend; transformers' CPU `topk` then keeps a different entry than our rule
(dsv4serve/model/indexer.py `Indexer.select`: among equal scores the earlier entry wins), and one
swapped entry moves logits by tens of percent. Neither side is wrong, so to compare the rest of the
model we make transformers use our rule: a forward hook on each `DeepseekV4IndexerScorer` keeps the
scores it returns (the exact tensor transformers ranks), and a forward hook on its
`DeepseekV4Indexer` replaces the chosen indices with a stable descending sort of the same scores
under the same causal mask. Hooks, not patches: transformers' own code is untouched, and the
unaligned model stays one `remove()` away.

`hf_config` maps our ModelArgs to transformers' config and `hf_model` loads our weights into it. Used by tests/model/test_hf_parity_long.py and bench/bench_engine_vs_hf.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsv4serve.model.args import ModelArgs

HF_LAYER_TYPE = {
    "swa": "sliding_attention",
    "csa": "compressed_sparse_attention",
    "hca": "heavily_compressed_attention",
}


def hf_config(a: ModelArgs):
    """A transformers DeepseekV4Config describing the same model as our `a` (the bench's dsv4-tiny)."""
    from transformers import DeepseekV4Config

    rates = {HF_LAYER_TYPE[k]: r for k, r in zip(a.layer_kinds, a.compress_ratios) if r}
    return DeepseekV4Config(
        vocab_size=a.vocab_size,
        hidden_size=a.dim,
        moe_intermediate_size=a.moe_inter_dim,
        num_hidden_layers=a.n_layers,
        num_attention_heads=a.n_heads,
        head_dim=a.head_dim,
        qk_rope_head_dim=a.rope_head_dim,
        q_lora_rank=a.q_lora_rank,
        o_groups=a.o_groups,
        o_lora_rank=a.o_lora_rank,
        n_routed_experts=a.n_routed_experts,
        n_shared_experts=a.n_shared_experts,
        num_experts_per_tok=a.n_activated_experts,
        routed_scaling_factor=a.route_scale,
        swiglu_limit=a.swiglu_limit,
        layer_types=[HF_LAYER_TYPE[k] for k in a.layer_kinds[: a.n_layers]],
        compress_rates=rates,
        sliding_window=a.window_size,
        hc_mult=a.hc_mult,
        hc_sinkhorn_iters=a.hc_sinkhorn_iters,
        hc_eps=a.hc_eps,
        rms_norm_eps=a.norm_eps,
        index_n_heads=a.index_n_heads,
        index_head_dim=a.index_head_dim,
        index_topk=a.index_topk,
        num_hash_layers=a.n_hash_layers,
        rope_theta=a.rope_theta,
        compress_rope_theta=a.compress_rope_theta,
        rope_scaling={
            "type": "yarn",
            "factor": a.rope_factor,
            "original_max_position_embeddings": a.original_seq_len,
            "beta_fast": a.beta_fast,
            "beta_slow": a.beta_slow,
        },
        max_position_embeddings=a.max_position_embeddings,
        eos_token_id=None,
        bos_token_id=a.bos_token_id,
    )


@dataclass
class TieStats:
    """What the hooks saw, summed over every indexer call since the hooks were attached."""

    rows_ranked: int = 0  # query rows with more visible entries than top-k (where a choice is made)
    boundary_ties: int = 0  # of those, rows whose k-th and (k+1)-th best visible scores are exactly equal
    rows_changed: int = 0  # rows where transformers' own topk chose a different set than the stable rule
    first_changed_position: int | None = None  # the earliest query position among those rows
    handles: list = field(default_factory=list, repr=False)  # torch hook handles, for `remove`

    def remove(self) -> None:
        """Detach the hooks: the model is transformers' unaligned one again."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def stable_top_k(scores: torch.Tensor, position_ids: torch.Tensor, compress_rate: int, top_k: int) -> torch.Tensor:
    """scores [B, S, T] fp32 (unmasked), position_ids [B, S] -> [B, S, top_k] int64 entry indices.

    transformers' indexer rule (entry w is visible to the query at position p when w < (p + 1) //
    compress_rate; picks past the visible entries become -1) with ties broken toward the earlier entry.
    """
    threshold = ((position_ids + 1) // compress_rate).unsqueeze(-1)  # [B, S, 1]
    entries = torch.arange(scores.shape[-1], device=scores.device)
    masked = scores.masked_fill(entries >= threshold, float("-inf"))
    top = masked.sort(dim=-1, descending=True, stable=True).indices[..., :top_k]
    return torch.where(top >= threshold, torch.full_like(top, -1), top)


def _count(stats: TieStats, scores: torch.Tensor, position_ids: torch.Tensor, rate: int, theirs, ours) -> None:
    """Adds one indexer call to `stats`: scores [B, S, T], theirs / ours [B, S, k] chosen entries."""
    changed = (theirs.sort(dim=-1).values != ours.sort(dim=-1).values).any(dim=-1)
    stats.rows_changed += int(changed.sum())
    if changed.any():
        first = int(position_ids[changed].min())
        earlier = stats.first_changed_position
        stats.first_changed_position = first if earlier is None else min(first, earlier)
    top_k, n_entries = ours.shape[-1], scores.shape[-1]
    if n_entries <= top_k:  # every visible entry is kept: no boundary to tie at
        return
    n_visible = ((position_ids + 1) // rate).clamp(max=n_entries)  # [B, S]
    future = torch.arange(n_entries, device=scores.device) >= n_visible.unsqueeze(-1)
    ranked = scores.masked_fill(future, float("-inf")).sort(dim=-1, descending=True).values
    rows = n_visible > top_k
    stats.rows_ranked += int(rows.sum())
    stats.boundary_ties += int((rows & (ranked[..., top_k - 1] == ranked[..., top_k])).sum())


def align_indexer_ties(hf) -> TieStats:
    """Make every lightning indexer of the transformers model `hf` break score ties toward the earlier
    entry (our rule). Returns the counters the hooks keep; `.remove()` undoes the alignment."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Indexer

    stats = TieStats()
    for indexer in (m for m in hf.modules() if isinstance(m, DeepseekV4Indexer)):
        seen: dict[str, torch.Tensor] = {}  # this indexer's latest scores, handed from one hook to the next

        def keep_scores(_module, _args, scores, seen=seen) -> None:
            seen["scores"] = scores  # [B, S, T] fp32

        def rerank(module, args, kwargs, top, seen=seen) -> torch.Tensor:
            scores = seen.pop("scores")
            if scores.shape[-1] == 0:  # no compressed entry yet: nothing to choose
                return top
            position_ids = args[2] if len(args) > 2 else kwargs["position_ids"]  # [B, S]
            ours = stable_top_k(scores, position_ids, module.compress_rate, top.shape[-1])
            _count(stats, scores, position_ids, module.compress_rate, top, ours)
            return ours

        stats.handles.append(indexer.scorer.register_forward_hook(keep_scores))
        stats.handles.append(indexer.register_forward_hook(rerank, with_kwargs=True))
    return stats


def hf_model(config, official_state: dict[str, torch.Tensor], n_layers: int, align_ties: bool = True):
    """A transformers DeepseekV4ForCausalLM (eval) for the DeepseekV4Config `config`, holding
    `official_state` (official names, dense), and the TieStats of its aligned indexers (None when
    `align_ties` is False)."""
    from transformers import DeepseekV4ForCausalLM

    from dsv4serve.checkpoint.hf_names import official_state_dict_to_hf

    hf = DeepseekV4ForCausalLM(config).eval()
    hf.load_state_dict(official_state_dict_to_hf(official_state, n_layers), strict=True)
    return hf, (align_indexer_ties(hf) if align_ties else None)
