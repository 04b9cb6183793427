"""KV compressor (dsv4-model.md §2.4): gated per-channel softmax pooling over windows of `ratio`.

CSA (ratio 4) windows overlap: each token projects to 2d values; the first half (`A`) joins the
next window, the second half (`B`) its own, so entry w pools 2*ratio slots. HCA windows do not
overlap. Entries are RMS-normed, rotated at the window's first position, then QAT-simulated: FP8 on
the nope dims for attention keys, Hadamard + FP4 for indexer keys (`rotate`). With
`num.backends.compressor == "triton"` the pooling runs in the compressor_pool kernel, and a decode step
(`update_decode`) is one compressor_decode launch: carry, pooling, entry and previous half together.
The two fp32 projections wkv and wgate run as one product over their concatenated weights (`project`): a
torch matmul, or with the compressor on Triton the head's kernel on the weights held in bf16. There a third
projection of the same input can ride in the launch (`carry_tail`: the CSA indexer's head weights, whose own
torch linear took five launches a layer): its weight rows stacked under [wkv; wgate], its columns finished by
the kernel as its Linear finishes them (rounded to the compute dtype, then scaled: head_logits.Tail).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from dsv4serve.model import compressor_cpu
from dsv4serve.model.args import ModelArgs
from dsv4serve.model.backends import KernelBackends
from dsv4serve.model.batch import BatchLayout
from dsv4serve.model.kv_pool import CompressedCache
from dsv4serve.model.layers import Linear, RMSNorm
from dsv4serve.model.numerics import (
    FP4_BLOCK,
    KV_BLOCK,
    Numerics,
    fp4_quant_dequant,
    fp8_quant_dequant,
    hadamard,
    in_fp64,
    matmul,
)
from dsv4serve.model.rope import apply_rope, rope_cos_sin

log = logging.getLogger(__name__)


class Compressor(nn.Module):
    def __init__(self, args: ModelArgs, ratio: int, head_dim: int, rotate: bool):
        super().__init__()
        self.ratio, self.head_dim, self.rotate = ratio, head_dim, rotate
        self.overlap = ratio == 4
        self.rope_head_dim = args.rope_head_dim
        coff = 2 if self.overlap else 1
        self.wkv = Linear(args.dim, coff * head_dim, fp8_act=False)
        self.wgate = Linear(args.dim, coff * head_dim, fp8_act=False)
        self.ape = nn.Parameter(torch.empty(ratio, coff * head_dim))
        self.norm = RMSNorm(head_dim, args.norm_eps)
        self._fused: tuple[tuple, torch.Tensor] | None = None  # (the weights' identity, [wkv; wgate(; tail)])
        self._fused_dtype = torch.float32  # bf16 once `prepare` puts the projection on the Triton kernel
        self._tail: tuple[Linear, float] | None = None  # `carry_tail`'s projection and scale (not a submodule)

    def carry_tail(self, linear: Linear, scale: float) -> None:
        """Have `linear` (its own input being this compressor's, D wide) ride in the Triton projection's launch,
        its output then times `scale` (`project_with_tail`). Only the bf16 fused weight takes it; the torch path
        leaves `linear` alone."""
        if linear.weight.shape[1] != self.wkv.weight.shape[1]:
            inputs = (linear.weight.shape[1], self.wkv.weight.shape[1])
            raise ValueError(f"a tail of {inputs[0]} inputs under a {inputs[1]}-input projection")
        self._tail, self._fused = (linear, scale), None

    def project(self, x: torch.Tensor, num: Numerics) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, D] (fp32 or bf16; cast to fp32) -> (kv, gate) [N, coff * d] fp32 views of one fp32 product; the
        reference compresses in fp32. With the compressor on Triton and the fused weight held in bf16 (as the
        checkpoint stores it: `prepare`), the head's kernel computes it, every product exact, from half the
        bytes (dsv4_kernels.head_logits, its K split over programs: a decode step has few rows to tile);
        otherwise torch multiplies in fp32."""
        kv, gate, _ = self.project_with_tail(x, num)
        return kv, gate

    def project_with_tail(
        self, x: torch.Tensor, num: Numerics
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """`project`, and the carried tail's output (`carry_tail`) when the fused weight holds it (bf16, after
        `prepare`): fp32 [N, rows], its Linear's output in the compute dtype times the scale. None otherwise
        (the caller runs the tail's Linear itself)."""
        fused = self._fused_weight()
        width = self.wkv.weight.shape[0]
        held = self._tail if fused.dtype == torch.bfloat16 else None  # only the bf16 fused weight stacks it
        if num.backends.compressor == "triton" and fused.dtype == torch.bfloat16:
            from dsv4_kernels.head_logits import Tail, head_logits, pick_block_m  # lazy, as for the other kernels

            if held is not None and num.compute_dtype not in (torch.bfloat16, torch.float32):
                raise ValueError(f"the carried projection finishes in bf16 or fp32, not {num.compute_dtype}")
            tail = None if held is None else Tail(2 * width, held[1], num.compute_dtype == torch.bfloat16)
            y = x if x.dtype in (torch.bfloat16, torch.float32) else x.float()  # the kernel upcasts bf16 exactly
            out = head_logits(y, fused, block_m=pick_block_m(x.shape[0], num.batch_invariant), tail=tail)
        else:
            out = matmul(x.float(), fused.float(), num)  # [N, 2 * coff * d (+ the tail's rows)]
            if held is not None:  # as its Linear finishes it (with fp32 weights: the same products)
                out[:, 2 * width :] = out[:, 2 * width :].to(num.compute_dtype).float() * held[1]
        return out[:, :width], out[:, width : 2 * width], None if held is None else out[:, 2 * width :]

    def prepare(self, backends: KernelBackends | None = None) -> None:
        """Build the fused projection weight now (after loading), not on the first forward: a first step
        must launch what every later step does (the step census counts it; a CUDA graph's warm-up would
        otherwise be the first user). With the compressor on Triton it is held in bf16 when that is exact (a
        checkpoint stores wkv and wgate so; memory/weights.py plans them so): half the memory and reads."""
        if backends is not None and backends.compressor == "triton" and self._fused_dtype != torch.bfloat16:
            weights = (self.wkv.weight, self.wgate.weight) + (() if self._tail is None else (self._tail[0].weight,))
            if all(torch.equal(w.to(torch.bfloat16).to(w.dtype), w) for w in weights):
                self._fused_dtype, self._fused = torch.bfloat16, None
            else:
                log.warning("compressor=triton: wkv / wgate are not exact in bf16; their projection stays on torch")
        self._fused_weight()

    def _fused_weight(self) -> torch.Tensor:
        """[wkv; wgate] as one [2 * coff * d, D] tensor in `_fused_dtype` (fp32, or bf16 after `prepare` for
        the Triton path), built on first use. Weights of that dtype then become views into it: no second
        copy, and a later in-place load into them lands in it; a weight replaced or moved (a new tensor)
        makes it rebuild. Weights of another dtype keep a copy beside them, rebuilt when either changes
        (their version counters)."""
        parts = self._parts()
        dtype = self._fused_dtype
        starts = [0]
        for w in parts:
            starts.append(starts[-1] + w.shape[0])
        if self._fused is not None:
            known, fused = self._fused
            views = all(w.dtype == fused.dtype == dtype and w.device == fused.device for w in parts)
            views = views and all(w.data_ptr() == fused[a:].data_ptr() for w, a in zip(parts, starts))
            if views or (known == self._key() and fused.dtype == dtype):
                return fused
        with torch.inference_mode(False), torch.no_grad():  # a normal tensor: params may be loaded into later
            fused = torch.cat([w.detach().to(dtype) for w in parts])
            if all(w.dtype == dtype for w in parts) or dtype == torch.bfloat16:  # bf16: the fp32 copies are freed
                for w, a, b in zip(parts, starts, starts[1:]):
                    w.data = fused[a:b]
        self._fused = (self._key(), fused)
        return fused

    def _parts(self) -> list[torch.Tensor]:
        """The weights the fused tensor stacks: wkv, wgate, and in bf16 the carried tail's."""
        parts: list[torch.Tensor] = [self.wkv.weight, self.wgate.weight]
        if self._tail is not None and self._fused_dtype == torch.bfloat16:
            parts.append(self._tail[0].weight)
        return parts

    def _key(self) -> tuple:
        return tuple((w.data_ptr(), w.device, w.dtype, w._version) for w in self._parts())

    def update(
        self,
        kv: torch.Tensor,
        gate: torch.Tensor,
        start_pos: int,
        cache: CompressedCache,
        slot: int,
        pages: torch.Tensor,
        freqs: torch.Tensor,
        num: Numerics,
    ) -> None:
        """Feed one row's tokens [T, coff * d] at positions start_pos.. of the sequence in `slot`: closed
        windows become entries in the row's pages, the rest stays in the slot's carry."""
        ratio = self.ratio
        dev = kv.device
        n_pending = start_pos % ratio  # tokens after the last closed window
        slots = (start_pos + torch.arange(kv.shape[0], device=dev)) % ratio
        kv = torch.cat((cache.pending_kv[slot, :n_pending], kv))
        score = torch.cat((cache.pending_score[slot, :n_pending], gate + self.ape.float()[slots]))
        n_windows = kv.shape[0] // ratio
        cut = n_windows * ratio
        # positional, as the decode path writes it: carry row q % ratio holds position q, for the row's last
        # `ratio` positions (those past the cut are the carry; the others fill rows nobody reads), so that a
        # speculative forward's rejected positions can be rolled back row by row (model/rollback.py)
        tail = max(kv.shape[0] - ratio, 0)
        rows = torch.arange(tail, kv.shape[0], device=dev) % ratio
        cache.pending_kv[slot, rows] = kv[tail:]
        cache.pending_score[slot, rows] = score[tail:]
        if n_windows == 0:
            return
        first = start_pos // ratio  # entries closed before this row
        kv = kv[:cut].view(n_windows, ratio, -1)
        score = score[:cut].view(n_windows, ratio, -1)
        if self.overlap:
            kv, score = self._overlap(kv, score, cache, slot, has_prev=first > 0)
        pooled = self._pool(kv, score, num)  # [n_windows, d] fp32
        positions = (first + torch.arange(n_windows, device=dev)) * ratio
        cache.write(pages, first, self._finish(pooled, positions, 1, freqs, num))

    def update_decode(
        self,
        kv: torch.Tensor,
        gate: torch.Tensor,
        layout: BatchLayout,
        cache: CompressedCache,
        freqs: torch.Tensor,
        num: Numerics,
    ) -> None:
        """`update` for a decode step, every row at once (one token each, kv / gate [B, coff * d] fp32), with
        shapes that do not depend on which windows close. Each row's token joins its slot's carry; the
        entry of the row's current window is computed for every row and written at its index p // ratio
        (its page holds position p, so it exists): a window that did not close yet writes a partial entry
        nobody reads (reads stop at (t + 1) // ratio) and that its closing overwrites. The overlap half
        moves to `prev` only for the rows whose window closed. On Triton: all of it in one launch; on the CPU
        without batch invariance, all of it up to the pooled windows in one compiled call (compressor_cpu.py)."""
        if num.backends.compressor == "triton":
            from dsv4_kernels.compressor_decode import compressor_decode  # lazy: kernels build on import

            compressor_decode(
                kv, gate, self.ape, layout.positions, layout.seq_slot, layout.block_table, cache.pending_kv,
                cache.pending_score, cache.prev_kv, cache.prev_score, cache.entries, self.norm.weight, self.norm.eps,
                freqs, self._entry_mode(num), num.compute_dtype, self.head_dim - self.rope_head_dim,
            )  # fmt: skip
            return
        pos = layout.positions64
        pooled = None
        if kv.device.type == "cpu" and not num.batch_invariant:  # compiled (compressor_cpu.py): the same values
            carry = (cache.pending_kv, cache.pending_score, cache.prev_kv, cache.prev_score)
            pooled = compressor_cpu.carry_and_pool(kv, gate, self.ape, pos, layout.slots64, carry, self.head_dim)
        if pooled is None:
            pooled = self._carry_pool_torch(kv, gate, layout, cache, num)
        entry = self._finish(pooled, pos, self.ratio, freqs, num)  # [B, d]
        entry_idx = pos // self.ratio
        pages = layout.table64.gather(1, (entry_idx // cache.per_page)[:, None])[:, 0]
        cache.entries[pages, entry_idx % cache.per_page] = entry.to(cache.entries.dtype)

    def _carry_pool_torch(
        self, kv: torch.Tensor, gate: torch.Tensor, layout: BatchLayout, cache: CompressedCache, num: Numerics
    ) -> torch.Tensor:
        """update_decode's carry writes and each row's current window pooled [B, d] fp32, as torch ops."""
        ratio = self.ratio
        pos, slots = layout.positions64, layout.slots64
        j = pos % ratio
        cache.pending_kv[slots, j] = kv
        cache.pending_score[slots, j] = gate + self.ape.float().index_select(0, j)
        # index_select, not x[slots]: the same rows, a third of advanced indexing's cost at 16 rows on the CPU
        win_kv, win_score = cache.pending_kv.index_select(0, slots), cache.pending_score.index_select(0, slots)
        entry_idx = pos // ratio  # win_*: [B, ratio, coff * d]
        if self.overlap:
            assert cache.prev_kv is not None and cache.prev_score is not None, "an overlapping cache keeps prev_*"
            d = self.head_dim
            old_kv, old_score = cache.prev_kv.index_select(0, slots), cache.prev_score.index_select(0, slots)
            has_prev = (entry_idx > 0)[:, None, None]
            prev_kv = torch.where(has_prev, old_kv, 0.0)
            prev_score = torch.where(has_prev, old_score, float("-inf"))
            closes = (j == ratio - 1)[:, None, None]
            cache.prev_kv[slots] = torch.where(closes, win_kv[..., :d], old_kv)
            cache.prev_score[slots] = torch.where(closes, win_score[..., :d], old_score)
            win_kv = torch.cat((prev_kv, win_kv[..., d:]), dim=1)
            win_score = torch.cat((prev_score, win_score[..., d:]), dim=1)
        return self._pool(win_kv, win_score, num)

    @staticmethod
    def _pool(kv: torch.Tensor, score: torch.Tensor, num: Numerics) -> torch.Tensor:
        """Per-channel softmax pooling over each window's slots: [W, L, d] fp32 -> [W, d] fp32."""
        if num.backends.compressor == "triton":
            from dsv4_kernels.compressor_pool import compressor_pool  # lazy: kernels build on import

            return compressor_pool(kv, score)
        return (kv * in_fp64(lambda z: z.softmax(dim=1), score)).sum(dim=1)

    def _overlap(
        self, kv: torch.Tensor, score: torch.Tensor, cache: CompressedCache, slot: int, has_prev: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[W, ratio, 2d] -> [W, 2*ratio, d]: window w-1's A halves, then window w's B halves."""
        assert cache.prev_kv is not None and cache.prev_score is not None, "an overlapping cache keeps prev_*"
        d = self.head_dim
        prev_kv = kv.new_zeros(kv.shape[0], self.ratio, d)
        prev_score = score.new_full((kv.shape[0], self.ratio, d), float("-inf"))
        prev_kv[1:], prev_score[1:] = kv[:-1, :, :d], score[:-1, :, :d]
        if has_prev:
            prev_kv[0], prev_score[0] = cache.prev_kv[slot], cache.prev_score[slot]
        cache.prev_kv[slot], cache.prev_score[slot] = kv[-1, :, :d], score[-1, :, :d]
        return torch.cat((prev_kv, kv[..., d:]), dim=1), torch.cat((prev_score, score[..., d:]), dim=1)

    def _finish(
        self, pooled: torch.Tensor, positions: torch.Tensor, window: int, freqs: torch.Tensor, num: Numerics
    ) -> torch.Tensor:
        """Pooled windows [W, d] fp32 -> entries in the compute dtype: RMSNorm, RoPE at each window's first
        position ((positions // window) * window), the QAT simulation. With token_ops on Triton: one launch."""
        if num.backends.token_ops == "triton":
            from dsv4_kernels.token_ops import Angles, compressed_entry

            angles = Angles.at(positions, freqs, window)
            nope = self.head_dim - self.rope_head_dim
            mode = self._entry_mode(num)
            return compressed_entry(pooled, self.norm.weight, self.norm.eps, angles, mode, num.compute_dtype, nope)
        entry = self.norm(pooled.to(num.compute_dtype))
        first = torch.div(positions.long(), window, rounding_mode="floor") * window
        return self._simulate(apply_rope(entry, *rope_cos_sin(freqs, first)), num)

    def _entry_mode(self, num: Numerics) -> str:
        """The QAT simulation of an entry, as token_ops.compressed_entry names it."""
        if self.rotate:
            return "index" if num.indexer_fp4 else "plain"
        return "kv" if num.kv_fp8 else "plain"

    def _simulate(self, entry: torch.Tensor, num: Numerics) -> torch.Tensor:
        if self.rotate:
            if num.indexer_fp4:
                entry = fp4_quant_dequant(hadamard(entry), FP4_BLOCK)
            return entry
        if num.kv_fp8:
            nope = self.head_dim - self.rope_head_dim
            entry = torch.cat((fp8_quant_dequant(entry[:, :nope], KV_BLOCK), entry[:, nope:]), dim=1)
        return entry
