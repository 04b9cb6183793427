"""mHC's gates and stream mix on the CPU's torch path in one numba call: what hc_pre and hc_head run after the
mixes `m` (hc._mixes: the RMS and the fn product stay torch ops), ~25 ops a site (9 sites a step of dsv4-tiny).

For each row, the torch ops' arithmetic in order: every gate's logit m * scale + base in fp32; pre = sigmoid in
fp64 (1 / (1 + exp(-t)), numerics.in_fp64) rounded to fp32, plus eps; post = 2 * sigmoid; comb = the row softmax
of its hc x hc logits in fp64 rounded to fp32, plus eps, then the Sinkhorn rounds (sinkhorn_cpu's loop); x = the
streams weighted by pre, summed over the streams in ascending order in fp32 (torch's sum over that dimension).
exp is numba_math.exp_inplace: rounded to fp32, torch's values but for one in ~2^25 (within a few fp64 ulp of an
fp32 tie); tests/unit/test_hc_cpu.py holds the outputs to the torch ops bit for bit over 2^16 rows. Each row is
computed alone (batch invariance holds); where numba cannot compile, the torch ops run (logged, doctor's line).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import torch

from dsv4serve.model.numba_loops import compile_loop
from dsv4serve.model.numba_math import exp_inplace
from dsv4serve.model.sinkhorn_cpu import HC, rounds_loop


def _gates(
    m: np.ndarray,
    scale: np.ndarray,
    base: np.ndarray,
    h: np.ndarray,
    eps: np.float32,
    n_iters: int,
    pre: np.ndarray,
    post: np.ndarray,
    comb: np.ndarray,
    x: np.ndarray,
) -> None:  # pragma: no cover (runs compiled)
    """m [N, G] f32 (G = hc: hc_head's pre only; (2 + hc) hc: hc_pre's pre, post and comb), scale [3] or [1], base
    [G], h [N, hc, D] f32 -> pre [N, hc], post [N, hc], comb [N, hc, hc] (hc_pre only), x [N, D], all f32."""
    n_rows, n_mix = m.shape
    hc = h.shape[1]
    full = n_mix > hc
    t = np.empty(n_mix, np.float32)
    e = np.empty(n_mix)
    s64 = np.empty(n_mix)
    for r in range(n_rows):
        for i in range(n_mix):  # every gate's logit in fp32, as torch's broadcast mul and add
            part = 0 if i < hc else (1 if i < 2 * hc else 2)
            t[i] = m[r, i] * scale[part] + base[i]
        for i in range(2 * hc if full else hc):
            e[i] = -np.float64(t[i])
        if full:
            for a in range(hc):  # each comb row's softmax: exp(t - max) in fp64
                top = np.float64(t[2 * hc + a * hc])
                for b in range(1, hc):
                    top = max(top, np.float64(t[2 * hc + a * hc + b]))
                for b in range(hc):
                    e[2 * hc + a * hc + b] = np.float64(t[2 * hc + a * hc + b]) - top
        exp_inplace(e, s64)
        for i in range(hc):
            pre[r, i] = np.float32(1.0 / (1.0 + e[i])) + eps
        if full:
            for i in range(hc):
                post[r, i] = np.float32(2.0) * np.float32(1.0 / (1.0 + e[hc + i]))
            for a in range(hc):
                total = 0.0
                for b in range(hc):
                    total = total + e[2 * hc + a * hc + b]
                for b in range(hc):
                    comb[r, a, b] = np.float32(e[2 * hc + a * hc + b] / total) + eps
            rounds_loop(comb[r : r + 1], n_iters, eps)
        for d in range(x.shape[1]):
            x[r, d] = 0.0
        for i in range(hc):
            w = pre[r, i]
            for d in range(x.shape[1]):
                x[r, d] = x[r, d] + w * h[r, i, d]


WHAT = "mHC gates"  # its name in numba_loops' log and doctor's line


def _sample() -> tuple:
    n_mix = (2 + HC) * HC
    return (
        np.zeros((1, n_mix), np.float32),
        np.ones(3, np.float32),
        np.zeros(n_mix, np.float32),
        np.zeros((1, HC, 2), np.float32),
        np.float32(1e-6),
        2,
        np.empty((1, HC), np.float32),
        np.empty((1, HC), np.float32),
        np.empty((1, HC, HC), np.float32),
        np.empty((1, 2), np.float32),
    )


@functools.cache
def compiled() -> Callable[..., None] | None:
    """The compiled gates (compiled or loaded from numba's cache on the first call); None where numba cannot compile
    them on this machine (logged once): hc then runs its torch ops."""
    return compile_loop(_gates, _sample(), WHAT, "the mHC's torch ops run", helpers=(exp_inplace, rounds_loop))


def gates_and_mix(
    m: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, h: torch.Tensor, eps: float, n_iters: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(x [N, D] in h's dtype, post [N, hc] f32, comb [N, hc, hc] f32) from the mixes m [N, G] f32 and the streams h
    [N, hc, D] (G = hc for hc_head: post and comb then empty); None where the loop did not compile or the shapes do
    not fit it (hc = 4, G = hc or (2 + hc) hc)."""
    loop = compiled()
    n_rows, hc = h.shape[0], h.shape[1]
    if (
        loop is None
        or hc != HC
        or m.shape[1] not in (hc, (2 + hc) * hc)
        or m.dtype != torch.float32
        or m.device.type != "cpu"
        or h.device.type != "cpu"
    ):
        return None
    full = m.shape[1] > hc
    pre = torch.empty(n_rows, hc, device=m.device)
    post = torch.empty(n_rows if full else 0, hc, device=m.device)
    comb = torch.empty(n_rows if full else 0, hc, hc, device=m.device)
    x = torch.empty(n_rows, h.shape[2], device=m.device)
    loop(
        m.contiguous().numpy(),
        scale.detach().float().contiguous().numpy(),
        base.detach().float().contiguous().numpy(),
        h.float().contiguous().numpy(),
        np.float32(eps),
        n_iters,
        pre.numpy(),
        post.numpy(),
        comb.numpy(),
        x.numpy(),
    )
    return x.to(h.dtype), post, comb
