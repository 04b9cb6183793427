"""transformers names <-> official DeepSeek names.

transformers (>= 5.10, `conversion_mapping.py`, model_type deepseek_v4) renames the official tensors
when it loads them. Two dialects reach disk:
- module names (`model.layers.7.self_attn.q_a_proj.weight`), with the routed experts stacked:
  `mlp.experts.gate_up_proj` [E, 2I, D] holds w1 rows then w3 rows, `mlp.experts.down_proj` [E, D, I]
  holds w2 (a state dict saved as is, and older `save_pretrained`);
- what `save_pretrained` of transformers 5.24 writes after running the renames backwards: `model.`
  + official names, experts unstacked, but with `model.embed_tokens.weight`, `model.norm.weight`,
  `model.hc_head.hc_{fn,base,scale}`, `head.weight`, and `attn.norm.weight` for the attention's
  kv_norm (the reverse of its `.norm.` -> `.kv_norm.` rule).
Both load as the official names the model uses. transformers has no MTP layer.
"""

from __future__ import annotations

import re

import torch

# block-relative suffixes: HF name -> official name (after `model.layers.{i}.` -> `layers.{i}.`)
_BLOCK_SUFFIXES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "attn_hc.fn": "hc_attn_fn",
    "attn_hc.base": "hc_attn_base",
    "attn_hc.scale": "hc_attn_scale",
    "ffn_hc.fn": "hc_ffn_fn",
    "ffn_hc.base": "hc_ffn_base",
    "ffn_hc.scale": "hc_ffn_scale",
    "self_attn.sinks": "attn.attn_sink",
    "self_attn.q_a_proj.weight": "attn.wq_a.weight",
    "self_attn.q_a_norm.weight": "attn.q_norm.weight",
    "self_attn.q_b_proj.weight": "attn.wq_b.weight",
    "self_attn.kv_proj.weight": "attn.wkv.weight",
    "self_attn.kv_norm.weight": "attn.kv_norm.weight",
    "self_attn.o_a_proj.weight": "attn.wo_a.weight",
    "self_attn.o_b_proj.weight": "attn.wo_b.weight",
    "self_attn.compressor.kv_proj.weight": "attn.compressor.wkv.weight",
    "self_attn.compressor.gate_proj.weight": "attn.compressor.wgate.weight",
    "self_attn.compressor.position_bias": "attn.compressor.ape",
    "self_attn.compressor.kv_norm.weight": "attn.compressor.norm.weight",
    "self_attn.compressor.indexer.kv_proj.weight": "attn.indexer.compressor.wkv.weight",
    "self_attn.compressor.indexer.gate_proj.weight": "attn.indexer.compressor.wgate.weight",
    "self_attn.compressor.indexer.position_bias": "attn.indexer.compressor.ape",
    "self_attn.compressor.indexer.kv_norm.weight": "attn.indexer.compressor.norm.weight",
    "self_attn.compressor.indexer.q_b_proj.weight": "attn.indexer.wq_b.weight",
    "self_attn.compressor.indexer.scorer.weights_proj.weight": "attn.indexer.weights_proj.weight",
    "mlp.gate.weight": "ffn.gate.weight",
    "mlp.gate.tid2eid": "ffn.gate.tid2eid",
    "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
    "mlp.shared_experts.gate_proj.weight": "ffn.shared_experts.w1.weight",
    "mlp.shared_experts.up_proj.weight": "ffn.shared_experts.w3.weight",
    "mlp.shared_experts.down_proj.weight": "ffn.shared_experts.w2.weight",
}
_TOP = {
    "model.embed_tokens.weight": "embed.weight",
    "lm_head.weight": "head.weight",
    "model.norm.weight": "norm.weight",
    "model.hc_head.hc_fn": "hc_head_fn",
    "model.hc_head.hc_base": "hc_head_base",
    "model.hc_head.hc_scale": "hc_head_scale",
}
GATE_UP = "mlp.experts.gate_up_proj"
DOWN = "mlp.experts.down_proj"
# the save_pretrained dialect, after stripping "model."
_SAVED_FIXES = {
    "embed_tokens.weight": "embed.weight",
    "hc_head.hc_fn": "hc_head_fn",
    "hc_head.hc_base": "hc_head_base",
    "hc_head.hc_scale": "hc_head_scale",
}
_SAVED_ATTN_NORM = re.compile(r"^(layers\.\d+\.attn)\.norm\.weight$")
_OFFICIAL_BLOCK = {v: k for k, v in _BLOCK_SUFFIXES.items()}
_OFFICIAL_TOP = {v: k for k, v in _TOP.items()}
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_OFFICIAL_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_OFFICIAL_EXPERT = re.compile(r"^ffn\.experts\.(\d+)\.(w[123])\.weight$")


