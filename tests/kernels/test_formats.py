"""The checkpoint number formats, checked against the format specs (OCP MX, e4m3fn), not our code."""

import math

import pytest
import torch

from dsv4_kernels import formats as quant


def test_e2m1_table_is_the_mx_spec_table():
    # OCP MX v1.0 table for FP4 E2M1: exponent bias 1, one mantissa bit, subnormal 0.5
    expected = []
    for code in range(16):
        sign, exp, man = code >> 3, (code >> 1) & 0b11, code & 1
        value = (man * 0.5) if exp == 0 else (1 + man * 0.5) * 2.0 ** (exp - 1)
        expected.append(-value if sign else value)
    assert list(quant.E2M1_VALUES) == expected
    assert math.copysign(1, quant.E2M1_VALUES[8]) == -1  # code 8 is -0


def test_e8m0_bias_127_and_nan():
    raw = torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8)
    got = quant.e8m0_to_float(raw.view(torch.float8_e8m0fnu))
    assert got[:6].tolist() == [2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127]
    assert math.isnan(got[6])
    # torch's own e8m0 dtype agrees
    assert torch.equal(got[:6], raw[:6].view(torch.float8_e8m0fnu).float())


def test_fp4_low_nibble_is_even_k():
    # byte 0x71: low nibble 1 (0.5) is K index 0, high nibble 7 (6.0) is K index 1
    packed = torch.tensor([[0x71, 0x0F]], dtype=torch.uint8).view(torch.int8)
    scale = torch.full((1, 1), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    got = quant.dequant_fp4(packed, scale)
    assert got.tolist() == [[0.5, 6.0, -6.0, 0.0]]


def test_fp4_scale_per_32_k():
    codes = torch.full((2, 64), 2, dtype=torch.uint8)  # value 1.0 everywhere
    scale = torch.tensor([[127, 129], [126, 130]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    got = quant.dequant_fp4(quant.pack_fp4(codes), scale)
    assert torch.equal(got[0, :32], torch.full((32,), 1.0)) and torch.equal(got[0, 32:], torch.full((32,), 4.0))
    assert torch.equal(got[1, :32], torch.full((32,), 0.5)) and torch.equal(got[1, 32:], torch.full((32,), 8.0))


def test_pack_unpack_roundtrip():
    codes = torch.randint(0, 16, (5, 96), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(quant.unpack_fp4(quant.pack_fp4(codes)), codes)


@pytest.mark.parametrize("shape", [(128, 128), (200, 300), (1, 129), (257, 64)])
def test_fp8_block_edges(shape):
    out_dim, in_dim = shape
    g = torch.Generator().manual_seed(1)
    w8 = (torch.randn(shape, generator=g) * 10).to(torch.float8_e4m3fn)
    n_bo, n_bi = -(-out_dim // 128), -(-in_dim // 128)
    exps = torch.randint(120, 135, (n_bo, n_bi), dtype=torch.uint8, generator=g)
    got = quant.dequant_fp8_block(w8, exps.view(torch.float8_e8m0fnu))
    for i in range(0, out_dim, 37):
        for j in range(0, in_dim, 41):
            want = float(w8[i, j].float()) * 2.0 ** (int(exps[i // 128, j // 128]) - 127)
            assert float(got[i, j]) == want


def test_fp8_scale_shape_is_checked():
    w8 = torch.zeros(200, 300).to(torch.float8_e4m3fn)
    bad = torch.full((1, 3), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    with pytest.raises(ValueError, match="expected \\(2, 3\\)"):
        quant.dequant_fp8_block(w8, bad)


def test_quantizers_roundtrip_representable_values_exactly():
    g = torch.Generator().manual_seed(2)
    # FP4: e2m1 values times a power of two per 32-block survive quantize -> dequantize exactly
    codes = torch.randint(0, 16, (4, 64), dtype=torch.uint8, generator=g)
    codes[:, ::32] = 7  # every block holds its max magnitude (6.0) so the chosen scale is the true one
    scale = torch.randint(120, 135, (4, 2), dtype=torch.uint8, generator=g).view(torch.float8_e8m0fnu)
    dense = quant.dequant_fp4(quant.pack_fp4(codes), scale)
    packed, s2 = quant.quant_fp4(dense)
    assert torch.equal(quant.dequant_fp4(packed, s2), dense)
    # FP8: quantize -> dequantize is within e4m3 precision: 3 mantissa bits give a relative error
    # <= 2**-4 for normals; below the smallest normal (2**-6 of the scale) the step is 2**-9 of the scale
    w = torch.randn(300, 200, generator=g)
    w8, s8 = quant.quant_fp8_block(w)
    back = quant.dequant_fp8_block(w8, s8)
    scale = quant.e8m0_to_float(s8).repeat_interleave(128, 0).repeat_interleave(128, 1)[:300, :200]
    assert torch.all((back - w).abs() <= w.abs() * 2.0**-4 + scale * 2.0**-10)
    assert s8.shape == (3, 2)
    assert torch.all(w8.float().abs().amax() <= quant.FP8_MAX)
