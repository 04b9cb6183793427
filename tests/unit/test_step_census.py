"""bench/census: the counter on toys whose launches and syncs are known from CUDA semantics and the source
text, the projection on DeepSeek-V4-Flash's real layer schedule, and (slow) censuses of dsv4-tiny decode
steps whose per-layer components must follow the architecture (which layers compress, which index)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # read when @triton.jit decorates: before the toy kernel and any kernel module

import inspect
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: `bench.census`, as the script does

from bench.census.counter import StepCounter, fingerprint
from bench.census.summary import compare_steps, project

HERE = (str(Path(__file__).resolve()),)  # the toys' "project": sites are lines of this file


@triton.jit
def _double_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) * 2, mask=mask)


def _reads(x: torch.Tensor) -> None:
    x.sum().item()  # SYNC item
    x.tolist()  # SYNC tolist


def _line_of(fn, marker: str) -> str:
    lines, first = inspect.getsourcelines(fn)
    return f"tests/unit/test_step_census.py:{first + next(i for i, t in enumerate(lines) if marker in t)}"


def test_scalar_reads_are_syncs_at_the_line_that_made_them() -> None:
    with StepCounter(roots=HERE) as seen:
        _reads(torch.arange(4.0))
    assert [(s.what, s.site) for s in seen.syncs] == [
        ("item", _line_of(_reads, "SYNC item")),
        ("tolist", _line_of(_reads, "SYNC tolist")),
    ]


def test_data_sized_outputs_and_host_data_on_the_device_are_syncs() -> None:
    x = torch.arange(6.0)
    with StepCounter(roots=HERE) as seen:
        x[x > 2]  # a boolean mask: its size is a nonzero on the device
        x.nonzero()
        torch.repeat_interleave(torch.ones(3, dtype=torch.long))  # output size from the data
        torch.tensor([1, 2], device=x.device)  # pageable host -> device copy
    assert len(seen.syncs) == 4
    with StepCounter(roots=HERE) as quiet:
        x[torch.tensor([0, 2])]  # an integer index: no sync
        torch.repeat_interleave(torch.ones(3, dtype=torch.long), output_size=3)
        torch.tensor([1, 2])  # a host tensor, no device involved
        torch.as_tensor([1, 2], device="cpu")
    assert quiet.syncs == [] and len(quiet.host_tensors) == 3


def test_launches_count_kernels_not_views_and_triton_launches_with_their_grid() -> None:
    x = torch.arange(8.0)
    out = torch.empty_like(x)
    with StepCounter(roots=HERE) as seen:
        y = x * 2  # 1
        z = y + 1  # 2
        z.add_(1)  # 3: in place
        z.view(2, 4).t().reshape(-1)  # 4: reshape of a transposed view copies; view and t launch nothing
        z.unsqueeze(0).expand(3, -1)[1:, 2:].squeeze(0)  # views only
        z.contiguous().to(torch.float32)  # no-ops: z is contiguous fp32
        torch.empty(5)  # an allocation without a fill
        for _ in range(3):
            _double_kernel[(2,)](x, out, 8, BLOCK=4)
    assert [launch.name for launch in seen.launches if launch.kind == "aten"] == ["mul", "add", "add_", "clone"]
    triton_launches = [launch for launch in seen.launches if launch.kind == "triton"]
    assert [(t.name, t.signature[2]) for t in triton_launches] == [("_double_kernel", (2,))] * 3
    assert torch.equal(out, 2 * x)  # the launches ran (the interpreter's own copies were not counted)


def test_two_steps_compare_equal_only_with_the_same_shapes() -> None:
    def step(n: int) -> StepCounter:
        counter = StepCounter(roots=HERE)
        with counter:
            torch.arange(float(n)) * 2  # STEP
        return counter

    a, same, longer = step(4).seen, step(4).seen, step(5).seen
    assert fingerprint(a) == fingerprint(same) and compare_steps(a, same)["static"]
    diff = compare_steps(a, longer)
    assert not diff["static"] and diff["first_differences"][0]["site"] == _line_of(step, "STEP")


def test_projection_covers_deepseek_v4_flash_layer_schedule(real_model_dir) -> None:
    from dsv4serve.model.args import read_model_args

    real = read_model_args(real_model_dir)
    layers = [
        {"kind": kind, "routing": routing, "launches": n, "syncs": s}
        for kind, routing, n, s in [
            ("swa", "hash", 10, 1),
            ("csa", "hash", 30, 0),
            ("hca", "gate", 20, 2),
            ("csa", "gate", 40, 0),
        ]
    ]
    p = project({"layers": layers, "per_step": {"launches": 7, "syncs": 3}}, real)
    # the model card: 43 layers, the first two sliding-window only, then CSA / HCA alternating; 3 hash layers
    assert p["layers"] == {"swa": 2, "csa": 21, "hca": 20}
    assert p["launches"] == 7 + 2 * 10 + 30 + 20 * 40 + 20 * 20
    assert p["syncs"] == 3 + 2 * 1 + 20 * 2


@pytest.mark.slow  # ~30 s each: the kernels of a whole decode step run in the interpreter
@pytest.mark.parametrize("batch, slots", [(1, None), (2, 16)], ids=["b1", "b2_slot_cache"])
def test_a_tiny_decode_step_is_attributed_to_every_layer_by_its_kind(tiny_dir, batch, slots) -> None:
    from bench.census.engine import build_census_engine
    from bench.census.steps import decode_census
    from bench.census.summary import summarize

    engine = build_census_engine(tiny_dir, batch, 64, moe_cache_size=slots)
    (step,) = decode_census(engine, batch, prompt_tokens=40, compare_gap=None)
    args = engine.args
    s = summarize(step, args)
    assert s["rows"] == batch and s["tokens"] == batch
    for row in s["layers"]:
        comps = row["components"]
        kind = args.kind(row["layer"])  # from the config: which layers compress and which index
        assert {"mhc", "attention projections", "attention core", "moe router", "shared expert"} <= set(comps)
        assert ("compressor" in comps) == (kind in ("csa", "hca")), (row["layer"], kind, comps)
        assert ("indexer" in comps) == (kind == "csa"), (row["layer"], kind, comps)
    assert {"head", "sampler"} <= set(s["per_step"]["components"])
    # projected onto its own layer schedule, a census gives back its own totals
    assert project(s, args) == {
        "layers": {kind: k["layers"] for kind, k in s["per_kind"].items()},
        "launches": s["total"]["launches"],
        "syncs": s["total"]["syncs"],
    }
