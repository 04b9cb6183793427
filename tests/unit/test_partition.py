"""The tensor-parallel partition (dsv4serve/parallel/partition.py) on the real DeepSeek-V4-Flash tensor list:
every tensor placed, shards tiling each tensor, scale shards on their weights' blocks, bytes by hand."""

from __future__ import annotations

import dataclasses
import gzip
from collections import defaultdict

import pytest
import torch

from dsv4serve.model.args import read_model_args
from dsv4serve.model.schema import DTYPE_BYTES, checkpoint_schema
from dsv4serve.parallel.partition import (
    PartitionError,
    make_partition,
    rank_bytes,
    rank_specs,
    shard_byte_ranges,
    weight_kind,
)

SIZES = (1, 2, 4, 8)
MODES = [(t, ep) for t in SIZES for ep in (False, True)]


@pytest.fixture(scope="module")
def real(real_model_dir):
    args = read_model_args(real_model_dir)
    with gzip.open(real_model_dir / "tensors.tsv.gz", "rt") as f:
        rows = [line.rstrip("\n").split("\t") for line in f][1:]
    listed = {name: (dtype, tuple(int(d) for d in shape.split(","))) for name, dtype, shape in rows}
    return args, checkpoint_schema(args), listed


@pytest.fixture(scope="module")
def partitions(real):
    args, specs, _ = real
    return {(t, ep): make_partition(args, t, ep, specs) for t, ep in MODES}


def test_every_real_tensor_has_a_rule(real, partitions):
    _, _, listed = real
    assert len(listed) == 69_187
    for part in partitions.values():
        assert set(part.rules) == set(listed)


@pytest.mark.parametrize("tp,ep", MODES)
def test_shards_tile_every_tensor_exactly(real, partitions, tp, ep):
    """Replicated: whole on every rank; owned: whole on exactly one; split: T disjoint intervals of one dim
    covering it, every other dim whole."""
    _, _, listed = real
    part = partitions[(tp, ep)]
    for name, (_, shape) in listed.items():
        slices = [part.shard_slice(name, shape, r) for r in range(tp)]
        held = [s for s in slices if s is not None]
        rule = part.rules[name]
        if rule.placement == "replicated":
            assert all(s == tuple(slice(0, d) for d in shape) for s in slices), name
            continue
        if rule.placement == "owned":
            assert len(held) == 1 and held[0] == tuple(slice(0, d) for d in shape), name
            continue
        d = rule.dim
        assert len(held) == tp
        assert all(s[:d] + s[d + 1 :] == tuple(slice(0, n) for i, n in enumerate(shape) if i != d) for s in held)
        cuts = sorted((s[d].start, s[d].stop) for s in held)
        assert cuts[0][0] == 0 and cuts[-1][1] == shape[d], name
        assert all(a[1] == b[0] for a, b in zip(cuts, cuts[1:])), name  # no gap, no overlap


