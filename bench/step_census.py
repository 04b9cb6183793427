"""Step census: the device kernel launches and host-device syncs of one decode step (and one prefill chunk)
on the code path the CUDA worker runs, counted on the CPU, per layer and component, projected to
DeepSeek-V4-Flash.

dsv4-tiny (every layer kind of the real model at toy width) is built as a CUDA worker builds it, every
kernel on Triton (in the interpreter), weights loaded packed, optionally behind an expert-slot cache; B
requests are brought to a steady decode state and ONE decode step of B rows is counted (then a second,
to compare the two steps' op sequences: CUDA graphs need them equal). What counts as a launch or a sync,
and why: bench/census/counter.py; components: bench/census/attribution.py; projection:
bench/census/summary.py. Counts, not times: the wall times are the interpreter's.

    python bench/step_census.py [--batch 1 8 64] [--moe-cache-size none half] [--json PATH]
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any dsv4_kernels import: the kernels run in the interpreter

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: `bench.census`
from bench.census.engine import build_census_engine
from bench.census.steps import CHAT, GREEDY, decode_census, prefill_census
from bench.census.summary import compare_steps, project, summarize
from bench.gpu_cases import real_config_dir
from bench.report import format_table
from dsv4serve.env import read_environment
from dsv4serve.model.args import read_model_args
from dsv4serve.tiny.builder import ensure_tiny


def cache_sizes(values: list[str], n_experts: int) -> list[int | None]:
    """ "none" -> no slot cache; "half" -> half the routed experts; N -> N slots."""
    named = {"none": None, "half": n_experts // 2}
    return [named[v] if v in named else int(v) for v in values]


def run_all(opts: argparse.Namespace) -> dict:
    ranks = opts.tensor_parallel_size
    tiny = ensure_tiny(opts.cache_dir, split=ranks > 1)  # dsv4-tiny does not split: its widened variant does
    real = read_model_args(opts.real_config)
    twin, runs = None, []
    sampling = GREEDY if opts.greedy else CHAT
    for slots in opts.slots:
        for batch in opts.batch:
            engine = build_census_engine(
                tiny, batch, opts.prompt_tokens + 64, slots, twin, not opts.enforce_eager, None, ranks, opts.ep
            )
            twin = engine.twin
            steps = decode_census(engine, batch, opts.prompt_tokens, sampling, opts.settle_steps, opts.compare_gap)
            s = summarize(steps[0], engine.args)
            s["compare"] = compare_steps(steps[0].seen, steps[1].seen) if len(steps) > 1 else None
            runs.append({"batch": batch, "cache_slots": slots, **s, "projected": project(s, real)})
            print(
                f"decode B={batch} slots={slots}: {s['total']['launches']} launches, {s['total']['syncs']} syncs"
                + (f", {s['collectives']['calls']} collectives" if ranks > 1 else "")
            )
        if opts.prefill_tokens:
            length = opts.prefill_context + 2 * opts.prefill_tokens
            engine = build_census_engine(tiny, 1, length, slots, twin, not opts.enforce_eager, None, ranks, opts.ep)
            step = prefill_census(engine, opts.prefill_context, opts.prefill_tokens, sampling)
            s = summarize(step, engine.args)
            runs.append({"batch": 1, "cache_slots": slots, **s, "projected": project(s, real)})
            print(f"prefill {opts.prefill_tokens} tokens slots={slots}: {s['total']['launches']} launches")
    return {
        "model": tiny.name,
        "real_config": str(opts.real_config),
        "sampling": repr(sampling),
        "decode_path": "eager (--enforce-eager)" if opts.enforce_eager else "decode buckets (static buffers)",
        "rank": None if ranks == 1 else f"rank 0 of {ranks}, experts {'owned (EP)' if opts.ep else 'split'}",
        "runs": runs,
    }


def table(result: dict) -> str:
    rows = []
    for r in result["runs"]:
        k, p, t = r["per_kind"], r["projected"], r["total"]
        per = [
            f"{k[kind]['launches_per_layer']:.0f} / {k[kind]['syncs_per_layer']:.0f}" for kind in ("swa", "csa", "hca")
        ]
        c = r.get("compare")
        static = "-" if not c else "yes" if c["static"] else "forward" if c["forward_static"] else "no"
        step = f"{r['per_step']['launches']} / {r['per_step']['syncs']}"
        outside = f"{r['outside_forward']['launches']} / {r['outside_forward']['syncs']}"
        rows.append(
            [f"{r['phase']} x{r['tokens']}", r["batch"], r["cache_slots"] or "-", *per, step, outside,
             f"{t['launches']} / {t['syncs']}", f"{p['launches']} / {p['syncs']}", static,
             f"{r['collectives']['calls']} / {p['collectives']}"]
        )  # fmt: skip
    kinds = result["runs"][0]["projected"]["layers"]
    headers = ["step", "B", "slots", "swa/layer", "csa/layer", "hca/layer", "per-step", "outside fwd", "tiny",
               "V4-Flash", "static", "collectives"]  # fmt: skip
    return (
        "launches / syncs; V4-Flash = per-kind counts x its layers "
        + ", ".join(f"{n} {kind}" for kind, n in kinds.items())
        + " + the per-step parts; outside fwd: the per-step parts outside the model's forward (sampler, runner,"
        + " slot-cache boundary), what a CUDA graph of the decode forward leaves around its replay; static: two decode"
        + " steps a page apart issue the same ops and shapes (forward: the forward's do, the rest not); collectives:"
        + " a tensor-parallel rank's calls, tiny / V4-Flash (--tensor-parallel-size)\n"
        + format_table(headers, [[str(c) for c in row] for row in rows])
    )


def details(result: dict, top: int = 15) -> str:
    lines = []
    for r in result["runs"]:
        lines.append(f"\n{r['phase']} B={r['batch']} slots={r['cache_slots']}: top sync sites")
        lines += [f"  {x['count']:5d}  {x['site']}  ({x['what']})" for x in r["sync_sites"][:top]]
        for kind, k in r["per_kind"].items():
            comps = ", ".join(f"{c} {n / k['layers']:.0f}" for c, n in list(k["components"].items())[:6])
            lines.append(f"  {kind} launches/layer by component: {comps}")
        comps = ", ".join(f"{c} {n}" for c, n in r["per_step"]["components"].items())
        lines.append(f"  per-step launches by component: {comps}")
        c = r.get("compare")
        if c and not c["static"]:
            lines.append(
                f"  two decode steps a page apart differ in {c['blocks']} blocks, {c['differing_entries']} of "
                f"{c['lengths']} entries; Triton scalar arguments changed at {list(c['triton_scalar_changes'])}"
            )
            lines += [
                f"    {d['change']} {d['entries']} at {d['site']}: {d['a'][:90]} -> {d['b'][:90]}"
                for d in c["first_differences"][:3]
            ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64], help="decode rows B")
    parser.add_argument("--moe-cache-size", nargs="+", default=["none", "half"], help="slots: none, half or N")
    parser.add_argument("--prompt-tokens", type=int, default=192, help="each decode request's prompt")
    parser.add_argument("--prefill-tokens", type=int, default=256, help="the prefill chunk counted (0: none)")
    parser.add_argument("--prefill-context", type=int, default=256, help="tokens before the prefill chunk")
    parser.add_argument("--settle-steps", type=int, default=1, help="uncounted real-path decode steps first")
    parser.add_argument(
        "--compare-gap", type=int, default=0, help="count a 2nd decode step this many positions later (0: a page)"
    )
    parser.add_argument(
        "--enforce-eager", action="store_true", help="decode without the static-buffer buckets (as --enforce-eager)"
    )
    parser.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="count rank 0 of N (dsv4-tiny-split; no slot cache)"
    )
    parser.add_argument("--expert-parallel", dest="ep", action="store_true", help="with N > 1: experts owned whole")
    parser.add_argument("--greedy", action="store_true", help="greedy sampling instead of temperature 0.6, top-p 0.95")
    parser.add_argument("--cache-dir", type=Path, default=read_environment().cache_dir, help="holds dsv4-tiny")
    parser.add_argument("--real-config", type=Path, default=real_config_dir(), help="the projection's config")
    parser.add_argument("--json", type=Path, help="write the numbers here")
    opts = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)  # the sampler's draws
    args = read_model_args(ensure_tiny(opts.cache_dir))
    opts.slots = cache_sizes(opts.moe_cache_size, args.n_layers * args.n_routed_experts)
    result = run_all(opts)
    print(details(result))
    print()
    print(table(result))
    if opts.json:
        opts.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
