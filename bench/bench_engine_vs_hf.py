"""Prefill and decode tokens/s of dsv4serve's model path vs transformers' `generate`, side by side.

Same weights (the built-in dsv4-tiny checkpoint, FP8/FP4 dequantized by our loader, given to
transformers through `official_state_dict_to_hf`), same prompt, greedy, one thread. Every repeat
runs each path once, in a rotating order, so load on this shared machine hits all paths alike.

  prefill tokens/s = prompt tokens / t(1 new token)                 (the prompt forward + one sample)
  decode tokens/s  = (N - 1) / (t(N new tokens) - t(1 new token))   (prefill cancels out)

Paths: transformers `DeepseekV4ForCausalLM.generate` (fp32); ours with numerics OFF (fp32, the
same arithmetic, so the same tokens); ours with numerics ON (bf16 with the FP8/FP4 simulation, what
the server runs for an FP8 checkpoint such as dsv4-tiny). Ratios are taken per repeat (ours / HF of
the same repeat) and reported as min / median / max.

    python bench/bench_engine_vs_hf.py [--prompt-tokens 128] [--new-tokens 32] [--repeats 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from dsv4serve.checkpoint.hf_names import official_state_dict_to_hf
from dsv4serve.checkpoint.loader import load_dense_state_dict
from dsv4serve.env import read_environment
from dsv4serve.model.args import ModelArgs
from dsv4serve.model.numerics import NUMERICS_OFF, NUMERICS_ON, Numerics
from dsv4serve.model.transformer import BatchRow, Transformer
from dsv4serve.tiny.builder import ensure_tiny

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: `bench.report`
from bench.report import format_table, spread

HF_LAYER_TYPE = {
    "swa": "sliding_attention",
    "csa": "compressed_sparse_attention",
    "hca": "heavily_compressed_attention",
}
Generate = Callable[[int], list[int]]  # number of new tokens -> the greedy tokens


def hf_config(a: ModelArgs):
    """A transformers DeepseekV4Config describing the same model as `a`."""
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


def ours_generate(model: Transformer, prompt: torch.Tensor, n_new: int, num: Numerics) -> list[int]:
    """Greedy tokens from our model: one prompt forward, then one forward per new token."""
    state = model.new_state(num)
    logits = model([BatchRow(prompt, state)], num).logits[0]
    out = [int(logits.argmax())]
    for _ in range(n_new - 1):
        logits = model([BatchRow(torch.tensor(out[-1:]), state)], num).logits[0]
        out.append(int(logits.argmax()))
    return out


def hf_generate(hf, prompt: torch.Tensor, n_new: int) -> list[int]:
    with torch.no_grad():
        ids = hf.generate(prompt[None], max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False, pad_token_id=0)
    return ids[0, prompt.shape[0] :].tolist()


def time_phases(generate: Generate, n_prompt: int, n_new: int) -> tuple[float, float, list[int]]:
    """(prefill tokens/s, decode tokens/s, tokens) from one t(1) and one t(n_new) run."""
    t0 = time.perf_counter()
    generate(1)
    t1 = time.perf_counter()
    tokens = generate(n_new)
    t2 = time.perf_counter()
    return n_prompt / (t1 - t0), (n_new - 1) / max((t2 - t1) - (t1 - t0), 1e-9), tokens


def summarize(rates: dict[str, dict[str, list[float]]], base: str) -> tuple[dict, list[list[str]]]:
    """rates[path][phase] per repeat -> (JSON summary, table rows); ratios are per repeat vs `base`."""
    summary: dict = {}
    rows = []
    for path, phases in rates.items():
        summary[path] = {}
        for phase, values in phases.items():
            ratios = [v / b for v, b in zip(values, rates[base][phase])]
            summary[path][phase] = {"tokens_per_s": spread(values), "ratio_to_" + base: spread(ratios)}
            s, r = spread(values), spread(ratios)
            rows.append(
                [
                    path,
                    phase,
                    f"{s['min']:.1f}",
                    f"{s['median']:.1f}",
                    f"{s['max']:.1f}",
                    f"{r['min']:.2f} / {r['median']:.2f} / {r['max']:.2f}",
                ]
            )
    return summary, rows


def load_models() -> tuple[ModelArgs, Transformer, object]:
    """Our model and transformers' model holding the same dsv4-tiny weights."""
    from transformers import DeepseekV4ForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    args, state = load_dense_state_dict(ensure_tiny(read_environment().cache_dir))
    state = {k: v for k, v in state.items() if not k.startswith("mtp.")}  # transformers has no MTP
    model = Transformer(args, include_mtp=False).eval()
    model.load_state_dict(state, strict=True)
    hf = DeepseekV4ForCausalLM(hf_config(args)).eval()
    hf.load_state_dict(official_state_dict_to_hf(state, args.n_layers), strict=True)
    return args, model, hf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, help="write the numbers here")
    opts = parser.parse_args()
    torch.set_num_threads(1)
    args, model, hf = load_models()
    prompt = torch.randint(0, args.vocab_size, (opts.prompt_tokens,), generator=torch.Generator().manual_seed(1))
    paths: dict[str, Generate] = {
        "transformers": lambda k: hf_generate(hf, prompt, k),
        "ours numerics OFF": lambda k: ours_generate(model, prompt, k, NUMERICS_OFF),
        "ours numerics ON": lambda k: ours_generate(model, prompt, k, NUMERICS_ON),
    }
    names = list(paths)
    rates = {name: {"prefill": [], "decode": []} for name in names}
    tokens: dict[str, list[int]] = {}
    for rep in range(opts.repeats):
        order = names[rep % len(names) :] + names[: rep % len(names)]  # rotate who runs first
        for name in order:
            prefill, decode, tokens[name] = time_phases(paths[name], opts.prompt_tokens, opts.new_tokens)
            rates[name]["prefill"].append(prefill)
            rates[name]["decode"].append(decode)
        print(
            f"repeat {rep + 1}/{opts.repeats}: "
            + ", ".join(f"{n} {rates[n]['prefill'][-1]:.0f}/{rates[n]['decode'][-1]:.1f}" for n in names),
            flush=True,
        )
    same = {name: tokens[name] == tokens["transformers"] for name in names}
    summary, rows = summarize(rates, "transformers")
    if opts.json:
        opts.json.write_text(
            json.dumps(
                {
                    "prompt_tokens": opts.prompt_tokens,
                    "new_tokens": opts.new_tokens,
                    "repeats": opts.repeats,
                    "threads": 1,
                    "results": summary,
                    "same_tokens_as_transformers": same,
                },
                indent=2,
            )
        )
    print(
        f"\ndsv4-tiny, prompt {opts.prompt_tokens} tokens, {opts.new_tokens} new, greedy, 1 thread, "
        f"{opts.repeats} alternating repeats; tokens/s min / median / max; ratio = ours / transformers"
    )
    print("same greedy tokens as transformers: " + ", ".join(f"{n}: {'yes' if s else 'no'}" for n, s in same.items()))
    print(format_table(["path", "phase", "min", "median", "max", "ratio min / med / max"], rows))


if __name__ == "__main__":
    main()
