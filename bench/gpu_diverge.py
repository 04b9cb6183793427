"""Where a decode step first parts from a one-shot prefill of the same tokens: forward hooks on every module.

bench/gpu_cases/end_to_end.py checks the logits of token P decoded after a P-token prefill against a one-shot
prefill of all P + 1 tokens. When that check fails, this finds the first module (in call order) whose output
for token P differs past --rtol between the two runs, and the routing of token P in each MoE layer (an expert
choice flipped by rounding moves a whole row: the usual, harmless, cause). It runs the comparison once per
kernel set in --backends: "triton" (what the server runs on CUDA) and "torch" (the reference), on the same
random model (DeepSeek-V4-Flash's dimensions cut to 2 layers), so a difference only the kernels show stands out.

    python bench/gpu_diverge.py [--prompt 2048] [--backends triton torch] [--rtol 0.02]
    python bench/gpu_diverge.py --cpu-smoke      # dsv4-tiny, the Triton interpreter: checks the code path
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


class Recorder:
    """Each module's outputs, call by call: the first tensor of the output, its row `row` (a token), on the CPU;
    and each MoE gate's choice for that token (its output's second tensor: the expert ids), sorted."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.calls, self.order, self.routes, self.row = model, {}, [], {}, -1
        self.handles = [m.register_forward_hook(self._hook(name)) for name, m in model.named_modules() if name]

    def _hook(self, name: str):
        def hook(module, args, output):
            from dsv4serve.model.moe_output import Combined

            if isinstance(output, Combined):  # an MoE output whose sum rides in the post launch: made here
                output = output.value()
            t = output[0] if isinstance(output, (tuple, list)) and output else output
            if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] == 0:
                return
            calls = self.calls.setdefault(name, [])
            self.order.append((name, len(calls)))
            calls.append(t[self.row].detach().float().cpu().clone())
            if name.endswith("ffn.gate"):
                self.routes[name] = sorted(output[1][self.row].tolist())

        return hook

    def reset(self, row: int) -> None:
        self.calls, self.order, self.routes, self.row = {}, [], {}, row

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def compare(model, num, ids: torch.Tensor, prompt: int, rtol: float, label: str) -> None:
    from dsv4serve.model.transformer import BatchRow

    rec = Recorder(model)
    rec.reset(-1)
    state = model.new_state(num)
    full_logits = model([BatchRow(ids, state)], num).logits[0]
    state.pool.release(state)
    one_shot, one_order, one_routes = rec.calls, rec.order, rec.routes
    state = model.new_state(num)
    rec.reset(-1)  # the prefill's records are dropped: only the decode step's
    model([BatchRow(ids[:prompt], state)], num)
    rec.reset(0)
    step_logits = model([BatchRow(ids[prompt:], state)], num).logits[0]
    state.pool.release(state)
    rec.close()
    decoded, routes = rec.calls, rec.routes
    diff = (step_logits.float() - full_logits.float()).abs()
    print(
        f"\n[{label}] logits of token {prompt}: max |diff| {float(diff.max()):.4g}, mean {float(diff.mean()):.3g}, "
        f"scale {float(full_logits.float().abs().max()):.3g}; argmax {int(step_logits.argmax())} vs "
        f"{int(full_logits.argmax())}"
    )
    shown = 0
    for name, i in one_order:
        if name not in decoded or i >= len(decoded[name]) or i >= len(one_shot[name]):
            continue
        a, b = decoded[name][i], one_shot[name][i]
        if a.shape != b.shape:
            continue
        err = float((a - b).abs().max())
        scale = float(b.abs().max()) or 1.0
        if err > rtol * scale and shown < 12:
            print(f"  {name}[call {i}] {tuple(a.shape)}: max |diff| {err:.4g} at scale {scale:.4g}")
            shown += 1
    if shown == 0:
        print(f"  no module output differs past {rtol} of its scale")
    for name, experts in one_routes.items():  # token P's routed experts in every MoE layer
        same = "same" if routes.get(name) == experts else f"DIFFER: one-shot {experts}, decode {routes.get(name)}"
        print(f"  [{label}] {name}: token {prompt}'s experts {same}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--backends", nargs="+", default=["triton", "torch"])
    parser.add_argument("--rtol", type=float, default=0.02)
    parser.add_argument("--cpu-smoke", action="store_true")
    opts = parser.parse_args()
    if opts.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, str(REPO))
    from bench.gpu_cases import two_layer_model
    from dsv4serve.model.backends import KernelBackends
    from dsv4serve.model.numerics import NUMERICS_ON
    from dsv4serve.model.random_init import random_model

    device, args = two_layer_model(opts.cpu_smoke)
    prompt = min(opts.prompt, 64) if opts.cpu_smoke else opts.prompt
    gen = torch.Generator(device=device).manual_seed(1)
    ids = torch.randint(0, args.vocab_size, (prompt + 1,), device=device, generator=gen)
    for kind in opts.backends:
        num = replace(NUMERICS_ON, backends=KernelBackends.every(kind))
        model = random_model(args, device, seed=0, include_mtp=False)
        model.use_kernels(num.backends)
        compare(model, num, ids, prompt, opts.rtol, kind)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
