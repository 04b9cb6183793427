"""A forward's batch as the model and the kernels index it: built once per step, copied to the device once.

    layout = build_layout(token_lists, starts, slots, page_tables, device, table_width=..., staging=...)

Every row is a chunk of one request's tokens (decode: one token). The host metadata (the rows' spans) stays
on the host for the per-row torch paths; the device metadata is packed into ONE int32 buffer on the host,
copied to the device in one transfer (from pinned memory through `HostStaging` on a GPU, so the copy never
blocks the host) and sliced into views: token ids, positions, cu_seqlens, start positions, sequence slots,
each row's last token, and the block table. The block table's width can be fixed (`table_width`, from
max_model_len) so that a decode step's shapes depend only on its row count (CUDA graphs).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class RowSpan:
    """One row of the packed batch, on the host."""

    index: int  # the row's number b
    begin: int  # first packed token of the row
    end: int
    start_pos: int  # absolute position of the row's first token
    slot: int  # the row's sequence slot in the KV pool

    @property
    def num_tokens(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class BatchLayout:
    spans: tuple[RowSpan, ...]
    token_ids: torch.Tensor  # [N] int32
    positions: torch.Tensor  # [N] int32, absolute position of every packed token
    cu_seqlens: torch.Tensor  # [B + 1] int32, row b's tokens are packed [cu[b], cu[b + 1])
    start_pos: torch.Tensor  # [B] int32
    seq_slot: torch.Tensor  # [B] int32, each row's sequence slot (window ring, compressor carry)
    last_token: torch.Tensor  # [B] int32, each row's last packed token
    block_table: torch.Tensor  # [B, W] int32, each row's page table, -1 padded
    max_rows: int  # the most tokens a row runs in this step
    max_end: int  # the most tokens a row holds after this step (a static bound when shapes are fixed)
    # [N] int32 or None: the packed token whose expert routing each token takes. Itself, except in a padding
    # row of a static bucket (worker/graphs.py, worker/spec_graphs.py), which takes a request's token: so
    # padding reaches no expert the requests do not (no extra expert read or fetch) and the expert-slot
    # cache records only the requests' uses. None: every token routes itself
    route_rows: torch.Tensor | None = None
    # per-step device values the layers share (`ring_index`), made by the first layer that asks; not an init
    # field, so that dataclasses.replace (a static layout copied for a step) starts empty
    _memo: dict[int, torch.Tensor] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def num_rows(self) -> int:
        return len(self.spans)

    @property
    def is_decode(self) -> bool:
        """Every row runs one token: the vectorized decode paths apply."""
        return self.max_rows == 1

    @functools.cached_property
    def tokens_per_row(self) -> int:
        """T when every row runs the same T tokens (a verify step's rows), else 0: from the host spans, no
        device read."""
        first = self.spans[0].num_tokens
        return first if all(s.num_tokens == first for s in self.spans) else 0

    @functools.cached_property
    def substeps(self) -> tuple[BatchLayout, ...]:
        """Equal rows of T tokens as T decode layouts: sub-step t holds token t of every row (position
        start + t), with the rows' slots and block table, so the decode paths (one token a row) run a
        multi-token step as T launches of each, whatever the batch. Rows are separate sequences, so running
        token t of every row before token t + 1 writes the same state as running each row's tokens in turn.
        Built once per step: two small copies (the t-major positions, the decode cu_seqlens)."""
        n_tokens, n_rows = self.tokens_per_row, self.num_rows
        if n_tokens == 0:
            raise ValueError("sub-steps need rows of equal length")
        # [T, B] int32, each sub-step's positions contiguous (the kernels index them densely); a clone, not
        # .contiguous(), so the copy happens at every batch size (one op sequence: B = 1 is already t-major)
        by_token = self.positions.view(n_rows, n_tokens).t().clone(memory_format=torch.contiguous_format)
        cu = torch.arange(n_rows + 1, dtype=torch.int32, device=self.positions.device)  # one token a row
        ids = self.token_ids.view(n_rows, n_tokens)
        return tuple(
            BatchLayout(
                tuple(RowSpan(s.index, s.index, s.index + 1, s.start_pos + t, s.slot) for s in self.spans),
                ids[:, t],  # a strided view: no path of a sub-step reads token ids
                by_token[t],
                cu,
                by_token[t],  # a decode row starts at its token
                self.seq_slot,
                cu[:-1],
                self.block_table,
                1,
                self.max_end,
            )
            for t in range(n_tokens)
        )

    def pages(self, span: RowSpan) -> torch.Tensor:
        """The row's page table on the device, [W] int64 (-1 padded): for the per-row (prefill) paths."""
        return self.table64[span.index]

    # int64 views for torch indexing, converted once per step (not once per layer and use). A layout reused
    # across steps (worker/graphs.py's static buffers) must be copied (dataclasses.replace) for each step or
    # capture, so that these are computed from the current buffer.
    @functools.cached_property
    def positions64(self) -> torch.Tensor:
        return self.positions.long()

    @functools.cached_property
    def slots64(self) -> torch.Tensor:
        return self.seq_slot.long()

    @functools.cached_property
    def table64(self) -> torch.Tensor:
        return self.block_table.long()

    @functools.cached_property
    def token_rows(self) -> torch.Tensor:
        """[N] int32, the row of every packed token, for the attention kernel. A decode step's row b holds
        token b, which is what `last_token` already says: no launch; else built once per step (not per layer)."""
        if self.is_decode:
            return self.last_token
        counts = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).long()
        rows = torch.arange(self.num_rows, device=counts.device, dtype=torch.int32)
        return torch.repeat_interleave(rows, counts, output_size=self.spans[-1].end)

    def ring_index(self, window: int) -> torch.Tensor:
        """[N] int64, every packed token's entry in a window ring of `window` keys (position % window):
        one launch a step, shared by the layers (one window size in a model)."""
        if window not in self._memo:
            self._memo[window] = self.positions64 % window
        return self._memo[window]


