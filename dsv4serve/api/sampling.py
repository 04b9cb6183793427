"""Request fields -> SamplingParams, and the checks that need the engine's numbers."""

from __future__ import annotations

import dataclasses

from dsv4serve.api.errors import APIError, bad_request
from dsv4serve.api.protocol import _Sampling, logit_bias_pairs
from dsv4serve.ipc.sampling import SamplingParams

_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


def check_model(model: str | None, served_name: str) -> None:
    """Only the served name is accepted (vLLM also accepts a missing model: the served one)."""
    if model is not None and model != served_name:
        raise APIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")


def build_sampling(req: _Sampling, max_tokens: int | None, logprobs: int | None, vocab_size: int) -> SamplingParams:
    """Raises a 400 naming the field for anything out of range."""
    values: dict = {}
    for name in _FLOAT_FIELDS:
        value = getattr(req, name)
        if value is not None:
            values[name] = float(value)
    if req.top_k is not None:
        values["top_k"] = req.top_k
    if req.seed is not None:
        values["seed"] = req.seed
    try:
        params = SamplingParams(
            **values,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=bool(req.ignore_eos),
            min_tokens=req.min_tokens or 0,
            max_tokens=max_tokens,
            logprobs=logprobs,
            logit_bias=logit_bias_pairs(req.logit_bias),
            allowed_token_ids=tuple(req.allowed_token_ids) if req.allowed_token_ids is not None else None,
        )
        params.validate(vocab_size)
    except ValueError as exc:
        field = str(exc).split(" ", 1)[0]
        raise bad_request(str(exc), field) from exc
    return params


def with_seed(params: SamplingParams, seed_offset: int) -> SamplingParams:
    """The params of choice i of n: seed + i, as vLLM does (no seed: independent samples)."""
    if params.seed is None or seed_offset == 0:
        return params
    return dataclasses.replace(params, seed=params.seed + seed_offset)


def check_context(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
    """The contract's limits: a 400 naming the context length."""
    if num_prompt_tokens == 0:
        raise bad_request("the prompt is empty", "prompt")
    if num_prompt_tokens >= max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"request has {num_prompt_tokens} input tokens. Please reduce the length of the "
            "input messages.",
            "messages",
        )
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
            f"input, {max_tokens} for the completion). Please reduce the length of the input "
            "or of max_tokens.",
            "max_tokens",
        )


def check_prompt_chars(num_chars: int, max_model_len: int, max_token_chars: int) -> None:
    """The cheap early reject, before tokenizing: a token stands for at most `max_token_chars` characters,
    so a prompt of more than (max_model_len - 1) x max_token_chars characters has max_model_len tokens
    or more (check_context's 400, decided from the length alone)."""
    if num_chars > (max_model_len - 1) * max_token_chars:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{num_chars} characters of input, which is at least {-(-num_chars // max_token_chars)} tokens. "
            "Please reduce the length of the input messages.",
            "messages",
        )


def stop_strings(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)
