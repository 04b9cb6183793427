"""The verify step's cost against a decode step (issue 19), on dsv4-tiny, whose random weights make its own
acceptance rate meaningless: what a speculative step costs, and the speed-up that buys at a given acceptance.

One step's pieces, each run on B rows whose context (`--context-tokens`) is already in the KV pool:
  decode     the main forward of 1 token per row, then `sampling.sample` and the read of the tokens;
  verify N   the main forward of N + 1 tokens per row (the last token and N drafts: a multi-token row as a short
             prefill chunk is), all positions' logits, then `spec_sampling.verify` and the read;
  sampler    the sampling part of decode / verify N alone, on fixed logits (included in the two above);
  mtp xT     the MTP block over T tokens per row (T = N + 1: the positions a verify step keeps, at most; T = 1:
             each further recurrent draft), then `spec_sampling.draft_tokens`.
  draft N = mtp x(N + 1) + (N - 1) x mtp x1; a speculative step costs verify N + draft N.
The positions do not advance between runs (each piece starts from the same state), so the pieces can alternate.

(a) Census (counts, not times) of each piece on the CUDA worker's code path (every kernel on Triton, through the
    interpreter; bench/census/counter.py says what a launch and a sync are); eager forwards (a decode bucket's CUDA
    graph replays the same ops).
(b) CPU milliseconds of each piece on the CPU worker's path (torch kernels, weights packed), one thread, the
    pieces alternating within each repeat; median of the repeats.
(c) The projected speed-up (bench/spec_projection.py) for acceptance 0.5..0.95 and N = 1..3, from the CPU times
    and from DeepSeek-V4-Flash's bandwidth model (batch 1 and the largest batch measured).

    python bench/bench_spec_verify.py [--batch 1 8] [--drafts 1 2 3] [--repeats 7] [--no-census] [--json PATH]
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any dsv4_kernels import: the census runs the kernels interpreted

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: `bench.*`
from bench.census.attribution import Attributor
from bench.census.counter import StepCounter
from bench.census.engine import cuda_worker_numerics
from bench.census.stand_ins import stand_ins
from bench.gpu_cases import real_config_dir
from bench.report import format_table
from bench.spec_projection import BandwidthModel, expected_tokens, speedup
from dsv4serve.checkpoint.loader import open_checkpoint
from dsv4serve.env import read_environment
from dsv4serve.ipc.sampling import SamplingParams
from dsv4serve.model.args import read_model_args
from dsv4serve.model.batch import HostStaging, build_layout
from dsv4serve.model.kv_pool import KvPool
from dsv4serve.model.numerics import Numerics
from dsv4serve.model.packed_load import load_packed
from dsv4serve.model.transformer import BatchRow, ForwardOutput, Transformer
from dsv4serve.tiny.builder import ensure_tiny
from dsv4serve.worker.model_load import worker_numerics
from dsv4serve.worker.sampling import SamplingRow, sample
from dsv4serve.worker.spec_sampling import draft_tokens, verify

CPU = torch.device("cpu")
CHAT = SamplingParams(temperature=0.6, top_p=0.95)  # a chat request's sampling: the full sampler runs
ACCEPTANCE = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95)


class Rows:
    """B sequences in one pool with `context` tokens computed (main and MTP layers), and what each piece needs."""

    def __init__(self, model: Transformer, num: Numerics, batch: int, context: int, max_drafts: int, seed: int = 0):
        args = model.args
        gen = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1000, 100_000, (batch, context + max_drafts + 2), generator=gen)  # [B, L]
        self.pool = KvPool(args, num.compute_dtype, 16, batch, include_mtp=True, device=CPU, standalone=True)
        self.states = [self.pool.new_sequence() for _ in range(batch)]
        self.context = context
        self.id_lists: list[list[int]] = self.ids.tolist()
        self.staging = HostStaging(CPU)
        out = model([BatchRow(self.ids[b, :context], st) for b, st in enumerate(self.states)], num, return_hidden=True)
        assert out.hidden is not None
        model.forward_mtp(
            [BatchRow(self.ids[b, 1 : context + 1], st) for b, st in enumerate(self.states)], out.hidden, num
        )
        self.sampling = [SamplingRow(CHAT, (), (), args.eos_token_id)] * batch
        self.hidden: dict[int, list[torch.Tensor]] = {}  # T -> per row [T, hc, D]: a verify's streams, MTP input
        self.drafts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # N -> (q [B, N, V], d [B, N])

    def main_forward(self, model: Transformer, num: Numerics, tokens: int, all_logits: bool) -> ForwardOutput:
        """`tokens` tokens per row through the main model as the runner runs a step: the layout from the host
        lists, copied once through the staging buffer, then `Transformer.run`."""
        c = self.context
        for st in self.states:
            self.pool.reserve(st, c + tokens)
        token_lists = [ids[c : c + tokens] for ids in self.id_lists]  # host lists, as a plan's rows carry them
        layout = build_layout(
            token_lists, [c] * len(self.states), [st.slot for st in self.states], [st.pages for st in self.states],
            CPU, staging=self.staging,
        )  # fmt: skip
        return model.run(layout, self.pool, num, all_logits=all_logits, return_hidden=True)

    def mtp_forward(self, model: Transformer, num: Numerics, tokens: int, hidden: list[torch.Tensor]) -> ForwardOutput:
        """The MTP block over `tokens` positions per row from the context on (the main streams `hidden` paired
        with the tokens after them), as the runner's drafter runs it: a staged layout, then `run_mtp`."""
        c = self.context
        for st in self.states:
            self.pool.reserve(st, c + tokens)
        token_lists = [ids[c + 1 : c + 1 + tokens] for ids in self.id_lists]
        layout = build_layout(
            token_lists, [c] * len(self.states), [st.slot for st in self.states], [st.pages for st in self.states],
            CPU, staging=self.staging,
        )  # fmt: skip
        return model.run_mtp(layout, self.pool, torch.cat(hidden), num)

    def rewind(self) -> None:
        for st in self.states:
            st.num_tokens = st.mtp_num_tokens = self.context


