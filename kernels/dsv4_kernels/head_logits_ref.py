"""Torch reference of the output head (dsv4-model.md §2.0 step 6): logits = head . y in fp32, the bf16
head weight upcast, as DeepSeek's reference computes them (and `Transformer.logits` on torch)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def head_logits_ref(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """y [M, K] (fp32 hidden states), w [V, K] (bf16 or fp32) -> fp32 logits [M, V]."""
    return F.linear(y.float(), w.float())
