"""The paged KV pool: every tier of DeepSeek-V4's attention cache in fixed-size pieces.

A page covers `page_tokens` tokens of one request (ModelArgs.page_tokens: 128 for DeepSeek-V4-Flash,
the window, a multiple of every compression ratio); a page id addresses the same token range in
every layer. Per attention layer:

- window ring `swa` [num_slots, W, D]: the request in sequence slot s keeps the key of position p at
  swa[s, p % W]; before a step it holds positions [max(0, n - W), n), n = the tokens already run.
- compressed entries `comp.entries` [num_pages, page_tokens // ratio, D] (CSA and HCA layers) and indexer keys
  `idx.entries` [num_pages, page_tokens // 4, D_I] (CSA layers): entry e of a request lives in page
  pages[e // per_page], row e % per_page. Entry e pools tokens [e * ratio, (e + 1) * ratio).
- compressor carry (fp32, per slot): the tokens after the last closed window (`pending_*`, their
  count is n % ratio) and, for the overlapping CSA compressors, the `A` half of the last closed
  window (`prev_*`, meaningful once n >= ratio).

Everything a request reads is bounded by its token count, so a reused slot or page never leaks old
data. A page is complete (never written again) once the request passes its last token, which is what
lets a cached prefix share its pages with later requests; the slot part (ring + carry) is copied.
kernels/dsv4_kernels/sparse_attention.py, indexer_topk.py read exactly this layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsv4serve.model.args import ModelArgs
from dsv4serve.paging import IdAllocator


def _grow(t: torch.Tensor, size: int) -> torch.Tensor:
    """t with dim 0 extended to `size` (new rows zero)."""
    if t.shape[0] >= size:
        return t
    return torch.cat((t, t.new_zeros((size - t.shape[0],) + tuple(t.shape[1:]))))


@dataclass
class SequenceState:
    """One request's handle on the pool: its sequence slot, its page table and its length. With the
    pool's contents this is everything a forward needs from earlier tokens, so a forward is exact at
    any chunk boundary (dsv4-model.md §2.12). `num_tokens` is the position of the next token to run
    (MTP layers: `mtp_num_tokens`)."""

    pool: KvPool
    slot: int  # the window ring and compressor carry of this sequence
    pages: list[int] = field(default_factory=list)  # physical page of each page_tokens-long token range
    num_tokens: int = 0
    mtp_num_tokens: int = 0


@dataclass
class CompressedCache:
    """One compressor's entries (paged) and carry (per slot)."""

    ratio: int
    per_page: int  # entries per page: page_tokens // ratio
    entries: torch.Tensor  # [num_pages, per_page, d] compute dtype
    pending_kv: torch.Tensor  # [num_slots, ratio, coff * d] fp32
    pending_score: torch.Tensor
    prev_kv: torch.Tensor | None  # [num_slots, ratio, d] fp32, overlapping (CSA) compressors only
    prev_score: torch.Tensor | None

    @classmethod
    def empty(
        cls,
        ratio: int,
        page_tokens: int,
        d: int,
        num_pages: int,
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> CompressedCache:
        overlap = ratio == 4
        width = (2 if overlap else 1) * d

        def carry(cols: int) -> torch.Tensor:  # [num_slots, ratio, cols] fp32
            return torch.zeros(num_slots, ratio, cols, dtype=torch.float32, device=device)

        return cls(
            ratio,
            page_tokens // ratio,
            torch.zeros(num_pages, page_tokens // ratio, d, dtype=dtype, device=device),
            carry(width),
            carry(width),
            carry(d) if overlap else None,
            carry(d) if overlap else None,
        )

    def _where(self, pages: torch.Tensor, first: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        e = torch.arange(first, first + n, device=pages.device)
        return pages[e // self.per_page], e % self.per_page

    def read(self, pages: torch.Tensor, n: int) -> torch.Tensor:
        """The first n entries of a request whose page table is `pages` [num_pages] -> [n, d]."""
        return self.entries[self._where(pages, 0, n)]

    def write(self, pages: torch.Tensor, first: int, values: torch.Tensor) -> None:
        """Store entries first.. of a request."""
        self.entries[self._where(pages, first, values.shape[0])] = values.to(self.entries.dtype)

    def copy_slot(self, src: int, dst: int) -> None:
        for t in (self.pending_kv, self.pending_score, self.prev_kv, self.prev_score):
            if t is not None:
                t[dst] = t[src]

    def grow(self, num_pages: int, num_slots: int) -> None:
        self.entries = _grow(self.entries, num_pages)
        self.pending_kv, self.pending_score = _grow(self.pending_kv, num_slots), _grow(self.pending_score, num_slots)
        if self.prev_kv is not None and self.prev_score is not None:  # both or neither (CSA only)
            self.prev_kv, self.prev_score = _grow(self.prev_kv, num_slots), _grow(self.prev_score, num_slots)

    def tensors(self) -> list[torch.Tensor]:
        return [
            t
            for t in (self.entries, self.pending_kv, self.pending_score, self.prev_kv, self.prev_score)
            if t is not None
        ]


@dataclass
class LayerCache:
    swa: torch.Tensor  # [num_slots, W, D] compute dtype, the window ring
    comp: CompressedCache | None  # CSA / HCA layers
    idx: CompressedCache | None  # CSA layers: the indexer's keys

    def tensors(self) -> list[torch.Tensor]:
        return [self.swa] + [t for c in (self.comp, self.idx) if c is not None for t in c.tensors()]


class KvPool:
    """The cache of every layer (the MTP layers too when asked), `num_pages` pages and `num_slots`
    sequence slots. Engine pools are fixed and their ids come from the scheduler; a standalone pool
    (`standalone=True`, for direct use of the model) hands out ids itself and grows on demand."""

    def __init__(
        self,
        args: ModelArgs,
        dtype: torch.dtype,
        num_pages: int,
        num_slots: int,
        include_mtp: bool = False,
        device: torch.device | str = "cpu",
        standalone: bool = False,
    ):
        self.args, self.dtype, self.device = args, dtype, torch.device(device)
        self.page_tokens = args.page_tokens
        self.num_pages, self.num_slots = num_pages, num_slots
        n_layers = args.n_layers + (args.n_mtp_layers if include_mtp else 0)
        self.layers = [self._layer(i) for i in range(n_layers)]
        self.standalone = standalone
        self._pages = IdAllocator(num_pages) if standalone else None
        self._slots = IdAllocator(num_slots) if standalone else None

    def _layer(self, layer_id: int) -> LayerCache:
        a, dev = self.args, self.device
        ratio = a.compress_ratios[layer_id]
        swa = torch.zeros(self.num_slots, a.window_size, a.head_dim, dtype=self.dtype, device=dev)
        comp = (
            CompressedCache.empty(ratio, self.page_tokens, a.head_dim, self.num_pages, self.num_slots, self.dtype, dev)
            if ratio
            else None
        )
        idx = (
            CompressedCache.empty(
                ratio, self.page_tokens, a.index_head_dim, self.num_pages, self.num_slots, self.dtype, dev
            )
            if a.kind(layer_id) == "csa"
            else None
        )
        return LayerCache(swa, comp, idx)

    # ------------------------------------------------------------------ sizes
    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer.tensors())

    @property
    def page_bytes(self) -> int:
        """Bytes one page takes across all layers."""
        return sum(
            c.entries[0].numel() * c.entries.element_size()
            for layer in self.layers
            for c in (layer.comp, layer.idx)
            if c is not None
        )

    # ------------------------------------------------------------------ slots
    def copy_slot(self, src: int, dst: int) -> None:
        """Copy a sequence's window ring and compressor carry (a prefix snapshot saved or restored)."""
        for layer in self.layers:
            layer.swa[dst] = layer.swa[src]
            for c in (layer.comp, layer.idx):
                if c is not None:
                    c.copy_slot(src, dst)

    # ------------------------------------------------------------------ standalone use
    def new_sequence(self) -> SequenceState:
        """A fresh sequence with a slot of its own (standalone pools only)."""
        assert self._slots is not None, "engine pools get their slots from the scheduler"
        if not self._slots.num_free:
            self._resize(self.num_pages, 2 * self.num_slots)
        return SequenceState(self, self._slots.take()[0])

    def reserve(self, seq: SequenceState, n_tokens: int) -> None:
        """Make sure `seq` has pages for n_tokens: a standalone pool takes (and grows) them; in an engine
        pool the scheduler assigned them already and a missing page is a bug."""
        need = -(-n_tokens // self.page_tokens) - len(seq.pages)
        if need <= 0:
            return
        if self._pages is None:
            raise RuntimeError(
                f"sequence in slot {seq.slot} has {len(seq.pages)} pages, {n_tokens} tokens "
                "need more: the scheduler did not assign them"
            )
        if need > self._pages.num_free:
            self._resize(max(2 * self.num_pages, self.num_pages + need), self.num_slots)
        seq.pages.extend(self._pages.take(need))

    def release(self, seq: SequenceState) -> None:
        """Give a standalone sequence's slot and pages back."""
        assert self._pages is not None and self._slots is not None
        self._pages.release(seq.pages)
        self._slots.release([seq.slot])
        seq.pages = []

    def _resize(self, num_pages: int, num_slots: int) -> None:
        assert self._pages is not None and self._slots is not None, "only a standalone pool grows"
        for layer in self.layers:
            layer.swa = _grow(layer.swa, num_slots)
            for c in (layer.comp, layer.idx):
                if c is not None:
                    c.grow(num_pages, num_slots)
        self.num_pages, self.num_slots = num_pages, num_slots
        self._pages.grow(num_pages)
        self._slots.grow(num_slots)
