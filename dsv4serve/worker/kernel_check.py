"""The start-up kernel check: before a CUDA worker loads its weights, every kernel it will run on
Triton is compiled and run on the dsv4-tiny architecture (random weights drawn on the device, rounded
as a checkpoint stores them) and its logits compared with the torch path's. A broken toolchain (the
driver's libcuda not found, no C compiler for Triton's launcher, a ptxas failure) or a wrong result
then stops the start with the kernel's name, the error and a fix, instead of killing the first request.

A kernel whose launches change when another runs on Triton too (PARTNERS: the mHC with token_ops and the FP4 MoE,
the attention with token_ops) is checked together with those of them the worker runs on Triton.

What a failure does, by kernel:
- a kernel left on auto whose torch path reads the same weights (attention, indexer, compressor, head,
  hc, token_ops, router) falls back to torch, with a warning naming it;
- a kernel named in --kernels, and the FP8 GEMM / FP4 MoE on any setting (their torch path needs the
  weights loaded dense, about four times the memory), stop the start (KernelCheckError).

The comparison is loose on purpose: one kernel's bf16-ulp differences can flip an FP8 activation
rounding and move the tiny model's logits by O(1) at a position (tests/kernels/test_model_kernels.py
measured 91% greedy agreement and a 4% mean logit gap with every kernel on Triton), while a kernel
that computes garbage agrees on almost no greedy token of a 2,048-token vocabulary.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import torch

from dsv4serve.model.args import ModelArgs, args_from_dicts
from dsv4serve.model.backends import Backend, KernelBackends, kernel_names
from dsv4serve.model.numerics import NUMERICS_ON, Numerics
from dsv4serve.model.transformer import BatchRow, Transformer

log = logging.getLogger(__name__)

PROMPT_TOKENS = (24, 17)  # two ragged rows, batched: prefill, then decode steps
DECODE_STEPS = 2
CHECK_VOCAB = 2048
MIN_GREEDY_AGREEMENT = 0.5
MAX_MEAN_LOGIT_GAP = 0.25  # mean |logit difference| over the mean |logit| of the torch path
NO_FALLBACK = ("fp8_gemm", "fp4_moe")  # their torch path needs the weights dense
# kernels that launch another form when a partner runs on Triton too: checked with those partners the worker runs
# on Triton, so that the fused forms it will launch are the ones checked (hc with token_ops: the sub-layer norm in
# the mHC launch; hc with fp4_moe: the MoE output summed in the post launch, dsv4_kernels.hc_post_combine;
# attention with token_ops: a decode step's keys stored by the kv launch). A failure there is the kernel's: its
# partners have verdicts of their own, from running alone.
PARTNERS = {"hc": ("token_ops", "fp4_moe"), "attention": ("token_ops",)}
HINTS = (
    (
        "libcuda.so cannot found",
        "Triton cannot find the driver's libcuda.so.1: on WSL2 set "
        "TRITON_LIBCUDA_PATH=/usr/lib/wsl/lib, elsewhere run /sbin/ldconfig",
    ),
    (
        "Failed to find C compiler",
        "Triton builds a small C launcher on first use: install gcc and the "
        "Python headers (the Docker image has them), or set CC",
    ),
    ("ptxas", "ptxas (shipped in the triton wheel) failed: reinstall triton at the version pyproject.toml pins"),
)


class KernelCheckError(RuntimeError):
    """A kernel the worker must run on Triton failed the check; the message says which, why, and what to do."""


@dataclass(frozen=True)
class Verdict:
    kernel: str
    ok: bool
    detail: str  # "greedy 41/43, mean gap 0.031" or the error and its fix


def tiny_args() -> ModelArgs:
    """dsv4-tiny's architecture with a CHECK_VOCAB vocabulary (the real one is 129,280: sixty times the
    head's work, for nothing the check needs)."""
    from dsv4serve.tiny.spec import TINY_CONFIG

    return args_from_dicts({**TINY_CONFIG, "vocab_size": CHECK_VOCAB}, expert_dtype_hint="fp4")


# the numerics a worker runs the Triton kernels in: batch invariance off (worker_numerics refuses Triton with
# --batch-invariant), so the check runs the kernels' batched forms, the ones serving launches
CHECK_NUMERICS = dataclasses.replace(NUMERICS_ON, batch_invariant=False)


