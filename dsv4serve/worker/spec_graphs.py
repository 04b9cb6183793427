"""Speculative steps on static buffers per batch bucket, and CUDA graphs of them (issue 19 item 5).

Two forwards of a speculating request run on static buffers, as the plain decode step does (worker/graphs.py):

- the verify step, per (bucket, n) for n = 1 .. N drafts: every row [last token, d_1 .. d_n] (n + 1 tokens, the
  equal-rows path of model/batch.py), padded to `bucket` rows with padding rows (token 0 at positions 0 .. n in
  the pool's padding slot and page, never a request's; each padding row takes a request's expert routing, as in
  worker/graphs.py), the logits of every position out ([bucket * (n + 1), V]
  through a static `picks`) and the main model's streams (the MTP block's input). The host-driven rollback
  (model/rollback.py save before, restore after) stays outside: it is built from the real rows alone, so a
  padding row is neither saved nor restored; what it writes lands in the padding slot and page only.
- one application of the MTP block to one token a row (the draft chain's step), per bucket: its token ids and
  input streams are device tensors copied into the bucket's static buffers, and its positions advance by one on
  the device after each application, so the chain's N - 1 applications are N - 1 replays of one graph with no
  host work between them. The catch-up over the kept positions (1 .. n + 1 tokens a row, varying) stays eager.

On CUDA each bucket's forward is captured at start-up into the decode graphs' memory pool, largest first, with
the expert-slot cache's step boundary outside the graph; without CUDA the same buffers run eagerly.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dsv4serve.experts import graph_cuts
from dsv4serve.experts.slot_cache import ExpertSlotCache
from dsv4serve.model.batch import BatchLayout, RowSpan
from dsv4serve.model.kv_pool import KvPool
from dsv4serve.model.numerics import Numerics
from dsv4serve.model.transformer import Transformer
from dsv4serve.worker.graphs import bucket_sizes, takes_cuts

log = logging.getLogger("dsv4serve.worker")

Entry = tuple[Sequence[int], int, int, Sequence[int]]  # (token ids, first position, slot, page ids) of one row


@dataclass
class StaticRows:
    """`rows` rows of `tokens` tokens each on one metadata buffer (filled on the host, copied once a step)."""

    rows: int
    tokens: int
    host: torch.Tensor  # [n] int32 (pinned on CUDA)
    device: torch.Tensor  # [n] int32, the layout's views
    layout: BatchLayout
    advance: torch.Tensor  # positions and start positions, contiguous: the chain adds 1 per application
    graph: graph_cuts.CutGraph | None = None  # once captured
    outputs: Any = None  # the captured forward's outputs


def static_rows(device: torch.device, rows: int, tokens: int, width: int, max_end: int, pad: Entry) -> StaticRows:
    """The buffer: ids [R*T] | positions [R*T] | starts [R] | cu [R+1] | slots [R] | last [R] | table [R, W] |
    route rows [R*T], filled with padding rows (what a capture at start-up runs on)."""
    n_tok = rows * tokens
    n = 2 * n_tok + rows + (rows + 1) + 2 * rows + rows * width + n_tok
    pin = device.type == "cuda"
    host = torch.zeros(n, dtype=torch.int32, device="cpu")
    host = host.pin_memory() if pin else host
    dev = torch.zeros(n, dtype=torch.int32, device=device) if pin else host
    o = [0, n_tok, 2 * n_tok, 2 * n_tok + rows, 2 * n_tok + 2 * rows + 1, 2 * n_tok + 3 * rows + 1]
    o.append(o[-1] + rows)
    o.append(o[-1] + rows * width)
    spans = tuple(RowSpan(b, b * tokens, (b + 1) * tokens, pad[1], pad[2]) for b in range(rows))
    layout = BatchLayout(
        spans,
        dev[o[0] : o[1]],
        dev[o[1] : o[2]],
        dev[o[3] : o[4]],
        dev[o[2] : o[3]],
        dev[o[4] : o[5]],
        dev[o[5] : o[6]],
        dev[o[6] : o[7]].view(rows, width),
        tokens,
        max_end,
        dev[o[7] :],
    )
    static = StaticRows(rows, tokens, host, dev, layout, dev[o[1] : o[3]])
    fill(static, [], pad, width)
    return static


def fill(b: StaticRows, entries: Sequence[Entry], pad: Entry, width: int) -> tuple[RowSpan, ...]:
    """Write the rows (padded with `pad`) into the bucket's host buffer and copy it to the device once;
    returns the host spans of the padded rows (the eager per-row paths read positions and slots there)."""
    t = b.tokens
    rows = list(entries) + [pad] * (b.rows - len(entries))
    if any(len(e[0]) != t for e in rows):
        raise ValueError(f"a static bucket runs rows of {t} tokens")
    values = [tok for e in rows for tok in e[0]]
    values += [e[1] + j for e in rows for j in range(t)]
    values += [e[1] for e in rows]
    values += [i * t for i in range(b.rows + 1)]
    values += [e[2] for e in rows]
    values += [(i + 1) * t - 1 for i in range(b.rows)]
    for e in rows:
        values += list(e[3]) + [-1] * (width - len(e[3]))
    live = len(entries) or b.rows  # padding row i routes as row i mod live (all padding: itself)
    values += [(i % live) * t + j for i in range(b.rows) for j in range(t)]
    b.host.copy_(torch.tensor(values, dtype=torch.int32, device="cpu"))
    if b.device is not b.host:
        b.device.copy_(b.host, non_blocking=True)  # pinned: the host does not wait
    return tuple(RowSpan(i, i * t, (i + 1) * t, e[1], e[2]) for i, e in enumerate(rows))


def capture(
    b: StaticRows, forward: Callable[[BatchLayout], Any], mempool: Any, expert_cache: ExpertSlotCache | None
) -> None:
    """Warm up `forward` on a side stream (lazy initialization and compiles stay out of the graph), then capture
    it with the expert-slot cache's step boundary outside."""
    device = b.device.device
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        forward(dataclasses.replace(b.layout))
    torch.cuda.current_stream(device).wait_stream(stream)
    if expert_cache is not None:
        expert_cache.begin_step()
    # a fresh layout: its int64 views are captured too; cut where the host stages unpinned layers' experts
    with graph_cuts.capture(mempool, takes_cuts(expert_cache)) as graph:
        outputs = forward(dataclasses.replace(b.layout))
    if expert_cache is not None:
        expert_cache.end_step()
    b.graph, b.outputs = graph, outputs


