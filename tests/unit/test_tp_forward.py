"""The forward split over T ranks (torch.distributed on gloo, one process a rank) against one rank's, on a
tiny model that splits (parallel/split_check.split_tiny_args): T = 2 and 4, experts split or owned (expert
parallelism), the engine's CPU numerics (FP8 / bf16 simulations on; batch invariance off, and on once).

The split sums the same products in another order only (partial sums all-reduced in fp32, cast after, as
the unsplit GEMMs accumulate in fp32 and cast once; each routed expert's w2 output rounded whole, after the
sum over ranks). Bound: 1e-4 of the logit scale, a few hundred fp32 ulps of reassociated sums carried through
4 layers. It is not loose: a single bf16 or FP8 rounding that went the other way moves the logits by 1e-2 of
their scale and more (rounding each expert's w2 partial before the sum over ranks gave 1.6 at a scale of 4.1
in prefill, and other greedy tokens by the second step). Measured: 0.0 at every T (see bench/RESULTS.md)."""

from __future__ import annotations

import ast
import copy
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsv4serve.model.args import args_from_dicts
from dsv4serve.model.backends import KernelBackends
from dsv4serve.model.random_init import dense_shape, random_model
from dsv4serve.model.schema import checkpoint_schema
from dsv4serve.parallel.comm_volume import NVLINK4_EAGER, decode_collectives, step_comm
from dsv4serve.parallel.partition import PartitionError, make_partition, rank_specs
from dsv4serve.parallel.shard_model import shard_model
from dsv4serve.parallel.split_check import RankResult, SplitJob, run_split, split_tiny_args
from dsv4serve.tiny.spec import TINY_CONFIG, inference_config

REL_TOL = 1e-4
REPO = Path(__file__).resolve().parents[2]


def test_the_split_config_partitions_at_1_2_4_where_dsv4_tiny_is_refused():
    args = split_tiny_args()
    for tp in (1, 2, 4):
        for ep in (False, True):
            part = make_partition(args, tp, ep)
            assert part.shard_slice("layers.0.attn.wo_b.weight", (args.dim, 512), tp - 1) is not None
    with pytest.raises(PartitionError, match="attn.wo_a"):
        make_partition(
            args_from_dicts(TINY_CONFIG, inference_config(TINY_CONFIG)), 2, False
        )  # o_lora_rank 64: half of a 128-row FP8 block a rank


class _Rank:
    """A TensorParallel stand-in for cutting alone (no forward runs, so no collective is called)."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size


@pytest.fixture(scope="module")
def whole_model():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # ~500 small tensors drawn and rounded: threads only contend (3.5 s vs 10 s on 2 cores)
    try:
        return random_model(split_tiny_args(), "cpu", seed=3, include_mtp=True)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_a_cut_model_holds_exactly_the_ranks_checkpoint_shards(whole_model, expert_parallel):
    """Against partition.rank_specs (the checkpoint tensors a rank reads, at their shard shapes, as the memory
    plan counts them): the same names and shapes in the cut model's state dict, MTP block included."""
    args, rank, size = split_tiny_args(), 1, 4
    model = copy.deepcopy(whole_model)
    part = make_partition(args, size, expert_parallel)
    shard_model(model, part, _Rank(rank, size))
    want = {
        spec.name: dense_shape(spec)
        for spec in rank_specs(checkpoint_schema(args), part, rank)
        if spec.role not in ("fp8_scale", "fp4_scale")
    }
    assert {name: tuple(t.shape) for name, t in model.state_dict().items()} == want
    moe = model.layers[0].ffn
    assert moe.not_owned == (frozenset(range(8)) - {2, 3} if expert_parallel else frozenset())
    assert (model.layers[0].attn.n_heads, model.layers[0].attn.n_groups) == (2, 1)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, RankResult]:
    """T = 1, by batch invariance: the reference."""
    out = tmp_path_factory.mktemp("t1")
    return {bi: run_split(SplitJob(1, batch_invariant=bi), out / str(bi))[0] for bi in (False, True)}


