"""The late-scale loop's word decode (fp4_moe_tiles._decode_fp4_words), alone, in the interpreter: every byte
value in every byte of a word decodes to its two e2m1 values x 2^-14, bit for bit, at the K positions the
loop's permuted order gives them (position 8a + 2q + t: channel 8q + a + 4t), and `_act_group`'s permutation
of the activations is that same order."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4_kernels.formats import E2M1_VALUES
from dsv4_kernels.fp4_moe_tiles import _decode_fp4_words

ROWS = 64


@triton.jit
def _decode_kernel(words_ptr, out_ptr, ROWS: tl.constexpr):
    rows = tl.arange(0, ROWS)
    words = tl.load(words_ptr + rows[:, None] * 4 + tl.arange(0, 4)[None, :])
    w = _decode_fp4_words(words, True)
    tl.store(out_ptr + rows[:, None] * 32 + tl.arange(0, 32)[None, :], w)


@triton.jit
def _permute_kernel(x_ptr, out_ptr, ROWS: tl.constexpr):
    """`_act_group`'s reshape / permute on a [ROWS, 32] tile (channel 8 w + 4 t + a -> position 8 a + 2 w + t)."""
    rows = tl.arange(0, ROWS)
    q = tl.load(x_ptr + rows[:, None] * 32 + tl.arange(0, 32)[None, :])
    q = tl.reshape(tl.permute(tl.reshape(q, (ROWS, 4, 2, 4)), (0, 3, 1, 2)), (ROWS, 32))
    tl.store(out_ptr + rows[:, None] * 32 + tl.arange(0, 32)[None, :], q)


def _position_channel() -> torch.Tensor:
    k = torch.arange(32)
    return 8 * ((k % 8) // 2) + k // 8 + 4 * (k % 2)


def test_every_byte_decodes_to_its_values_at_the_permuted_positions() -> None:
    # 64 rows x 4 words: byte i of word number n is (n + 64 i) mod 256, so each of a word's 4 byte positions
    # holds every value 0..255 once
    n = torch.arange(ROWS * 4).view(ROWS, 4, 1)
    packed = (n + 64 * torch.arange(4).view(1, 1, 4)).remainder(256).to(torch.uint8).view(ROWS, 16)
    words = packed.view(torch.int32)
    out = torch.empty(ROWS, 32, dtype=torch.float32)
    _decode_kernel[(1,)](words, out, ROWS=ROWS)
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).view(ROWS, 32).long()  # low nibble = even channel
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32)[codes] * 2.0**-14
    want = values[:, _position_channel()]
    assert torch.equal(out, want)
    assert torch.equal(torch.signbit(out), torch.signbit(want))  # -0.0 kept
    seen = {(int(b), i) for row in packed.view(ROWS, 4, 4) for q in row for i, b in enumerate(q)}
    assert len(seen) == 256 * 4


def test_the_activation_permutation_is_the_weights_order() -> None:
    x = torch.arange(ROWS * 32, dtype=torch.float32).view(ROWS, 32)
    out = torch.empty_like(x)
    _permute_kernel[(1,)](x, out, ROWS=ROWS)
    assert torch.equal(out, x[:, _position_channel()])
