"""Torch reference of the MoE router (dsv4-model.md §2.8), as `dsv4serve.model.router.Gate` computes it:

  logits = x @ W^T                      fp32 (x upcast from the compute dtype, W as the model holds it)
  scores = f(logits)                    evaluated in fp64, rounded to fp32; f = sqrt(softplus) (the
                                        checkpoint's), sigmoid, or softmax over the E experts
  ids    = the k largest scores + bias  (learned layers: the bias picks, it does not weigh) in
                                        descending order, ties to the lower expert id; or, on hash
                                        layers, tid2eid[token] as stored
  w      = scores[ids]                  / their sum (norm_topk_prob; never after a softmax)
  w      = w * route_scale

Ties: `torch.topk` on the CPU orders equal values arbitrarily (a partial sort: [1, 3, 3, 0, 3] keeps
index 1 first, but 320 such values need not), so the reference needs a rule of its own: a stable
descending sort, which puts the lower expert id first among equal values. Where no two of the k + 1
largest values are equal the two choices are the same.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SCORE_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")


def scores_ref(logits: torch.Tensor, score_func: str) -> torch.Tensor:
    """fp32 logits [N, E] -> fp32 scores [N, E], the function evaluated in fp64 (as `numerics.in_fp64`)."""
    z = logits.double()
    if score_func == "softmax":
        s = z.softmax(dim=-1)
    elif score_func == "sigmoid":
        s = torch.sigmoid(z)
    elif score_func == "sqrtsoftplus":
        s = F.softplus(z).sqrt()
    else:
        raise ValueError(f"unknown score function {score_func!r}; expected one of {SCORE_FUNCS}")
    return s.to(torch.float32)


def topk_ids_ref(values: torch.Tensor, k: int) -> torch.Tensor:
    """The k largest of each row [N, E] in descending order, the lower id first among equal values."""
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[:, :k]


def router_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    k: int,
    score_func: str,
    route_scale: float,
    norm_topk_prob: bool,
    tid2eid: torch.Tensor | None = None,
    token_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, D], weight [E, D] -> (routing weights fp32 [N, k], expert ids int64 [N, k]). Hash layers
    pass tid2eid [vocab, k] and token_ids [N] (and no bias)."""
    scores = scores_ref(x.float() @ weight.float().t(), score_func)
    if tid2eid is not None:
        ids = tid2eid[token_ids].long()
    else:
        ids = topk_ids_ref(scores + bias.float() if bias is not None else scores, k)
    w = scores.gather(1, ids)
    if norm_topk_prob and score_func != "softmax":
        w = w / w.sum(dim=-1, keepdim=True)
    return w * route_scale, ids