def _max_diff(results: list[RankResult], ref: RankResult) -> float:
    return max((r.logits - ref.logits).abs().max().item() for r in results)


def _expected_calls(args, job: SplitJob) -> dict[tuple[str, str], tuple[int, int]]:
    """{(op, what): (calls, bytes a call)} of one decode step of len(prompts) rows, from the architecture."""
    rows, dim, k = len(job.prompts), args.dim, args.n_activated_experts
    moe_rows = 2 if job.expert_parallel else k + 1  # (routed sum, shared) or (each pair, shared)
    share = 8 if job.batch_invariant else 4  # the row-parallel shares: exact fp64 sums (numerics.exact_sums), or fp32
    return {
        ("all_reduce", "attention output (after wo_b)"): (args.n_layers, rows * dim * share),
        ("all_reduce", "MoE output (routed + shared)"): (args.n_layers, rows * moe_rows * dim * share),
        ("all_reduce", "embedding (vocab-parallel)"): (1, rows * dim * 4),
        ("all_gather", "logits (vocab-parallel)"): (1, rows * args.vocab_size // job.tp_size * 4),
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    "tp_size, expert_parallel, batch_invariant",
    [(2, False, False), (2, True, False), (4, False, False), (4, True, False), (2, False, True)],
)
def test_split_forward_gives_one_ranks_tokens_and_logits(
    one_rank, tmp_path: Path, tp_size, expert_parallel, batch_invariant
):
    job = SplitJob(tp_size, expert_parallel, batch_invariant=batch_invariant)
    ref = one_rank[batch_invariant]
    results = run_split(job, tmp_path)
    for r in results:
        assert torch.equal(r.tokens, ref.tokens), f"greedy tokens {r.tokens.tolist()} != {ref.tokens.tolist()}"
        assert torch.equal(r.logits, results[0].logits)  # all-gathered: every rank holds the same logits
    diff, scale = _max_diff(results, ref), ref.logits.abs().max().item()
    assert diff <= REL_TOL * scale, f"max |dlogit| {diff:.3g} at logit scale {scale:.3g}"
    if batch_invariant:  # the row-parallel shares are exact sums: any split adds up to one rank's bits
        assert diff == 0, f"max |dlogit| {diff:.3g} with --batch-invariant"
    # the collectives of a decode step: counted against the architecture, and as many as comm_volume projects
    args = split_tiny_args()
    want = _expected_calls(args, job)
    for r in results:
        got: dict[tuple[str, str], list[int]] = {}
        for call in r.decode_calls:
            got.setdefault((call.op, call.what), []).append(call.message_bytes)
        assert {key: (len(b), max(b)) for key, b in got.items()} == want
        projected = step_comm(decode_collectives(args, len(job.prompts), tp_size, "tp"), NVLINK4_EAGER)
        assert len(r.decode_calls) == projected.calls == 2 * args.n_layers + 2


@pytest.mark.slow  # ~1 min: three spawns of prefill and 5 served decode steps
def test_ranks_serving_through_the_decode_buckets_give_one_ranks_tokens(tmp_path: Path):
    """What the worker's decode graphs need of a split model: each rank's scheduler, KV pool and runner with every
    decode step on the static buffers of worker/graphs.py (captured as CUDA graphs on GPUs; eager here) and a
    padding row in the 4-row bucket that 3 requests use: the tokens one rank serves, bit for bit (--batch-invariant),
    and the tokens of the unpaged split forward above."""
    job = SplitJob(1, served=True, batch_invariant=True)
    (ref,) = run_split(job, tmp_path / "t1")
    assert ref.buckets and set(ref.buckets) == {4}, ref.buckets  # 3 rows a step: one padding row in each
    assert ref.served == ref.tokens.T.tolist()  # the unpaged forward's greedy choices, prefill's and each step's
    for expert_parallel in (False, True):
        two = dataclasses.replace(job, tp_size=2, expert_parallel=expert_parallel)
        for r in run_split(two, tmp_path / f"t2_ep{int(expert_parallel)}"):
            assert r.served == ref.served and r.buckets == ref.buckets, expert_parallel


@pytest.mark.slow
def test_a_rank_on_the_wrong_heads_is_caught(one_rank, tmp_path: Path):
    """Rank 1 computes rank 0's heads (its wq_b rows) with its own sinks and wo_a groups: the logits leave the
    bound at once, so the equality above does check the head split."""
    ref = one_rank[False]
    results = run_split(SplitJob(2, wrong_heads_on_rank=1), tmp_path)
    first = max((r.logits[0] - ref.logits[0]).abs().max().item() for r in results)
    assert first > 100 * REL_TOL * ref.logits.abs().max().item(), f"max |dlogit| {first:.3g} in prefill"


def test_the_one_gpu_path_never_loads_the_split_forward():
    """The worker and the model import no module that cuts or runs a split model (collectives, shard_model,
    rank_load, split_check): only the pure partition, and the group / step-link modules whose functions a
    one-rank worker never calls (torch.distributed is imported inside them): no process group is started."""
    code = (
        "import sys\n"
        "import dsv4serve.worker.main, dsv4serve.model.transformer, dsv4serve.plan_ranks\n"
        "print(sorted(m for m in sys.modules if m.startswith('dsv4serve.parallel.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    loaded = {m.removeprefix("dsv4serve.parallel.") for m in ast.literal_eval(out.stdout.strip())}
    assert loaded == {"partition", "group", "rendezvous", "step_link"}


@pytest.mark.slow  # ~2 min on 2 shared cores: prefill and one decode step of 1, then 2 ranks in the interpreter
def test_the_triton_kernels_split_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Every kernel on Triton (the FP8 GEMM, the MXFP4 MoE on each rank's expert columns or, expert parallel, on
    its own experts, the head on its vocabulary rows, ...), T = 2 against T = 1 on the same kernels. The FP8
    GEMM hands a row-parallel partial (wo_b, the shared expert's w2) over as its fp32 accumulator, cast after
    the sum over ranks: with expert parallelism (every routed expert whole on one rank) the split is then one
    rank's bit for bit here (measured 0; bound REL_TOL of the scale, the fp32 summation order). With every
    expert's columns split it is not exact: the MXFP4 kernel rounds each expert's output to bf16 in its epilogue,
    so each rank's w2 partial of an expert is rounded before the sum over ranks (2^-9 relative), and the FP8
    activation quantizers downstream turn such an ulp now and then into a flipped e4m3 rounding (2^-4 relative).
    Measured: 0.26 at a logit scale of 4.1 (0.25 while the FP8 partials were rounded too). Bound: 0.15 of
    the scale, and the same greedy tokens."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read by the spawned ranks when their kernels build
    prompts = ((5, 17, 3, 99, 250), (42, 8, 600))
    one = SplitJob(1, decode_steps=1, backends=KernelBackends.every("triton"), prompts=prompts)
    ref = run_split(one, tmp_path / "t1")[0]
    scale = ref.logits.abs().max().item()
    for expert_parallel in (False, True):  # each expert's columns split, or each rank its own experts (EP)
        two = dataclasses.replace(one, tp_size=2, expert_parallel=expert_parallel)
        for r in run_split(two, tmp_path / f"t2_ep{int(expert_parallel)}"):
            assert torch.equal(r.tokens, ref.tokens)
            diff = (r.logits - ref.logits).abs().max().item()
            if expert_parallel:
                assert diff <= REL_TOL * scale, f"max |dlogit| {diff:.3g} at logit scale {scale:.3g} (EP)"
            else:
                assert 0 < diff <= 0.15 * scale, f"max |dlogit| {diff:.3g} at logit scale {scale:.3g} (split experts)"
