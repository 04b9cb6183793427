"""Request models of the OpenAI API (plus vLLM's extra sampling fields), checked at the boundary.

Unknown fields are kept by pydantic (`extra="allow"`) and reported once per name by the app, never
rejected. Type errors become 400s (see errors.py). Range checks that pydantic does not express are
done by `check_common` and `SamplingParams.validate`, before anything is queued.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr

from dsv4serve.api.errors import bad_request
from dsv4serve.ipc.sampling import MAX_LOGPROBS

MAX_TEMPERATURE = 2.0  # OpenAI's documented range is [0, 2]


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow")

    def unknown_fields(self, prefix: str = "") -> list[str]:
        names = [prefix + name for name in (self.model_extra or {})]
        for name, value in self:
            if isinstance(value, _Model):
                names += value.unknown_fields(f"{prefix}{name}.")
        return names


class StreamOptions(_Model):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class Thinking(_Model):
    type: Literal["enabled", "disabled"]


class _Sampling(_Model):
    """Fields shared by chat and text completions."""

    model: StrictStr | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: StrictInt | None = 1
    max_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: StrictInt | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: bool | None = False
    min_tokens: StrictInt | None = 0
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True
    user: str | None = None
    logit_bias: dict[str, float] | None = None  # token id (as JSON keys are: text) -> bias in [-100, 100]
    allowed_token_ids: list[StrictInt] | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[Any]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = None
    tools: list[Any] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    thinking: Thinking | None = None
    reasoning_effort: StrictStr | None = None


PromptInput = Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]  # noqa: UP007 (pydantic alias)


class CompletionRequest(_Sampling):
    prompt: PromptInput
    echo: bool | None = False
    logprobs: StrictInt | None = None
    suffix: str | None = None


class TokenizeRequest(_Model):
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[Any] | None = None
    add_generation_prompt: bool | None = True
    add_special_tokens: bool | None = None
    tools: list[Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Model):
    model: StrictStr | None = None
    tokens: list[StrictInt]


def check_common(req: _Sampling) -> None:
    """The Fine-print 400s shared by both completion endpoints."""
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    if req.n is not None and req.n < 1:
        raise bad_request(f"n must be at least 1, got {req.n}", "n")
    if req.n is not None and req.n > 128:
        raise bad_request(f"n must be at most 128, got {req.n}", "n")
    if req.temperature is not None and not 0.0 <= req.temperature <= MAX_TEMPERATURE:  # NaN fails too
        raise bad_request(f"temperature must be in [0, 2], got {req.temperature!r}", "temperature")
    stops = [req.stop] if isinstance(req.stop, str) else req.stop or []
    if any(s == "" for s in stops):
        raise bad_request("stop must not contain an empty string", "stop")


def logit_bias_pairs(logit_bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias object as (token id, bias) pairs; a key that is not an integer is a 400
    (the range of ids and values is checked with the vocabulary, in SamplingParams.validate)."""
    pairs = []
    for key, value in (logit_bias or {}).items():
        try:
            token_id = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids (integers), got {key!r}", "logit_bias") from None
        pairs.append((token_id, float(value)))
    return tuple(pairs)


def check_chat(req: ChatCompletionRequest) -> None:
    check_common(req)
    if req.tools is not None and not req.tools:
        raise bad_request("tools must not be an empty list (leave it out instead)", "tools")
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}", "top_logprobs")
    _check_tool_choice(req)


def _check_tool_choice(req: ChatCompletionRequest) -> None:
    choice = req.tool_choice
    if choice is None:
        return
    if not req.tools:
        raise bad_request("tool_choice needs tools", "tool_choice")
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise bad_request(f"tool_choice {choice!r} is not none, auto, required or a named function", "tool_choice")
        return
    fn = choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if choice.get("type", "function") != "function" or not isinstance(name, str):
        raise bad_request(
            'tool_choice must name a function: {"type": "function", "function": {"name": ...}}', "tool_choice"
        )
    names = [
        t.get("function", {}).get("name")
        for t in req.tools
        if isinstance(t, dict) and isinstance(t.get("function"), dict)
    ]
    if name not in names:
        raise bad_request(f"tool_choice names the function {name!r}, which is not in tools", "tool_choice")


def check_completion(req: CompletionRequest) -> None:
    check_common(req)
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise bad_request(f"logprobs must be in [0, {MAX_LOGPROBS}], got {req.logprobs}", "logprobs")
    if req.suffix:
        raise bad_request("suffix is not supported", "suffix")
