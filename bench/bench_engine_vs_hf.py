"""Prefill and decode tokens/s of dsv4serve's model path vs transformers' `generate`, side by side.

Same weights (the built-in dsv4-tiny checkpoint, FP8/FP4 dequantized by our loader, given to
transformers by tests/model/hf_oracle.py), same prompt, greedy, one thread. Every repeat runs each
path once, in a rotating order, so load on this shared machine hits all paths alike.

  prefill tokens/s = prompt tokens / t(1 new token)                 (the prompt forward + one sample)
  decode tokens/s  = (N - 1) / (t(N new tokens) - t(1 new token))   (prefill cancels out)

Paths: transformers `DeepseekV4ForCausalLM.generate` (fp32), its lightning indexer breaking exact
score ties toward the earlier entry as ours does (tests/model/hf_oracle.py: DeepSeek's reference
leaves the order of tied scores to topk's backend, transformers' CPU topk keeps another entry than
ours, and that alone changes the tokens past a few dozen prompt tokens); ours with numerics OFF
(fp32, the same arithmetic and tie rule, so the same tokens); ours with numerics ON (bf16 with the
FP8/FP4 simulation, what the server runs for an FP8 checkpoint such as dsv4-tiny); both as the server runs
them by default (--batch-invariant off: each projection one GEMM over the batch's tokens) and in the opt-in
batch-invariant mode (every projection one token at a time, the row-parallel ones summed in fp64: what
the engine tests compare bit for bit). Ratios are taken per repeat (ours / HF of the same repeat) and reported
as min / median / max.

    python bench/bench_engine_vs_hf.py [--prompt-tokens 128] [--new-tokens 32] [--repeats 5] [--clock wall|cpu]
        [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from dsv4serve.checkpoint.loader import load_dense_state_dict
from dsv4serve.env import read_environment
from dsv4serve.model.args import ModelArgs
from dsv4serve.model.backends import TORCH
from dsv4serve.model.numerics import NUMERICS_OFF, NUMERICS_ON, Numerics
from dsv4serve.model.transformer import BatchRow, Transformer
from dsv4serve.tiny.builder import ensure_tiny

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: bench.report, tests.model.hf_oracle
from bench.report import format_table, spread
from tests.model.hf_oracle import TieStats, hf_config, hf_model

Generate = Callable[[int], list[int]]  # number of new tokens -> the greedy tokens


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
    # an explicit mask: without one, generate treats every prompt token equal to pad_token_id as padding
    mask = torch.ones_like(prompt[None])
    with torch.no_grad():
        ids = hf.generate(
            prompt[None],
            attention_mask=mask,
            max_new_tokens=n_new,
            min_new_tokens=n_new,
            do_sample=False,
            pad_token_id=0,
        )
    return ids[0, prompt.shape[0] :].tolist()


def time_phases(
    generate: Generate, n_prompt: int, n_new: int, clock: Callable[[], float] = time.perf_counter
) -> tuple[float, float, list[int]]:
    """(prefill tokens/s, decode tokens/s, tokens) from one t(1) and one t(n_new) run."""
    t0 = clock()
    generate(1)
    t1 = clock()
    tokens = generate(n_new)
    t2 = clock()
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


def load_models() -> tuple[ModelArgs, Transformer, object, TieStats]:
    """Our model and transformers' model (indexer ties broken as ours, counted in the TieStats) holding
    the same dsv4-tiny weights."""
    from transformers.utils import logging

    logging.set_verbosity_error()
    args, state = load_dense_state_dict(ensure_tiny(read_environment().cache_dir))
    state = {k: v for k, v in state.items() if not k.startswith("mtp.")}  # transformers has no MTP
    model = Transformer(args, include_mtp=False).eval()
    model.load_state_dict(state, strict=True)
    model.use_kernels(TORCH)  # what the engine's load does on the CPU (the head held K-major: layers.py)
    hf, ties = hf_model(hf_config(args), state, args.n_layers, align_ties=True)
    return args, model, hf, ties


def prompt_ties(hf, ties: TieStats, prompt: torch.Tensor) -> dict[str, int]:
    """Indexer ties in one transformers prefill of `prompt` (no cache): the query rows that choose
    among more entries than top-k, those tied at the k-th / (k+1)-th score, and those where
    transformers' own topk would have chosen other entries than the earlier-entry rule."""
    before = (ties.rows_ranked, ties.boundary_ties, ties.rows_changed)
    with torch.no_grad():
        hf(prompt[None], use_cache=False)
    after = (ties.rows_ranked, ties.boundary_ties, ties.rows_changed)
    return dict(zip(("rows_ranked", "boundary_ties", "rows_changed"), (b - a for a, b in zip(before, after))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: this process's CPU time (one thread), robust to other processes taking the cores",
    )
    parser.add_argument("--json", type=Path, help="write the numbers here")
    opts = parser.parse_args()
    clock = time.process_time if opts.clock == "cpu" else time.perf_counter
    torch.set_num_threads(1)
    args, model, hf, tie_stats = load_models()
    prompt = torch.randint(0, args.vocab_size, (opts.prompt_tokens,), generator=torch.Generator().manual_seed(1))
    ties = prompt_ties(hf, tie_stats, prompt)
    # the server's default (--batch-invariant off: batched projections) and the opt-in per-token mode
    serving_off = dataclasses.replace(NUMERICS_OFF, batch_invariant=False)
    serving_on = dataclasses.replace(NUMERICS_ON, batch_invariant=False)
    paths: dict[str, Generate] = {
        "transformers": lambda k: hf_generate(hf, prompt, k),
        "ours numerics OFF": lambda k: ours_generate(model, prompt, k, serving_off),
        "ours numerics ON": lambda k: ours_generate(model, prompt, k, serving_on),
        "ours OFF, batch-invariant": lambda k: ours_generate(model, prompt, k, NUMERICS_OFF),
        "ours ON, batch-invariant": lambda k: ours_generate(model, prompt, k, NUMERICS_ON),
    }
    names = list(paths)
    rates = {name: {"prefill": [], "decode": []} for name in names}
    tokens: dict[str, list[int]] = {}
    for rep in range(opts.repeats):
        order = names[rep % len(names) :] + names[: rep % len(names)]  # rotate who runs first
        for name in order:
            prefill, decode, tokens[name] = time_phases(paths[name], opts.prompt_tokens, opts.new_tokens, clock)
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
                    "indexer_ties_in_prefill": ties,
                },
                indent=2,
            )
        )
    print(
        f"\ndsv4-tiny, prompt {opts.prompt_tokens} tokens, {opts.new_tokens} new, greedy, 1 thread, "
        f"{opts.repeats} alternating repeats, {opts.clock} clock; tokens/s min / median / max; "
        "ratio = ours / transformers"
    )
    print("same greedy tokens as transformers: " + ", ".join(f"{n}: {'yes' if s else 'no'}" for n, s in same.items()))
    print(
        f"indexer ties in the prompt's prefill (transformers given our earlier-entry rule): {ties['boundary_ties']} "
        f"of {ties['rows_ranked']} ranked query rows tie at the top-k boundary; transformers' own topk would "
        f"choose other entries in {ties['rows_changed']}"
    )
    print(format_table(["path", "phase", "min", "median", "max", "ratio min / med / max"], rows))


if __name__ == "__main__":
    main()
