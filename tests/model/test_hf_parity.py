"""Parity with transformers' DeepseekV4ForCausalLM, an independent implementation (numerics OFF).

Tolerance: both sides run the same fp32 math and differ only in summation order (matmul shapes,
the sink concatenated vs added, the routing weight applied before vs after w2). Each op then
agrees to a few fp32 ulps; measured end-to-end logit differences are ~1e-6 of the logit scale.
We allow 1e-4 of the largest logit: 100x headroom over rounding, while any real formula
difference (a missing eps, a transposed comb, a wrong RoPE pair, an off-by-one window) moves
logits by 1e-2 or more of their scale.
"""

from __future__ import annotations

import torch

from dsv4serve.model.numerics import NUMERICS_OFF
from dsv4serve.model.transformer import BatchRow

REL_TOL = 1e-4
NEW_TOKENS = 8


def test_parsed_args_match_the_hf_config(tiny_case):
    cfg, a = tiny_case.hf_config, tiny_case.args
    assert (a.dim, a.n_layers, a.n_heads, a.head_dim) == (
        cfg.hidden_size,
        cfg.num_hidden_layers,
        cfg.num_attention_heads,
        cfg.head_dim,
    )
    assert a.rope_head_dim == cfg.qk_rope_head_dim and a.window_size == cfg.sliding_window
    kinds = {"sliding_attention": "swa", "compressed_sparse_attention": "csa", "heavily_compressed_attention": "hca"}
    assert list(a.layer_kinds) == [kinds[t] for t in cfg.layer_types]
    assert list(a.compress_ratios) == [
        0 if t == "sliding_attention" else cfg.compress_rates[t] for t in cfg.layer_types
    ]
    assert a.n_hash_layers == sum(t == "hash_moe" for t in cfg.mlp_layer_types)
    assert (a.index_n_heads, a.index_head_dim, a.index_topk) == (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk)
    assert (a.hc_mult, a.hc_sinkhorn_iters, a.n_mtp_layers) == (cfg.hc_mult, cfg.hc_sinkhorn_iters, 0)
    assert a.rope_factor == 16 and a.original_seq_len == 64 and a.compress_rope_theta == 160000


def test_rope_frequencies_match_hf(tiny_case):
    hf = tiny_case.hf_model()
    rotary = hf.model.rotary_emb
    attn = {a.compress_ratio: a for a in (blk.attn for blk in tiny_case.model.layers)}
    assert torch.allclose(attn[0].freqs, rotary.main_inv_freq, rtol=1e-6, atol=0)
    compressed = next(a for r, a in attn.items() if r)
    assert torch.allclose(compressed.freqs, rotary.compress_inv_freq, rtol=1e-6, atol=0)


def test_full_sequence_logits_match_hf(tiny_case, monkeypatch):
    from dsv4serve.model.indexer import Indexer

    selections = []  # (scores [T, S] with invisible entries at -inf, top-k) for every CSA layer
    original = Indexer.select

    def recording_select(self, q, weights, keys, visible):
        scores = ((q.float().unsqueeze(2) * keys.float()).sum(-1).relu() * weights.unsqueeze(-1)).sum(1)
        selections.append((scores.masked_fill(~visible, float("-inf")), self.index_topk))
        return original(self, q, weights, keys, visible)

    monkeypatch.setattr(Indexer, "select", recording_select)
    hf = tiny_case.hf_model()
    ids = tiny_case.token_ids
    with torch.no_grad():
        ref = hf(ids[None], use_cache=False).logits[0].float()  # [S, vocab]
    state = tiny_case.model.new_state(NUMERICS_OFF)
    ours = tiny_case.model([BatchRow(ids, state)], NUMERICS_OFF, all_logits=True).logits[0]
    err = (ours - ref).abs().max().item()
    assert err <= REL_TOL * ref.abs().max().item(), f"{tiny_case.name}: max |dlogit| {err:.3g}"
    # the indexer really dropped entries, and never at a tie (where top-k may pick either entry)
    dropped = 0
    for scores, k in selections:
        ranked = scores.sort(dim=-1, descending=True).values
        n_visible = (scores > float("-inf")).sum(-1)
        rows = n_visible > k
        dropped += int(rows.sum())
        assert bool((ranked[rows, k - 1] > ranked[rows, k]).all()), "indexer tie at the top-k boundary"
    assert dropped > 0 and ids.shape[0] > 2 * tiny_case.args.window_size


def test_greedy_continuation_matches_hf_generate(tiny_case):
    hf = tiny_case.hf_model()
    prompt = tiny_case.token_ids[: tiny_case.token_ids.shape[0] - NEW_TOKENS]
    with torch.no_grad():
        ref = hf.generate(prompt[None], max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)[
            0, prompt.shape[0] :
        ].tolist()  # may stop early at EOS
    model, state = tiny_case.model, tiny_case.model.new_state(NUMERICS_OFF)
    logits = model([BatchRow(prompt, state)], NUMERICS_OFF).logits[0]
    ours = []
    for _ in range(NEW_TOKENS):
        token = int(logits.argmax())
        ours.append(token)
        logits = model([BatchRow(torch.tensor([token]), state)], NUMERICS_OFF).logits[0]
    assert len(ref) >= 1 and ours[: len(ref)] == ref
