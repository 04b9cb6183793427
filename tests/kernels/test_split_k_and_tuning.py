"""The decode GEMMs' K-loop forms and the card's tuning file, in the interpreter.

- fp4_moe_gemm's forms (even / odd K halves, prefetch, split K in one launch, the scales applied to each
  32-channel dot's sums) each give the reference's
  stage outputs within the stage tolerance of test_fp4_moe.py (the split changes only the fp32 order), and
  a split launch leaves its arrival counters at 0 (the next launch and graph replays start from there).
- fp8_linear split over K gives the unsplit bits (fp32 parts added in split order, one bf16 rounding).
- tuning.py: the nearest size key, a file per device name, and the wrappers taking a tuned choice (with a
  fake device name, as the interpreter runs on the CPU), a split that does not fit K dropped.
"""

from __future__ import annotations

import json

import pytest
import torch

from dsv4_kernels import tuning
from dsv4_kernels.fp4_moe import LoopForm, fp4_moe_gemm, store_dtype
from dsv4_kernels.fp4_moe_layer import fp4_moe
from dsv4_kernels.fp4_moe_ref import down_ref, gate_up_ref
from dsv4_kernels.fp8_gemm import fp8_linear, pick_split_k
from dsv4_kernels.fp8_gemm_ref import act_quant_fp8_ref, fp8_linear_ref
from dsv4_kernels.moe_align import moe_align
from dsv4_kernels.split_k import split_counters
from dsv4_kernels.testing import assert_fp4_stage as _assert_stage
from dsv4_kernels.testing import fp4_moe_problem as _problem

LIMIT = 0.75  # as test_fp4_moe.py: the clamps bite
FORMS = [
    LoopForm(True),
    LoopForm(False, True),
    LoopForm(True, True),
    LoopForm(split_k=2),
    LoopForm(True, True, 4),
    LoopForm(late_scale=True),
    LoopForm(split_k=2, late_scale=True),
]


def _poison(rows: int, cols: int) -> torch.Tensor:
    return torch.full((rows, cols), float("nan"), dtype=store_dtype())


# (T, D, I, BLOCK_K) x the forms whose split divides both K (D for gate/up, I for down); D=160, I=96: the masked K
CASES = [
    (loop, *case)
    for case in [(1, 256, 128, 64), (3, 256, 128, 32), (2, 160, 96, 32)]
    for loop in FORMS
    if not (case[1] % (loop.split_k * case[3]) or case[2] % (loop.split_k * case[3]))
]


@pytest.mark.parametrize(("loop", "t", "d", "i", "bk"), CASES, ids=lambda v: v.name if isinstance(v, LoopForm) else v)
def test_loop_forms_match_the_reference(loop, t, d, i, bk) -> None:
    topk, e = 2, 4
    x, (w1, s1, w3, s3, w2, s2), weights, ids = _problem(t, topk, e, d, i, seed=11 * t + d)
    routes = t * topk
    sorted_ids, expert_ids = moe_align(ids, e, 16)
    common = dict(block_m=16, block_k=bk, loop=loop)
    act = fp4_moe_gemm(x, None, w1, s1, sorted_ids, expert_ids, routes, topk, w3=w3, w3_scale=s3,
                       topk_weights=weights, limit=LIMIT, out=_poison(routes, i), **common)  # fmt: skip
    act_ref = gate_up_ref(*act_quant_fp8_ref(x), w1, s1, w3, s3, weights, ids, LIMIT)
    _assert_stage(act, act_ref)
    a_q, a_s = act_quant_fp8_ref(act_ref)
    y = fp4_moe_gemm(a_q, a_s, w2, s2, sorted_ids, expert_ids, routes, 1, out=_poison(routes, d), **common)
    _assert_stage(y, down_ref(a_q, a_s, w2, s2, ids))
    assert int(split_counters(1, x.device).abs().sum()) == 0


def test_late_scale_is_its_own_loop() -> None:
    with pytest.raises(ValueError, match="late_scale"):
        LoopForm(even_odd=True, late_scale=True)
    assert LoopForm(split_k=2, late_scale=True).name == "late_scale+split2"


def test_a_split_that_does_not_divide_k_is_refused() -> None:
    x, (w1, s1, w3, s3, _, _), weights, ids = _problem(1, 2, 4, 160, 96, seed=1)
    sorted_ids, expert_ids = moe_align(ids, 4, 16)
    with pytest.raises(ValueError, match="split_k 2"):
        fp4_moe_gemm(x, None, w1, s1, sorted_ids, expert_ids, 2, 2, w3=w3, w3_scale=s3, topk_weights=weights,
                     limit=LIMIT, block_k=64, loop=LoopForm(split_k=2))  # fmt: skip


