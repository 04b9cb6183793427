"""What the routes share: the engine client, tokenizer, metrics and the serving settings."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from fastapi import Request

from dsv4serve.api.engine import Engine
from dsv4serve.api.errors import APIError, bad_request
from dsv4serve.api.metrics import Metrics
from dsv4serve.api.protocol import _Model
from dsv4serve.api.tokenizer import TextTokenizer
from dsv4serve.ipc.messages import Ready

log = logging.getLogger("dsv4serve.api")
TEXT_WORKERS = 4  # threads rendering / tokenizing prompts; the tokenizer releases the GIL while it encodes
PARSE_ON_LOOP_BYTES = 256 * 1024  # bodies from this size on are parsed off the event loop
R = TypeVar("R")


@dataclass
class ServeOptions:
    served_model_name: str
    default_thinking: bool = True
    api_key: str | None = None
    max_request_bytes: int | None = None  # None: no limit (tests); `serve` always sets one


@dataclass
class AppState:
    engine: Engine  # supervisor.EngineClient, or a test double with the same surface
    tokenizer: TextTokenizer
    options: ServeOptions
    metrics: Metrics
    created: int = 0
    inflight: set[str] = field(default_factory=set)  # engine request ids being generated
    _unknown_seen: set[str] = field(default_factory=set)
    # prompt rendering and tokenization run here, never on the event loop: a long prompt takes seconds
    # to tokenize, and meanwhile /health and every stream must keep answering
    text_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=TEXT_WORKERS, thread_name_prefix="dsv4serve-text")
    )

    async def off_loop(self, fn: Callable[..., R], *args: object) -> R:
        """fn(*args) on the text pool (a bounded thread pool), awaited without blocking the loop."""
        return await asyncio.get_running_loop().run_in_executor(self.text_pool, fn, *args)

    def abort_all(self) -> None:
        """On shutdown: every running request ends with finish_reason "abort" (not a cut stream)."""
        for request_id in list(self.inflight):
            self.engine.abort(request_id)

    def note_unknown(self, names: list[str]) -> None:
        """Unknown request fields are ignored, and logged once per name."""
        for name in names:
            if name not in self._unknown_seen:
                self._unknown_seen.add(name)
                log.warning("ignoring unknown request field %r (logged once)", name)

    def ready(self) -> Ready:
        """The worker's Ready message; 503 while none is ready."""
        info = self.engine.ready_info
        if not self.engine.healthy or info is None:
            raise APIError(503, "the model worker is not ready (starting or restarting); retry shortly")
        return info


def get_state(request: Request) -> AppState:
    return request.app.state.dsv4


def parse_json(raw: bytes) -> dict:
    """The body as a JSON object; anything else is a 400 (never a 422)."""
    try:
        body = json.loads(raw)
        # a lone surrogate (`"\ud800"`) decodes, but no tokenizer can take it
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except (ValueError, UnicodeError, RecursionError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


async def read_json(request: Request) -> dict:
    """The body as a JSON object; a large one is parsed on the text pool (tens of ms for a few MB, which
    the event loop must not stall for)."""
    raw = await request.body()
    if len(raw) < PARSE_ON_LOOP_BYTES:
        return parse_json(raw)
    return await get_state(request).off_loop(parse_json, raw)


M = TypeVar("M", bound=_Model)


async def read_request(request: Request, model: type[M]) -> tuple[AppState, M]:
    """The app state and the body validated as `model`; unknown fields are noted (logged once)."""
    state = get_state(request)
    req = model.model_validate(await read_json(request))
    state.note_unknown(req.unknown_fields())
    return state, req
