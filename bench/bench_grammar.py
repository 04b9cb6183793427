"""Structured output's cost in the sampler: time per step with 1, 16 and 64 constrained rows at the real
vocabulary (129,280) on the CPU, next to the same rows unconstrained.

A constrained step is what the runner does (worker/runner.py): `GrammarBook.step_mask` fills the
bitmask of the active rows, `sample(..., token_mask=...)` applies it (worker/sampling.py), and each
row's matcher accepts its token. The rows' matchers stand at realistic places of
a JSON reply (inside a string, after a key, inside a number, between items), advanced along their own
samples, and are reset when they finish. Unconstrained: the same `sample` call on the same logits with
no mask. Both are timed greedy (the common decode case, a plain argmax) and sampled (temperature 1).
Target: the added time under 1 ms per constrained row per step. Beside it, untimed in the step: the
same mask applied alone by xgrammar's CPU kernel (grammar.TokenMask.apply), the floor for that part.
One torch thread (toolchain.md); levels alternate one step at a time, so this shared machine's load hits
them alike.

    python bench/bench_grammar.py [--levels 1 16 64] [--steps 30] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from dsv4serve.ipc.sampling import SamplingParams, StructuredOutput
from dsv4serve.worker.grammar import GrammarBook
from dsv4serve.worker.sampling import SamplingRow, sample

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: `bench.report`
from bench.report import format_table, spread

VOCAB, EOS = 129_280, 1
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}}},
    },
    "required": ["name", "age", "tags", "address"],
}
STARTS = [
    '{"name": "Ada Lov',
    '{"name": "x", "age": ',
    '{"name": "x", "age": 3',
    '{"name": "x", "age": 1, "tags": ["a", ',
]


class Level:
    """`rows` requests decoding together, constrained or not, greedy or sampled."""

    def __init__(self, book: GrammarBook, rows: int, constrained: bool, greedy: bool):
        self.book, self.rows, self.constrained = book, rows, constrained
        structured = StructuredOutput("json_schema", json.dumps(SCHEMA)) if constrained else None
        self.params = SamplingParams(temperature=0.0 if greedy else 1.0, structured=structured)
        self.outputs: list[list[int]] = [[] for _ in range(rows)]
        self.grammars = [self._fresh(i) for i in range(rows)]
        self.generator = torch.Generator().manual_seed(rows)
        self.apply_s: list[float] = []  # xgrammar's kernel alone on this step's mask (outside the step's time)

    def _fresh(self, i: int):
        grammar = self.book.start(self.params)
        if grammar is not None:
            grammar.matcher.accept_string(STARTS[i % len(STARTS)])
        return grammar

    def step(self, logits: torch.Tensor) -> float:
        """One sampler step over logits [rows, V]; the seconds it took."""
        rows = [SamplingRow(self.params, (), out, EOS) for out in self.outputs]
        start = time.perf_counter()
        mask = self.book.step_mask(self.grammars) if self.constrained else None
        picked = sample(logits, rows, self.generator, token_mask=mask).token_ids.tolist()
        for grammar, token in zip(self.grammars, picked):
            if grammar is not None:
                grammar.advance(token)
        elapsed = time.perf_counter() - start
        if mask is not None:
            work = logits.clone()
            start = time.perf_counter()
            mask.apply(work)
            self.apply_s.append(time.perf_counter() - start)
        for i, token in enumerate(picked):
            self.outputs[i] = self.outputs[i][-32:] + [token]
            if self.grammars[i] is not None and not self.grammars[i].wants_mask:  # finished: start over
                self.grammars[i], self.outputs[i] = self._fresh(i), []
        return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    book = GrammarBook("", VOCAB, EOS)
    book.compile(StructuredOutput("json_schema", json.dumps(SCHEMA)))  # the compile is not a step's cost
    keys = [(n, c, g) for n in args.levels for g in (True, False) for c in (False, True)]
    levels = {k: Level(book, *k) for k in keys}
    logits = {n: torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(n)) * 4 for n in args.levels}
    times: dict[tuple, list[float]] = {k: [] for k in keys}
    for _ in range(args.steps):
        for key in keys:
            times[key].append(levels[key].step(logits[key[0]]))
    rows, out = [], []
    for n in args.levels:
        for greedy in (True, False):
            free = spread(times[(n, False, greedy)])
            held = spread(times[(n, True, greedy)])
            added = (held["median"] - free["median"]) / n
            kernel = spread(levels[(n, True, greedy)].apply_s)["median"] / n
            out.append(
                {
                    "rows": n,
                    "greedy": greedy,
                    "unconstrained_s": free,
                    "constrained_s": held,
                    "added_per_row_s": added,
                    "xgrammar_apply_per_row_s": kernel,
                }
            )
            rows.append(
                [
                    f"{n} rows, {'greedy' if greedy else 'temperature 1'}",
                    f"{free['median'] * 1e3:.2f}",
                    f"{held['median'] * 1e3:.2f} ({held['min'] * 1e3:.2f}-{held['max'] * 1e3:.2f})",
                    f"{added * 1e3:.3f}",
                    f"{kernel * 1e3:.3f}",
                ]
            )
    print(f"sampler step at vocabulary {VOCAB:,}, {args.steps} steps per level, one torch thread (median ms)")
    header = ["level", "unconstrained", "constrained (min-max)", "added ms / row", "xgrammar apply ms / row"]
    print(format_table(header, rows))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
