"""What the routes share: the engine client, tokenizer, metrics and the serving settings."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import TypeVar

from fastapi import Request

from dsv4serve.api.errors import APIError, bad_request
from dsv4serve.api.metrics import Metrics
from dsv4serve.api.tokenizer import TextTokenizer

log = logging.getLogger("dsv4serve.api")


@dataclass
class ServeOptions:
    served_model_name: str
    default_thinking: bool = True
    api_key: str | None = None


@dataclass
class AppState:
    engine: object  # EngineClient (or a test double with the same surface)
    tokenizer: TextTokenizer
    options: ServeOptions
    metrics: Metrics
    created: int = 0
    inflight: set[str] = field(default_factory=set)  # engine request ids being generated
    _unknown_seen: set[str] = field(default_factory=set)

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

    def ready(self):
        """The worker's Ready message; 503 while none is ready."""
        info = self.engine.ready_info
        if not self.engine.healthy or info is None:
            raise APIError(503, "the model worker is not ready (starting or restarting); retry shortly")
        return info


def get_state(request: Request) -> AppState:
    return request.app.state.dsv4


async def read_json(request: Request) -> dict:
    """The body as a JSON object; anything else is a 400 (never a 422)."""
    raw = await request.body()
    try:
        body = json.loads(raw)
        # a lone surrogate (`"\ud800"`) decodes, but no tokenizer can take it
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except (ValueError, UnicodeError, RecursionError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


M = TypeVar("M")


async def read_request(request: Request, model: type[M]) -> tuple[AppState, M]:
    """The app state and the body validated as `model`; unknown fields are noted (logged once)."""
    state = get_state(request)
    req = model.model_validate(await read_json(request))
    state.note_unknown(req.unknown_fields())
    return state, req
