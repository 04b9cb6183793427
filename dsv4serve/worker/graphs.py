"""The decode step replayed per batch bucket: static buffers, padding, and CUDA graphs.

A decode step (every row one token) has shapes that depend only on its row count once the block table's
width and the bound on a row's length come from max_model_len (model/batch.py). So for each bucket of
row counts (1, 2, 4, 8, ..., up to --max-num-seqs) the step runs on static buffers: the metadata of the
step is written into the bucket's pinned host buffer, copied once into its static device buffer, and the
model's forward (embedding to logits) runs over the layout that views that buffer. Rows past the step's
count are padding: token 0 at position 0 in the pool's padding slot and padding page (never a request's),
so they change no real row, and each takes a request's expert routing (`BatchLayout.route_rows`: row b that
of row b mod the step's rows), so padding reads or fetches no expert the requests do not and the slot cache
counts only the requests' uses. On CUDA each bucket's forward is captured once into a CUDA graph at start-up
and replayed (one launch for the whole step instead of thousands); without CUDA, or with
--enforce-eager, the same static-buffer path runs eagerly, which is how the CPU tests check padding and
bucket choice (the same tokens as the unpadded step). With hybrid CPU experts the MoE layers take the split
fixed between steps (experts/hybrid_graph.py: kt-kernel on the stream, no host sync), its CPU sets chosen at the
step boundary with the slot cache's, in the eager form too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from dsv4serve.experts import graph_cuts
from dsv4serve.experts.attach import cpu_experts_of
from dsv4serve.experts.hybrid_graph import GraphSplit
from dsv4serve.experts.slot_cache import ExpertSlotCache
from dsv4serve.memory.graph_memory import batch_buckets
from dsv4serve.model.batch import BatchLayout, RowSpan
from dsv4serve.model.kv_pool import KvPool
from dsv4serve.model.numerics import Numerics
from dsv4serve.model.transformer import Transformer

log = logging.getLogger("dsv4serve.worker")


def takes_cuts(expert_cache: ExpertSlotCache | None) -> bool:
    """Whether a captured step is cut (experts/graph_cuts.py): where the host stages some layers' experts mid-step."""
    return expert_cache is not None and bool(expert_cache.staged_layers)


def bucket_sizes(max_rows: int) -> tuple[int, ...]:
    """1, 2, 4, 8, ... below max_rows, then max_rows itself (the list the graph memory plan sums over)."""
    return tuple(batch_buckets(max_rows))


@dataclass
class _Bucket:
    rows: int
    host: torch.Tensor  # [n] int32, pinned on CUDA: this bucket's metadata, filled by the host each step
    device: torch.Tensor  # [n] int32: the static device copy the layout views
    layout: BatchLayout
    graph: graph_cuts.CutGraph | None = None  # once captured
    logits: torch.Tensor | None = None  # the captured forward's output [rows, vocab] fp32


@dataclass(frozen=True)
class GraphReport:
    buckets: tuple[int, ...]
    captured: bool  # CUDA graphs (else the static buffers run eagerly)
    capture_s: float
    graph_bytes: int  # device memory the captured graphs hold (their private pool)
    cuts: int = 0  # host points a step's graph is cut at (unpinned layers staged between segments)

    def describe(self) -> str:
        how = "CUDA graphs" if self.captured else "eager (static buffers, no graphs)"
        if self.cuts:
            how += f" cut in {self.cuts + 1} segments (the host stages {self.cuts} unpinned layers' experts between)"
        sizes = ", ".join(map(str, self.buckets))
        return (
            f"{how} for decode batch sizes {sizes}; capture {self.capture_s:.1f} s, {self.graph_bytes / 2**20:.0f} MiB"
        )


