"""The model's architecture, read once from a checkpoint's config files.

Field names mirror DeepSeek's reference `ModelArgs` (inference/model.py) so that code written against
the reference reads the same here. Every architectural number comes from the checkpoint's config,
never from constants: the real model's 4/128/128 are just one config.

Three config dialects are understood:
- the official HF-repo `config.json` (HF-style keys plus legacy `compress_ratios`, `num_hash_layers`,
  `qk_rope_head_dim`, `rope_scaling`), optionally with `inference/config.json` beside it;
- the reference `inference/config.json` alone (keys `dim`, `n_layers`, ...);
- transformers' `DeepseekV4Config.save_pretrained` (`layer_types`, `compress_rates`,
  `mlp_layer_types`, `rope_parameters`, `partial_rotary_factor`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

LayerKind = Literal["swa", "csa", "hca"]
WeightDtype = Literal["fp8", "bf16", "fp32"]
ExpertDtype = Literal["fp4", "fp8", "bf16", "fp32"]

HF_LAYER_TYPE_TO_KIND: dict[str, LayerKind] = {
    "sliding_attention": "swa",
    "compressed_sparse_attention": "csa",
    "heavily_compressed_attention": "hca",
}
CSA_RATIO = 4  # the reference ties the overlapping compressor and the indexer to ratio 4


class ModelConfigError(ValueError):
    """A config file that does not describe a DeepSeek-V4 model we can run."""


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    dim: int
    moe_inter_dim: int
    n_layers: int
    n_hash_layers: int
    n_heads: int
    n_routed_experts: int
    n_shared_experts: int
    n_activated_experts: int
    score_func: str
    route_scale: float
    swiglu_limit: float
    q_lora_rank: int
    head_dim: int
    rope_head_dim: int
    o_groups: int
    o_lora_rank: int
    window_size: int
    original_seq_len: int
    rope_theta: float
    rope_factor: float
    beta_fast: float
    beta_slow: float
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    norm_eps: float
    compress_rope_theta: float
    # one entry per main layer, then one per MTP layer; 0 = sliding window only
    compress_ratios: tuple[int, ...]
    layer_kinds: tuple[LayerKind, ...]  # same indexing as compress_ratios
    n_mtp_layers: int
    max_position_embeddings: int
    bos_token_id: int
    eos_token_id: int
    norm_topk_prob: bool = True
    dtype: WeightDtype = "fp8"  # storage of the linear weights that carry `.scale` in FP8 checkpoints
    expert_dtype: ExpertDtype = "fp4"
    scale_fmt: str | None = "ue8m0"
    weight_block_size: tuple[int, int] = (128, 128)

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def n_all_layers(self) -> int:
        return self.n_layers + self.n_mtp_layers

    @property
    def page_tokens(self) -> int:
        """Tokens per KV page: the least common multiple of window_size and every compress ratio, so a
        page holds whole compressed entries in every layer (128 for DeepSeek-V4-Flash)."""
        return math.lcm(self.window_size, *(r for r in self.compress_ratios if r))

    def kind(self, layer_id: int) -> LayerKind:
        return self.layer_kinds[layer_id]

    def is_hash_layer(self, layer_id: int) -> bool:
        return layer_id < self.n_hash_layers  # MTP layers (id >= n_layers) are never hash-routed

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _validate(a: ModelArgs) -> None:
    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ModelConfigError(msg)

    need(
        len(a.compress_ratios) == a.n_all_layers,
        f"compress_ratios has {len(a.compress_ratios)} entries; expected n_layers + MTP layers "
        f"= {a.n_layers} + {a.n_mtp_layers}",
    )
    need(len(a.layer_kinds) == a.n_all_layers, "layer_kinds must have one entry per layer")
    for i, (r, k) in enumerate(zip(a.compress_ratios, a.layer_kinds)):
        need((r == 0) == (k == "swa"), f"layer {i}: ratio {r} does not fit kind {k}")
        need(
            k != "csa" or r == CSA_RATIO, f"layer {i}: CSA layers use overlapping windows of ratio {CSA_RATIO}, got {r}"
        )
    need(
        0 < a.rope_head_dim <= a.head_dim and a.rope_head_dim % 2 == 0,
        f"rope_head_dim {a.rope_head_dim} must be even and at most head_dim {a.head_dim}",
    )
    need(a.rope_head_dim <= a.index_head_dim, "index_head_dim must hold the rope dims")
    need(a.n_heads % a.o_groups == 0, f"n_heads {a.n_heads} must divide into o_groups {a.o_groups}")
    need(0 < a.n_activated_experts <= a.n_routed_experts, "n_activated_experts out of range")
    need(0 <= a.n_hash_layers <= a.n_layers, "n_hash_layers out of range")
    need(a.window_size > 0, "window_size must be positive")
    need(a.hc_mult >= 1 and a.hc_sinkhorn_iters >= 1, "hc_mult and hc_sinkhorn_iters must be >= 1")
    need(a.score_func in ("sqrtsoftplus", "softmax", "sigmoid"), f"unknown score_func {a.score_func}")
    if a.expert_dtype == "fp4":
        need(
            a.dim % 32 == 0 and a.moe_inter_dim % 32 == 0,
            "FP4 experts need dim and moe_inter_dim divisible by 32 (one e8m0 scale per 32 K)",
        )


# ---------------------------------------------------------------------------------------- reading


def read_model_args(folder: str | Path, expert_dtype_hint: ExpertDtype | None = None) -> ModelArgs:
    """Read `config.json` (and `inference/config.json` where present) from a checkpoint folder.

    `expert_dtype_hint` is what the checkpoint's tensors say (I8 experts are FP4); it is used only
    where no config file declares `expert_dtype`.
    """
    folder = Path(folder)
    root_path, ref_path = folder / "config.json", folder / "inference" / "config.json"
    if not root_path.is_file() and not ref_path.is_file():
        raise ModelConfigError(f"{folder}: no config.json (is this a DeepSeek-V4 checkpoint folder?)")
    root = _read_json(root_path) if root_path.is_file() else {}
    ref = _read_json(ref_path) if ref_path.is_file() else {}
    return args_from_dicts(root, ref, expert_dtype_hint)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelConfigError(f"{path}: not readable JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ModelConfigError(f"{path}: expected a JSON object")
    return data


def args_from_dicts(
    root: dict[str, Any], ref: dict[str, Any] | None = None, expert_dtype_hint: ExpertDtype | None = None
) -> ModelArgs:
    """Build ModelArgs from an HF-style `config.json` dict and/or a reference `inference/config.json`."""
    ref = ref or {}
    mt = root.get("model_type")
    if root and mt not in (None, "deepseek_v4"):
        raise ModelConfigError(f"model_type is {mt!r}; dsv4serve runs DeepSeek-V4 (model_type 'deepseek_v4')")
    g = _Getter(root, ref)
    n_layers = g.int("num_hidden_layers", "n_layers")
    layer_kinds, ratios, n_mtp = _layer_schedule(root, ref, n_layers)
    rope = _rope(root, ref)
    dtype, expert_dtype, scale_fmt, block = _storage(root, ref, expert_dtype_hint)
    head_dim = g.int("head_dim", "head_dim")
    if "qk_rope_head_dim" in root or "rope_head_dim" in ref:
        rope_head_dim = g.int("qk_rope_head_dim", "rope_head_dim")
    elif root.get("partial_rotary_factor") is not None:
        rope_head_dim = int(round(head_dim * float(root["partial_rotary_factor"])))
    else:
        raise ModelConfigError("config names no rope head dim (qk_rope_head_dim / partial_rotary_factor)")
    if "mlp_layer_types" in root and root["mlp_layer_types"] is not None:
        n_hash = _hash_prefix(root["mlp_layer_types"], n_layers)
    else:
        n_hash = g.int("num_hash_layers", "n_hash_layers")
    eos = root.get("eos_token_id", 1)
    return ModelArgs(
        vocab_size=g.int("vocab_size", "vocab_size"),
        dim=g.int("hidden_size", "dim"),
        moe_inter_dim=g.int("moe_intermediate_size", "moe_inter_dim"),
        n_layers=n_layers,
        n_hash_layers=n_hash,
        n_heads=g.int("num_attention_heads", "n_heads"),
        n_routed_experts=g.int("n_routed_experts", "n_routed_experts"),
        n_shared_experts=g.int("n_shared_experts", "n_shared_experts"),
        n_activated_experts=g.int("num_experts_per_tok", "n_activated_experts"),
        score_func=str(g.get("scoring_func", "score_func")),
        route_scale=g.float("routed_scaling_factor", "route_scale"),
        swiglu_limit=g.float("swiglu_limit", "swiglu_limit"),
        q_lora_rank=g.int("q_lora_rank", "q_lora_rank"),
        head_dim=head_dim,
        rope_head_dim=rope_head_dim,
        o_groups=g.int("o_groups", "o_groups"),
        o_lora_rank=g.int("o_lora_rank", "o_lora_rank"),
        window_size=g.int("sliding_window", "window_size"),
        original_seq_len=rope["original_seq_len"],
        rope_theta=rope["rope_theta"],
        rope_factor=rope["rope_factor"],
        beta_fast=rope["beta_fast"],
        beta_slow=rope["beta_slow"],
        index_n_heads=g.int("index_n_heads", "index_n_heads"),
        index_head_dim=g.int("index_head_dim", "index_head_dim"),
        index_topk=g.int("index_topk", "index_topk"),
        hc_mult=g.int("hc_mult", "hc_mult"),
        hc_sinkhorn_iters=g.int("hc_sinkhorn_iters", "hc_sinkhorn_iters"),
        hc_eps=g.float("hc_eps", "hc_eps", default=1e-6),
        norm_eps=g.float("rms_norm_eps", "norm_eps", default=1e-6),
        compress_rope_theta=rope["compress_rope_theta"],
        compress_ratios=ratios,
        layer_kinds=layer_kinds,
        n_mtp_layers=n_mtp,
        max_position_embeddings=int(
            root.get("max_position_embeddings") or rope["original_seq_len"] * rope["rope_factor"]
        ),
        bos_token_id=int(root.get("bos_token_id", 0)),
        eos_token_id=int(eos[0] if isinstance(eos, list) else eos),
        norm_topk_prob=bool(root.get("norm_topk_prob", True)),
        dtype=dtype,
        expert_dtype=expert_dtype,
        scale_fmt=scale_fmt,
        weight_block_size=block,
    )


class _Getter:
    """Reads a value by its HF name from config.json, else by its reference name."""

    _MISSING = object()

    def __init__(self, root: dict[str, Any], ref: dict[str, Any]):
        self.root, self.ref = root, ref

    def get(self, hf_key: str, ref_key: str, default: Any = _MISSING) -> Any:
        if self.root.get(hf_key) is not None:
            return self.root[hf_key]
        if self.ref.get(ref_key) is not None:
            return self.ref[ref_key]
        if default is not self._MISSING:
            return default
        raise ModelConfigError(f"config is missing {hf_key!r} (reference name {ref_key!r})")

    def int(self, hf_key: str, ref_key: str, default: Any = _MISSING) -> int:
        value = self.get(hf_key, ref_key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
            raise ModelConfigError(f"config field {hf_key!r} must be an integer, got {value!r}")
        return int(value)

    def float(self, hf_key: str, ref_key: str, default: Any = _MISSING) -> float:
        value = self.get(hf_key, ref_key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ModelConfigError(f"config field {hf_key!r} must be a number, got {value!r}")
        return float(value)


def _layer_schedule(
    root: dict[str, Any], ref: dict[str, Any], n_layers: int
) -> tuple[tuple[LayerKind, ...], tuple[int, ...], int]:
    ratios = root.get("compress_ratios", ref.get("compress_ratios"))
    if ratios is not None:
        ratios = [int(r) for r in ratios]
        if len(ratios) < n_layers:
            raise ModelConfigError(f"compress_ratios has {len(ratios)} entries for {n_layers} layers")
        kinds = [_kind_of_ratio(r) for r in ratios]
        return tuple(kinds), tuple(ratios), len(ratios) - n_layers
    layer_types = root.get("layer_types")
    if layer_types is None:
        raise ModelConfigError("config has neither compress_ratios nor layer_types")
    rates = {
        "compressed_sparse_attention": CSA_RATIO,
        "heavily_compressed_attention": 128,
        **(root.get("compress_rates") or {}),
    }
    if len(layer_types) != n_layers:
        raise ModelConfigError(f"layer_types has {len(layer_types)} entries for {n_layers} layers")
    kinds, out = [], []
    for t in layer_types:
        if t not in HF_LAYER_TYPE_TO_KIND:
            raise ModelConfigError(f"unknown layer type {t!r}")
        kinds.append(HF_LAYER_TYPE_TO_KIND[t])
        out.append(0 if t == "sliding_attention" else int(rates[t]))
    # transformers does not instantiate the MTP layer, and save_pretrained writes no mtp.* weights
    return tuple(kinds), tuple(out), 0


def _kind_of_ratio(ratio: int) -> LayerKind:
    if ratio < 0:
        raise ModelConfigError(f"negative compress ratio {ratio}")
    return "swa" if ratio == 0 else ("csa" if ratio == CSA_RATIO else "hca")


def _hash_prefix(mlp_layer_types: list[str], n_layers: int) -> int:
    n = 0
    while n < len(mlp_layer_types) and mlp_layer_types[n] == "hash_moe":
        n += 1
    if any(t != "moe" for t in mlp_layer_types[n:]) or len(mlp_layer_types) != n_layers:
        raise ModelConfigError(f"mlp_layer_types must be hash_moe layers then moe layers: {mlp_layer_types}")
    return n


def _rope(root: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    params = root.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("compress"), dict):
        main, comp = params["main"], params["compress"]
        scaled = comp.get("rope_type", comp.get("type")) == "yarn"
        return {
            "rope_theta": float(main.get("rope_theta", 10000.0)),
            "compress_rope_theta": float(comp.get("rope_theta", 160000.0)),
            "rope_factor": float(comp.get("factor", 1.0)) if scaled else 1.0,
            "original_seq_len": int(comp.get("original_max_position_embeddings", 0)) if scaled else 0,
            "beta_fast": float(comp.get("beta_fast", 32)),
            "beta_slow": float(comp.get("beta_slow", 1)),
        }
    scaling = root.get("rope_scaling") or {}
    g = _Getter({**root, **{k: v for k, v in scaling.items()}}, ref)
    return {
        "rope_theta": g.float("rope_theta", "rope_theta"),
        "compress_rope_theta": g.float("compress_rope_theta", "compress_rope_theta"),
        "rope_factor": g.float("factor", "rope_factor", default=1.0),
        "original_seq_len": g.int("original_max_position_embeddings", "original_seq_len", default=0),
        "beta_fast": g.float("beta_fast", "beta_fast", default=32.0),
        "beta_slow": g.float("beta_slow", "beta_slow", default=1.0),
    }


def _storage(
    root: dict[str, Any], ref: dict[str, Any], expert_dtype_hint: ExpertDtype | None
) -> tuple[WeightDtype, ExpertDtype, str | None, tuple[int, int]]:
    quant = root.get("quantization_config") or {}
    if quant:
        if quant.get("quant_method") != "fp8" or quant.get("fmt", "e4m3") != "e4m3":
            raise ModelConfigError(
                f"unsupported quantization_config {quant}; dsv4serve reads the "
                "official FP8 e4m3 / FP4 checkpoint or an unquantized one"
            )
        block = tuple(int(b) for b in quant.get("weight_block_size", (128, 128)))
        expert = ref.get("expert_dtype") or root.get("expert_dtype") or quant.get("expert_dtype") or expert_dtype_hint
        if expert is None:
            raise ModelConfigError(
                "the config does not say how the experts are stored (expert_dtype) "
                "and the checkpoint could not be probed"
            )
        if expert not in ("fp4", "fp8"):
            raise ModelConfigError(f"unsupported expert_dtype {expert!r}")
        return "fp8", expert, quant.get("scale_fmt", ref.get("scale_fmt")), (block[0], block[1])
    if ref.get("dtype") == "fp8":
        return "fp8", ref.get("expert_dtype") or expert_dtype_hint or "fp4", ref.get("scale_fmt"), (128, 128)
    torch_dtype = str(root.get("dtype") or root.get("torch_dtype") or "bfloat16")
    dense: WeightDtype = "fp32" if torch_dtype in ("float32", "fp32") else "bf16"
    return dense, dense, None, (128, 128)