def pieces(model: Transformer, num: Numerics, rows: Rows, drafts: list[int]) -> dict[str, Callable[[], object]]:
    """name -> one run of that piece (module doc); inputs that come from earlier pieces are prepared here."""
    vocab, gen = model.args.vocab_size, torch.Generator().manual_seed(1)
    for n in drafts:
        q = torch.rand(len(rows.states), n, vocab, generator=gen).softmax(-1)
        rows.drafts[n] = (q, torch.multinomial(q.flatten(0, 1), 1, generator=gen).view(len(rows.states), n))
        for t in {n + 1, 1}:
            out = rows.main_forward(model, num, t, all_logits=False)
            assert out.hidden is not None
            rows.hidden[t] = out.hidden
            rows.rewind()

    def decode() -> object:
        out = rows.main_forward(model, num, 1, all_logits=False)
        assert out.last_logits is not None
        result = sample(out.last_logits, rows.sampling).packed().tolist()  # the step's one read
        rows.rewind()
        return result

    def verify_n(n: int) -> Callable[[], object]:
        def run() -> object:
            out = rows.main_forward(model, num, n + 1, all_logits=True)
            logits = torch.stack(out.logits)  # [B, N + 1, V]
            q, d = rows.drafts[n]
            result = verify(logits, q, d, rows.sampling).packed().tolist()  # the step's one read
            rows.rewind()
            return result

        return run

    def mtp(t: int) -> Callable[[], object]:
        def run() -> object:
            out = rows.mtp_forward(model, num, t, rows.hidden[t])
            assert out.last_logits is not None
            result = draft_tokens(out.last_logits, rows.sampling)
            rows.rewind()
            return result

        return run

    logits = {t: torch.randn(len(rows.states), t, vocab, generator=gen) for t in {1} | {n + 1 for n in drafts}}

    def sampler_only(n: int) -> Callable[[], object]:  # the sampling part of decode / verify N, on fixed logits
        if n == 0:
            return lambda: sample(logits[1][:, 0], rows.sampling).packed().tolist()
        return lambda: verify(logits[n + 1], *rows.drafts[n], rows.sampling).packed().tolist()

    named: dict[str, Callable[[], object]] = {"decode": decode}
    named |= {f"verify N={n}": verify_n(n) for n in drafts}
    named |= {"sampler decode": sampler_only(0)} | {f"sampler verify N={n}": sampler_only(n) for n in drafts}
    named |= {f"mtp x{t}": mtp(t) for t in sorted({n + 1 for n in drafts} | {1})}
    return named