class DecodeGraphs:
    def __init__(
        self,
        model: Transformer,
        pool: KvPool,
        numerics: Numerics,
        max_rows: int,
        max_model_len: int,
        pad_slot: int,
        pad_page: int,
        capture: bool,
        expert_cache: ExpertSlotCache | None = None,
        sizes: tuple[int, ...] | None = None,
        mempool: Any = None,
    ):
        self.model, self.pool, self.numerics = model, pool, numerics
        self.expert_cache = expert_cache
        hybrid = cpu_experts_of(model)  # --moe-backend hybrid: its split fixed between steps, inside the graph
        self.hybrid: GraphSplit | None = hybrid.graph if hybrid is not None else None
        self.device = model.embed.weight.device
        self.width = -(-max_model_len // pool.page_tokens)
        self.max_end, self.pad_slot, self.pad_page = max_model_len, pad_slot, pad_page
        self.cut = takes_cuts(expert_cache)
        self.buckets = {n: self._bucket(n) for n in (sizes or bucket_sizes(max_rows))}
        self.report = self._capture(mempool) if capture else GraphReport(tuple(self.buckets), False, 0.0, 0)

    @property
    def max_rows(self) -> int:
        return max(self.buckets)

    def _bucket(self, rows: int) -> _Bucket:
        n = rows * (7 + self.width) + 1  # ids, positions, cu (rows + 1), start, slot, last, table, route rows
        pin = self.device.type == "cuda"
        host = torch.zeros(n, dtype=torch.int32, device="cpu")
        host = host.pin_memory() if pin else host
        device = torch.zeros(n, dtype=torch.int32, device=self.device) if pin else host
        self._fill(host, rows, [(0, 0, self.pad_slot, [self.pad_page])] * rows)
        if device is not host:
            device.copy_(host)
        o = [0, rows, 2 * rows, 3 * rows + 1, 4 * rows + 1, 5 * rows + 1, 6 * rows + 1, (6 + self.width) * rows + 1]
        spans = tuple(RowSpan(b, b, b + 1, 0, self.pad_slot) for b in range(rows))
        layout = BatchLayout(
            spans,
            device[o[0] : o[1]],
            device[o[1] : o[2]],
            device[o[2] : o[3]],
            device[o[3] : o[4]],
            device[o[4] : o[5]],
            device[o[5] : o[6]],
            device[o[6] : o[7]].view(rows, self.width),
            1,
            self.max_end,
            device[o[7] :],
        )
        return _Bucket(rows, host, device, layout)

    def _fill(self, host: torch.Tensor, rows: int, entries: list[tuple[int, int, int, list[int]]]) -> None:
        """entries: (token, position, slot, pages) per row, padded to `rows` with padding rows (module doc)."""
        live = len(entries) or rows  # all padding (the capture's warm-up): each row routes itself
        entries = entries + [(0, 0, self.pad_slot, [self.pad_page])] * (rows - len(entries))
        values = [e[0] for e in entries] + [e[1] for e in entries] + list(range(rows + 1))
        values += [e[1] for e in entries] + [e[2] for e in entries] + list(range(rows))
        for _, _, _, pages in entries:
            values += list(pages) + [-1] * (self.width - len(pages))
        values += [b % live for b in range(rows)]
        host.copy_(torch.tensor(values, dtype=torch.int32, device="cpu"))

    def bucket_for(self, rows: int) -> int | None:
        return min((n for n in self.buckets if n >= rows), default=None)

    def run(
        self, entries: list[tuple[int, int, int, list[int]]], eager: bool = False, same_split: bool = False
    ) -> torch.Tensor:
        """One decode step: (token, position, slot, pages) per row -> logits [rows, vocab] fp32; `eager`: the
        eager form even where the bucket is captured, and `same_split`: with the hybrid CPU sets of the step
        before (what a replay is checked against: the same arithmetic)."""
        size = self.bucket_for(len(entries))
        if size is None:
            raise ValueError(f"{len(entries)} rows exceed the largest decode bucket ({self.max_rows})")
        b = self.buckets[size]
        self._fill(b.host, size, entries)
        if b.device is not b.host:
            b.device.copy_(b.host, non_blocking=True)  # pinned: the host never waits for it
        if self.hybrid is not None:  # kt-kernel computes the requests' rows, not the padding
            self.hybrid.set_rows(size, len(entries))
        if b.graph is not None and not eager:
            self._begin_step()  # the layers' hooks do not run in a replay: the boundary is here
            b.graph.replay()
            self._end_step()
            assert b.logits is not None
            return b.logits[: len(entries)]
        # eager: the host spans too (the per-row paths of --batch-invariant read positions and slots there)
        padded = entries + [(0, 0, self.pad_slot, [self.pad_page])] * (size - len(entries))
        spans = tuple(RowSpan(i, i, i + 1, e[1], e[2]) for i, e in enumerate(padded))
        if self.hybrid is not None:  # the graph's split, its boundary first (as a replay takes them)
            self._begin_step(split=not same_split)
        with self._steps():
            out = self.model.run(dataclasses.replace(b.layout, spans=spans), self.pool, self.numerics)
        if self.hybrid is not None:
            self._end_step()
        assert out.last_logits is not None
        return out.last_logits[: len(entries)]

    def _begin_step(self, split: bool = True) -> None:
        """The host's work between steps: the slot cache's boundary, then the hybrid CPU sets that read it (kept
        without `split`: a slot promoted or evicted meanwhile changes where the device reads an expert, not its
        arithmetic)."""
        if self.expert_cache is not None:
            self.expert_cache.begin_step()
        if self.hybrid is not None and split:
            self.hybrid.begin_step()

    def _end_step(self) -> None:
        if self.expert_cache is not None:
            self.expert_cache.end_step()

    def _steps(self) -> contextlib.AbstractContextManager:
        """With hybrid CPU experts, MoE layers take the split fixed between steps (experts/hybrid_graph.py)."""
        return self.hybrid.steps() if self.hybrid is not None else contextlib.nullcontext()

    def _capture(self, mempool: Any = None) -> GraphReport:
        """Capture every bucket's forward (largest first, so the smaller ones reuse its memory pool); `mempool`:
        a pool the speculative steps' graphs (worker/spec_graphs.py), captured first, already use."""
        t0 = time.monotonic()
        before = torch.cuda.memory_allocated(self.device)
        mempool = mempool if mempool is not None else torch.cuda.graph_pool_handle()
        for size in sorted(self.buckets, reverse=True):
            b = self.buckets[size]
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):  # warm-up: lazy initializations and Triton compiles, outside the graph
                self._begin_step()
                with self._steps():
                    self.model.run(dataclasses.replace(b.layout), self.pool, self.numerics)
                self._end_step()
            torch.cuda.current_stream(self.device).wait_stream(stream)
            self._begin_step()  # the boundary (host decisions, copies) stays outside the graph
            # a fresh layout: its int64 views are captured too; cut where the host stages unpinned layers' experts
            with graph_cuts.capture(mempool, cuts=self.cut) as graph, self._steps():
                out = self.model.run(dataclasses.replace(b.layout), self.pool, self.numerics)
            self._end_step()
            b.graph, b.logits = graph, out.last_logits
        torch.cuda.synchronize(self.device)
        cuts = max(b.graph.cuts for b in self.buckets.values() if b.graph is not None)
        report = GraphReport(
            tuple(sorted(self.buckets)),
            True,
            time.monotonic() - t0,
            torch.cuda.memory_allocated(self.device) - before,
            cuts,
        )
        log.info("decode graphs: %s", report.describe())
        return report
