"""--kernels in the worker: auto is torch on the CPU, Triton on CUDA; Triton on a CPU worker is refused
by name unless the interpreter runs (tests). Whether decode steps are captured as CUDA graphs, and why not."""

from __future__ import annotations

import msgspec
import pytest
import torch

from dsv4serve.cli import main as cli_main
from dsv4serve.model.args import args_from_dicts
from dsv4serve.model.backends import KernelBackends
from dsv4serve.tiny.spec import TINY_CONFIG
from dsv4serve.worker.engine_setup import eager_reason
from dsv4serve.worker.model_load import StartupError, worker_numerics

ARGS = args_from_dicts(TINY_CONFIG, expert_dtype_hint="fp4")
CPU = torch.device("cpu")


def test_auto_is_torch_on_the_cpu_and_triton_on_cuda(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert worker_numerics(ARGS, "auto", CPU).backends == KernelBackends.every("torch")
    assert worker_numerics(ARGS, "auto", torch.device("cuda")).backends == KernelBackends.every("triton")
    assert worker_numerics(ARGS, "fp4_moe=torch", torch.device("cuda")).backends.fp4_moe == "torch"


def test_triton_on_a_cpu_worker_is_refused_unless_interpreted(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(StartupError, match="--kernels attention=triton: the Triton kernels need a CUDA device"):
        worker_numerics(ARGS, "attention=triton", CPU)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert worker_numerics(ARGS, "attention=triton", CPU).backends.attention == "triton"


def test_a_bad_spec_stops_at_the_command_line(capsys):
    with pytest.raises(SystemExit) as stop:
        cli_main(["plan", "--model", "dsv4-tiny", "--kernels", "attention=cuda"])
    assert stop.value.code != 0
    err = capsys.readouterr().err
    assert "--kernels" in err and "'cuda'" in err


def test_a_checkpoint_whose_dense_weights_cannot_fit_is_refused_by_name(real_model_dir):
    from types import SimpleNamespace

    from dsv4serve.ipc.messages import Sourced, WorkerLaunch
    from dsv4serve.model.args import read_model_args
    from dsv4serve.model.schema import checkpoint_schema
    from dsv4serve.worker.model_load import check_weights_fit

    args = read_model_args(real_model_dir)
    ckpt = SimpleNamespace(args=args, specs=tuple(checkpoint_schema(args)))
    launch = WorkerLaunch("", "", "m", "cpu", Sourced(1), Sourced(1), Sourced(1), Sourced(None), Sourced(None))
    with pytest.raises(
        StartupError,
        match=r"need 1\d\d\d\.\d GiB dense in fp32, more than .* host memory: on CUDA "
        r"the FP8 GEMM and FP4 MoE kernels load them packed",
    ):
        check_weights_fit(ckpt, KernelBackends.every("torch"), False, False, launch, CPU)


def test_packed_weights_that_cannot_fit_the_card_are_refused_with_the_fix(real_model_dir, monkeypatch):
    from types import SimpleNamespace

    from dsv4serve.ipc.messages import Sourced, WorkerLaunch
    from dsv4serve.memory.chunk_planner import MemorySnapshot
    from dsv4serve.model.args import read_model_args
    from dsv4serve.model.schema import checkpoint_schema
    from dsv4serve.worker import model_load

    monkeypatch.setattr(model_load, "take_snapshot", lambda device: MemorySnapshot(30 * 2**30, 32 * 2**30, "wsl2"))
    args = read_model_args(real_model_dir)
    ckpt = SimpleNamespace(args=args, specs=tuple(checkpoint_schema(args)))
    every = KernelBackends.every("triton")
    resident = WorkerLaunch("", "", "m", "cuda", Sourced(1), Sourced(1), Sourced(1), Sourced(None), Sourced(None))
    with pytest.raises(
        StartupError,
        match=r"need 1\d\d\.\d GiB packed as stored, more than the 32\.0 GiB of GPU"
        r".*--moe-cache-size",
    ):
        model_load.check_weights_fit(ckpt, every, True, False, resident, torch.device("cuda"))
    offloaded = msgspec.structs.replace(resident, moe_cache_size=Sourced(900, "cli"))
    model_load.check_weights_fit(ckpt, every, True, False, offloaded, torch.device("cuda"))  # ~15 GiB: fits


def test_auto_expert_slots_on_cuda_are_the_memory_plan_s(real_model_dir, monkeypatch):
    """Without --moe-cache-size the CUDA worker takes the slots `dsv4serve plan` prints for its card."""
    import json
    import subprocess
    import sys

    from dsv4serve.ipc.messages import Sourced, WorkerLaunch
    from dsv4serve.memory import expert_plan
    from dsv4serve.memory.chunk_planner import MemorySnapshot
    from dsv4serve.model.args import read_model_args
    from dsv4serve.model.schema import checkpoint_schema

    gib = 2**30
    monkeypatch.setattr(expert_plan, "take_snapshot", lambda device: MemorySnapshot(30 * gib, 32 * gib, "wsl2"))
    monkeypatch.setattr(expert_plan, "host_snapshot", lambda: MemorySnapshot(100 * gib, 128 * gib, "native"))
    args = read_model_args(real_model_dir)
    launch = WorkerLaunch(
        "",
        "",
        "m",
        "cuda",
        Sourced(32),
        Sourced(256),
        Sourced(args.max_position_embeddings, "model-rule"),
        Sourced(None),
        Sourced(None),
    )
    slots, why = expert_plan.planned_expert_slots(checkpoint_schema(args), args, launch, KernelBackends.every("triton"))
    plan = subprocess.run(
        [
            sys.executable,
            "-m",
            "dsv4serve",
            "plan",
            "--model",
            str(real_model_dir),
            "--gpu-memory",
            "32GiB",
            "--host-memory",
            "128GiB",
            "--platform",
            "wsl2",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert slots == json.loads(plan.stdout)["memory_plan"]["experts"]["slots"] and "expert-slot cache" in why


def test_batch_invariance_is_opt_in_and_a_bf16_checkpoint_keeps_fp8_kernels_off(monkeypatch):
    import dataclasses

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cuda = torch.device("cuda")
    assert (
        not worker_numerics(ARGS, "auto", cuda).batch_invariant
        and not worker_numerics(ARGS, "auto", CPU).batch_invariant
    )
    # --batch-invariant: the torch reference path everywhere (the Triton kernels sum in tile order)
    inv = worker_numerics(ARGS, "auto", cuda, batch_invariant=True)
    assert inv.batch_invariant and inv.backends == KernelBackends.every("torch")
    with pytest.raises(StartupError, match="--batch-invariant with --kernels attention=triton"):
        worker_numerics(ARGS, "attention=triton", cuda, batch_invariant=True)
    bf16 = dataclasses.replace(ARGS, dtype="bf16")
    auto = worker_numerics(bf16, "auto", cuda)
    assert auto.backends.fp8_gemm == auto.backends.fp4_moe == "torch" and auto.backends.attention == "triton"
    with pytest.raises(StartupError, match="fp8_gemm=triton reads FP8"):
        worker_numerics(bf16, "fp8_gemm=triton", cuda)


def test_decode_graphs_are_captured_unless_a_step_makes_the_host_wait_in_a_way_no_cut_holds():
    """Hybrid CPU experts sync per layer in the speculative verify steps (decode steps take the split fixed between
    steps: experts/hybrid_graph.py): those run eager. A layer whose experts are not pinned is staged by the host
    mid-step (WSL2's pin cap, or a bank larger than host RAM): its graphs are cut there (experts/graph_cuts.py),
    once a cut graph passes its start-up check; a failed check keeps them eager and says why."""
    from types import SimpleNamespace

    from dsv4serve.worker import engine_setup

    cuda = torch.device("cuda")
    assert eager_reason(cuda, False, False) is None
    assert eager_reason(CPU, False, False) == "off (CPU: every step eager)"
    assert eager_reason(cuda, True, False) == "off (--enforce-eager)"
    assert "--speculative-tokens" in (eager_reason(cuda, False, True) or "")
    model = SimpleNamespace(layers=[SimpleNamespace(ffn="moe0"), SimpleNamespace(ffn="moe1")], args=ARGS)
    pinned = SimpleNamespace(layers=[0, 1, 2], staged_layers=[])
    partly = SimpleNamespace(layers=[0, 1, 2], staged_layers=[1, 2])  # 2: the MTP layer's, not checked
    checked = []

    def check(moe, cache, numerics, device, dim, vocab):
        checked.append(moe)
        return verdict

    verdict = None
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("dsv4serve.experts.cut_check.check_cut_graph", check)
        assert engine_setup._cut_graph_reason(model, None, None, cuda) is None  # type: ignore[arg-type]
        assert engine_setup._cut_graph_reason(model, pinned, None, cuda) is None  # type: ignore[arg-type]
        assert checked == []  # nothing cut: nothing to check
        assert engine_setup._cut_graph_reason(model, partly, None, cuda) is None  # type: ignore[arg-type]
        assert checked == ["moe1"]
        verdict = "a replayed cut graph differed from the eager layer (max |diff| 0.5)"
        why = engine_setup._cut_graph_reason(model, partly, None, cuda)  # type: ignore[arg-type]
    assert why is not None and why.startswith("off (2 of 3 MoE layers' experts are not pinned")
    assert verdict in why


def test_auto_on_a_cuda_worker_projects_both_offloaded_backends_with_this_host_s_ram(real_model_dir, monkeypatch):
    """model_load._offload_faster: the real tensor list, the expert bank in the RAM the host has available, the
    assumed bandwidths: on a 128 GiB host (the 137 GiB bank does not fit) offload is the faster, and says so."""
    from types import SimpleNamespace

    from dsv4serve.memory.chunk_planner import MemorySnapshot
    from dsv4serve.model.args import read_model_args
    from dsv4serve.model.schema import checkpoint_schema
    from dsv4serve.worker import model_load

    args = read_model_args(real_model_dir)
    ckpt = SimpleNamespace(specs=tuple(checkpoint_schema(args)), args=args)
    value = SimpleNamespace
    launch = SimpleNamespace(
        moe_cache_size=value(value=936), enforce_eager=value(value=False), speculative_tokens=value(value=0)
    )
    free = 128 * 2**30
    monkeypatch.setattr(model_load, "host_snapshot", lambda: MemorySnapshot(free, free, "native"))
    line = model_load._offload_faster(ckpt, launch, KernelBackends.every("triton"), False)  # type: ignore[arg-type]
    # hybrid at its best count of kt-kernel layers (one: every layer that fit left the bank on disk, 2.5 tokens/s)
    assert line is not None and line.startswith("projected batch-1 decode offload 6.8 vs hybrid 5.4 tokens/s")
    free = 1024 * 2**30  # room for the bank and kt-kernel's copy: both replay graphs, hybrid is the faster
    assert model_load._offload_faster(ckpt, launch, KernelBackends.every("triton"), False) is None
    assert model_load._kt_layers(ckpt, launch, KernelBackends.every("triton"), False) == 43  # every layer beside it
    free = 192 * 2**30  # the bank pinned whole beside the copy of the first layers, not every layer's copy
    k = model_load._kt_layers(ckpt, launch, KernelBackends.every("triton"), False)  # type: ignore[arg-type]
    assert k is not None and 1 < k < 43
