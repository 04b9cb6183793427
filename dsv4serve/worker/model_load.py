"""The worker's model: its device, its numerics and kernel backends, and its weights, loaded where the
memory plan says they live.

    device = worker_device(launch.device)
    numerics = worker_numerics(args, kernels, device)     # then, on CUDA, checked_numerics(...)
    model, expert_cache = load_model(ckpt, launch, numerics, device)

What is loaded is decided once: the MTP block only when speculative decoding uses it
(memory/weights.include_mtp, the same function `dsv4serve plan` calls), the weights packed as stored
when the FP8 GEMM and FP4 MoE run on Triton (else dense in fp32), the routed experts behind an expert-slot
cache when --moe-cache-size (or, on CUDA, the memory plan) says so. Before anything is allocated, the
bytes are checked against the device from the checkpoint's headers (memory/weights.device_bytes).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping

import msgspec
import torch

from dsv4serve.checkpoint.loader import Checkpoint, iter_dense
from dsv4serve.config import ConfigError
from dsv4serve.experts.attach import attach_cpu_experts, attach_expert_cache, bank_ram_beside_kt, iter_resident_dense
from dsv4serve.experts.moe_backend import MoeBackendError, moe_backend_for
from dsv4serve.experts.slot_cache import ExpertSlotCache
from dsv4serve.ipc.messages import WorkerLaunch
from dsv4serve.memory.expert_plan import planned_expert_slots
from dsv4serve.memory.probe import host_snapshot, take_snapshot
from dsv4serve.memory.weights import device_bytes, include_mtp, model_specs
from dsv4serve.model.args import ModelArgs
from dsv4serve.model.backends import TORCH, KernelBackends, default_backends, named_kernels, resolve_backends
from dsv4serve.model.numerics import NUMERICS_OFF, NUMERICS_ON, Numerics
from dsv4serve.model.packed_load import load_packed
from dsv4serve.model.transformer import Transformer
from dsv4serve.parallel.group import RankGroup
from dsv4serve.parallel.partition import Partition, PartitionError, make_partition, rank_specs
from dsv4serve.worker.k_split_check import check_and_apply
from dsv4serve.worker.kernel_check import KernelCheckError, check_kernels

log = logging.getLogger("dsv4serve.worker")


class StartupError(RuntimeError):
    """The worker cannot honour the settings; the message names the flag, the limit and why."""


def worker_device(name: str, rank: int = 0, ranks: int = 1) -> torch.device:
    """The device this worker (tensor-parallel rank `rank` of `ranks`) computes on: cuda:rank, or the CPU
    with its share of the cores."""
    if name == "cuda" and not torch.cuda.is_available():
        raise StartupError("--device cuda: no CUDA device is visible to torch; run `dsv4serve doctor`")
    threads = cpu_worker_threads(os.environ, usable_cores(), ranks) if name == "cpu" else None
    if threads is not None:
        torch.set_num_threads(threads)
        log.info(
            "CPU worker: %d torch thread(s)%s, one core left to the API process (OMP_NUM_THREADS overrides)",
            threads,
            f" in each of {ranks} ranks" if ranks > 1 else "",
        )
    if name == "cuda" and ranks > 1:
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return torch.device(name)


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, which containers narrow), else the machine's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cpu_worker_threads(env: Mapping[str, str], cores: int, ranks: int = 1) -> int | None:
    """Torch threads for a worker computing on the CPU: every core but one, which the API process needs while
    it renders, tokenizes and streams beside the worker (bench/RESULTS.md, issues 17 and 20: on 2 cores, two
    worker threads served 36 soak requests where one served 141, their hand-offs waiting on a descheduled
    peer), shared out between the tensor-parallel ranks (at least one each). None (torch's default) when the
    user set OMP_NUM_THREADS."""
    if env.get("OMP_NUM_THREADS"):
        return None
    return max(1, (cores - 1) // ranks)


def worker_numerics(args: ModelArgs, kernels: str, device: torch.device, batch_invariant: bool = False) -> Numerics:
    """The checkpoint's numerics with the kernel backends of --kernels (auto: Triton on CUDA; the FP8
    GEMM and FP4 MoE only for an FP8 checkpoint, whose numerics they need). Batch invariance only when asked
    for (--batch-invariant): it runs every projection one token at a time."""
    fp8 = args.dtype == "fp8"
    # the Triton kernels sum in tile order (not batch-invariant): --batch-invariant keeps auto on torch
    base = default_backends("cpu" if batch_invariant else device)
    if not fp8:
        base = dataclasses.replace(base, fp8_gemm="torch", fp4_moe="torch")
    try:
        backends = resolve_backends(kernels, base)
    except ValueError as exc:
        raise StartupError(f"--kernels: {exc}") from exc
    if backends.uses_triton() and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise StartupError(
            f"--kernels {kernels}: the Triton kernels need a CUDA device (or TRITON_INTERPRET=1, "
            "for tests); this worker runs on the CPU"
        )
    fixed = [k for k in ("fp8_gemm", "fp4_moe") if getattr(backends, k) == "triton"]
    if fixed and not fp8:
        raise StartupError(
            f"--kernels {kernels}: {', '.join(fixed)}=triton reads FP8 / MXFP4 weights as an FP8 "
            f"checkpoint stores them; this checkpoint is {args.dtype}: choose torch for them"
        )
    num: Numerics = NUMERICS_ON if fp8 else NUMERICS_OFF
    if batch_invariant and backends.uses_triton():
        raise StartupError(
            f"--batch-invariant with --kernels {kernels}: the Triton kernels sum in tile order and are not "
            "batch-invariant; leave --kernels auto (the torch reference path then runs) or drop --batch-invariant"
        )
    return dataclasses.replace(num, backends=backends, batch_invariant=batch_invariant)


def checked_numerics(num: Numerics, kernels: str, device: torch.device) -> Numerics:
    """The backends that passed the start-up kernel check (worker/kernel_check.py). A CUDA worker runs it
    before any weight is placed: a fallback changes how the head loads. Then, on CUDA, the K splits and tuned
    loop forms the tiny model cannot reach are checked too (worker/k_split_check.py: a failure switches them
    off, the start goes on)."""
    try:
        checked = check_kernels(num.backends, device, named_kernels(kernels))
    except KernelCheckError as exc:
        raise StartupError(f"--kernels {kernels}: {exc}") from exc
    if device.type == "cuda" and checked.uses_triton():
        check_and_apply(device)
    return dataclasses.replace(num, backends=checked)


def loads_packed(backends: KernelBackends) -> bool:
    """The FP8 GEMM and FP4 MoE kernels read FP8 / MXFP4 as stored: the weights then load packed."""
    return backends.fp8_gemm == "triton" and backends.fp4_moe == "triton"


def load_model(
    ckpt: Checkpoint, launch: WorkerLaunch, numerics: Numerics, device: torch.device, group: RankGroup | None = None
) -> tuple[Transformer, ExpertSlotCache | None, WorkerLaunch]:
    """The model on `device` (and its expert-slot cache, None when every expert is resident), and the
    launch with the expert slots it was loaded with (the memory plan's, when --moe-cache-size is auto on
    CUDA and the weights load packed). In a group of more than one rank: this rank's part (parallel/rank_load.py)."""
    args, backends = ckpt.args, numerics.backends
    check_speculative(args, launch.speculative_tokens.value)
    mtp = include_mtp(args, launch.speculative_tokens.value)
    packed = loads_packed(backends)
    if group is not None and group.size > 1:
        return _load_rank(ckpt, launch, numerics, device, group, packed, mtp), None, launch
    if packed and launch.moe_cache_size.value is None and device.type == "cuda":
        launch = _with_planned_expert_slots(ckpt, launch, backends)
    check_weights_fit(ckpt, backends, packed, mtp, launch, device)
    slots = launch.moe_cache_size.value
    n_experts = args.n_routed_experts * (args.n_all_layers if mtp else args.n_layers)
    try:
        offloaded = slots is not None and slots < n_experts

        def offload_faster() -> str | None:  # auto on a CUDA worker: would hybrid decode slower than offload here?
            return _offload_faster(ckpt, launch, backends, mtp) if device.type == "cuda" else None

        moe_backend, why = moe_backend_for(launch.moe_backend, offloaded, numerics, offload_faster)
    except MoeBackendError as exc:
        raise StartupError(str(exc)) from exc
    # hybrid: kt-kernel's copy of its layers (the count the projection prefers) first, the bank fills the RAM left
    kt = _kt_layers(ckpt, launch, backends, mtp) if moe_backend == "hybrid" and device.type == "cuda" else None
    n_moe = args.n_all_layers if mtp else args.n_layers
    bank_ram = bank_ram_beside_kt(model_specs(ckpt.specs, args, mtp), n_moe, kt) if moe_backend == "hybrid" else None
    if packed:
        model, cache = load_packed(ckpt, backends, device, mtp, slots, bank_ram_bytes=bank_ram)
    else:
        ckpt = dataclasses.replace(ckpt, specs=tuple(model_specs(ckpt.specs, args, mtp)))
        model = Transformer(args, include_mtp=mtp)
        cache = attach_expert_cache(model, ckpt, slots, device, ram_bytes=bank_ram)  # None: all resident
        if cache is None:
            weights = iter_dense(ckpt, torch.float32, progress=True)
        else:
            weights = iter_resident_dense(ckpt, torch.float32)
        model.load_state_dict(dict(weights), strict=True)
        model.to(device)
    model.eval()
    if moe_backend == "hybrid":
        assert cache is not None, "hybrid is chosen only for offloaded experts"
        try:
            attach_cpu_experts(model, cache, device, max_layers=kt)
        except ValueError as exc:  # no room for kt-kernel's copy: auto falls back, an explicit choice stops
            if launch.moe_backend.explicit:
                raise StartupError(str(exc)) from exc
            moe_backend, why = "offload", f"{exc}; the offload path instead"
    log.info("routed experts: --moe-backend %s (%s)", moe_backend, why)
    model.use_kernels(backends)  # packs what the Triton kernels read (nothing left to do after load_packed)
    log.info("kernels: %s", backends)
    return model, cache, launch


