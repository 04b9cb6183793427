"""One-choice APIs (Anthropic Messages, OpenAI Responses) on the chat machinery: the chat choice parses
the output into reasoning / content / tool-call deltas, and the API's assembler turns those into its own
objects and events. This module drives both, streamed or not."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi.responses import JSONResponse

from dsv4serve.api.chat_routes import PreparedChat
from dsv4serve.api.choices import ChatChoice
from dsv4serve.api.errors import APIError
from dsv4serve.api.generation import ChoiceEvent
from dsv4serve.api.streaming import chain, collect, open_stream


@dataclass(frozen=True)
class ChoiceEnd:
    finish_reason: str | None  # stop | length | tool_calls | abort
    stop_str: str | None  # the stop string that ended it
    num_output_tokens: int
    num_cached_tokens: int


class Assembler(Protocol):
    def start(self) -> list[dict]: ...  # the opening events
    def on_delta(self, delta: dict[str, Any]) -> list[dict]: ...  # events for one chat delta
    def finish(self, end: ChoiceEnd) -> tuple[list[dict], dict]: ...  # closing events, the whole object


class _Driver:
    def __init__(self, choice: ChatChoice, assembler: Assembler):
        self.choice, self.assembler = choice, assembler
        self.last: ChoiceEvent | None = None

    def on_event(self, item: ChoiceEvent) -> list[dict]:
        self.last = item
        out = self.choice.on_event(item)
        return self.assembler.on_delta(out["delta"]) if out is not None else []

    def finish(self) -> tuple[list[dict], dict]:
        last = self.last
        end = ChoiceEnd(
            self.choice.finish_reason,
            last.stop_str if last else None,
            last.num_output_tokens if last else 0,
            last.num_cached_tokens if last else 0,
        )
        return self.assembler.finish(end)

    async def body(
        self,
        items: AsyncGenerator[ChoiceEvent | APIError, None],
        frame: Callable[[dict], str],
        error_frame: Callable[[APIError], str],
    ) -> AsyncIterator[str]:
        async with contextlib.aclosing(items):
            for e in self.assembler.start():
                yield frame(e)
            async for item in items:
                if isinstance(item, APIError):
                    yield error_frame(item)
                    return
                for e in self.on_event(item):
                    yield frame(e)
            for e in self.finish()[0]:
                yield frame(e)


async def answer(
    state,
    request,
    prepared: PreparedChat,
    assembler: Assembler,
    stream: bool,
    frame: Callable[[dict], str],
    error_frame: Callable[[APIError], str],
):
    """The whole object as JSON, or (stream) the assembler's events framed by `frame`."""
    driver = _Driver(ChatChoice(0, state.tokenizer, prepared.opens_reasoning, False), assembler)
    if not stream:
        await collect(state, request, prepared.specs, driver.on_event)
        return JSONResponse(driver.finish()[1])

    def body(first: ChoiceEvent, events: AsyncGenerator) -> AsyncIterator[str]:
        return driver.body(chain(first, events), frame, error_frame)

    return await open_stream(state, request, prepared.specs, body)
