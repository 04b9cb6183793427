"""Server-sent events and the drivers shared by chat and text completions.

Framing is exactly `data: <one-line JSON>\n\n`, ending with `data: [DONE]\n\n`. A choice object
(chat or text) turns ChoiceEvents into the endpoint's choice dicts; the drivers here handle fan-in,
usage, errors mid-stream (an error event, then [DONE]) and client disconnects.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi.responses import JSONResponse, StreamingResponse

from dsv4serve.api.errors import APIError, error_body
from dsv4serve.api.generation import ChoiceEvent, ChoiceSpec, fan_in

DONE = "data: [DONE]\n\n"


def sse(obj: Any) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class Choice(Protocol):
    def start(self) -> dict | None: ...  # a stream's opening choice dict (chat: the role)
    def on_event(self, event: ChoiceEvent) -> dict | None: ...  # a stream choice dict, or nothing
    def result(self) -> dict: ...  # the whole choice, non-streamed


@dataclass
class Usage:
    completion_tokens: dict[int, int] = field(default_factory=dict)  # by choice index
    prompts: dict[int, tuple[int, int]] = field(default_factory=dict)  # prompt index -> (tokens, cached)

    def add(self, event: ChoiceEvent, prompt_key: int) -> None:
        self.completion_tokens[event.index] = event.num_output_tokens
        self.prompts[prompt_key] = (event.num_prompt_tokens, event.num_cached_tokens)

    def to_dict(self, index: int | None = None, prompt_key: int | None = None) -> dict:
        """The request's usage, or (index given) one choice's usage so far."""
        prompts = [self.prompts[prompt_key]] if prompt_key is not None else list(self.prompts.values())
        prompt, cached = sum(p for p, _ in prompts), sum(c for _, c in prompts)
        if index is None:
            done = sum(self.completion_tokens.values())
        else:
            done = self.completion_tokens.get(index, 0)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": done,
            "total_tokens": prompt + done,
            "prompt_tokens_details": {"cached_tokens": cached},
        }


@dataclass
class Reply:
    """What the route knows about one request's reply."""

    id: str
    object: str  # chat.completion | text_completion
    model: str
    choices: list[Choice]
    prompt_of: list[int]  # choice index -> prompt index (usage counts each prompt once)
    created: int = field(default_factory=lambda: int(time.time()))

    def envelope(self, obj: str, **fields) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, **fields}


async def collect(state, request, specs: list[ChoiceSpec], on_event: Callable[[ChoiceEvent], object]) -> None:
    """Run the choices to their end, handing each event to `on_event`; an engine error is raised (the
    route's error handler answers it in the API's envelope)."""
    async with contextlib.aclosing(fan_in(state, specs, request)) as events:
        async for item in events:
            if isinstance(item, APIError):
                raise item
            on_event(item)


async def complete(state, request, reply: Reply, specs: list[ChoiceSpec]) -> JSONResponse:
    usage = Usage()

    def on_event(item: ChoiceEvent) -> None:
        usage.add(item, reply.prompt_of[item.index])
        reply.choices[item.index].on_event(item)

    await collect(state, request, specs, on_event)
    body = reply.envelope(reply.object, choices=[c.result() for c in reply.choices], usage=usage.to_dict())
    return JSONResponse(body)


StreamBody = Callable[[ChoiceEvent, AsyncGenerator], AsyncIterator[str]]


async def open_stream(state, request, specs: list[ChoiceSpec], body: StreamBody):
    """A StreamingResponse of body(first event, the rest); an engine error before the first output is
    raised instead (answered as plain JSON, with its status, by the error handler)."""
    events = fan_in(state, specs, request)
    try:
        first = await events.__anext__()
    except StopAsyncIteration:  # the client left before anything came
        return JSONResponse({}, status_code=499)
    if isinstance(first, APIError):
        await events.aclose()
        raise first
    return StreamingResponse(
        body(first, events),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def chain(first: ChoiceEvent, events: AsyncGenerator) -> AsyncGenerator[ChoiceEvent | APIError, None]:
    """The first event, then the rest, ending after an engine error; the events are closed at the end."""
    try:
        item = first
        while True:
            yield item
            if isinstance(item, APIError):
                return
            try:
                item = await events.__anext__()
            except StopAsyncIteration:
                return
    finally:
        await events.aclose()


async def stream(state, request, reply: Reply, specs: list[ChoiceSpec], include_usage: bool, continuous_usage: bool):
    def body(first: ChoiceEvent, events: AsyncGenerator) -> AsyncIterator[str]:
        return _stream_body(reply, chain(first, events), include_usage, continuous_usage)

    return await open_stream(state, request, specs, body)


async def respond(state, request, reply: Reply, specs: list[ChoiceSpec], req: Any):
    """Answer a generation request (`req` with `stream` / `stream_options`): streamed or complete."""
    if not req.stream:
        return await complete(state, request, reply, specs)
    opts = req.stream_options
    return await stream(
        state, request, reply, specs, bool(opts and opts.include_usage), bool(opts and opts.continuous_usage_stats)
    )


async def _stream_body(
    reply: Reply, items: AsyncGenerator[ChoiceEvent | APIError, None], include_usage: bool, continuous_usage: bool
) -> AsyncIterator[str]:
    chunk_obj = reply.object + ".chunk" if reply.object == "chat.completion" else reply.object
    usage = Usage()
    async with contextlib.aclosing(items):
        for choice in reply.choices:
            opening = choice.start()
            if opening is not None:
                yield sse(reply.envelope(chunk_obj, choices=[opening]))
        async for item in items:
            if isinstance(item, APIError):
                yield sse(error_body(item.status, item.message, item.param, item.code))
                break
            usage.add(item, reply.prompt_of[item.index])
            out = reply.choices[item.index].on_event(item)
            if out is not None:
                chunk = reply.envelope(chunk_obj, choices=[out])
                if continuous_usage:
                    chunk["usage"] = usage.to_dict(item.index, reply.prompt_of[item.index])
                yield sse(chunk)
        else:
            if include_usage:
                yield sse(reply.envelope(chunk_obj, choices=[], usage=usage.to_dict()))
        yield DONE
