"""One choice of a completion: engine outputs -> text pieces, with stop strings and metrics.

`run_choice` drives one engine request and yields `ChoiceEvent`s holding the new text (raw model
text, before the chat parser), the new tokens (for logprobs) and, last, the finish reason. Stop
strings are matched on the text; a possible partial match is held back, so it never leaks into a
stream. `fan_in` merges the choices of a request and aborts them all (closing their engine
generators) when the client goes away or the consumer stops early.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field

from dsv4serve.api.detokenize import IncrementalDetokenizer
from dsv4serve.api.errors import APIError
from dsv4serve.ipc.messages import TokenOut
from dsv4serve.ipc.sampling import SamplingParams
from dsv4serve.supervisor import EngineUnavailable, RequestFailed, RequestRejected

DISCONNECT_POLL_S = 0.5
log = logging.getLogger("dsv4serve.api")


@dataclass
class ChoiceSpec:
    index: int
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    stop: tuple[str, ...] = ()
    include_stop_str: bool = False
    skip_special_tokens: bool = True


@dataclass
class ChoiceEvent:
    index: int
    text: str = ""
    tokens: list[TokenOut] = field(default_factory=list)
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0  # so far
    prompt_logprobs: list[TokenOut | None] | None = None  # with the first event, when asked for
    stop_str: str | None = None  # the stop string that ended the choice (Anthropic's stop_sequence)


class StopStrings:
    """Cuts the text at the first stop string; holds back a tail that could start one."""

    def __init__(self, stops: tuple[str, ...], include: bool):
        self._stops = tuple(s for s in stops if s)
        self._include = include
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._pending = ""
        self.matched: str | None = None  # the stop string found, once found

    def push(self, text: str) -> tuple[str, bool]:
        """(text that is safe to emit, whether a stop string was found)."""
        if not self._stops:
            return text, False
        self._pending += text
        best = None
        for stop in self._stops:
            pos = self._pending.find(stop)
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, stop)
        if best is not None:
            end = best[0] + (len(best[1]) if self._include else 0)
            out, self._pending = self._pending[:end], ""
            self.matched = best[1]
            return out, True
        keep = min(self._hold, len(self._pending))
        cut = len(self._pending) - keep
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return out


def _engine_error(exc: Exception) -> APIError:
    if isinstance(exc, RequestRejected):
        return APIError(exc.status, str(exc), code=None)
    if isinstance(exc, RequestFailed):
        return APIError(503, f"{exc}; retry the request")
    return APIError(503, str(exc) or "the engine is not ready")


def _ends_on_stop_token(spec: ChoiceSpec, token_id: int, eos_token_id: int) -> bool:
    s = spec.sampling
    if token_id in s.stop_token_ids:
        return not spec.include_stop_str
    return token_id == eos_token_id and not s.ignore_eos


async def run_choice(app_state, spec: ChoiceSpec) -> AsyncIterator[ChoiceEvent]:
    """Raises APIError for engine failures (queue full, worker died, not ready)."""
    engine, metrics = app_state.engine, app_state.metrics
    eos = engine.ready_info.eos_token_id if engine.ready_info else -1
    detok = IncrementalDetokenizer(app_state.tokenizer, spec.skip_special_tokens)
    stops = StopStrings(spec.stop, spec.include_stop_str)
    start = last = time.monotonic()
    num_out, num_prompt, reason = 0, len(spec.prompt_ids), None
    app_state.inflight.add(spec.request_id)
    try:
        gen = engine.generate(spec.request_id, spec.prompt_ids, spec.sampling)
        async with contextlib.aclosing(gen):
            async for out in gen:
                if out.error is not None or out.finish_reason == "error":  # the worker failed it, not the input
                    raise APIError(503, out.error or "the worker could not finish the request; retry it")
                now = time.monotonic()
                num_prompt = out.num_prompt_tokens
                if out.tokens:
                    if num_out == 0:
                        metrics.ttft.observe(now - start)
                    else:
                        for _ in out.tokens:
                            metrics.itl.observe((now - last) / len(out.tokens))
                    last = now
                num_out += len(out.tokens)
                ids = [t.token_id for t in out.tokens]
                if out.finish_reason == "stop" and ids and _ends_on_stop_token(spec, ids[-1], eos):
                    ids = ids[:-1]
                text, matched = stops.push(detok.push(ids))
                reason = "stop" if matched else out.finish_reason
                if reason is not None and not matched:  # the end: release what was held back
                    tail, matched = stops.push(detok.flush())
                    text += tail if matched else tail + stops.flush()
                    reason = "stop" if matched else reason
                yield ChoiceEvent(
                    spec.index,
                    text,
                    list(out.tokens),
                    reason,
                    num_prompt,
                    out.num_cached_tokens,
                    num_out,
                    out.prompt_logprobs,
                    stops.matched,
                )
                if reason is not None:
                    break  # a stop string: closing the generator aborts the engine request
    except (EngineUnavailable, RequestRejected, RequestFailed) as exc:
        raise _engine_error(exc) from exc
    except APIError:
        raise
    except Exception as exc:  # never a 500 or a hung stream: an engine bug still ends the request
        log.exception("request %s failed: %s", spec.request_id, exc)
        raise APIError(503, f"the request failed in the engine: {exc}") from exc
    finally:
        app_state.inflight.discard(spec.request_id)
        if reason is not None:
            metrics.e2e.observe(time.monotonic() - start)
            metrics.prompt_tokens.inc(num_prompt)
            metrics.generation_tokens.inc(num_out)
            metrics.request_success.labels(finished_reason=reason).inc()


async def fan_in(app_state, specs: list[ChoiceSpec], request=None) -> AsyncGenerator[ChoiceEvent | APIError, None]:
    """Events of all choices as they come; an engine failure comes as an APIError item (and ends
    that choice). Stopping early, or a client disconnect, cancels every choice (aborting it)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(spec: ChoiceSpec) -> None:
        try:
            async for event in run_choice(app_state, spec):
                queue.put_nowait(event)
        except APIError as exc:
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(None)

    tasks = [asyncio.create_task(pump(s)) for s in specs]
    try:
        remaining, next_poll = len(tasks), time.monotonic() + DISCONNECT_POLL_S
        while remaining:
            try:
                item = await asyncio.wait_for(queue.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                item = False
            if request is not None and time.monotonic() >= next_poll:
                next_poll = time.monotonic() + DISCONNECT_POLL_S
                if await request.is_disconnected():
                    return
            if item is None:
                remaining -= 1
            elif item is not False:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
