"""The packed loader (model/packed_load.py) on dsv4-tiny, kernels in the interpreter.

The oracle is the dense path the engine runs today: every weight dequantized to fp32, then
`use_kernels` re-packs FP8 projections and MXFP4 experts exactly. The packed loader must give a model
whose logits are bitwise those (same packed bytes, same kernels), without ever holding the dense copy.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsv4_kernels.fp4_moe_ref import down_ref, gate_up_ref
from dsv4_kernels.fp8_gemm_ref import act_quant_fp8_ref
from dsv4serve.checkpoint.loader import iter_dense, open_checkpoint
from dsv4serve.experts.attach import attach_expert_cache, iter_resident_dense
from dsv4serve.experts.slot_cache import PART_ORDER, ExpertSlotCache
from dsv4serve.memory.weights import COMPRESSOR_BF16, device_bytes, held_bf16, weight_bytes
from dsv4serve.model.args import read_model_args
from dsv4serve.model.backends import TORCH, KernelBackends
from dsv4serve.model.layers import Linear
from dsv4serve.model.moe import MoE
from dsv4serve.model.numerics import NUMERICS_ON, act_quant
from dsv4serve.model.packed_load import load_packed
from dsv4serve.model.schema import checkpoint_schema
from dsv4serve.model.transformer import BatchRow, Transformer

pytestmark = pytest.mark.slow  # the interpreter runs whole models: `pytest -m "not slow"` skips it

PROMPT_TOKENS, DECODE_STEPS = 24, 1  # the interpreter runs a decode step as slowly as the prefill
ALL_TRITON = KernelBackends.every("triton")
# the loader only changes what fp8_gemm and fp4_moe read: the mixes below leave the other kernels on
# torch, which is faster in the interpreter and reads the same (dense) weights either way
MIXED = KernelBackends(fp4_moe="triton")  # FP8 projections dense, experts packed
FP8_ONLY = KernelBackends(fp8_gemm="triton")
CPU = torch.device("cpu")
GIB = 2**30


@pytest.fixture(scope="module")
def ckpt(tiny_dir):
    c = open_checkpoint(tiny_dir)
    yield c
    c.source.close()


@pytest.fixture(scope="module")
def dense(ckpt) -> Transformer:
    model = Transformer(ckpt.args, include_mtp=True).eval()
    model.load_state_dict(dict(iter_dense(ckpt, progress=False)), strict=True)
    model.use_kernels(ALL_TRITON)  # packs both kinds (serves every backends mix below); head held in bf16
    return model


def _nbytes(model: Transformer) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def _logits(model: Transformer, backends: KernelBackends) -> torch.Tensor:
    """A 24-token prefill, then a greedy decode step (the kernels' M=1 paths): logit rows [25, vocab] fp32. Batch
    invariance off: the numerics a worker runs the Triton kernels in (worker_numerics refuses them with it)."""
    num = dataclasses.replace(NUMERICS_ON, backends=backends, batch_invariant=False)
    ids = torch.randint(0, model.args.vocab_size, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(3))
    state = model.new_state(num)
    rows = [model([BatchRow(ids, state)], num, all_logits=True).logits[0]]
    for _ in range(DECODE_STEPS):
        rows.append(model([BatchRow(rows[-1][-1].argmax().view(1), state)], num).logits[0][None])
    return torch.cat(rows)


@pytest.mark.parametrize("backends", [ALL_TRITON, MIXED], ids=["all_triton", "fp8_torch_fp4_triton"])
def test_packed_model_matches_the_dense_model_bitwise(ckpt, dense, backends):
    model, cache = load_packed(ckpt, backends, CPU, include_mtp=True, progress=False)
    assert cache is None
    assert not [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    assert torch.equal(_logits(model, backends), _logits(dense, backends))
    assert _nbytes(model) == device_bytes(ckpt.specs, ckpt.args, backends, include_mtp=True).total_bytes


def test_packed_model_holds_no_dense_copy(ckpt, dense):
    model, _ = load_packed(ckpt, ALL_TRITON, CPU, include_mtp=True, progress=False)
    names = {n for n, _ in model.named_parameters()}
    assert not [n for n in names if ".experts." in n], "routed experts must be held only stacked"
    fp8 = [n for n, m in model.named_modules() if isinstance(m, Linear) and m.fp8_stored]
    assert fp8 and not [n for n in fp8 if f"{n}.weight" in names], "FP8 projections must hold no dense weight"

    # the weights the kernels read: dense-loaded fp32 + the packed copies vs packed only (1 byte per
    # FP8 value and half a byte per FP4 value, plus scales: about 1/4 and 1/8 of fp32)
    def kernel_bytes(m: Transformer) -> int:
        mods = [x for x in m.modules() if (isinstance(x, Linear) and x.fp8_act) or isinstance(x, MoE)]
        own = [t for x in mods for t in [*x.parameters(recurse=False), *x.buffers(recurse=False)]]
        experts = [t for x in mods if isinstance(x, MoE) for t in x.experts.parameters()]
        return sum(t.numel() * t.element_size() for t in [*own, *experts])

    assert kernel_bytes(model) < 0.3 * kernel_bytes(dense)
    assert _nbytes(model) < _nbytes(dense)
    with pytest.raises(RuntimeError, match="fp8_gemm=torch needs the model loaded dense"):
        _logits(model, dataclasses.replace(ALL_TRITON, fp8_gemm="torch"))
    with pytest.raises(RuntimeError, match="fp4_moe=torch needs them loaded dense"):
        _logits(model, dataclasses.replace(ALL_TRITON, fp4_moe="torch"))
    held = _nbytes(model)
    model.use_kernels(ALL_TRITON)  # the engine's call after loading: everything is packed already
    assert _nbytes(model) == held


def test_all_torch_estimate_is_the_dense_model(ckpt, dense):
    """With every kernel on torch the packed path loads everything dense: the estimate must then be the
    dense model's own bytes, less the packed copies use_kernels added to it and less half of the fp32
    tensors the packed path holds in bf16 (the embedding and every wo_a), plus what use_kernels saved by
    holding the head and the compressors' wkv / wgate in bf16 (head / compressor = triton; with every kernel
    on torch the packed path keeps them fp32)."""
    packed_copies = sum(t.numel() * t.element_size() for n, t in dense.named_buffers() if "_fp" in n)
    halved = [n for n, _ in dense.named_parameters() if held_bf16(n, TORCH)]
    assert "embed.weight" in halved and sum(n.endswith(".attn.wo_a.weight") for n in halved) == 5  # 4 layers + MTP
    bf16_saved = sum(t.numel() * 2 for n, t in dense.named_parameters() if held_bf16(n, TORCH))
    assert dense.head.weight.dtype == torch.bfloat16 and not held_bf16("head.weight", TORCH)
    head_saved = dense.head.weight.numel() * 2
    compressors = [t for n, t in dense.named_parameters() if n.endswith(COMPRESSOR_BF16)]
    # 5 compressors' wkv / wgate and 2 CSA indexers' head weights, which ride in their compressor's launch
    assert len(compressors) == 2 * 5 + 2 and all(t.dtype == torch.bfloat16 for t in compressors)
    compressor_saved = sum(t.numel() * 2 for t in compressors)
    assert (
        device_bytes(ckpt.specs, ckpt.args, TORCH, include_mtp=True).total_bytes
        == _nbytes(dense) - packed_copies - bf16_saved + head_saved + compressor_saved
    )


def test_embedding_wo_a_and_head_are_held_in_bf16_exactly(ckpt):
    """Held in bf16, the embedding rows, every wo_a and (head=triton) the head equal the dense fp32
    values exactly."""
    model, _ = load_packed(ckpt, ALL_TRITON, CPU, include_mtp=True, progress=False)
    dense = Transformer(ckpt.args, include_mtp=True)
    dense.load_state_dict(dict(iter_dense(ckpt, progress=False)), strict=True)
    dense_params = dict(dense.named_parameters())
    assert held_bf16("head.weight", ALL_TRITON) and model.head.weight.dtype == torch.bfloat16
    for name, t in model.named_parameters():
        if held_bf16(name, ALL_TRITON):
            assert t.dtype == torch.bfloat16 and torch.equal(t.float(), dense_params[name]), name
        else:
            assert t.dtype != torch.bfloat16, name


@pytest.mark.parametrize("backends", [FP8_ONLY, MIXED], ids=["torch_experts", "triton_experts"])
def test_expert_slots_go_through_the_slot_cache(ckpt, dense, backends):
    """Experts offloaded behind 3 slots (most reads from the host bank): on torch bitwise the resident
    torch path (tests/model/test_expert_offload.py), on Triton bitwise the resident kernel path (the same
    kernel reads each expert from a slot or the bank: the same bytes in the same order)."""
    model, cache = load_packed(ckpt, backends, CPU, include_mtp=True, expert_cache_slots=3, progress=False)
    assert cache is not None and cache.n_slots == 3
    assert torch.equal(_logits(model, backends), _logits(dense, backends))
    cache.collect_usage()
    assert 0 < cache.stats.hits < cache.stats.queries and cache.stats.staged_layers == 0
    estimate = device_bytes(ckpt.specs, ckpt.args, backends, include_mtp=True, experts_resident=False)
    assert estimate.routed_expert_bytes == 0 and _nbytes(model) == estimate.total_bytes


def _offloaded(ckpt, slots: int, ram_layers: int, stream_group: int = 0) -> tuple[Transformer, ExpertSlotCache]:
    """The dense loader's model with its experts behind `slots` slots and only `ram_layers` layers of
    them in RAM: the rest stays in the mapped shards, which the kernel reads through the staging area."""
    layer_bytes = sum(s.nbytes for s in ckpt.specs if s.group == "routed_experts" and s.layer == 0)
    model = Transformer(ckpt.args, include_mtp=True).eval()
    cache = attach_expert_cache(
        model, ckpt, slots, CPU, ram_bytes=ram_layers * layer_bytes, progress=False, stream_group=stream_group
    )
    model.load_state_dict(dict(iter_resident_dense(ckpt, progress=False)), strict=True)
    # prepared as the dense reference is: its head held in bf16 (exact) and read in one layout, so the two heads
    # compute alike (a torch head on the CPU is otherwise held K-major, whose GEMV rounds otherwise at 1-2 rows)
    model.use_kernels(ALL_TRITON)
    return model, cache


def test_mapped_expert_layers_are_staged_for_the_kernel(ckpt, dense):
    model, cache = _offloaded(ckpt, 12, ram_layers=2)
    assert len(cache.bank.mapped) == ckpt.args.n_layers + ckpt.args.n_mtp_layers - 2
    assert torch.equal(_logits(model, MIXED), _logits(dense, MIXED))
    s = cache.stats
    assert s.staged_layers == 2 * (ckpt.args.n_layers - 2)  # 2 steps x the main layers in the shards
    assert s.stalls >= s.staged_layers and s.staged_bytes > 0


def test_triton_and_torch_slot_cache_paths_agree_per_layer(ckpt):
    """Each MoE layer's routed sum, on its prefill input, by the kernel (slots + bank) and by the torch
    slot-cache path, within the kernel's stated tolerance (tests/kernels/test_fp4_moe.py): 2^-6 of the
    routes' summed magnitudes (per the reference on the layer's stacked bank experts) + 2^-8 relative."""
    model, cache = _offloaded(ckpt, 3, ram_layers=ckpt.args.n_layers + ckpt.args.n_mtp_layers)
    inputs = {}

    def keep_first(m, args) -> None:  # returns None: a pre-hook's return value would replace the inputs
        inputs.setdefault(m.layer_id, args)

    for block in model.layers:
        block.ffn.register_forward_pre_hook(keep_first)
    _logits(model, MIXED)
    num = dataclasses.replace(NUMERICS_ON, backends=MIXED)
    for layer, (x, token_ids, _) in inputs.items():
        moe = model.layers[layer].ffn
        weights, ids = moe.gate(x, token_ids, num)
        kernel = moe._routed_kernel(x, weights, ids)
        torch_path = moe._routed_torch(act_quant(x, num), weights, ids, num)
        w = [cache.bank.layers[layer][p] for p in PART_ORDER]
        limit = moe.swiglu_limit
        per_route = down_ref(
            *act_quant_fp8_ref(gate_up_ref(*act_quant_fp8_ref(x), *w[:4], weights, ids, limit)), *w[4:], ids
        )
        bound = 2.0**-6 * per_route.float().abs().view(*ids.shape, -1).sum(1) + 2.0**-8 * torch_path.abs()
        assert bool(((kernel - torch_path).abs() <= bound).all()), layer


def test_prefill_streamed_experts_give_the_in_place_bits(ckpt):
    """Each MoE layer's routed sum on a 24-token prefill input (48 routes over 8 experts: past the 4 an expert that
    stream), its experts streamed into the slot tensors in ranges of 3 (buffers 0, 1, 0) and read from there, equals
    the same kernels reading the bank in place bit for bit (the same tiles): layers 0 and 1 in RAM (layer 1's first
    two ranges copied ahead by layer 0) and layer 3 in the shards (staged, then streamed); the usage and hit counts
    are the same."""
    model, cache = _offloaded(ckpt, 3, ram_layers=2, stream_group=3)
    stream = cache.stream
    assert stream is not None
    num = dataclasses.replace(NUMERICS_ON, backends=MIXED)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(PROMPT_TOKENS, ckpt.args.dim, generator=g).to(torch.bfloat16)
    token_ids = torch.randint(0, ckpt.args.vocab_size, (PROMPT_TOKENS,), generator=g)
    layers = (0, 1, ckpt.args.n_layers - 1)  # in RAM, in RAM, in the shards
    routes = {layer: model.layers[layer].ffn.gate(x, token_ids, num) for layer in layers}

    def run(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel's sum and the usage counts it added (no step boundary: no promotion, one epoch)."""
        with cache.detached():
            before = cache.usage.clone()
            return model.layers[layer].ffn._routed_kernel(x, *routes[layer]), cache.usage - before

    copied = []
    cache.stream.copy_range = lambda bank, g, runs, real=stream.copy_range: (copied.append(g), real(bank, g, runs))[1]
    streamed = {layer: run(layer) for layer in layers}  # one after the other, as a step runs them
    assert copied == [0, 1, 2, 0, 1, 2, 0, 1, 2]  # layer 0's three, layer 1's first two ahead, its third; layer 3's
    cache.stream = None
    for layer in layers:
        (out, counted), (in_place, counted_in_place) = streamed[layer], run(layer)
        assert torch.equal(out, in_place), layer
        assert torch.equal(counted, counted_in_place) and int(counted.sum()) > 0
    assert cache.bank.mapped and ckpt.args.n_layers - 1 in cache.staged_layers


