"""POST /v1/completions: text or token-id prompts (one or a batch), echo, legacy logprobs."""

from __future__ import annotations

import dataclasses

from fastapi import APIRouter, Request

from dsv4serve.api.choices import TextChoice
from dsv4serve.api.errors import bad_request
from dsv4serve.api.generation import ChoiceSpec
from dsv4serve.api.protocol import CompletionRequest, check_completion
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

router = APIRouter()
DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for text completions


def prompt_token_lists(state: AppState, prompt, vocab_size: int, max_model_len: int) -> list[list[int]]:
    """Every prompt of the request as token ids (a batch gives several); run off the event loop."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        prompt = [prompt]
    out = []
    for p in prompt:
        if isinstance(p, str):
            check_prompt_chars(len(p), max_model_len, state.tokenizer.max_token_chars)
    for p in prompt:
        ids = state.tokenizer.encode(p, add_special_tokens=True) if isinstance(p, str) else list(p)
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise bad_request(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})", "prompt")
        out.append(ids)
    return out


@router.post("/v1/completions")
async def completions(request: Request):
    state, req = await read_request(request, CompletionRequest)
    check_completion(req)
    check_model(req.model, state.options.served_model_name)
    ready = state.ready()
    prompts = await state.off_loop(prompt_token_lists, state, req.prompt, ready.vocab_size, ready.max_model_len)
    max_tokens = req.max_tokens if "max_tokens" in req.model_fields_set else DEFAULT_MAX_TOKENS
    sampling = build_sampling(req, max_tokens, req.logprobs, ready.vocab_size)
    if req.echo and req.logprobs is not None:  # the echoed prompt carries its logprobs too
        sampling = dataclasses.replace(sampling, prompt_logprobs=req.logprobs)
    for ids in prompts:
        check_context(len(ids), max_tokens, ready.max_model_len)
    reply = Reply(new_id("cmpl"), "text_completion", state.options.served_model_name, [], [])
    specs, n = [], req.n or 1
    for p, ids in enumerate(prompts):
        echo = state.tokenizer.decode(ids, skip_special_tokens=False) if req.echo else ""
        for j in range(n):
            index = p * n + j
            reply.choices.append(TextChoice(index, state.tokenizer, req.logprobs, echo, ids if req.echo else None))
            reply.prompt_of.append(p)
            specs.append(
                ChoiceSpec(
                    index,
                    f"{reply.id}-{index}",
                    ids,
                    with_seed(sampling, j),
                    stop_strings(req.stop),
                    bool(req.include_stop_str_in_output),
                    req.skip_special_tokens is not False,
                )
            )
    return await respond(state, request, reply, specs, req)
