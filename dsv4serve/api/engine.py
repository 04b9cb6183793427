"""What the API process needs from the engine: the surface of supervisor.EngineClient, as a Protocol
(tests drive the routes with scripted doubles of the same surface)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from dsv4serve.ipc.messages import Ready, RequestOutput, Stats
from dsv4serve.ipc.sampling import SamplingParams


class Engine(Protocol):
    @property
    def healthy(self) -> bool:
        """A worker is ready and the engine is not shutting down (/health answers 200)."""
        ...

    @property
    def ready_info(self) -> Ready | None:
        """What the current worker allocated; None while none is ready."""
        ...

    stats: Stats | None  # the worker's latest Stats message
    worker_restarts_total: int

    def generate(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; closing the iterator early aborts the request. Raises
        supervisor.EngineUnavailable, RequestRejected or RequestFailed."""
        ...

    def abort(self, request_id: str) -> None: ...