def test_real_checkpoint_device_bytes(real_model_dir):
    """DeepSeek-V4-Flash, every kernel on Triton, no MTP, from the schema (the real tensor list matches it:
    tests/unit/test_real_checkpoint_list.py). The routed experts stay as stored: exactly the memory
    plan's 137.06 GiB. The rest is 9.67 GiB, not the plan's 8.24 GiB of stored bytes, because the model
    runs wo_a dequantized (FP8 stored; held in bf16: 43 x 8192 x 4096 at 2 bytes instead of 1, +1.34
    GiB) and holds the bf16 router weights and the rest of the indexers' in fp32 (+0.085 GiB); the embedding,
    the head, the compressors' wkv / wgate and the indexers' head weights (their compressor's launch computes
    them) are held in bf16 as stored (with head=torch the head would be fp32: +0.99 GiB; with
    compressor=torch those 145 weights: +0.58 GiB), the FP8 projections on the kernel keep their stored
    bytes."""
    args = read_model_args(real_model_dir)
    specs = checkpoint_schema(args)
    plan = weight_bytes(specs, args)
    got = device_bytes(specs, args, ALL_TRITON, include_mtp=False)
    assert got.routed_expert_bytes == plan.routed_expert_bytes and got.mtp_bytes == 0
    wo_a = 43 * (8192 * 4096 * (2 - 1) - 64 * 32)  # bf16 instead of e4m3 + its e8m0 scales
    rest = got.non_expert_bytes - plan.non_expert_bytes - wo_a
    assert rest == pytest.approx(0.0848 * GIB, rel=0.01)
    assert got.non_expert_bytes == pytest.approx(9.67 * GIB, rel=1e-3)
    head_on_torch = device_bytes(specs, args, dataclasses.replace(ALL_TRITON, head="torch"), include_mtp=False)
    assert head_on_torch.non_expert_bytes - got.non_expert_bytes == 129280 * 4096 * (4 - 2)
    compressor_on_torch = device_bytes(specs, args, dataclasses.replace(ALL_TRITON, compressor="torch"), False)
    compressors = [s for s in specs if s.name.endswith(COMPRESSOR_BF16) and s.layer < args.n_layers]
    # 21 CSA layers x 5 (compressor, indexer compressor, indexer head weights) + 20 HCA layers x 2
    assert len(compressors) == 145
    assert compressor_on_torch.non_expert_bytes - got.non_expert_bytes == sum(s.nbytes for s in compressors)
    assert device_bytes(specs, args, ALL_TRITON, include_mtp=True).mtp_bytes == pytest.approx(3.38 * GIB, rel=1e-3)
