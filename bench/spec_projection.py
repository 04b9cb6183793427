"""Projected speed-up of speculative decoding from step costs: pure arithmetic, no tensors.

    expected_tokens(a, n)                       tokens a verify step yields at acceptance rate a, n drafts
    speedup(a, n, decode, verify, draft)        tokens per unit time over plain decode's
    BandwidthModel.from_config(real_args)       DeepSeek-V4-Flash's bytes read per step, decode / verify / draft

Acceptance model: each draft is accepted with probability a, independently, until the first rejection (the
i.i.d. model of Leviathan et al. 2023). A verify step of n drafts yields the accepted drafts plus one token of the
target's (the replacement or the bonus): E = sum_{i=0..n} a^i = (1 - a^(n+1)) / (1 - a).

Bandwidth model (a GPU decoding at batch 1 reads every weight it uses once per step, and nothing else matters at
short context): a decode step of B tokens reads every non-routed tensor (the embedding table aside: a gather)
and the distinct routed experts its tokens pick, per layer; a verify step of B rows x (n + 1) tokens reads the
same non-routed tensors and the distinct experts of B (n + 1) tokens; a draft reads the MTP block (its non-routed
tensors and its tokens' experts) and the shared head, once per draft position. Distinct experts of T tokens:
`n_experts (1 - (1 - k / n_experts)^T)` when tokens route independently (the upper bound; consecutive tokens of
one text share experts more often) and k when they all pick the same ones (the lower bound).
"""

from __future__ import annotations

from dataclasses import dataclass

from dsv4serve.model.args import ModelArgs
from dsv4serve.model.schema import TensorSpec, checkpoint_schema


def expected_tokens(acceptance: float, num_drafts: int) -> float:
    """Tokens per verify step: the accepted drafts plus the target's own token (module doc)."""
    if not 0.0 <= acceptance <= 1.0:
        raise ValueError(f"an acceptance rate is in [0, 1], got {acceptance}")
    return float(sum(acceptance**i for i in range(num_drafts + 1)))


def speedup(acceptance: float, num_drafts: int, decode_cost: float, verify_cost: float, draft_cost: float) -> float:
    """Tokens per unit time with speculation over tokens per unit time of plain decode (one token per step)."""
    return expected_tokens(acceptance, num_drafts) * decode_cost / (verify_cost + draft_cost)


def distinct_experts(n_experts: int, top_k: int, tokens: int, independent: bool = True) -> float:
    """Expected distinct routed experts that `tokens` tokens pick in one layer (module doc's two bounds)."""
    if not independent:
        return float(min(top_k, n_experts))
    return n_experts * (1.0 - (1.0 - top_k / n_experts) ** tokens)


@dataclass(frozen=True)
class BandwidthModel:
    main_dense_bytes: int  # non-routed tensors of the main model a step reads (head included, embedding not)
    main_expert_bytes: float  # one routed expert of one main layer, times the main layers
    mtp_dense_bytes: int  # the MTP block's non-routed tensors
    mtp_expert_bytes: float  # one routed expert of the MTP layer
    head_bytes: int  # the head the MTP block shares with the main model (read again per draft)
    n_experts: int
    top_k: int

    @classmethod
    def from_config(cls, args: ModelArgs) -> BandwidthModel:
        specs = checkpoint_schema(args, include_mtp=True)

        def total(pick) -> int:
            return sum(s.nbytes for s in specs if pick(s))

        def is_mtp(s: TensorSpec) -> bool:
            return s.layer is not None and s.layer >= args.n_layers

        n = args.n_routed_experts
        routed_main = total(lambda s: s.group == "routed_experts" and not is_mtp(s))
        routed_mtp = total(lambda s: s.group == "routed_experts" and is_mtp(s))
        return cls(
            main_dense_bytes=total(lambda s: not is_mtp(s) and s.group not in ("routed_experts", "embed")),
            main_expert_bytes=routed_main / n,
            mtp_dense_bytes=total(lambda s: is_mtp(s) and s.group != "routed_experts"),
            mtp_expert_bytes=routed_mtp / n if args.n_mtp_layers else 0.0,
            head_bytes=total(lambda s: s.group == "head"),
            n_experts=n,
            top_k=args.n_activated_experts,
        )

    def forward_bytes(self, tokens: int, independent: bool = True) -> float:
        """A main-model forward of `tokens` tokens in all (a decode step of B rows: B; a verify: B (n + 1))."""
        experts = distinct_experts(self.n_experts, self.top_k, tokens, independent)
        return self.main_dense_bytes + experts * self.main_expert_bytes

    def draft_bytes(self, rows: int, num_drafts: int, independent: bool = True) -> float:
        """n draft positions of `rows` rows: the MTP block and the head once per position."""
        experts = distinct_experts(self.n_experts, self.top_k, rows, independent)
        per_position = self.mtp_dense_bytes + self.head_bytes + experts * self.mtp_expert_bytes
        return num_drafts * per_position

    def costs(self, rows: int, num_drafts: int, independent: bool = True) -> tuple[float, float, float]:
        """(decode, verify, draft) bytes of one step of `rows` rows."""
        return (
            self.forward_bytes(rows, independent),
            self.forward_bytes(rows * (num_drafts + 1), independent),
            self.draft_bytes(rows, num_drafts, independent),
        )