def _projection_inputs(ckpt: Checkpoint, launch: WorkerLaunch, backends: KernelBackends, mtp: bool):
    """(decode bytes, slots, bank bytes, machine, eager, speculative) as this worker would run the offloaded backends:
    the bank in this host's available RAM (attach.py), the assumed bandwidths (memory/decode_choice.py)."""
    from dsv4serve.memory.decode_speed import decode_bytes
    from dsv4serve.memory.plan import Machine
    from dsv4serve.memory.probe import detect_platform

    specs = model_specs(ckpt.specs, ckpt.args, mtp)
    bank = sum(s.nbytes for s in specs if s.group == "routed_experts")
    machine = Machine(0, host_snapshot().free_bytes, detect_platform())  # the RAM the bank may fill (attach.py)
    b = decode_bytes(specs, ckpt.args, backends)
    slots = launch.moe_cache_size.value or 0
    return b, slots, bank, machine, launch.enforce_eager.value, launch.speculative_tokens.value > 0


def _offload_faster(ckpt: Checkpoint, launch: WorkerLaunch, backends: KernelBackends, mtp: bool) -> str | None:
    """Both offloaded backends projected as this worker would run them; the line to log when offload is the faster."""
    from dsv4serve.memory.decode_choice import offload_faster, project_backends
    from dsv4serve.memory.decode_speed import Bandwidths

    b, slots, bank, machine, eager, spec = _projection_inputs(ckpt, launch, backends, mtp)
    return offload_faster(project_backends(b, slots, bank, machine, Bandwidths(), eager, ("offload", "hybrid"), spec))