class HostStaging:
    """A reusable pinned host buffer for the step metadata (GPU), so the one copy per step is asynchronous.
    Two buffers alternate: the host fills one while the previous step's copy may still read the other."""

    def __init__(self, device: torch.device):
        self.device = device
        self._bufs: list[torch.Tensor] = []
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        """host [n] int32 (pageable) -> the same values on the device, copied once from pinned memory."""
        if self.device.type != "cuda":
            return host
        i, self._turn = self._turn, 1 - self._turn
        while len(self._bufs) <= i:
            self._bufs.append(torch.empty(0, dtype=torch.int32, device="cpu").pin_memory())
        if self._bufs[i].numel() < host.numel():
            size = max(host.numel(), 2 * self._bufs[i].numel())
            self._bufs[i] = torch.empty(size, dtype=torch.int32, device="cpu").pin_memory()
        event = self._events[i]
        if event is not None:
            event.synchronize()  # the copy that read this buffer two steps ago (long finished in practice)
        pinned = self._bufs[i][: host.numel()]
        pinned.copy_(host)
        out = pinned.to(self.device, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self._events[i] = done
        return out


def build_layout(
    token_lists: Sequence[Sequence[int]],
    starts: Sequence[int],
    slots: Sequence[int],
    page_tables: Sequence[Sequence[int]],
    device: torch.device,
    table_width: int | None = None,
    max_end: int | None = None,
    staging: HostStaging | None = None,
) -> BatchLayout:
    """The layout of rows (token ids, first position, slot, page ids each). `table_width` / `max_end` fix the
    block table's width and the bound on any row's length (CUDA graphs); else the step's own maxima."""
    spans, begin = [], 0
    for b, (tokens, start, slot) in enumerate(zip(token_lists, starts, slots)):
        if not tokens:
            raise ValueError("a batch row needs at least one token")
        spans.append(RowSpan(b, begin, begin + len(tokens), start, slot))
        begin += len(tokens)
    n, rows = begin, len(spans)
    width = table_width if table_width is not None else max(max(len(p) for p in page_tables), 1)
    if any(len(p) > width for p in page_tables):
        raise ValueError(f"a row holds more than the block table's {width} pages")
    values: list[int] = [t for tokens in token_lists for t in tokens]
    for span in spans:
        values.extend(range(span.start_pos, span.start_pos + span.num_tokens))
    values.append(0)
    values.extend(s.end for s in spans)
    values.extend(starts)
    values.extend(slots)
    values.extend(s.end - 1 for s in spans)
    for pages in page_tables:
        values.extend(pages)
        values.extend([-1] * (width - len(pages)))
    host = torch.tensor(values, dtype=torch.int32, device="cpu")  # one host buffer: one copy to the device
    dev = staging.upload(host) if staging is not None else host.to(device)
    return BatchLayout(
        tuple(spans),
        dev[:n],
        dev[n : 2 * n],
        dev[2 * n : 2 * n + rows + 1],
        dev[2 * n + rows + 1 : 2 * n + 2 * rows + 1],
        dev[2 * n + 2 * rows + 1 : 2 * n + 3 * rows + 1],
        dev[2 * n + 3 * rows + 1 : 2 * n + 4 * rows + 1],
        dev[2 * n + 4 * rows + 1 :].view(rows, width),
        max(s.num_tokens for s in spans),
        max_end if max_end is not None else max(s.start_pos + s.num_tokens for s in spans),
    )
