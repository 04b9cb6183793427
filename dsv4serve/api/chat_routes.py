"""POST /v1/chat/completions: DSV4 prompt rendering, thinking controls, tools, n, streaming."""

from __future__ import annotations

import dataclasses

from fastapi import APIRouter, Request

from dsv4serve.api.choices import ChatChoice
from dsv4serve.api.errors import bad_request
from dsv4serve.api.generation import ChoiceSpec
from dsv4serve.api.protocol import ChatCompletionRequest, check_chat
from dsv4serve.api.sampling import build_sampling, check_context, check_model, stop_strings, with_seed
from dsv4serve.api.state import AppState, read_request
from dsv4serve.api.streaming import Reply, new_id, respond
from dsv4serve.chat import ChatFormatError, prompt_opens_reasoning, render_prompt
from dsv4serve.chat import tokens as T
from dsv4serve.chat.tools import forced_call_opening
from dsv4serve.ipc.sampling import SamplingParams

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
    after = None
    if opens_reasoning:
        (after,) = state.tokenizer.encode(T.THINK_END)
    return dataclasses.replace(sampling, forced_tokens=tuple(state.tokenizer.encode(opening)), forced_after=after)


def _render_and_encode(state: AppState, req: ChatCompletionRequest) -> tuple[str, list[int]]:
    prompt = render_chat(state, req)
    return prompt, state.tokenizer.encode(prompt)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    state, req = await read_request(request, ChatCompletionRequest)
    check_chat(req)
    check_model(req.model, state.options.served_model_name)
    ready = state.ready()
    prompt, prompt_ids = await state.off_loop(_render_and_encode, state, req)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    sampling = build_sampling(req, max_tokens, logprobs, ready.vocab_size)
    check_context(len(prompt_ids), max_tokens, ready.max_model_len)
    reply = Reply(new_id("chatcmpl"), "chat.completion", state.options.served_model_name, [], [])
    opens = prompt_opens_reasoning(prompt)
    sampling = force_tool_call(state, req, sampling, opens)
    specs = []
    for i in range(req.n or 1):
        reply.choices.append(ChatChoice(i, state.tokenizer, opens, bool(req.logprobs)))
        reply.prompt_of.append(0)
        specs.append(
            ChoiceSpec(
                i,
                f"{reply.id}-{i}",
                prompt_ids,
                with_seed(sampling, i),
                stop_strings(req.stop),
                bool(req.include_stop_str_in_output),
                req.skip_special_tokens is not False,
            )
        )
    return await respond(state, request, reply, specs, req)
