"""The whole model's forward at DeepSeek-V4-Flash's real dimensions, with 2 of its 43 layers.

A random checkpoint (the rules of `dsv4serve.model.random_init`, drawn tensor by tensor on the
device) for ModelArgs read from the real config.json with n_layers = 2: one CSA and one HCA layer,
the two kinds that make up 41 of the 43 (no hash routing: 40 of 43 layers route by score). Run
through the model's public forward (`new_state`, `forward` with BatchRows) with the numerics the
server uses for an FP8 checkpoint on this device (Triton kernels on CUDA, `default_backends`; the
case name says which).

  prefill: a 2048-token prompt on a fresh state; checked against the same prompt in two
           1024-token chunks (the model is exact at any chunk boundary), last-position logits.
  decode:  one token after that prompt. The first call (gpu_check's check) decodes token 2048 and is
           compared with the logits of a one-shot prefill of all 2049 tokens; the timed calls keep
           decoding on the same state (the context grows by one per call, negligible at 2048).

`notes` projects to 43 layers: decode ms x 43 / 2 (head and embedding counted 21.5 times: an upper
bound) and compares with the bandwidth bound, the checkpoint bytes one decoded token reads at
batch 1 (every non-expert tensor, the shared expert, 6 of 256 routed experts: ~11.2 GB) over the
measured copy bandwidth.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from bench.gpu_cases import GpuCase, real_config_dir
from dsv4serve.model.random_init import random_model

REAL_LAYERS = 43
N_LAYERS = 2
PREFILL_TOKENS = 2048


def prefill_name(tokens: int) -> str:
    return f"e2e prefill {tokens} tok, {N_LAYERS} layers"


def decode_name(context_tokens: int) -> str:
    return f"e2e decode bs=1 @{context_tokens}, {N_LAYERS} layers"


def bench_args(real):
    """The real ModelArgs cut to one CSA and one HCA layer (MTP entries kept as they are)."""
    extra = slice(real.n_layers, None)
    return replace(
        real,
        n_layers=N_LAYERS,
        n_hash_layers=0,
        compress_ratios=(4, 128) + real.compress_ratios[extra],
        layer_kinds=("csa", "hca") + real.layer_kinds[extra],
    )


def _active(real, size) -> int:
    """Sum of size(spec) over what one decoded token reads at batch 1: every tensor but the embedding
    table and the routed experts, plus top-k / n_experts of the routed experts."""
    from dsv4serve.model.schema import checkpoint_schema

    specs = checkpoint_schema(real, include_mtp=False)
    routed = sum(size(s) for s in specs if s.group == "routed_experts")
    rest = sum(size(s) for s in specs if s.group not in ("routed_experts", "embed"))
    return rest + routed * real.n_activated_experts // real.n_routed_experts


def decode_bytes_per_token(real) -> int:
    """Checkpoint bytes (FP8 / FP4 as stored) read to decode one token at batch 1."""
    return _active(real, lambda s: s.nbytes)


def active_params(real) -> int:
    """Parameters used per token (an FP4 tensor stores two per byte)."""
    return _active(real, lambda s: 0 if s.role.endswith("scale") else s.numel * (2 if s.role == "fp4_weight" else 1))


def build(device: torch.device, args, prompt_tokens: int) -> list[GpuCase]:
    from dsv4serve.model.backends import default_backends
    from dsv4serve.model.numerics import NUMERICS_ON
    from dsv4serve.model.transformer import BatchRow

    num = replace(NUMERICS_ON, backends=default_backends(device))  # what the server runs on this device
    model = random_model(args, device, seed=0, include_mtp=False)
    model.use_kernels(num.backends)
    label = "triton" if num.backends.uses_triton() else "torch"
    gen = torch.Generator(device=device).manual_seed(1)
    ids = torch.randint(0, args.vocab_size, (prompt_tokens + 1,), device=device, generator=gen)
    prompt, half = ids[:prompt_tokens], prompt_tokens // 2

    def prefill(*chunks: torch.Tensor) -> torch.Tensor:
        state = model.new_state(num)
        for chunk in chunks:
            logits = model([BatchRow(chunk, state)], num).logits[0]
        state.pool.release(state)  # the model's standalone pool would otherwise grow every call
        return logits

    decode_state = model.new_state(num)
    model([BatchRow(prompt, decode_state)], num)

    def decode() -> torch.Tensor:
        return model([BatchRow(ids[prompt_tokens:], decode_state)], num).logits[0]

    active = decode_bytes_per_token(args)
    flops_per_token = 2 * active_params(args)  # one multiply-add per parameter used (attention scores aside)
    return [
        GpuCase(
            f"{prefill_name(prompt_tokens)} [{label}]",
            lambda: prefill(prompt),
            lambda: prefill(prompt[:half], prompt[half:]),
            atol=0.05,
            rtol=0.02,
            bytes_moved=active,
            flops=flops_per_token * prompt_tokens,
            bound="compute",
        ),
        GpuCase(
            f"{decode_name(prompt_tokens)} [{label}]",
            decode,
            lambda: prefill(ids),
            atol=0.05,
            rtol=0.02,
            bytes_moved=active,
            bound="memory",
        ),
    ]


def cases(device: torch.device) -> list[GpuCase]:
    from dsv4serve.model.args import read_model_args

    return build(device, bench_args(read_model_args(real_config_dir())), PREFILL_TOKENS)


def smoke_cases(device: torch.device) -> list[GpuCase]:
    """dsv4-tiny's architecture (the configs/ preset), 2 layers, a 64-token prompt."""
    from dsv4serve.env import read_environment
    from dsv4serve.model.args import read_model_args
    from dsv4serve.tiny.builder import ensure_tiny

    tiny = read_model_args(ensure_tiny(read_environment().cache_dir))
    return build(device, bench_args(tiny), 64)


def notes(times_ms: dict[str, float], ceilings: dict[str, float]) -> list[str]:
    """The 43-layer projection and the bandwidth bound, from the medians of this module's cases."""
    from dsv4serve.model.args import read_model_args

    bound_bytes = decode_bytes_per_token(read_model_args(real_config_dir()))
    bound_tps = ceilings["copy_GBps"] * 1e9 / bound_bytes
    lines = [
        f"end_to_end: bandwidth bound at batch 1 = {bound_bytes / 1e9:.1f} GB per token / "
        f"{ceilings['copy_GBps']:.0f} GB/s = {bound_tps:.0f} tokens/s"
    ]
    for name, ms in times_ms.items():
        if name.startswith("e2e decode"):
            step_ms = ms * REAL_LAYERS / N_LAYERS
            lines.append(
                f"end_to_end: decode {ms / N_LAYERS:.2f} ms per layer (head included: upper bound) -> "
                f"{REAL_LAYERS} layers {step_ms:.1f} ms = {1e3 / step_ms:.1f} tokens/s, "
                f"{100 * (1e3 / step_ms) / bound_tps:.1f}% of the bound"
            )
        elif name.startswith("e2e prefill"):
            tokens = int(name.split()[2])  # prefill_name's token count
            lines.append(
                f"end_to_end: prefill {tokens * 1e3 / ms:.0f} tokens/s with {N_LAYERS} layers -> "
                f"~{tokens * 1e3 / (ms / N_LAYERS * REAL_LAYERS):.0f} tokens/s projected to {REAL_LAYERS} layers"
            )
    return lines
