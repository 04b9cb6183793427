"""POST /v1/chat/completions: DSV4 prompt rendering, thinking controls, tools, structured output, n, streaming.

`prepare_chat` turns a chat request into the engine requests of its choices; the Anthropic Messages
and the Responses API translate their requests into a ChatCompletionRequest and use it too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fastapi import APIRouter, Request

from dsv4serve.api.choices import ChatChoice
from dsv4serve.api.errors import bad_request
from dsv4serve.api.generation import ChoiceSpec
from dsv4serve.api.protocol import ChatCompletionRequest, check_chat
from dsv4serve.api.sampling import (
    build_sampling,
    check_context,
    check_model,
    check_prompt_chars,
    stop_strings,
    with_seed,
)
from dsv4serve.api.state import AppState, read_request
from dsv4serve.api.streaming import Reply, new_id, respond
from dsv4serve.chat import ChatFormatError, prompt_opens_reasoning, render_prompt
from dsv4serve.chat import tokens as T
from dsv4serve.chat.constraints import forced_call_constraint, response_format_constraint
from dsv4serve.chat.messages import check_functions
from dsv4serve.chat.tools import forced_call_opening
from dsv4serve.ipc.sampling import SamplingParams, StructuredOutput

router = APIRouter()


def thinking_controls(req: ChatCompletionRequest, default: bool) -> tuple[bool, str | None]:
    """(thinking, reasoning_effort) from chat_template_kwargs, `thinking` and `reasoning_effort`."""
    kwargs = req.chat_template_kwargs or {}
    thinking = default
    if req.thinking is not None:
        thinking = req.thinking.type == "enabled"
    for key in ("thinking", "enable_thinking"):
        if key in kwargs:
            if not isinstance(kwargs[key], bool):
                raise bad_request(f"chat_template_kwargs.{key} must be a boolean", "chat_template_kwargs")
            thinking = kwargs[key]
    effort = req.reasoning_effort
    if "reasoning_effort" in kwargs:
        effort = kwargs["reasoning_effort"]
        if effort is not None and not isinstance(effort, str):
            raise bad_request("chat_template_kwargs.reasoning_effort must be a string", "chat_template_kwargs")
    return thinking, effort


def render_chat(state: AppState, req: ChatCompletionRequest) -> str:
    thinking, effort = thinking_controls(req, state.options.default_thinking)
    tools = req.tools if req.tool_choice != "none" else None
    try:
        return render_prompt(
            req.messages, tools, thinking=thinking, reasoning_effort=effort, response_format=req.response_format
        )
    except ChatFormatError as exc:
        raise bad_request(str(exc), "messages") from exc


def force_tool_call(
    state: AppState, req: ChatCompletionRequest, sampling: SamplingParams, opens_reasoning: bool
) -> SamplingParams:
    """tool_choice "required" or a named function: the reply is forced to open a DSML call (after its
    reasoning, when the prompt opened one), so the model cannot answer without calling."""
    opening = forced_call_opening(req.tool_choice) if req.tools else None
    if opening is None:
        return sampling
    after = state.tokenizer.encode(T.THINK_END)[0] if opens_reasoning else None
    return dataclasses.replace(sampling, forced_tokens=tuple(state.tokenizer.encode(opening)), forced_after=after)


def structured_output(
    state: AppState, req: ChatCompletionRequest, sampling: SamplingParams, opens_reasoning: bool
) -> SamplingParams:
    """The constraint the reply is decoded under: a forced tool call's DSML block (its arguments follow the
    tool's schema), else the response_format's JSON; it starts after the reasoning (`</think>`)."""
    forced = bool(req.tools) and req.tool_choice not in (None, "auto", "none")
    try:
        if forced:
            constraint = forced_call_constraint(check_functions(req.tools), req.tool_choice, req.parallel_tool_calls)
        else:
            constraint = response_format_constraint(req.response_format)
    except ChatFormatError as exc:
        raise bad_request(str(exc), "tools" if forced else "response_format") from exc
    if constraint is None:
        return sampling
    if sampling.ignore_eos or sampling.min_tokens:
        raise bad_request(
            "ignore_eos and min_tokens cannot be combined with structured output (the grammar decides the end)",
            "ignore_eos" if sampling.ignore_eos else "min_tokens",
        )
    after = state.tokenizer.encode(T.THINK_END)[0] if opens_reasoning else None
    return dataclasses.replace(sampling, structured=StructuredOutput(*constraint, after_token=after))


def _render_and_encode(state: AppState, req: ChatCompletionRequest, max_model_len: int) -> tuple[str, list[int]]:
    """Run on the text pool: render, refuse a prompt whose length alone is too long, tokenize."""
    prompt = render_chat(state, req)
    check_prompt_chars(len(prompt), max_model_len, state.tokenizer.max_token_chars)
    return prompt, state.tokenizer.encode(prompt)


@dataclass
class PreparedChat:
    specs: list[ChoiceSpec]  # one engine request per choice
    opens_reasoning: bool  # the prompt ends in <think>: each reply starts as reasoning
    num_prompt_tokens: int


async def count_chat_tokens(state: AppState, req: ChatCompletionRequest) -> int:
    """The prompt tokens the request would be given (Anthropic's count_tokens)."""
    check_chat(req)
    check_model(req.model, state.options.served_model_name)
    _, prompt_ids = await state.off_loop(_render_and_encode, state, req, state.ready().max_model_len)
    return len(prompt_ids)


async def prepare_chat(
    state: AppState, req: ChatCompletionRequest, reply_id: str, clamp_max_tokens: bool = False
) -> PreparedChat:
    """Every check, then the rendered, tokenized prompt and the sampling params of each choice.
    `clamp_max_tokens`: a max_tokens past the context is cut to fit (Anthropic) instead of a 400."""
    check_chat(req)
    check_model(req.model, state.options.served_model_name)
    ready = state.ready()
    prompt, prompt_ids = await state.off_loop(_render_and_encode, state, req, ready.max_model_len)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if clamp_max_tokens and max_tokens is not None:
        max_tokens = min(max_tokens, max(ready.max_model_len - len(prompt_ids), 1))
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    sampling = build_sampling(req, max_tokens, logprobs, ready.vocab_size)
    check_context(len(prompt_ids), max_tokens, ready.max_model_len)
    opens = prompt_opens_reasoning(prompt)
    sampling = structured_output(state, req, force_tool_call(state, req, sampling, opens), opens)
    stops, include_stop = stop_strings(req.stop), bool(req.include_stop_str_in_output)
    skip_special = req.skip_special_tokens is not False
    specs = [
        ChoiceSpec(i, f"{reply_id}-{i}", prompt_ids, with_seed(sampling, i), stops, include_stop, skip_special)
        for i in range(req.n or 1)
    ]
    return PreparedChat(specs, opens, len(prompt_ids))


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    state, req = await read_request(request, ChatCompletionRequest)
    reply = Reply(new_id("chatcmpl"), "chat.completion", state.options.served_model_name, [], [])
    prepared = await prepare_chat(state, req, reply.id)
    for spec in prepared.specs:
        reply.choices.append(ChatChoice(spec.index, state.tokenizer, prepared.opens_reasoning, bool(req.logprobs)))
        reply.prompt_of.append(0)
    return await respond(state, request, reply, prepared.specs, req)