def is_hf_name(name: str) -> bool:
    return name.startswith("model.") or name == "lm_head.weight"


def hf_to_official(name: str) -> str | None:
    """Official name of an unstacked HF tensor (either dialect); None for stacked experts and unknowns.

    A name of the save_pretrained dialect maps to whatever official-looking name it spells; whether
    that tensor belongs to the model is for the schema check to say.
    """
    if name in _TOP:
        return _TOP[name]
    m = _HF_LAYER.match(name)
    if m and m.group(2) in _BLOCK_SUFFIXES:
        return f"layers.{m.group(1)}.{_BLOCK_SUFFIXES[m.group(2)]}"
    if name == "head.weight":
        return name
    if name.startswith("model.") and not (m and m.group(2) in (GATE_UP, DOWN)):
        rest = name[len("model.") :]
        return _SAVED_ATTN_NORM.sub(r"\1.kv_norm.weight", _SAVED_FIXES.get(rest, rest))
    return None


def hf_stacked_experts(name: str) -> tuple[int, str] | None:
    """(layer, 'gate_up' | 'down') for a stacked-experts HF tensor, else None."""
    m = _HF_LAYER.match(name)
    if m and m.group(2) == GATE_UP:
        return int(m.group(1)), "gate_up"
    if m and m.group(2) == DOWN:
        return int(m.group(1)), "down"
    return None


def official_to_hf(name: str) -> str | None:
    """HF name of an official tensor that HF stores unstacked; None for experts, MTP and scales."""
    if name in _OFFICIAL_TOP:
        return _OFFICIAL_TOP[name]
    m = _OFFICIAL_LAYER.match(name)
    if m and m.group(2) in _OFFICIAL_BLOCK:
        return f"model.layers.{m.group(1)}.{_OFFICIAL_BLOCK[m.group(2)]}"
    return None


def split_stacked(layer: int, kind: str, stacked: torch.Tensor) -> dict[str, torch.Tensor]:
    """Unstack HF's fused experts into official per-expert tensors (views, no copy)."""
    out: dict[str, torch.Tensor] = {}
    if kind == "gate_up":  # [E, 2I, D]: w1 rows then w3 rows
        inter = stacked.shape[1] // 2
        for e in range(stacked.shape[0]):
            out[f"layers.{layer}.ffn.experts.{e}.w1.weight"] = stacked[e, :inter]
            out[f"layers.{layer}.ffn.experts.{e}.w3.weight"] = stacked[e, inter:]
    else:  # [E, D, I]
        for e in range(stacked.shape[0]):
            out[f"layers.{layer}.ffn.experts.{e}.w2.weight"] = stacked[e]
    return out


def split_stacked_shapes(layer: int, kind: str, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """The official names and shapes that `split_stacked` yields, from the stacked shape alone."""
    n_experts, rows, cols = shape
    if kind == "gate_up":
        return {
            f"layers.{layer}.ffn.experts.{e}.{w}.weight": (rows // 2, cols)
            for e in range(n_experts)
            for w in ("w1", "w3")
        }
    return {f"layers.{layer}.ffn.experts.{e}.w2.weight": (rows, cols) for e in range(n_experts)}


def official_state_dict_to_hf(state: dict[str, torch.Tensor], n_layers: int) -> dict[str, torch.Tensor]:
    """Dense official-named tensors -> an HF `DeepseekV4ForCausalLM` state dict (experts stacked).

    Used to give transformers the very weights our model runs (parity tests). MTP tensors are dropped.
    """
    out: dict[str, torch.Tensor] = {}
    experts: dict[int, dict[int, dict[str, torch.Tensor]]] = {}
    for name, tensor in state.items():
        hf = official_to_hf(name)
        if hf is not None:
            out[hf] = tensor
            continue
        m = _OFFICIAL_LAYER.match(name)
        e = _OFFICIAL_EXPERT.match(m.group(2)) if m else None
        if m and e:
            experts.setdefault(int(m.group(1)), {}).setdefault(int(e.group(1)), {})[e.group(2)] = tensor
    for layer in range(n_layers):
        per = experts.get(layer)
        if not per:
            continue
        ids = sorted(per)
        out[f"model.layers.{layer}.{GATE_UP}"] = torch.stack([torch.cat([per[i]["w1"], per[i]["w3"]]) for i in ids])
        out[f"model.layers.{layer}.{DOWN}"] = torch.stack([per[i]["w2"] for i in ids])
    return out