def replay(b: StaticRows, expert_cache: ExpertSlotCache | None) -> Any:
    assert b.graph is not None, "captured first"
    if expert_cache is not None:  # the layers' hooks do not run in a replay: the boundary is here
        expert_cache.begin_step()
    b.graph.replay()
    if expert_cache is not None:
        expert_cache.end_step()
    return b.outputs


@dataclass(frozen=True)
class SpecGraphReport:
    verify: tuple[tuple[int, int], ...]  # (bucket rows, drafts n)
    chain: tuple[int, ...]  # MTP single-token buckets
    captured: bool
    capture_s: float
    graph_bytes: int

    def describe(self) -> str:
        how = "CUDA graphs" if self.captured else "static buffers, eager"
        rows = sorted({r for r, _ in self.verify})
        ns = sorted({n for _, n in self.verify})
        return (
            f"speculative steps on {how}: verify for batch sizes {', '.join(map(str, rows))} x drafts "
            f"{', '.join(map(str, ns))}, MTP draft chain for batch sizes {', '.join(map(str, self.chain))}; "
            f"capture {self.capture_s:.1f} s, {self.graph_bytes / 2**20:.0f} MiB"
        )


class SpecGraphs:
    """The verify buckets (rows, n) and the MTP chain buckets (rows) of one engine (module doc)."""

    def __init__(
        self,
        model: Transformer,
        pool: KvPool,
        numerics: Numerics,
        max_rows: int,
        max_model_len: int,
        num_drafts: int,
        pad_slot: int,
        pad_page: int,
        capture: bool,
        expert_cache: ExpertSlotCache | None = None,
        sizes: tuple[int, ...] | None = None,
        mempool: Any = None,
    ):
        self.model, self.pool, self.numerics, self.expert_cache = model, pool, numerics, expert_cache
        self.device = model.embed.weight.device
        self.width = -(-max_model_len // pool.page_tokens)
        self.max_end, self.pad_slot, self.pad_page = max_model_len, pad_slot, pad_page
        sizes = sizes or bucket_sizes(max_rows)
        dev, w, end, pad = self.device, self.width, max_model_len, self._pad
        ns = range(1, num_drafts + 1)
        self.verify = {(r, n): static_rows(dev, r, n + 1, w, end, pad(n + 1)) for r in sizes for n in ns}
        self.chain = {r: static_rows(dev, r, 1, w, end, pad(1)) for r in sizes} if num_drafts > 1 else {}
        hc, d = model.args.hc_mult, model.args.dim
        self.streams = {r: torch.zeros(r, hc, d, dtype=numerics.compute_dtype, device=dev) for r in self.chain}
        # [R*T] int64: every position's logits (the verify picks), static so that a graph can hold it
        self.picks = {key: torch.arange(key[0] * (key[1] + 1), device=dev) for key in self.verify}
        self.counts = {"verify_static": 0, "chain_static": 0}  # steps that ran here (the rest ran eager)
        self.report = self._capture(mempool) if capture else self._report(False, 0.0, 0)

    def _report(self, captured: bool, seconds: float, nbytes: int) -> SpecGraphReport:
        return SpecGraphReport(tuple(sorted(self.verify)), tuple(sorted(self.chain)), captured, seconds, nbytes)

    def chain_bucket(self, rows: int) -> int | None:
        return min((r for r in self.chain if r >= rows), default=None)

    def verify_bucket(self, rows: int, n: int) -> tuple[int, int] | None:
        fits = [key for key in self.verify if key[1] == n and key[0] >= rows]
        return min(fits, default=None)

    def _pad(self, tokens: int) -> Entry:
        return ([0] * tokens, 0, self.pad_slot, [self.pad_page])

    # ------------------------------------------------------------------ verify

    def _verify_forward(self, key: tuple[int, int]) -> Callable[[BatchLayout], Any]:
        def forward(layout: BatchLayout) -> tuple[torch.Tensor, list[torch.Tensor]]:
            out = self.model.run(layout, self.pool, self.numerics, return_hidden=True, picks=self.picks[key])
            assert out.last_logits is not None and out.hidden is not None
            return out.last_logits, out.hidden  # [R*T, V] fp32; per row [T, hc, D], views of the last streams

        return forward

    def run_verify(self, entries: Sequence[Entry]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Verify rows of n + 1 tokens each -> (logits [rows * (n + 1), V] fp32, streams per row [n + 1, hc, D])."""
        n = len(entries[0][0]) - 1
        key = self.verify_bucket(len(entries), n)
        if key is None:
            raise ValueError(f"no verify bucket holds {len(entries)} rows of {n} drafts")
        b = self.verify[key]
        spans = fill(b, entries, self._pad(n + 1), self.width)
        if b.graph is not None:
            logits, streams = replay(b, self.expert_cache)
        else:
            logits, streams = self._verify_forward(key)(dataclasses.replace(b.layout, spans=spans))
        self.counts["verify_static"] += 1
        return logits[: len(entries) * (n + 1)], streams[: len(entries)]

    # ------------------------------------------------------------------ MTP chain

    def _chain_forward(self, rows: int) -> Callable[[BatchLayout], Any]:
        def forward(layout: BatchLayout) -> tuple[torch.Tensor, torch.Tensor]:
            out = self.model.run_mtp(layout, self.pool, self.streams[rows], self.numerics)
            assert out.last_logits is not None and out.hidden is not None
            return out.last_logits, torch.cat(out.hidden)  # [R, V] fp32, [R, hc, D]

        return forward

    def chain_start(self, entries: Sequence[tuple[int, int, Sequence[int]]]) -> ChainRun:
        """The chain's rows (MTP position of the first application, slot, pages): one fill, one copy."""
        rows = self.chain_bucket(len(entries))
        if rows is None:
            raise ValueError(f"no MTP chain bucket holds {len(entries)} rows")
        b = self.chain[rows]
        spans = fill(b, [([0], p, s, pages) for p, s, pages in entries], self._pad(1), self.width)
        self.counts["chain_static"] += 1
        return ChainRun(self, b, len(entries), spans)

    def _capture(self, mempool: Any) -> SpecGraphReport:
        t0 = time.monotonic()
        before = torch.cuda.memory_allocated(self.device)
        for key in sorted(self.verify, key=lambda k: (k[0] * (k[1] + 1), k), reverse=True):
            capture(self.verify[key], self._verify_forward(key), mempool, self.expert_cache)
        for rows in sorted(self.chain, reverse=True):
            capture(self.chain[rows], self._chain_forward(rows), mempool, self.expert_cache)
        torch.cuda.synchronize(self.device)
        report = self._report(True, time.monotonic() - t0, torch.cuda.memory_allocated(self.device) - before)
        log.info("%s", report.describe())
        return report


@dataclass
class ChainRun:
    """One draft chain on a chain bucket: `apply` runs the MTP block once on every row's previous draft."""

    graphs: SpecGraphs
    bucket: StaticRows
    num_rows: int
    spans: tuple[RowSpan, ...]  # the host spans of the first application (eager per-row paths)
    applied: int = 0

    def apply(self, tokens: torch.Tensor, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [P] int64 and streams [P, hc, D] on the device -> (draft logits [P, V] fp32, the block's output
        streams [P, hc, D]); the positions then advance by one, on the device."""
        g, b, p = self.graphs, self.bucket, self.num_rows
        b.layout.token_ids[:p].copy_(tokens)
        g.streams[b.rows][:p].copy_(streams)
        if b.graph is not None:
            logits, out = replay(b, g.expert_cache)
        else:
            k = self.applied
            spans = tuple(dataclasses.replace(s, start_pos=s.start_pos + k) for s in self.spans)
            logits, out = g._chain_forward(b.rows)(dataclasses.replace(b.layout, spans=spans))
        b.advance.add_(1)  # positions and start positions (padding rows' too: they stay in the padding slot)
        self.applied += 1
        return logits[:p], out[:p]
