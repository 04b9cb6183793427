"""The sampler's argmax over the vocabulary, fast on the CPU, with torch.argmax's result to the bit.

torch's CPU argmax is a scalar loop that tracks an index per element: [16, 129,280] fp32 takes ~2 ms on
this project's CPU, where `amax` (vectorized, no index) takes ~0.2 ms and the two levels below ~0.3 ms.
On the CPU the argmax is therefore taken in two levels: the max of every block of `BLOCK` logits (amax),
the first block holding the row's max (argmax over V / BLOCK values), then the first max inside that
block (argmax over BLOCK values). The first block whose max equals the row's max holds the row's first
max, so the index is torch.argmax's; NaN counts as the max in both (amax propagates it, argmax picks the
first NaN), and -0.0 == 0.0 in both. On other devices torch.argmax is one fast launch and is used as is.
"""

from __future__ import annotations

import torch

BLOCK = 256  # logits per block: 505 blocks for DeepSeek-V4's 129,280 tokens (64..640 measured alike)
MIN_BLOCKS = 16  # below this many blocks (small test vocabularies) one argmax is as cheap


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """x [B, V] float -> [B] int64, the first index of each row's max: exactly `x.argmax(dim=-1)`."""
    rows, vocab = x.shape
    if x.device.type != "cpu" or vocab % BLOCK or vocab < BLOCK * MIN_BLOCKS:
        return x.argmax(dim=-1)
    blocks = x.reshape(rows, vocab // BLOCK, BLOCK)  # a view for contiguous rows
    best = blocks.amax(dim=-1).argmax(dim=-1)  # [B] the first block holding the row's max
    inside = blocks.gather(1, best.view(rows, 1, 1).expand(rows, 1, BLOCK)).squeeze(1)  # [B, BLOCK]
    return best * BLOCK + inside.argmax(dim=-1)


def argmax_without(x: torch.Tensor, flat_index: torch.Tensor | None) -> torch.Tensor:
    """`row_argmax` of x [B, V] with the logits at flat positions row * V + token set to -inf, without a
    [B, V] copy: those few logits are saved, overwritten, and written back after the argmax, so x holds
    its own values again on return (x must be contiguous; `flat_index` [S] int64, None: nothing masked).
    The writes run in inference mode: the logits of a forward are inference tensors."""
    if flat_index is None:
        return row_argmax(x)
    flat = x.view(-1)
    with torch.inference_mode():
        kept = flat.index_select(0, flat_index)  # [S] the masked logits, restored below
        flat.index_fill_(0, flat_index, float("-inf"))
    token_ids = row_argmax(x)
    with torch.inference_mode():
        flat.index_copy_(0, flat_index, kept)  # duplicates in flat_index write the same value
    return token_ids