def _kt_layers(ckpt: Checkpoint, launch: WorkerLaunch, backends: KernelBackends, mtp: bool) -> int | None:
    """How many MoE layers kt-kernel holds on this host (memory/decode_choice.best_kt_layers: its copy and the bank
    share the RAM), logged; None: every layer that fits."""
    from dsv4serve.memory.decode_choice import best_kt_layers, eager_reason
    from dsv4serve.memory.decode_speed import Bandwidths

    b, slots, bank, machine, eager, spec = _projection_inputs(ckpt, launch, backends, mtp)
    graphs = eager_reason(eager, "hybrid", spec) is None
    k = best_kt_layers(b, slots, bank, machine, Bandwidths(), graphs)
    if k is not None:
        log.info(
            "hybrid MoE: kt-kernel holds the first %d of %d MoE layers, the bank the RAM beside them (the fastest "
            "projected decode on this host: memory/decode_choice.best_kt_layers)",
            k,
            b.n_moe_layers,
        )
    return k


def rank_partition(args: ModelArgs, launch: WorkerLaunch) -> Partition:
    """The split of --tensor-parallel-size / --expert-parallel, or the reason this model cannot take it."""
    try:
        return make_partition(args, launch.tensor_parallel_size.value, launch.expert_parallel.value)
    except PartitionError as exc:
        raise StartupError(f"{exc} (parallel/partition.py)") from exc


def check_parallel(launch: WorkerLaunch, device: torch.device) -> None:
    """What a tensor-parallel group does not run yet, refused by name before anything loads."""
    n = launch.tensor_parallel_size.value
    if n == 1:
        if launch.expert_parallel.value:
            raise StartupError("--expert-parallel needs --tensor-parallel-size N > 1 (the ranks that own the experts)")
        return
    refused = [
        (launch.moe_cache_size.value is not None, f"--moe-cache-size {launch.moe_cache_size.value}: expert slots"),
        (launch.moe_backend.value in ("offload", "hybrid"), f"--moe-backend {launch.moe_backend.value}"),
        (launch.speculative_tokens.value > 0, f"--speculative-tokens {launch.speculative_tokens.value}"),
    ]
    for is_set, what in refused:
        if is_set:
            raise StartupError(
                f"--tensor-parallel-size {n} with {what}: not built for a split model yet (every rank holds its "
                "experts resident; `dsv4serve plan --gpus N` sizes each rank)"
            )
    if device.type == "cuda" and torch.cuda.device_count() < n:
        raise StartupError(f"--tensor-parallel-size {n}: one GPU per rank, and torch sees {torch.cuda.device_count()}")


