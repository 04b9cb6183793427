"""Per-request sampling parameters: plain, frozen, tensor-free, checked by `validate()`.

Field names and meanings follow vLLM's `SamplingParams`. Nothing here touches a tensor: the params
cross process boundaries inside msgspec messages (ipc.messages.AddRequest).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_LOGPROBS = 20  # OpenAI's `top_logprobs` ceiling; the contract answers 400 above it
GREEDY_TEMPERATURE = 1e-5  # vLLM's _SAMPLING_EPS: a temperature below this samples greedily
PENALTY_LIMIT = 2.0  # OpenAI / vLLM: presence and frequency penalties lie in [-2, 2]
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1  # vLLM's seed range (torch.long)
LOGIT_BIAS_LIMIT = 100.0  # OpenAI: each logit_bias value lies in [-100, 100]
STRUCTURED_KINDS = ("json_schema", "structural_tag")


@dataclass(frozen=True)
class StructuredOutput:
    """A decoding constraint as plain data; the worker compiles it once per (kind, spec) with xgrammar
    (worker/grammar.py) and keeps a matcher per request.

    kind "json_schema": `spec` is a JSON schema as JSON text; "structural_tag": `spec` is an xgrammar
    structural tag as JSON text (the DSML tool-call block of a forced tool call, chat/constraints.py).
    """

    kind: str
    spec: str
    # the constraint starts after the first time this token is produced (</think>: the reasoning is free
    # text); None: from the first output token
    after_token: int | None = None


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 (below GREEDY_TEMPERATURE) = greedy argmax
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1 = off
    top_k: int = -1  # -1 or 0 = off
    min_p: float = 0.0  # drop tokens with prob < min_p * max prob; 0 = off
    presence_penalty: float = 0.0  # subtracted once from every token seen in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # divides positive / multiplies negative logits of prompt+output tokens
    seed: int | None = None  # per-request generator: same seed + same request => same tokens
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # EOS is never sampled (masked) and never stops the request
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many output tokens exist
    max_tokens: int | None = None  # None: up to the end of the context
    logprobs: int | None = None  # None: no alternatives; N in 0..20: the N most likely alternatives
    # logprobs of the prompt's own tokens (each given the tokens before it), with N alternatives;
    # a request that asks for them computes its whole prompt (no prefix-cache reuse)
    prompt_logprobs: int | None = None
    # the output must continue with these tokens: from its first token (forced_after None), or right
    # after the first time the token `forced_after` is produced (tool_choice: the DSML call opening,
    # after the reasoning ends)
    forced_tokens: tuple[int, ...] = ()
    forced_after: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, value added to its logit), OpenAI's logit_bias
    allowed_token_ids: tuple[int, ...] | None = None  # only these may be sampled; None: every token
    structured: StructuredOutput | None = None  # response_format / forced tool-call arguments, enforced

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the first bad field; `vocab_size` also bounds stop_token_ids."""
        _check_float(self, "temperature", lambda v: v >= 0.0, "a finite number >= 0")
        _check_float(self, "top_p", lambda v: 0.0 < v <= 1.0, "in (0, 1]")
        _check_int(self, "top_k", lambda v: v >= -1, ">= -1 (-1 or 0 turn it off)")
        _check_float(self, "min_p", lambda v: 0.0 <= v <= 1.0, "in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            _check_float(self, name, lambda v: -PENALTY_LIMIT <= v <= PENALTY_LIMIT, "in [-2, 2]")
        _check_float(self, "repetition_penalty", lambda v: v > 0.0, "a finite number > 0")
        if self.seed is not None:
            _check_int(self, "seed", lambda v: _INT64_MIN <= v <= _INT64_MAX, f"in [{_INT64_MIN}, {_INT64_MAX}]")
        _check_stop_token_ids(self.stop_token_ids, vocab_size)
        _check_stop_token_ids(self.forced_tokens, vocab_size, "forced_tokens")
        if self.forced_after is not None:
            _check_stop_token_ids((self.forced_after,), vocab_size, "forced_after")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
        _check_int(self, "min_tokens", lambda v: v >= 0, ">= 0")
        if self.max_tokens is not None:
            _check_int(self, "max_tokens", lambda v: v >= 1, ">= 1")
            if self.min_tokens > self.max_tokens:
                raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(self, name, lambda v: 0 <= v <= MAX_LOGPROBS, f"in [0, {MAX_LOGPROBS}]")
        _check_token_limits(self, vocab_size)


def _check_token_limits(params: SamplingParams, vocab_size: int | None) -> None:
    """logit_bias, allowed_token_ids and the structured-output constraint."""
    if not isinstance(params.logit_bias, tuple):
        raise ValueError("logit_bias must be a tuple of (token id, bias) pairs")
    _check_stop_token_ids(tuple(pair[0] for pair in params.logit_bias), vocab_size, "logit_bias")
    for token_id, bias in params.logit_bias:
        ok = isinstance(bias, (int, float)) and not isinstance(bias, bool) and math.isfinite(bias)
        if not ok or not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
            raise ValueError(f"logit_bias values must be in [-100, 100], got {bias!r} for token {token_id}")
    if params.allowed_token_ids is not None:
        if not params.allowed_token_ids:
            raise ValueError("allowed_token_ids must not be empty")
        _check_stop_token_ids(params.allowed_token_ids, vocab_size, "allowed_token_ids")
    s = params.structured
    if s is not None:
        if s.kind not in STRUCTURED_KINDS or not isinstance(s.spec, str):
            raise ValueError(f"structured output kind must be one of {', '.join(STRUCTURED_KINDS)}, got {s.kind!r}")
        if s.after_token is not None:
            _check_stop_token_ids((s.after_token,), vocab_size, "structured.after_token")


def _check_float(params: SamplingParams, name: str, ok, rule: str) -> None:
    value = getattr(params, name)
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    # `not ok(...)` rather than a negated comparison, so NaN fails every rule
    if not is_number or not math.isfinite(value) or not ok(value):
        raise ValueError(f"{name} must be {rule}, got {value!r}")


def _check_int(params: SamplingParams, name: str, ok, rule: str) -> None:
    value = getattr(params, name)
    if not isinstance(value, int) or isinstance(value, bool) or not ok(value):
        raise ValueError(f"{name} must be an integer {rule}, got {value!r}")


def _check_stop_token_ids(
    stop_token_ids: tuple[int, ...], vocab_size: int | None, name: str = "stop_token_ids"
) -> None:
    if not isinstance(stop_token_ids, tuple):
        raise ValueError(f"{name} must be a tuple of token ids, got {type(stop_token_ids).__name__}")
    upper = vocab_size if vocab_size is not None else _INT64_MAX + 1
    for token_id in stop_token_ids:
        if not isinstance(token_id, int) or isinstance(token_id, bool) or not 0 <= token_id < upper:
            raise ValueError(f"{name} must hold token ids in [0, {upper}), got {token_id!r}")
