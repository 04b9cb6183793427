"""--moe-backend: where the routed experts run (pure: facts in, a backend and its reason out).

    backend, why = choose_moe_backend(requested, explicit, offloaded, kt_ok_why, batch_invariant)

gpu       every routed expert resident on the device;
offload   some in device slots, the misses read from the host bank by the device (experts/slot_cache.py);
hybrid    as offload, but misses computed on the CPU by kt-kernel where the measured costs say so
          (experts/hybrid.py, experts/miss_split.py).
auto      gpu when every expert is resident, hybrid when they are offloaded and kt-kernel is installed
          and the projected decode speed does not say offload is faster (a CUDA worker projects both as it
          would run them: memory/decode_choice.py), else offload. An explicit choice is honoured exactly or
          refused with the reason.
"""

from __future__ import annotations

import logging

from dsv4serve.experts.kt_backend import kt_kernel_available, kt_version

log = logging.getLogger("dsv4serve.worker")

BACKENDS = ("auto", "gpu", "offload", "hybrid")


class MoeBackendError(ValueError):
    """An explicit --moe-backend this start cannot honour; the message says why and what to change."""


def choose_moe_backend(
    requested: str,
    explicit: bool,
    offloaded: bool,
    kt: tuple[bool, str],
    batch_invariant: bool = False,
    offload_faster: str | None = None,
) -> tuple[str, str]:
    """(backend, why). `offloaded`: the routed experts live in a host bank behind device slots
    (--moe-cache-size, or the memory plan); `kt`: kt_backend.kt_kernel_available(); `offload_faster`: the
    projections' line when they say offload decodes faster than hybrid here (auto then keeps offload)."""
    if requested not in BACKENDS:
        raise MoeBackendError(f"--moe-backend {requested}: choose one of {', '.join(BACKENDS)}")
    kt_ok, kt_why = kt
    if requested == "auto" or not explicit:
        if not offloaded:
            return "gpu", "every routed expert is resident"
        if not kt_ok:
            return "offload", f"experts offloaded; no CPU experts: {kt_why}"
        if batch_invariant:
            return "offload", "experts offloaded; --batch-invariant keeps the CPU experts off (their split varies)"
        if offload_faster:
            return "offload", f"experts offloaded; kt-kernel installed, but offload decodes faster: {offload_faster}"
        return "hybrid", "experts offloaded and kt-kernel installed: misses computed on the CPU where cheaper"
    if requested == "gpu":
        if offloaded:
            raise MoeBackendError(
                "--moe-backend gpu: the routed experts are offloaded to host memory (--moe-cache-size, or the "
                "memory plan for this card); drop --moe-cache-size on a card that holds them, or choose "
                "offload / hybrid"
            )
        return "gpu", "--moe-backend gpu"
    if not offloaded:
        raise MoeBackendError(
            f"--moe-backend {requested}: every routed expert is resident here; give --moe-cache-size N (N device "
            "expert slots) to offload them, or leave --moe-backend auto"
        )
    if requested == "offload":
        return "offload", "--moe-backend offload"
    if not kt_ok:
        raise MoeBackendError(f"--moe-backend hybrid needs kt-kernel: {kt_why} (or choose offload)")
    if batch_invariant:
        raise MoeBackendError(
            "--moe-backend hybrid with --batch-invariant: the CPU experts round differently from the device "
            "path and the split between them follows the batch, so results would depend on it"
        )
    return "hybrid", "--moe-backend hybrid"


def moe_backend_for(setting, offloaded: bool, numerics, offload_faster=lambda: None) -> tuple[str, str]:
    """The worker's choice from the launch's Sourced --moe-backend; logs what kt-kernel offers.
    `offload_faster()`: the projections' line when offload decodes faster (asked only when auto could pick hybrid)."""
    kt = kt_kernel_available()
    log.info("kt-kernel: %s", f"{kt_version()} installed" if kt[0] else kt[1])
    auto = setting.value == "auto" or not setting.explicit
    ask = auto and offloaded and kt[0] and not numerics.batch_invariant
    return choose_moe_backend(
        setting.value, setting.explicit, offloaded, kt, numerics.batch_invariant, offload_faster() if ask else None
    )
