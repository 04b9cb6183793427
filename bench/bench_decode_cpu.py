"""Decode tokens/s of the CPU reference path vs transformers' `generate`, side by side.

Same weights (the built-in dsv4-tiny checkpoint, FP8/FP4 dequantized by our loader, given to
transformers through `official_state_dict_to_hf`), same prompt, greedy, one thread. Decode rate is
(N - 1) / (time for N new tokens - time for 1 new token), so prefill cancels out on both sides.

    python bench/bench_decode_cpu.py [--new-tokens 64] [--prompt-tokens 32] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from dsv4serve.checkpoint.hf_names import official_state_dict_to_hf
from dsv4serve.checkpoint.loader import load_dense_state_dict
from dsv4serve.env import read_environment
from dsv4serve.model.args import ModelArgs
from dsv4serve.model.numerics import NUMERICS_OFF, NUMERICS_ON, Numerics
from dsv4serve.tiny.builder import ensure_tiny
from dsv4serve.model.transformer import BatchRow, Transformer

HF_LAYER_TYPE = {"swa": "sliding_attention", "csa": "compressed_sparse_attention",
                 "hca": "heavily_compressed_attention"}


def hf_config(a: ModelArgs):
    from transformers import DeepseekV4Config

    rates = {HF_LAYER_TYPE[k]: r for k, r in zip(a.layer_kinds, a.compress_ratios) if r}
    return DeepseekV4Config(
        vocab_size=a.vocab_size, hidden_size=a.dim, moe_intermediate_size=a.moe_inter_dim,
        num_hidden_layers=a.n_layers, num_attention_heads=a.n_heads, head_dim=a.head_dim,
        qk_rope_head_dim=a.rope_head_dim, q_lora_rank=a.q_lora_rank, o_groups=a.o_groups,
        o_lora_rank=a.o_lora_rank, n_routed_experts=a.n_routed_experts, n_shared_experts=a.n_shared_experts,
        num_experts_per_tok=a.n_activated_experts, routed_scaling_factor=a.route_scale,
        swiglu_limit=a.swiglu_limit, layer_types=[HF_LAYER_TYPE[k] for k in a.layer_kinds[:a.n_layers]],
        compress_rates=rates, sliding_window=a.window_size, hc_mult=a.hc_mult,
        hc_sinkhorn_iters=a.hc_sinkhorn_iters, hc_eps=a.hc_eps, rms_norm_eps=a.norm_eps,
        index_n_heads=a.index_n_heads, index_head_dim=a.index_head_dim, index_topk=a.index_topk,
        num_hash_layers=a.n_hash_layers, rope_theta=a.rope_theta, compress_rope_theta=a.compress_rope_theta,
        rope_scaling={"type": "yarn", "factor": a.rope_factor, "original_max_position_embeddings":
                      a.original_seq_len, "beta_fast": a.beta_fast, "beta_slow": a.beta_slow},
        max_position_embeddings=a.max_position_embeddings, eos_token_id=None, bos_token_id=a.bos_token_id)


def ours_generate(model: Transformer, prompt: torch.Tensor, n_new: int, num: Numerics) -> list[int]:
    state = model.new_state(num)
    logits = model([BatchRow(prompt, state)], num).logits[0]
    out = [int(logits.argmax())]
    for _ in range(n_new - 1):
        logits = model([BatchRow(torch.tensor(out[-1:]), state)], num).logits[0]
        out.append(int(logits.argmax()))
    return out


def hf_generate(hf, prompt: torch.Tensor, n_new: int) -> list[int]:
    with torch.no_grad():
        ids = hf.generate(prompt[None], max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                          pad_token_id=0)
    return ids[0, prompt.shape[0]:].tolist()


def decode_rate(fn, n_new: int, repeats: int) -> tuple[float, list[int]]:
    """Best-of-`repeats` decode tokens/s: (n_new - 1) / (t(n_new) - t(1))."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(1)
        t1 = time.perf_counter()
        tokens = fn(n_new)
        t2 = time.perf_counter()
        best = min(best, (t2 - t1) - (t1 - t0))
    return (n_new - 1) / best, tokens


def profile_ours(model: Transformer, prompt: torch.Tensor, n_new: int, num: Numerics) -> None:
    """Where a decode step's time goes: cumulative time of the main stages, per token."""
    prof = cProfile.Profile()
    prof.enable()
    ours_generate(model, prompt, n_new, num)
    prof.disable()
    stats = pstats.Stats(prof).stats  # {(file, line, fn): (cc, nc, tt, ct, callers)}
    stages = {"attention": ("attention.py", "forward"), "  compressor": ("compressor.py", "update"),
              "  indexer select": ("indexer.py", "select"), "  core attention": ("attention.py", "sparse_attention"),
              "moe": ("moe.py", "forward"), "hc_pre": ("hc.py", "hc_pre"), "hc_post": ("hc.py", "hc_post"),
              "FP8/FP4 simulation (all sites)": ("numerics.py", "fp8_quant_dequant"),
              "  FP4 + Hadamard": ("numerics.py", "fp4_quant_dequant"),
              "head (hc_head+norm+vocab matmul)": ("transformer.py", "logits"),
              "whole forward": ("transformer.py", "forward")}
    print(f"  profile of our {n_new}-token run with {num}, ms per token (cProfile adds overhead):")
    for label, (file, fn) in stages.items():
        total = sum(v[3] for k, v in stats.items() if k[0].endswith(file) and k[2] == fn)
        print(f"    {label:34s} {1000 * total / n_new:7.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--profile", action="store_true")
    opts = parser.parse_args()
    torch.set_num_threads(1)
    from transformers import DeepseekV4ForCausalLM
    from transformers.utils import logging
    logging.set_verbosity_error()

    args, state = load_dense_state_dict(ensure_tiny(read_environment().cache_dir))
    state = {k: v for k, v in state.items() if not k.startswith("mtp.")}  # transformers has no MTP
    model = Transformer(args, include_mtp=False).eval()
    model.load_state_dict(state, strict=True)
    hf = DeepseekV4ForCausalLM(hf_config(args)).eval()
    hf.load_state_dict(official_state_dict_to_hf(state, args.n_layers), strict=True)
    prompt = torch.randint(0, args.vocab_size, (opts.prompt_tokens,), generator=torch.Generator().manual_seed(1))

    n = opts.new_tokens
    hf_rate, hf_tokens = decode_rate(lambda k: hf_generate(hf, prompt, k), n, opts.repeats)
    print(f"dsv4-tiny, prompt {opts.prompt_tokens}, {n} new tokens, greedy, 1 thread")
    print(f"  transformers generate (fp32)          {hf_rate:8.1f} tok/s")
    for label, num in (("ours, numerics OFF (fp32)", NUMERICS_OFF), ("ours, numerics ON (bf16)", NUMERICS_ON)):
        rate, tokens = decode_rate(lambda k: ours_generate(model, prompt, k, num), n, opts.repeats)
        same = "same tokens as HF" if tokens == hf_tokens else "tokens differ from HF"
        print(f"  {label:38s}{rate:8.1f} tok/s   ratio ours/HF {rate / hf_rate:5.2f}   ({same})")
    if opts.profile:
        for num in (NUMERICS_OFF, NUMERICS_ON):
            profile_ours(model, prompt, n, num)


if __name__ == "__main__":
    main()
