"""The output head's product for one to three rows on the CPU, from a bf16 copy of the head, compiled by numba.

One decode row reads the whole head (dsv4-tiny: 129,280 x 128) for 2 FLOPs a weight: memory-bound. A
checkpoint stores the head in bf16, so its fp32 values are exact in half the bytes: these kernels stream a
bf16 copy (33 MB instead of 66) and widen each weight to fp32 in registers (a 16-bit shift), summing each
logit over the model dimension in order in fp32, a product and a sum a term, each rounded (numba contracts
nothing into fused multiply-adds: tests/unit/test_cpu_head.py checks the logits bit for bit against that sum
in torch). MKL's sgemv sums a K-major weight the same way on the CPU measured here: the logits equal MKL's bit
for bit there (bench/bench_cpu_head.py prints the difference); the start-up probe in model/cpu_head.py holds
them to MKL's within 1e-4 of the largest logit on any CPU. Each row is summed alone, so a row's
logits do not depend on the rows beside it. One row: ~1.4 ms against MKL's ~2.9 here; two rows: ~3.0
against oneDNN's ~4.7; from four rows the product is compute-bound and oneDNN's blocked fp32 kernel is
faster (these loops keep no register tile over rows).

The copy is laid out [blocks, dim, BLOCK]: a block of BLOCK consecutive vocabulary rows, each model channel's
BLOCK weights contiguous, so a block's accumulators stay in vector registers while its 16 KB stream in order.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import torch

from dsv4serve.model.numba_loops import compile_loop, failure

BLOCK = 64  # vocabulary rows a block (4 AVX-512 registers of fp32 accumulators)
MAX_ROWS = 3  # the rows these kernels take; from four oneDNN's fp32 kernel wins (module doc)


def _one_row(x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover (runs compiled)
    """out [blocks * BLOCK] = x [dim] . w [blocks, dim, BLOCK] (bf16 bits as uint16), fp32, in order of dim."""
    n_blocks, dim, _ = w.shape
    acc = np.zeros(BLOCK, np.float32)
    for b in range(n_blocks):
        for j in range(BLOCK):
            acc[j] = 0
        for k in range(dim):
            xk = x[k]
            for j in range(BLOCK):
                acc[j] += xk * np.uint32(np.uint32(w[b, k, j]) << np.uint32(16)).view(np.float32)
        for j in range(BLOCK):
            out[b * BLOCK + j] = acc[j]


def _few_rows(x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover (runs compiled)
    """out [rows, blocks * BLOCK] = x [rows, dim] . w: each row as `_one_row` sums it; a block's weights widened
    once for every row."""
    rows = x.shape[0]
    n_blocks, dim, _ = w.shape
    acc = np.zeros((rows, BLOCK), np.float32)
    wide = np.empty(BLOCK, np.float32)
    for b in range(n_blocks):
        acc[:, :] = 0
        for k in range(dim):
            for j in range(BLOCK):
                wide[j] = np.uint32(np.uint32(w[b, k, j]) << np.uint32(16)).view(np.float32)
            for r in range(rows):
                xk = x[r, k]
                for j in range(BLOCK):
                    acc[r, j] += xk * wide[j]
        for r in range(rows):
            for j in range(BLOCK):
                out[r, b * BLOCK + j] = acc[r, j]


WHAT = "bf16 head"  # its name in numba_loops' log and doctor's line
FALLBACK = "the fp32 head serves"


@functools.cache
def compiled() -> tuple[Callable[..., None], Callable[..., None]] | None:
    """The two loops, compiled (or loaded from numba's cache) on the first call; None where numba cannot compile
    them (logged once): model/cpu_head.py then keeps the fp32 head."""
    w = np.zeros((1, 2, BLOCK), np.uint16)
    one_row = compile_loop(_one_row, (np.zeros(2, np.float32), w, np.empty(BLOCK, np.float32)), WHAT, FALLBACK)
    few_rows = compile_loop(
        _few_rows, (np.zeros((2, 2), np.float32), w, np.empty((2, BLOCK), np.float32)), WHAT, FALLBACK
    )
    return None if one_row is None or few_rows is None else (one_row, few_rows)


def warm_up() -> None:
    """Compile both loops (or load them from numba's cache) now; raises where numba cannot compile them."""
    packed = pack(torch.zeros(BLOCK, 4))
    for rows in (1, MAX_ROWS):
        logits(torch.zeros(rows, 4), packed, BLOCK)


def exact_in_bf16(weight: torch.Tensor) -> bool:
    return bool(torch.equal(weight.to(torch.bfloat16).to(weight.dtype), weight))


def pack(weight: torch.Tensor) -> np.ndarray:
    """An fp32 head [vocab, dim] whose values are bf16 (`exact_in_bf16`) -> its bf16 bits [blocks, dim, BLOCK]
    uint16, the vocabulary zero-padded to whole blocks."""
    vocab, dim = weight.shape
    n_blocks = -(-vocab // BLOCK)
    bits = torch.zeros(n_blocks * BLOCK, dim, dtype=torch.bfloat16)
    bits[:vocab] = weight.detach().to(torch.bfloat16)
    blocked = bits.view(torch.int16).view(n_blocks, BLOCK, dim).transpose(1, 2).contiguous()
    return blocked.numpy().view(np.uint16)


def logits(y: torch.Tensor, packed: np.ndarray, vocab: int) -> torch.Tensor:
    """y [rows, dim] fp32 (1 <= rows <= MAX_ROWS) -> [rows, vocab] fp32 through the packed head."""
    rows, dim = y.shape
    if not 1 <= rows <= MAX_ROWS or dim != packed.shape[1] or y.dtype != torch.float32:
        raise ValueError(
            f"the bf16 head takes 1-{MAX_ROWS} fp32 rows of {packed.shape[1]}, not {tuple(y.shape)} {y.dtype}"
        )
    loops = compiled()
    if loops is None:
        raise RuntimeError(f"numba could not compile the {WHAT}'s loops: {failure(WHAT)}")
    one_row, few_rows = loops
    x = y.detach().contiguous().numpy()
    out = np.empty((rows, packed.shape[0] * BLOCK), np.float32)
    if rows == 1:
        one_row(x[0], packed, out[0])
    else:
        few_rows(x, packed, out)
    full = torch.from_numpy(out)
    return full if full.shape[1] == vocab else full[:, :vocab].contiguous()
