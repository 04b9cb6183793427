"""The pieces of serving over tensor-parallel ranks that run without a second process: the options, the
typed messages rank 0 hands the other ranks, the per-rank loader (only the rank's part read), what a group
refuses, the supervisor's account of a dead rank, and the attention math that keeps --batch-invariant exact
across ranks. The ranks themselves run in tests/e2e/test_tensor_parallel.py."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import pytest
import torch

from dsv4serve.checkpoint.loader import _cut_bytes, load_dense_state_dict, open_checkpoint
from dsv4serve.ipc.messages import Sourced, TokenLogprob, TokenOut
from dsv4serve.ipc.sampling import SamplingParams
from dsv4serve.model.attention import sparse_attention
from dsv4serve.model.transformer import Transformer
from dsv4serve.parallel.partition import make_partition
from dsv4serve.parallel.rank_load import load_rank_dense
from dsv4serve.parallel.shard_model import shard_model
from dsv4serve.parallel.step_link import Ping, RankMessage, RunStep, StepTokens, Stop
from dsv4serve.supervisor import _Incarnation
from dsv4serve.worker.model_load import StartupError, check_parallel, cpu_worker_threads
from dsv4serve.worker.step import NewRequest, ScheduledRow, StepPlan
from tests.unit.test_config import _resolve
from tests.worker_launch import launch_for


def test_the_options_resolve_with_their_source():
    cfg = _resolve(["--model", "x", "--tensor-parallel-size", "4", "--expert-parallel"])
    assert cfg.tensor_parallel_size.value == 4 and cfg.tensor_parallel_size.source.value == "cli"
    assert cfg.expert_parallel.value is True
    default = _resolve(["--model", "x"])
    assert default.tensor_parallel_size.value == 1 and default.expert_parallel.value is False
    with pytest.raises(SystemExit):
        _resolve(["--model", "x", "--tensor-parallel-size", "0"])


def test_step_messages_round_trip_typed():
    plan = StepPlan(
        rows=(ScheduledRow("a", (1, 2, 3), 0, True, 4, new_pages=(7, 8), snapshot_slot=5),),
        new_requests=(NewRequest("a", (1, 2, 3), SamplingParams(temperature=0.7, max_tokens=9, seed=3)),),
        dropped=("b",),
        finished=("b",),
    )
    decoder = msgspec.msgpack.Decoder(RankMessage)
    for message in (RunStep(plan), Ping(), Stop()):
        assert decoder.decode(msgspec.msgpack.encode(message)) == message
    tokens = StepTokens({"a": (TokenOut(5, -0.25, [TokenLogprob(5, -0.25)]), TokenOut(6))})
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(tokens), type=StepTokens) == tokens
    with pytest.raises(msgspec.ValidationError):  # a message of another kind is refused, never guessed
        decoder.decode(msgspec.msgpack.encode(tokens))


@dataclass(frozen=True)
class _Rank:
    rank: int
    size: int

    def reset(self) -> None:
        pass


@pytest.mark.parametrize("ranks,expert_parallel", [(2, True), (4, False)])
def test_a_rank_reads_exactly_its_part(tiny_split_dir, ranks, expert_parallel):
    """Each rank's model, loaded from its slices alone, equals the whole model cut by the partition; the bytes
    it reads (the progress bar's total) are its part of the checkpoint."""
    args, whole = load_dense_state_dict(tiny_split_dir)
    partition = make_partition(args, ranks, expert_parallel)
    ckpt = open_checkpoint(tiny_split_dir)
    read = []
    for rank in range(ranks):
        model = load_rank_dense(ckpt, partition, _Rank(rank, ranks), torch.device("cpu"), False, progress=False)
        reference = Transformer(args, include_mtp=False)
        reference.load_state_dict({k: v for k, v in whole.items() if not k.startswith("mtp.")})
        shard_model(reference, partition, _Rank(rank, ranks))
        got, want = model.state_dict(), reference.state_dict()
        assert got.keys() == want.keys()
        assert [k for k in got if not torch.equal(got[k], want[k])] == []
        assert model.layers[0].attn.n_heads == args.n_heads // ranks
        read.append(_cut_bytes(ckpt, lambda name, shape, r=rank: partition.shard_slice(name, shape, r)))
    assert max(read) < ckpt.total_bytes and sum(read) > ckpt.total_bytes  # the replicated parts are read by all


def test_a_group_refuses_what_it_does_not_run_by_name(tmp_path):
    cpu = torch.device("cpu")
    refused = {
        "--moe-cache-size 4": dict(moe_cache_size=4),
        "--moe-backend hybrid": dict(moe_backend="hybrid"),
        "--speculative-tokens 1": dict(speculative_tokens=1),
    }
    for flag, setting in refused.items():
        with pytest.raises(StartupError, match=f"--tensor-parallel-size 2 with {flag}"):
            check_parallel(launch_for(tmp_path, tensor_parallel_size=2, **setting), cpu)
    with pytest.raises(StartupError, match="--expert-parallel needs --tensor-parallel-size"):
        check_parallel(launch_for(tmp_path, expert_parallel=True), cpu)
    check_parallel(launch_for(tmp_path, tensor_parallel_size=2, expert_parallel=True), cpu)  # allowed
    assert launch_for(tmp_path).tensor_parallel_size == Sourced(1)


def test_cpu_ranks_share_the_cores():
    assert cpu_worker_threads({}, 16, 1) == 15
    assert cpu_worker_threads({}, 16, 4) == 3
    assert cpu_worker_threads({}, 2, 4) == 1
    assert cpu_worker_threads({"OMP_NUM_THREADS": "2"}, 16, 4) is None


class _Proc:
    def __init__(self, alive: bool, exitcode: int | None = None):
        self.alive, self.exitcode, self.killed = alive, exitcode, False

    def is_alive(self) -> bool:
        return self.alive and not self.killed

    def kill(self) -> None:
        self.killed = True


def test_the_supervisor_names_the_dead_rank_and_stops_the_rest():
    rank0, rank1, rank2 = _Proc(True), _Proc(False, -9), _Proc(True)
    inc = _Incarnation(rank0, channel=None, started=0.0, ranks=[rank1, rank2])  # type: ignore[arg-type]
    assert inc.dead() == "rank 1 of the worker's 3 (exit code -9)"
    inc.kill_all()
    assert rank0.killed and rank2.killed and not rank1.killed
    single = _Incarnation(_Proc(False, 1), channel=None, started=0.0)  # type: ignore[arg-type]
    assert single.dead() == "the worker process (exit code 1)"
    assert _Incarnation(_Proc(True), channel=None, started=0.0).dead() is None  # type: ignore[arg-type]


def test_per_head_attention_does_not_depend_on_the_heads_beside_it():
    g = torch.Generator().manual_seed(0)
    q, keys = torch.randn(3, 8, 64, generator=g), torch.randn(40, 64, generator=g)
    allowed, sink = torch.rand(3, 40, generator=g) > 0.3, torch.randn(8, generator=g)
    every = sparse_attention(q, keys, allowed, sink, 0.125, per_head=True)
    for lo, hi in ((0, 2), (2, 4), (6, 8)):  # a rank's heads alone: the very same bits
        mine = sparse_attention(q[:, lo:hi], keys, allowed, sink[lo:hi], 0.125, per_head=True)
        assert torch.equal(mine, every[:, lo:hi])
    torch.testing.assert_close(sparse_attention(q, keys, allowed, sink, 0.125), every, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("ranks,expert_parallel", [(2, True), (4, False)])
def test_a_rank_packed_for_the_kernels_equals_its_dense_part_packed(tiny_split_dir, ranks, expert_parallel):
    """The packed per-rank load (FP8 projections, MXFP4 expert stacks: the rank's slices or, expert parallel, its
    own experts in a local stack) equals the rank's dense part packed by use_kernels, tensor for tensor."""
    from dsv4_kernels.formats import dequant_fp4, dequant_fp8_block
    from dsv4serve.model.backends import KernelBackends
    from dsv4serve.model.layers import Linear
    from dsv4serve.model.moe import FP4_PARTS, MoE
    from dsv4serve.parallel.rank_load import load_rank_packed

    backends = KernelBackends.every("triton")
    ckpt = open_checkpoint(tiny_split_dir)
    partition = make_partition(ckpt.args, ranks, expert_parallel)
    cpu = torch.device("cpu")
    for rank in range(ranks):
        packed = load_rank_packed(ckpt, partition, _Rank(rank, ranks), backends, cpu, False, progress=False)
        dense = load_rank_dense(ckpt, partition, _Rank(rank, ranks), cpu, False, progress=False)
        dense.use_kernels(backends)
        modules = dict(dense.named_modules())
        compared = 0
        for name, module in packed.named_modules():
            twin = modules[name]
            if isinstance(module, Linear) and module.weight_fp8 is not None:
                got = dequant_fp8_block(module.weight_fp8, module.weight_fp8_scale)
                assert torch.equal(got, dequant_fp8_block(twin.weight_fp8, twin.weight_fp8_scale))
                compared += 1
            if isinstance(module, MoE):  # values, not codes: re-packing may write a zero as -0
                for part in FP4_PARTS:
                    codes, scale = getattr(module, f"{part}_fp4"), getattr(module, f"{part}_fp4_scale")
                    twin_codes, twin_scale = getattr(twin, f"{part}_fp4"), getattr(twin, f"{part}_fp4_scale")
                    assert codes.shape == twin_codes.shape, name
                    for e in range(codes.shape[0]):
                        assert torch.equal(dequant_fp4(codes[e], scale[e]), dequant_fp4(twin_codes[e], twin_scale[e]))
                want = twin.local_expert
                assert (module.local_expert is None) == (want is None)
                assert want is None or torch.equal(module.local_expert, want)
                compared += 1
        assert compared > 2 * ckpt.args.n_layers
        got, want = packed.state_dict(), dense.state_dict()
        for key, value in got.items():
            assert torch.equal(value.float(), want[key].float()), key