@pytest.mark.parametrize(("m", "n", "k"), [(1, 256, 1024), (3, 200, 512), (20, 130, 512)])
def test_fp8_split_k_gives_the_unsplit_bits(m, n, k) -> None:
    gen = torch.Generator().manual_seed(m + n)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    b = (0.5 * torch.randn(n, k, generator=gen)).to(torch.float8_e4m3fn)
    bs = torch.randint(115, 125, (-(-n // 128), k // 128), generator=gen, dtype=torch.uint8)
    whole = fp8_linear(x, b, bs, split_k=1)
    assert torch.equal(whole, fp8_linear_ref(x, b, bs.view(torch.float8_e8m0fnu)))
    for split in (2, 4):
        assert torch.equal(fp8_linear(x, b, bs, split_k=split), whole)
    assert int(split_counters(1, x.device).abs().sum()) == 0
    with pytest.raises(ValueError, match="split_k 3"):
        fp8_linear(x, b, bs, split_k=3)


def test_nearest_size_and_file_names(tmp_path, monkeypatch) -> None:
    assert tuning.nearest({"1": "a", "8": "b"}, 7) == "a"
    assert tuning.nearest({"1": "a", "8": "b"}, 64) == "b"
    assert tuning.nearest({"8": "b"}, 1) is None
    monkeypatch.setenv("DSV4_TUNING_DIR", str(tmp_path))
    assert tuning.file_for("NVIDIA H200") == tmp_path / "NVIDIA_H200.json"
    assert tuning.table(torch.device("cpu")) == {}  # off CUDA: no tuning
    tuning.record(tmp_path / "x.json", ("fp8_gemm", "512x4096"), 1, 4, "X", "now")
    tuning.record(tmp_path / "x.json", ("fp8_gemm", "512x4096"), 8, 2, "X", "now")
    assert json.loads((tmp_path / "x.json").read_text())["fp8_gemm"]["512x4096"] == {"1": 4, "8": 2}


@pytest.fixture
def fake_card(tmp_path, monkeypatch):
    """A tuning file for a 'Fake GPU' that the CPU device answers to."""
    monkeypatch.setenv("DSV4_TUNING_DIR", str(tmp_path))
    monkeypatch.setattr(tuning, "device_name", lambda device: "Fake GPU")
    yield tmp_path / "Fake_GPU.json"
    tuning._load.cache_clear()


def test_the_wrappers_take_the_cards_choices(fake_card, monkeypatch) -> None:
    tuning.record(fake_card, ("fp8_gemm", "256x1024"), 1, 4, "Fake GPU", "test")
    tuning.record(fake_card, ("fp8_gemm", "256x768"), 1, 4, "Fake GPU", "test")  # 6 K blocks: 4 does not fit
    cpu = torch.device("cpu")
    assert pick_split_k(1, 256, 1024, cpu) == 4 and pick_split_k(16, 256, 1024, cpu) == 4
    assert pick_split_k(1, 256, 768, cpu) == 1 and pick_split_k(1, 512, 1024, cpu) == 1
    up = {"even_odd": True, "prefetch": True, "split_k": 2, "block_k": 64, "num_warps": 8, "num_stages": 3}
    down = {"late_scale": True, "split_k": 4, "block_k": 32, "block_n": 32}
    tuning.record(fake_card, ("fp4_moe", "gate_up"), 2, up, "Fake GPU", "test")
    tuning.record(fake_card, ("fp4_moe", "down"), 2, down, "Fake GPU", "test")
    import dsv4_kernels.fp4_moe_layer as fp4

    seen = []
    real = fp4.fp4_moe_gemm
    monkeypatch.setattr(fp4, "fp4_moe_gemm", lambda *a, **kw: seen.append(kw) or real(*a, **kw))
    x, w, weights, ids = _problem(1, 2, 4, 256, 128, seed=5)
    tuned = fp4_moe(x, *w, weights, ids, LIMIT)
    assert (seen[0]["loop"], seen[0]["block_k"], seen[0]["num_warps"]) == (LoopForm(True, True, 2), 64, 8)
    assert (seen[1]["loop"], seen[1]["block_k"], seen[1]["block_n"]) == (LoopForm(split_k=4, late_scale=True), 32, 32)
    x2, w2, weights2, ids2 = _problem(1, 2, 4, 160, 96, seed=5)  # K = 160 / 96: neither split fits
    fp4_moe(x2, *w2, weights2, ids2, LIMIT)
    assert seen[2]["loop"].split_k == 1 and seen[3]["loop"].split_k == 1
    monkeypatch.setattr(tuning, "device_name", lambda device: "Other GPU")  # no file: the defaults
    plain = fp4_moe(x, *w, weights, ids, LIMIT)
    assert seen[4]["loop"] == LoopForm() and seen[5]["loop"] == LoopForm()
    assert torch.allclose(tuned, plain, rtol=2**-6, atol=1e-3)


def test_a_joined_weight_takes_its_own_split_else_its_parts(fake_card) -> None:
    """model/joined_fp8.py: wq_a and wkv stacked into one weight; until the card's file has the joined shape,
    the largest split its parts were tuned to."""
    cpu = torch.device("cpu")
    tuning.record(fake_card, ("fp8_gemm", "256x1024"), 1, 4, "Fake GPU", "test")
    tuning.record(fake_card, ("fp8_gemm", "128x1024"), 1, 2, "Fake GPU", "test")
    assert pick_split_k(1, 384, 1024, cpu, parts=(256, 128)) == 4
    assert pick_split_k(1, 384, 1024, cpu) == 1  # nothing known of the shape, no parts given
    tuning.record(fake_card, ("fp8_gemm", "384x1024"), 1, 8, "Fake GPU", "test")
    tuning._load.cache_clear()
    assert pick_split_k(1, 384, 1024, cpu, parts=(256, 128)) == 8  # measured: its own
