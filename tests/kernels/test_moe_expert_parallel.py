"""Expert parallelism on the MXFP4 kernel (issue 21), one MoE layer of dsv4-tiny in the interpreter.

A rank that owns some of a layer's experts (parallel/shard_model.py leaves the others as placeholders) packs only
its own (`MoE.pack_fp4`: stacks of its experts, a global -> row map), and the kernel path routes every token
to another rank's expert onto row 0 with weight 0, whose output is an exact 0. So each rank's MoE output on the
kernel equals the torch path's with the same experts left out (within the kernel's one bf16 ulp of rounding,
test_model_kernels.py's LAYER_TOL), and the two ranks' routed parts add up to the whole layer's.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

from dsv4serve.checkpoint.loader import load_dense_state_dict
from dsv4serve.model.backends import TORCH
from dsv4serve.model.moe import MoE
from dsv4serve.model.numerics import NUMERICS_ON, act_quant
from dsv4serve.model.transformer import Transformer

ENGINE = dataclasses.replace(NUMERICS_ON, batch_invariant=False)  # the numerics a worker runs the kernels in
TRITON = dataclasses.replace(ENGINE, backends=dataclasses.replace(TORCH, fp4_moe="triton"))  # the MoE kernel alone
TORCH_PATH = dataclasses.replace(ENGINE, backends=TORCH)
LAYER_TOL = 2.0**-6  # relative to the largest magnitude: a few bf16 ulps (test_model_kernels.py)
TOKENS = 12


@pytest.fixture(scope="module")
def layer(tiny_dir) -> MoE:
    args, state = load_dense_state_dict(tiny_dir)
    model = Transformer(args).eval()
    model.load_state_dict(state, strict=True)
    return model.layers[2].ffn


def _rank(moe: MoE, not_owned: set[int]) -> MoE:
    """`moe` as a rank owning the other experts holds it (placeholders where shard_model drops them)."""
    rank = copy.deepcopy(moe)
    for e in not_owned:
        rank.experts[e] = nn.Module()
    rank.not_owned = frozenset(not_owned)
    rank.pack_fp4()
    return rank


def test_each_ranks_kernel_output_is_the_torch_paths_without_the_other_ranks_experts(layer) -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(TOKENS, layer.gate.weight.shape[1], generator=gen).to(torch.bfloat16)
    token_ids = torch.randint(0, 1000, (TOKENS,), generator=gen)
    n = len(layer.experts)
    halves = ({e for e in range(n) if e % 2}, {e for e in range(n) if not e % 2})
    whole = copy.deepcopy(layer)
    whole.pack_fp4()
    with torch.inference_mode():
        full = whole(x, token_ids, TRITON).float()
        shared = whole.shared_experts(act_quant(x, TRITON), TRITON).float()  # as forward feeds it
        parts = []
        for not_owned in halves:
            rank = _rank(layer, not_owned)
            assert rank.w1_fp4.shape[0] == n - len(not_owned) and rank.local_expert is not None
            got = rank(x, token_ids, TRITON).float()
            want = rank(x, token_ids, TORCH_PATH).float()
            scale = want.abs().max()
            assert (got - want).abs().max() <= LAYER_TOL * scale, "a rank's experts differ from the torch path's"
            assert (got - full).abs().max() > 10 * LAYER_TOL * scale, "the other rank's experts were not left out"
            parts.append(got - shared)
    routed = parts[0] + parts[1]
    assert (routed + shared - full).abs().max() <= 2 * LAYER_TOL * full.abs().max()