def draft_cost(values: dict[str, float], n: int) -> float:
    return values[f"mtp x{n + 1}"] + (n - 1) * values["mtp x1"]


def census(model: Transformer, num: Numerics, rows: Rows, drafts: list[int]) -> dict[str, dict]:
    """Launches and syncs of each piece on the Triton path (the interpreter)."""
    result: dict[str, dict] = {}
    with stand_ins():
        named = pieces(model, num, rows, drafts)
        for name, run in named.items():
            run()  # first: imports and per-process caches, not a step's work
            t0 = time.perf_counter()
            with StepCounter(Attributor(model)) as seen:
                run()
            wall_s, sites = time.perf_counter() - t0, sorted({s.site for s in seen.syncs})
            result[name] = {"launches": seen.count(), "syncs": len(seen.syncs), "wall_s": wall_s, "sync_sites": sites}
            print(f"  census {name}: {result[name]['launches']} launches, {result[name]['syncs']} syncs", flush=True)
    return result


def cpu_times(model: Transformer, num: Numerics, rows: Rows, drafts: list[int], repeats: int) -> dict[str, dict]:
    """Milliseconds per piece, the pieces alternating within each repeat (one warm-up round first)."""
    named = pieces(model, num, rows, drafts)
    samples: dict[str, list[float]] = {name: [] for name in named}
    for rep in range(repeats + 1):
        for name, run in named.items():
            t0 = time.perf_counter()
            run()
            if rep:
                samples[name].append(1e3 * (time.perf_counter() - t0))
    return {k: {"median_ms": statistics.median(v), "min_ms": min(v), "max_ms": max(v)} for k, v in samples.items()}


def projection_rows(costs: dict[int, tuple[float, float, float]]) -> list[list[str]]:
    """costs: N -> (decode, verify N, draft N) -> one table row per N: the speed-up at each acceptance."""
    return [
        [f"N={n}", f"{(v + d) / dec:.2f}", *(f"{speedup(a, n, dec, v, d):.2f}" for a in ACCEPTANCE)]
        for n, (dec, v, d) in costs.items()
    ]