@pytest.mark.parametrize("tp,ep", [(2, False), (4, False), (8, False), (8, True)])
def test_scale_shards_line_up_with_their_weights_blocks(real, partitions, tp, ep):
    """dsv4-model.md §3.3-3.4: FP8 scale [o//128, i//128]; MXFP4 scale [o, k//32] with k two per byte."""
    args, specs, _ = real
    part = partitions[(tp, ep)]
    by_name = {s.name: s for s in specs}
    checked = 0
    for spec in specs:
        if spec.role not in ("fp8_weight", "fp4_weight") or part.rules[spec.name].placement != "split":
            continue
        scale = by_name[spec.name.removesuffix(".weight") + ".scale"]
        d = part.rules[spec.name].dim
        assert part.rules[scale.name].dim == d
        per_scale = args.weight_block_size[d] if spec.role == "fp8_weight" else (16 if d == 1 else 1)
        for r in range(tp):
            w = part.shard_slice(spec.name, spec.shape, r)[d]
            s = part.shard_slice(scale.name, scale.shape, r)[d]
            assert w.start % per_scale == 0 and w.stop % per_scale == 0, spec.name
            assert (w.start // per_scale, w.stop // per_scale) == (s.start, s.stop), spec.name
        checked += 1
    # per block (43 + MTP): wq_b, wo_a, wo_b, shared w1/w3/w2; without EP also 256 x 3 expert projections
    assert checked == 44 * (6 + (0 if ep else 256 * 3))


def _by_kind(args, specs):
    out = defaultdict(int)
    for s in specs:
        out[weight_kind(s, args)] += s.nbytes
    return dict(out)


def test_one_rank_is_the_identity(real, partitions):
    args, specs, _ = real
    for ep in (False, True):
        part = partitions[(1, ep)]
        assert rank_specs(specs, part, 0) == specs
        assert rank_bytes(args, 1, ep) == [_by_kind(args, specs)]


# by hand from the config (dim 4096, moe_inter 2048, vocab 129280, q_lora 1024, head_dim 512, FP8 128-blocks):
# one FP4 expert = w1 + w3 ([2048, 4096/2] I8 + [2048, 4096/32] E8M0) + w2 ([4096, 2048/2] + [4096, 2048/32])
EXPERT_BYTES = 2 * (2048 * 2048 + 2048 * 128) + (4096 * 1024 + 4096 * 64)
VOCAB_BYTES = 129280 * 4096 * 2  # embed or head, bf16
# attention tensors every rank holds whole, per layer: wq_a + scale, q_norm, wkv + scale, kv_norm
ATTN_REPLICATED = (1024 * 4096 + 8 * 32) + 1024 * 2 + (512 * 4096 + 4 * 32) + 512 * 2


@pytest.mark.parametrize("tp", (2, 4, 8))
@pytest.mark.parametrize("ep", (False, True))
def test_rank_bytes_by_hand(real, tp, ep):
    args, specs, _ = real
    whole = _by_kind(args, specs)
    ranks = rank_bytes(args, tp, ep)
    assert EXPERT_BYTES == 13_369_344  # 12.75 MiB
    for r in ranks:  # every rank the same share: E/T whole experts, or 1/T of every expert
        assert r["routed_experts"] == 43 * (256 // tp) * EXPERT_BYTES
        assert r["embed"] == r["head"] == VOCAB_BYTES // tp
    total = {k: sum(r.get(k, 0) for r in ranks) for k in whole}
    for kind in ("routed_experts", "shared_experts", "embed", "head"):  # split or owned: counted once
        assert total[kind] == whole[kind], kind
    for kind in ("compressor", "indexer", "router", "hc_norm"):  # replicated: counted T times
        assert total[kind] == tp * whole[kind], kind
    assert total["attention"] == whole["attention"] + (tp - 1) * 43 * ATTN_REPLICATED


def test_shard_specs_feed_the_weight_sums(real, partitions):
    """rank_specs keeps names, roles and groups: only shapes shrink; experts not owned disappear."""
    args, specs, _ = real
    mine = rank_specs(specs, partitions[(2, True)], 1)
    experts = {(s.layer, s.expert) for s in mine if s.group == "routed_experts"}
    assert {e for _, e in experts} == set(range(128, 256))
    wq_b = next(s for s in mine if s.name == "layers.5.attn.wq_b.weight")
    assert wq_b.shape == (32 * 512, 1024) and wq_b.dtype == "F8_E4M3"


def test_a_split_off_a_scale_block_is_refused_naming_the_tensor(real):
    args, _, _ = real
    with pytest.raises(PartitionError, match=r"wo_a.*o_groups"):
        make_partition(args, 16, False)
    # wo_a groups of 64 rows: 8 ranks would each hold half an FP8 128-row scale block
    narrow = dataclasses.replace(args, o_lora_rank=64)
    with pytest.raises(PartitionError, match=r"layers\.0\.attn\.wo_a\.weight .*128-element"):
        make_partition(narrow, 8, False)
    # an MXFP4 w2 split mid scale group: 2080 K over 2 ranks = 520 bytes a rank, not whole 16-byte groups
    odd = dataclasses.replace(args, moe_inter_dim=2080)
    with pytest.raises(PartitionError, match=r"ffn\.experts\.0\.w2\.weight .*16-element"):
        make_partition(odd, 2, False)
    with pytest.raises(PartitionError, match="routed experts"):
        make_partition(args, 3, True)


@pytest.mark.parametrize(
    "shape,dim,start,stop", [((6, 10), 0, 2, 4), ((6, 10), 1, 5, 10), ((3, 4, 8), 1, 2, 4), ((5,), 0, 0, 5)]
)
def test_byte_ranges_read_exactly_the_shard(shape, dim, start, stop):
    """The oracle: torch's own indexing of a tensor whose bytes are numbered."""
    t = torch.arange(torch.Size(shape).numel(), dtype=torch.int32).view(shape)
    slices = tuple(slice(start, stop) if i == dim else slice(0, n) for i, n in enumerate(shape))
    raw = t.contiguous().view(torch.uint8).flatten()
    got = torch.cat([raw[a:b] for a, b in shard_byte_ranges(shape, 4, slices)])
    assert torch.equal(got, t[slices].contiguous().view(torch.uint8).flatten())
    assert len(shard_byte_ranges(shape, 4, slices)) == (1 if dim == 0 or stop - start == shape[dim] else shape[0])


def test_dtype_table_matches_the_byte_sums():
    assert DTYPE_BYTES["F8_E4M3"] == DTYPE_BYTES["I8"] == DTYPE_BYTES["F8_E8M0"] == 1 and DTYPE_BYTES["BF16"] == 2


def test_the_parallel_package_sits_beside_model_and_never_imports_torch_distributed():
    """parallel/'s pure modules (what `plan --gpus N` imports) may import the model's args and schema only
    (docs/structure.md), never torch; the split forward's modules (group, collectives, shard_model,
    split_check) import torch.distributed only inside functions, never at module level."""
    import ast
    from pathlib import Path

    import dsv4serve.parallel

    allowed = {"dsv4serve.model.args", "dsv4serve.model.schema", "dsv4serve.parallel"}
    found = set()
    folder = Path(dsv4serve.parallel.__file__).parent
    for path in folder.glob("*.py"):
        top = [
            n for n in ast.parse(path.read_text(encoding="utf-8")).body if isinstance(n, ast.Import | ast.ImportFrom)
        ]
        assert not any("torch.distributed" in ast.unparse(n) for n in top), path.name
    for path in (folder / name for name in ("__init__.py", "partition.py", "comm_volume.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module)
    ours = {m for m in found if m.startswith("dsv4serve")}
    assert ours and all(m in allowed or m.startswith("dsv4serve.parallel.") for m in ours), ours
    assert not {m for m in found if m.startswith("torch")}, found


def _small(args):
    """The real config at small sizes (same layout rules), so that a forward on its shards is cheap."""
    return dataclasses.replace(
        args,
        dim=256,
        n_heads=8,
        o_groups=4,
        o_lora_rank=128,
        q_lora_rank=128,
        head_dim=128,
        moe_inter_dim=512,
        n_routed_experts=4,
        n_activated_experts=2,
        vocab_size=512,
    )


@pytest.mark.parametrize("tp", (2, 4))
def test_the_shards_compute_what_the_whole_tensors_compute(real, tp):
    """The oracle is the unsplit math (dsv4-model.md §2.2, 2.6-2.8): q heads from wq_b, a per-head step using
    the head's sink, the grouped wo_a, wo_b; the shared expert's SwiGLU; the head's logits. Summing the ranks'
    partial outputs (row parallel) or concatenating their slices (vocabulary) must give the same result, so a
    rule cutting the wrong dim, or heads and groups that do not match up, fails here."""
    args = _small(real[0])
    part = make_partition(args, tp, False)
    gen = torch.Generator().manual_seed(0)
    shapes = {s.name: s.shape for s in checkpoint_schema(args) if s.layer in (None, 0)}

    def rand(name):
        return torch.randn(shapes[name], generator=gen, dtype=torch.float64)

    names = ["attn.wq_b", "attn.wo_a", "attn.wo_b", "ffn.shared_experts.w1", "ffn.shared_experts.w3"]
    w = {n: rand(f"layers.0.{n}.weight") for n in [*names, "ffn.shared_experts.w2"]}
    sink, head = rand("layers.0.attn.attn_sink"), rand("head.weight")
    qr, x = (
        torch.randn(3, args.q_lora_rank, generator=gen, dtype=torch.float64),
        torch.randn(3, args.dim, generator=gen),
    )
    x = x.double()

    def attention(wq_b, sink_h, wo_a, wo_b):
        q = (qr @ wq_b.T).unflatten(-1, (-1, args.head_dim))  # [N, h, d]
        o = q / q.square().mean(-1, keepdim=True).sqrt() * torch.sigmoid(sink_h)[None, :, None]
        groups = wo_a.shape[0] // args.o_lora_rank
        z = torch.einsum("ngd,grd->ngr", o.reshape(3, groups, -1), wo_a.view(groups, args.o_lora_rank, -1))
        return z.flatten(1) @ wo_b.T

    def shared(w1, w3, w2):
        return (torch.nn.functional.silu(x @ w1.T) * (x @ w3.T)) @ w2.T

    def cut(name, t, rank):
        return t[part.shard_slice(name if name == "head.weight" else f"layers.0.{name}", t.shape, rank)]

    full_attn = attention(w["attn.wq_b"], sink, w["attn.wo_a"], w["attn.wo_b"])
    full_ffn = shared(w["ffn.shared_experts.w1"], w["ffn.shared_experts.w3"], w["ffn.shared_experts.w2"])
    attn = ffn = 0
    logits = []
    for r in range(tp):
        s = {n: cut(f"{n}.weight", t, r) for n, t in w.items()}
        attn = attn + attention(s["attn.wq_b"], cut("attn.attn_sink", sink, r), s["attn.wo_a"], s["attn.wo_b"])
        ffn = ffn + shared(s["ffn.shared_experts.w1"], s["ffn.shared_experts.w3"], s["ffn.shared_experts.w2"])
        logits.append(x @ cut("head.weight", head, r).T)
    torch.testing.assert_close(attn, full_attn)
    torch.testing.assert_close(ffn, full_ffn)
    assert torch.equal(torch.cat(logits, dim=1), x @ head.T)
