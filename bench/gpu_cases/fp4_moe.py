"""Routed experts with MXFP4 weights (dsv4_kernels.fp4_moe_layer) at DeepSeek-V4-Flash's sizes.

Real config: dim 4096, moe_inter_dim 2048, 256 experts, top-6, SwiGLU limit 10; decode (T=1: six
experts' weights read, memory-bound) and prefill (T=2048: every expert used, compute-bound).
Weights are random packed e2m1 bytes with random e8m0 scales, made on the device; routing is a
random distinct top-6 per token with weights in [0, 2.5).
Reference: `fp4_moe_ref` (run with the device as the default, so its own tensors live there).
Tolerance as tests/kernels/test_fp4_moe.py argues: products are exact, so only the fp32 summation
order differs, which can flip a bf16 rounding and, rarely, the FP8 rounding of an activation before
w2: rtol 2^-6, and atol 0.1 for outputs of order one summed over six experts.
Baseline: torch bf16 matmuls per used expert on weights dequantized once (a plain grouped loop).
flashinfer's fused MoE kernels take other weight layouts (and its MXFP4 paths target Blackwell), so
it is not a baseline here.

The expert-slot cache's cases (`slot_cases`): decode (T = 1 and 8) with every expert held twice, in
device slots and in a pinned host bank, and a slot map that sends 0%, 50% or 100% of the used experts
to the bank: the kernel then reads those in place over PCIe (zero-copy, unified virtual addressing).
The rate is the GB/s of expert weights read (slots from HBM, misses over PCIe: expect the PCIe link's
~50 GB/s to dominate as soon as one expert misses); the result must equal the reference as above.

The prefill stream's cases (`stream_cases`, dsv4serve/experts/prefill_stream.py): a prefill chunk (T = 2048 and
4096) with every expert in the pinned host bank, streamed into device memory 16 experts at a time (copies on a side
stream overlapped with the previous range's GEMMs): its output must be the in-place read's bit for bit (the
reference), and the baseline is that in-place read (each expert read over PCIe once per 64-route block). The rate
is the expert bytes that crossed PCIe (each expert once) per second.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from bench.gpu_cases import GpuCase, real_config_dir

FP4_BLOCK = 32


@dataclass(frozen=True)
class MoeDims:
    dim: int
    inter: int
    experts: int
    topk: int
    limit: float


def real_dims() -> MoeDims:
    from dsv4serve.model.args import read_model_args

    a = read_model_args(real_config_dir())
    return MoeDims(a.dim, a.moe_inter_dim, a.n_routed_experts, a.n_activated_experts, a.swiglu_limit)


def random_fp4(
    e: int, n: int, k: int, scale_byte: int, device: torch.device, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed e2m1 uint8 [E, N, K/2], e8m0 [E, N, K/32]); every code equally likely, scale 2^(byte-127)."""
    packed = torch.randint(0, 256, (e, n, k // 2), device=device, generator=gen, dtype=torch.uint8)
    scale = torch.full((e, n, k // FP4_BLOCK), scale_byte, device=device, dtype=torch.uint8)
    return packed, scale.view(torch.float8_e8m0fnu)


def random_experts(d: MoeDims, device: torch.device, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Every expert's packed parts (w1, w1 scales, w3, w3 scales, w2, w2 scales): gate/up and the output of order
    one."""
    w1, s1 = random_fp4(d.experts, d.inter, d.dim, 118, device, gen)
    w3, s3 = random_fp4(d.experts, d.inter, d.dim, 118, device, gen)
    w2, s2 = random_fp4(d.experts, d.dim, d.inter, 121, device, gen)
    return w1, s1, w3, s3, w2, s2


def random_routing(
    d: MoeDims, t: int, device: torch.device, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x bf16 [t, D], a random distinct top-k [t, k], weights in [0, 2.5) [t, k])."""
    x = (2 * torch.randn(t, d.dim, device=device, generator=gen)).to(torch.bfloat16)
    ids = torch.rand(t, d.experts, device=device, generator=gen).argsort(dim=1)[:, : d.topk].contiguous()
    return x, ids, 2.5 * torch.rand(t, d.topk, device=device, generator=gen)


def host_bank(parts: tuple[torch.Tensor, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    """The parts in host memory as the expert bank holds them: pinned on CUDA (read in place over PCIe)."""
    return tuple(t.cpu().pin_memory() if device.type == "cuda" else t.clone() for t in parts)


def torch_moe(
    x: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """The baseline: x [T, D] bf16, dequantized bf16 W1/W3 [E, I, D], W2 [E, D, I] -> fp32 [T, D]."""
    t, k = ids.shape
    out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
    flat = ids.flatten()
    order = flat.argsort()
    counts = torch.bincount(flat, minlength=w1.shape[0]).tolist()
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        slots = order[start : start + n]
        start += n
        tok = slots // k
        xe = x[tok]
        gate = (xe @ w1[e].t()).clamp(max=limit)
        up = (xe @ w3[e].t()).clamp(-limit, limit)
        act = (F.silu(gate.float()) * up.float() * weights.flatten()[slots, None]).to(torch.bfloat16)
        out.index_add_(0, tok, (act @ w2[e].t()).float())
    return out


def _dequant_all(packed: torch.Tensor, scale: torch.Tensor, device: torch.device) -> torch.Tensor:
    from dsv4_kernels.formats import dequant_fp4

    with torch.device(device):
        return torch.stack([dequant_fp4(packed[e], scale[e], dtype=torch.bfloat16) for e in range(packed.shape[0])])


def _reference(device: torch.device, *args) -> torch.Tensor:
    from dsv4_kernels.fp4_moe_ref import fp4_moe_ref

    with torch.device(device):
        return fp4_moe_ref(*args)


def build(device: torch.device, d: MoeDims, tokens: tuple[int, ...]) -> list[GpuCase]:
    from dsv4_kernels.fp4_moe_layer import fp4_moe

    gen = torch.Generator(device=device).manual_seed(0)
    w1, s1, w3, s3, w2, s2 = random_experts(d, device, gen)
    dq = [_dequant_all(w, s, device) for w, s in ((w1, s1), (w3, s3), (w2, s2))]
    expert_bytes = sum(w[0].numel() + s[0].numel() for w, s in ((w1, s1), (w3, s3), (w2, s2)))
    out = []
    for t in tokens:
        x, ids, weights = random_routing(d, t, device, gen)
        args = (x, w1, s1, w3, s3, w2, s2, weights, ids, d.limit)
        used = int(ids.unique().numel())
        nbytes = used * expert_bytes + 2 * t * d.dim + 4 * t * d.dim  # weights read, bf16 x in, fp32 out
        out.append(
            GpuCase(
                f"fp4_moe E={d.experts} top{d.topk} {d.dim}->{d.inter} T={t}",
                partial(fp4_moe, *args),
                partial(_reference, device, *args),
                atol=0.1,
                rtol=2.0**-6,
                bytes_moved=nbytes,
                flops=6 * t * d.topk * d.dim * d.inter,
                bound="memory" if t <= 16 else "compute",
                baseline=partial(torch_moe, x, *dq, weights, ids, d.limit),
                baseline_name="torch bf16 loop",
            )
        )
    return out


def slot_cases(
    device: torch.device, d: MoeDims, tokens: tuple[int, ...], miss_fractions: tuple[float, ...]
) -> list[GpuCase]:
    """fp4_moe with slots (device) + bank (pinned host on CUDA): `miss_fractions` of the used experts
    unmapped, so the kernel reads them from the bank."""
    from dsv4_kernels.fp4_moe_layer import ExpertSlots, fp4_moe

    gen = torch.Generator(device=device).manual_seed(1)
    on_device = random_experts(d, device, gen)  # slot e holds expert e
    bank = host_bank(on_device, device)
    expert_bytes = sum(t[0].numel() for t in on_device)
    out = []
    for t in tokens:
        x, ids, weights = random_routing(d, t, device, gen)
        used = ids.unique()
        for miss in miss_fractions:
            slot_of = torch.arange(d.experts, dtype=torch.int32, device=device)
            slot_of[used[: round(miss * used.numel())]] = -1
            slots = ExpertSlots(slot_of, on_device)
            out.append(
                GpuCase(
                    f"fp4_moe slots+bank T={t} {miss:.0%} misses (PCIe)",
                    partial(fp4_moe, x, *bank, weights, ids, d.limit, slots=slots),
                    partial(_reference, device, x, *on_device, weights, ids, d.limit),
                    atol=0.1,
                    rtol=2.0**-6,
                    bytes_moved=int(used.numel()) * expert_bytes,  # the expert weights read
                    bound="memory",
                )
            )
    return out


def stream_cases(device: torch.device, d: MoeDims, tokens: tuple[int, ...], group: int) -> list[GpuCase]:
    """A prefill chunk's experts streamed from the pinned bank `group` at a time, against the kernel reading the
    bank in place (module doc)."""
    from dsv4_kernels.fp4_moe_layer import ExpertGroups, ExpertSlots, fp4_moe
    from dsv4serve.experts.prefill_stream import BUFFERS, ExpertStream

    gen = torch.Generator(device=device).manual_seed(2)
    parts = ("w1", "w1_scale", "w3", "w3_scale", "w2", "w2_scale")
    bank = host_bank(random_experts(d, device, gen), device)  # the device copies go: only the bank holds them
    expert_bytes = sum(t[0].numel() for t in bank)
    area = {p: torch.empty((BUFFERS * group, *t.shape[1:]), dtype=t.dtype, device=device) for p, t in zip(parts, bank)}
    stream = ExpertStream(area, 0, group, d.experts, device)
    none = torch.full((d.experts,), -1, dtype=torch.int32, device=device)  # no expert in a slot: all from the bank
    in_place_slots = ExpertSlots(none, tuple(area.values()))
    in_slot = torch.zeros(d.experts, dtype=torch.bool)  # its host mirror
    out = []
    for t in tokens:
        x, ids, weights = random_routing(d, t, device, gen)
        args = (x, *bank, weights, ids, d.limit)

        def streamed(args=args) -> torch.Tensor:
            layer = stream.layer(dict(zip(parts, bank)), none, in_slot)
            groups = ExpertGroups(ExpertSlots(layer.slot_of_expert, tuple(area.values())), layer.ranges())
            return fp4_moe(*args, slots=in_place_slots, groups=groups)

        in_place = partial(fp4_moe, *args, slots=in_place_slots)
        out.append(
            GpuCase(
                f"fp4_moe prefill T={t} streamed {group} at a time (PCIe copies) vs in place",
                streamed,
                in_place,
                atol=0.0,
                rtol=0.0,  # the same tiles: bit for bit
                bytes_moved=d.experts * expert_bytes,  # every expert crosses PCIe once
                bound="memory",
                baseline=in_place,
                baseline_name="read in place over PCIe",
            )
        )
    return out


def cases(device: torch.device) -> list[GpuCase]:
    dims = real_dims()
    return (
        build(device, dims, (1, 2048))
        + slot_cases(device, dims, (1, 8), (0.0, 0.5, 1.0))
        + stream_cases(device, dims, (2048, 4096), 16)
    )


def smoke_cases(device: torch.device) -> list[GpuCase]:
    """Tiny shapes for the CPU interpreter: 8 experts, top-2, D=128, I=64."""
    dims = MoeDims(128, 64, 8, 2, 10.0)
    return (
        build(device, dims, (1, 24))
        + slot_cases(device, dims, (1,), (0.0, 0.5, 1.0))
        + stream_cases(device, dims, (24,), 3)
    )
