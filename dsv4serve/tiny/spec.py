"""The architecture of `dsv4-tiny`: every layer kind of DeepSeek-V4-Flash at toy width.

Layers: 0 sliding-window only, 1 CSA (ratio 4, with indexer), 2 HCA (ratio 16), 3 CSA; layers 0-1
hash-routed, 2-3 gate-routed; one MTP layer (sliding window only). hc_mult 4 as in the real model.
Inner dims are multiples of 128 so the reference's per-128 FP8 activation quantization applies
unchanged; the vocabulary is the real one (129280) so the real tokenizer works.
The same values are written down in configs/dsv4-tiny.json (a test keeps the two equal).
"""

from __future__ import annotations

from typing import Any

TINY_NAME = "dsv4-tiny"
TINY_VERSION = 2  # bump when the bytes change; the cache folder is named after it
TINY_SEED = 20260424

# config.json, in the official checkpoint's dialect (HF-style keys, legacy compress_ratios)
TINY_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 129280,
    "hidden_size": 128,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_hash_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 128,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 128,
    "o_groups": 2,
    "o_lora_rank": 64,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "sliding_window": 16,
    "compress_ratios": [0, 4, 16, 4, 0],
    # transformers' DeepseekV4Config maps legacy compress_ratios only for 4 and 128: these explicit
    # fields (which it prefers) let HF tools (AutoConfig, AutoTokenizer) read this folder too
    "layer_types": [
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
    ],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    "compress_rope_theta": 160000,
    "rope_theta": 10000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "max_position_embeddings": 1048576,
    "index_n_heads": 4,
    "index_head_dim": 128,
    "index_topk": 4,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-06,
    "rms_norm_eps": 1e-06,
    "num_nextn_predict_layers": 1,
    "hidden_act": "silu",
    "attention_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "bfloat16",
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
    },
}


# dsv4-tiny widened so that it splits over 1, 2 or 4 tensor-parallel ranks on every quantization block
# (parallel/partition.py): 8 heads in 4 output groups of o_lora_rank 128 (wo_a 128 rows a rank, wo_b 128 columns
# at 4 ranks), moe_intermediate_size 512 (the shared expert's 128 rows / columns a rank at 4); the rest, layer
# kinds, routing, vocabulary and tokenizer included, as dsv4-tiny. dsv4-tiny itself does not split: its
# o_lora_rank 64 is half an FP8 block. Built by tiny/builder.ensure_tiny(cache, split=True) for the
# tensor-parallel tests and benchmarks.
TINY_SPLIT_NAME = "dsv4-tiny-split"
TINY_SPLIT_CONFIG: dict[str, Any] = {
    **TINY_CONFIG,
    "num_attention_heads": 8,
    "o_groups": 4,
    "o_lora_rank": 128,
    "moe_intermediate_size": 512,
}


def inference_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """inference/config.json (the reference code's dialect) for the same architecture."""
    rs = cfg["rope_scaling"]
    return {
        "vocab_size": cfg["vocab_size"],
        "dim": cfg["hidden_size"],
        "moe_inter_dim": cfg["moe_intermediate_size"],
        "n_layers": cfg["num_hidden_layers"],
        "n_hash_layers": cfg["num_hash_layers"],
        "n_heads": cfg["num_attention_heads"],
        "n_routed_experts": cfg["n_routed_experts"],
        "n_shared_experts": cfg["n_shared_experts"],
        "n_activated_experts": cfg["num_experts_per_tok"],
        "score_func": cfg["scoring_func"],
        "route_scale": cfg["routed_scaling_factor"],
        "swiglu_limit": cfg["swiglu_limit"],
        "q_lora_rank": cfg["q_lora_rank"],
        "head_dim": cfg["head_dim"],
        "rope_head_dim": cfg["qk_rope_head_dim"],
        "o_groups": cfg["o_groups"],
        "o_lora_rank": cfg["o_lora_rank"],
        "window_size": cfg["sliding_window"],
        "original_seq_len": rs["original_max_position_embeddings"],
        "rope_theta": cfg["rope_theta"],
        "rope_factor": rs["factor"],
        "beta_fast": rs["beta_fast"],
        "beta_slow": rs["beta_slow"],
        "index_n_heads": cfg["index_n_heads"],
        "index_head_dim": cfg["index_head_dim"],
        "index_topk": cfg["index_topk"],
        "hc_mult": cfg["hc_mult"],
        "hc_sinkhorn_iters": cfg["hc_sinkhorn_iters"],
        "dtype": "fp8",
        "scale_fmt": "ue8m0",
        "expert_dtype": "fp4",
        "compress_rope_theta": cfg["compress_rope_theta"],
        "compress_ratios": cfg["compress_ratios"],
    }