def _scenario(model: Transformer, num: Numerics) -> torch.Tensor:
    """Every logit row of a batched two-row prefill and DECODE_STEPS decode steps: [positions, vocab]."""
    device = model.embed.weight.device
    gen = torch.Generator(device=device).manual_seed(5)
    prompts = [
        torch.randint(0, model.args.vocab_size, (n + DECODE_STEPS,), generator=gen, device=device)
        for n in PROMPT_TOKENS
    ]
    states = [model.new_state(num) for _ in prompts]
    rows = []
    steps = [PROMPT_TOKENS] + [(1, 1)] * DECODE_STEPS
    begins = [0, 0]
    for sizes in steps:
        batch = [BatchRow(p[b : b + n], st) for p, b, n, st in zip(prompts, begins, sizes, states)]
        rows += model(batch, num, all_logits=True).logits
        begins = [b + n for b, n in zip(begins, sizes)]
    for state in states:
        state.pool.release(state)
    return torch.cat(rows).float()


def _explain(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    hints = [fix for needle, fix in HINTS if needle in text]
    first = " ".join(text.split())[:300]
    return first + (f" -> {hints[0]}" if hints else "")


def _poisons_the_device(exc: BaseException) -> bool:
    """A device-side fault (an illegal address, a trap) is sticky: the CUDA context is lost for every
    later call. Compile and launch errors are not."""
    accelerator_error = getattr(torch, "AcceleratorError", None)
    return (accelerator_error is not None and isinstance(exc, accelerator_error)) or "CUDA error" in str(exc)


def _compare(kernel: str, got: torch.Tensor, want: torch.Tensor) -> Verdict:
    if not torch.isfinite(got).all():
        return Verdict(kernel, False, "non-finite logits")
    agree = int((got.argmax(-1) == want.argmax(-1)).sum())
    gap = ((got - want).abs().mean() / want.abs().mean().clamp_min(1e-30)).item()
    ok = agree >= MIN_GREEDY_AGREEMENT * got.shape[0] and gap <= MAX_MEAN_LOGIT_GAP
    return Verdict(kernel, ok, f"greedy {agree}/{got.shape[0]} as torch, mean logit gap {gap:.3f}")


def run_check(kernels: list[str], device: torch.device) -> list[Verdict]:
    """Each kernel on Triton, alone or with its PARTNERS among `kernels`, against the all-torch path, on the tiny
    random model."""
    from dsv4serve.model.random_init import random_model

    model = random_model(tiny_args(), device, seed=0, include_mtp=False)
    model.use_kernels(KernelBackends.every("triton"))  # packed copies beside the dense weights: both paths run
    want = _scenario(model, CHECK_NUMERICS)
    verdicts = []
    for kernel in kernels:
        with_partners = [kernel] + [k for k in PARTNERS.get(kernel, ()) if k in kernels]
        on: dict[str, Backend] = dict.fromkeys(with_partners, "triton")
        num = dataclasses.replace(CHECK_NUMERICS, backends=KernelBackends(**on))
        try:
            verdicts.append(_compare(kernel, _scenario(model, num), want))
        except Exception as exc:
            verdicts.append(Verdict(kernel, False, _explain(exc)))
            if _poisons_the_device(exc):  # later kernels (and torch) would fail for this one's fault
                raise KernelCheckError(
                    f"{kernel}: {verdicts[-1].detail}: a device fault, which leaves the "
                    "CUDA context unusable; run this kernel on torch with --kernels "
                    f"{kernel}=torch where its torch path fits in memory"
                ) from exc
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return verdicts


def check_kernels(backends: KernelBackends, device: torch.device, named: frozenset[str]) -> KernelBackends:
    """The backends to run with after the check (see the module doc); raises KernelCheckError."""
    kernels = [k for k in kernel_names() if getattr(backends, k) == "triton"]
    if not kernels:
        return backends
    start = time.monotonic()
    verdicts = run_check(kernels, device)
    seconds = time.monotonic() - start
    failed = [v for v in verdicts if not v.ok]
    for v in verdicts:
        log.info("kernel check %s: %s (%s)", v.kernel, "ok" if v.ok else "FAILED", v.detail)
    stop = [v for v in failed if v.kernel in named or v.kernel in NO_FALLBACK]
    if stop:
        lines = [
            f"  {v.kernel}: {v.detail}"
            + (" (named in --kernels)" if v.kernel in named else " (its torch path needs the weights loaded dense)")
            for v in stop
        ]
        raise KernelCheckError(
            "the Triton kernel check failed on the tiny model:\n"
            + "\n".join(lines)
            + "\nfix the cause above, or choose torch for the kernel with --kernels "
            "KERNEL=torch where its torch path fits in memory"
        )
    for v in failed:
        log.warning("kernel %s failed the start-up check (%s): running it on torch instead", v.kernel, v.detail)
    log.info(
        "Triton kernels checked on %s in %.1f s: %d ok, %d on torch instead",
        device,
        seconds,
        len(verdicts) - len(failed),
        len(failed),
    )
    fallback: dict[str, Backend] = {v.kernel: "torch" for v in failed}
    return dataclasses.replace(backends, **fallback)