def _load_rank(
    ckpt: Checkpoint,
    launch: WorkerLaunch,
    numerics: Numerics,
    device: torch.device,
    group: RankGroup,
    packed: bool,
    mtp: bool,
) -> Transformer:
    """This rank's part of the model, read as that part (parallel/rank_load.py), packed as stored for the FP8 /
    MXFP4 kernels or dense in fp32; every expert resident."""
    partition = rank_partition(ckpt.args, launch)
    specs = rank_specs(model_specs(ckpt.specs, ckpt.args, mtp), partition, group.rank)
    need = device_bytes(specs, ckpt.args, numerics.backends if packed else TORCH, mtp).total_bytes
    where, have = (
        ("GPU", take_snapshot(str(device)).total_bytes)
        if device.type == "cuda"
        else ("host", host_snapshot().free_bytes)
    )
    if need > have:
        held = "packed as stored" if packed else "dense in fp32"
        raise StartupError(
            f"rank {group.rank}: its part of the weights needs {need / 2**30:.1f} GiB {held}, more than the "
            f"{have / 2**30:.1f} GiB of {where} memory (`dsv4serve plan --gpus {group.size}` sizes each rank)"
        )
    from dsv4serve.parallel.collectives import Collectives  # lazy: a one-rank worker never cuts a model
    from dsv4serve.parallel.rank_load import load_rank_dense, load_rank_packed

    tp, progress = Collectives(group), group.rank == 0
    if packed:
        model = load_rank_packed(ckpt, partition, tp, numerics.backends, device, mtp, progress)
    else:
        model = load_rank_dense(ckpt, partition, tp, device, mtp, progress)
    model.use_kernels(numerics.backends)
    log.info("kernels: %s", numerics.backends)
    return model


def check_speculative(args: ModelArgs, n_tokens: int) -> None:
    """--speculative-tokens N needs the checkpoint's MTP block, and a verify row of N + 1 tokens short enough
    to roll back exactly (model/rollback.max_spec_tokens: the smallest compression ratio and the window)."""
    if n_tokens <= 0:
        return
    if args.n_mtp_layers == 0:
        raise StartupError(
            f"--speculative-tokens {n_tokens}: this checkpoint has no MTP layers to draft with "
            "(use --speculative-tokens 0)"
        )
    limit = min([args.window_size, *(r for r in args.compress_ratios if r)]) - 1
    if n_tokens > limit:
        raise StartupError(
            f"--speculative-tokens {n_tokens}: at most {limit} for this model (a verify row of N + 1 tokens must not "
            "close two windows of its smallest compression ratio, or its rollback would not be exact)"
        )


def _with_planned_expert_slots(ckpt: Checkpoint, launch: WorkerLaunch, backends: KernelBackends) -> WorkerLaunch:
    """--moe-cache-size auto on CUDA: the whole-card memory plan's expert slots for this card."""
    try:
        slots, why = planned_expert_slots(list(ckpt.specs), ckpt.args, launch, backends)
    except ConfigError as exc:
        raise StartupError(str(exc)) from exc
    if slots is None:
        return launch
    log.info("expert slots from the memory plan: %d (%s)", slots, why)
    return msgspec.structs.replace(launch, moe_cache_size=type(launch.moe_cache_size)(slots, "model-rule"))


def check_weights_fit(
    ckpt: Checkpoint, backends: KernelBackends, packed: bool, mtp: bool, launch: WorkerLaunch, device: torch.device
) -> None:
    """Refuse, by name and before allocating, weights that cannot fit where they will live: packed as
    stored for the Triton kernels, else dense in fp32 (FP8 / FP4 dequantized); from the checkpoint's
    headers (memory/weights.device_bytes); expert slots are not counted."""
    args = ckpt.args
    n_experts = args.n_routed_experts * (args.n_all_layers if mtp else args.n_layers)
    slots = launch.moe_cache_size.value
    resident = slots is None or slots >= n_experts
    need = device_bytes(ckpt.specs, args, backends if packed else TORCH, mtp, experts_resident=resident).total_bytes
    where, have = (
        ("GPU", take_snapshot("cuda").total_bytes) if device.type == "cuda" else ("host", host_snapshot().free_bytes)
    )
    if need > have:
        held = "packed as stored" if packed else "dense in fp32"
        fixes = [] if packed else ["on CUDA the FP8 GEMM and FP4 MoE kernels load them packed (--kernels auto)"]
        if resident:
            fixes.append(
                "--moe-cache-size N keeps the routed experts in host memory (`dsv4serve plan --model M "
                "--gpu-memory <this card>` proposes N)"
            )
        raise StartupError(
            f"the weights need {need / 2**30:.1f} GiB {held}, more than the {have / 2**30:.1f} GiB of "
            f"{where} memory" + (": " + "; ".join(fixes) if fixes else "")
        )