def report(result: dict, drafts: list[int]) -> str:
    out = []
    head = ["step cost / decode", *(f"a={a}" for a in ACCEPTANCE)]
    out.append("expected tokens per verify step E = (1 - a^(N+1)) / (1 - a):")
    out.append(format_table(["", *(f"a={a}" for a in ACCEPTANCE)], [
        [f"N={n}", *(f"{expected_tokens(a, n):.2f}" for a in ACCEPTANCE)] for n in drafts]))  # fmt: skip
    for r in result["runs"]:
        b = r["batch"]
        if "census" in r:
            c = r["census"]
            out.append(f"\nB={b} census (launches / syncs), Triton path:")
            names = list(c)
            out.append(format_table(["piece", "launches", "syncs", "vs decode"], [
                [k, str(c[k]["launches"]), str(c[k]["syncs"]), f"{c[k]['launches'] / c['decode']['launches']:.2f}"]
                for k in names]))  # fmt: skip
            launches = {k: float(v["launches"]) for k, v in c.items()}
            counted = {n: (launches["decode"], launches[f"verify N={n}"], draft_cost(launches, n)) for n in drafts}
            out.append(f"B={b} speed-up if a step cost its launches (launch-bound GPU, no graphs):")
            out.append(format_table(["", *head], projection_rows(counted)))
        t = {k: v["median_ms"] for k, v in r["cpu_ms"].items()}
        out.append(f"\nB={b} CPU ms per piece (median of {result['repeats']}, one thread, torch path):")
        out.append(format_table(["piece", "median ms", "min", "max", "vs decode"], [
            [k, f"{v['median_ms']:.1f}", f"{v['min_ms']:.1f}", f"{v['max_ms']:.1f}", f"{t[k] / t['decode']:.2f}"]
            for k, v in r["cpu_ms"].items()]))  # fmt: skip
        measured = {n: (t["decode"], t[f"verify N={n}"], draft_cost(t, n)) for n in drafts}
        out.append(f"B={b} projected speed-up from the CPU times (dsv4-tiny on the CPU):")
        out.append(format_table(["", *head], projection_rows(measured)))
    for b, label in result["bandwidth"].items():
        for bound, costs in label.items():
            out.append(f"\nDeepSeek-V4-Flash bandwidth model, B={b}, routing {bound} (bytes read per step):")
            out.append(format_table(["", *head], projection_rows({int(n): tuple(v) for n, v in costs.items()})))
    return "\n".join(out)


def bandwidth(real_config: Path, batches: list[int], drafts: list[int]) -> dict:
    model = BandwidthModel.from_config(read_model_args(real_config))
    out: dict = {"_model": model.__dict__}
    out[1] = {
        bound: {n: model.costs(1, n, bound == "independent") for n in drafts} for bound in ("independent", "shared")
    }
    if max(batches) > 1:  # B requests route independently of each other: the "shared" bound is for one row only
        out[max(batches)] = {"independent": {n: model.costs(max(batches), n, True) for n in drafts}}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--drafts", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--context-tokens", type=int, default=192, help="tokens in each row's KV before the step")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--no-census", action="store_true", help="CPU times and projections only")
    parser.add_argument("--cache-dir", type=Path, default=read_environment().cache_dir, help="holds dsv4-tiny")
    parser.add_argument("--real-config", type=Path, default=real_config_dir())
    parser.add_argument("--json", type=Path)
    opts = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)  # the shared generator of the sampled rows
    ckpt = open_checkpoint(ensure_tiny(opts.cache_dir))
    cpu_num = worker_numerics(ckpt.args, "auto", CPU)  # the CPU worker's path: torch kernels
    cpu_model, _ = load_packed(ckpt, cpu_num.backends, CPU, True, progress=False)
    if not opts.no_census:
        gpu_num = cuda_worker_numerics(ckpt.args)
        gpu_model, _ = load_packed(ckpt, gpu_num.backends, CPU, True, progress=False)
        gpu_model.use_kernels(gpu_num.backends)
    runs = []
    for b in opts.batch:
        print(f"B={b}", flush=True)
        run: dict = {"batch": b}
        if not opts.no_census:
            rows = Rows(cpu_model, cpu_num, b, opts.context_tokens, max(opts.drafts))  # context on the torch path
            run["census"] = census(gpu_model, gpu_num, rows, opts.drafts)
        rows = Rows(cpu_model, cpu_num, b, opts.context_tokens, max(opts.drafts))
        run["cpu_ms"] = cpu_times(cpu_model, cpu_num, rows, opts.drafts, opts.repeats)
        runs.append(run)
    result = {"model": ckpt.folder.name if hasattr(ckpt, "folder") else "dsv4-tiny", "repeats": opts.repeats}
    result |= {"runs": runs, "bandwidth": bandwidth(opts.real_config, opts.batch, opts.drafts)}
    print(report({**result, "bandwidth": {k: v for k, v in result["bandwidth"].items() if k != "_model"}}, opts.drafts))
    if opts.json:
        opts.json.write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
