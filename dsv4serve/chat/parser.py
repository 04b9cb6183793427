"""Splitting model output into reasoning, content and tool calls, as it streams.

The output of one assistant turn reads `{reasoning}</think>{content}\n\n<｜DSML｜tool_calls>...`
(thinking mode) or `{content}...` (chat mode); see DeepSeek's `parse_message_from_completion_text`
and vLLM's deepseek_v4 reasoning and tool parsers. Text arrives in arbitrary pieces, so any tail
that could still grow into a marker is held back until the next piece decides it; the result never
depends on where the pieces were cut, and no markup reaches reasoning or content.

- Reasoning ends at `</think>`, or at a tool-call block the model opened without closing its
  reasoning (vLLM moves such a block out of reasoning too).
- Content ends at the tool-call block; the blank line the format puts before it is not content.
- Each complete `<｜DSML｜invoke>` becomes one tool call, emitted whole (name + arguments JSON).
- After `</｜DSML｜tool_calls>` or EOS nothing more is read (the format allows only EOS there).
- Stray `<think>` / `</think>` where they cannot belong are dropped.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

from dsv4serve.chat import tokens as T
from dsv4serve.chat.tools import parse_invoke

_REASONING, _CONTENT, _TOOLS, _DONE = "reasoning", "content", "tools", "done"

# Markers looked for in each text state, and the state each leads to. A marker that keeps the
# state is dropped from the text. At one position the longest marker wins ("\n\n" + block start).
_TEXT_MARKERS = {
    _REASONING: {
        T.THINK_END: _CONTENT,
        "\n\n" + T.TOOL_CALLS_START: _TOOLS,
        T.TOOL_CALLS_START: _TOOLS,
        T.EOS: _DONE,
        T.THINK_START: _REASONING,
    },
    _CONTENT: {
        "\n\n" + T.TOOL_CALLS_START: _TOOLS,
        T.TOOL_CALLS_START: _TOOLS,
        T.EOS: _DONE,
        T.THINK_START: _CONTENT,
        T.THINK_END: _CONTENT,
    },
}
# In a tool-call block: the end of one invoke (a call is complete), of the block, or EOS.
_TOOL_MARKERS = (T.INVOKE_END, T.TOOL_CALLS_END, T.EOS)
_TOOL_MARKER_MAX = max(len(m) for m in _TOOL_MARKERS)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass
class ToolCall:
    index: int  # position among this choice's calls (OpenAI delta.tool_calls[].index)
    id: str
    name: str
    arguments: str  # a JSON object, as text

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParserDelta:
    """What one piece of output added: reasoning text, content text, finished tool calls."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


def _held_tail(text: str, markers) -> int:
    """Length of the longest end of `text` that is a proper prefix of some marker."""
    for size in range(min(len(text), max(len(m) for m in markers) - 1), 0, -1):
        tail = text[-size:]
        if any(m.startswith(tail) for m in markers):
            return size
    return 0


def _first_marker(text: str, markers) -> tuple[int, str | None]:
    best_pos, best = len(text), None
    for marker in markers:
        pos = text.find(marker)
        if pos != -1 and (pos < best_pos or (pos == best_pos and len(marker) > len(best or ""))):
            best_pos, best = pos, marker
    return best_pos, best


class StreamParser:
    """Feed decoded text pieces with feed(); call finish() once at the end of generation.

    `thinking`: whether the prompt ended in `<think>`, i.e. the output starts as reasoning.
    `id_factory`: makes tool-call ids (`call_<random hex>` by default; injectable for tests).
    """

    def __init__(self, thinking: bool, id_factory: Callable[[], str] | None = None):
        self._state = _REASONING if thinking else _CONTENT
        self._pending = ""
        self._scanned = 0  # in a tool block: where in _pending the marker search resumes
        self._new_id = id_factory or new_call_id
        self.tool_calls: list[ToolCall] = []

    def feed(self, text: str) -> ParserDelta:
        delta = ParserDelta()
        self._pending += text
        while self._pending and self._state != _DONE:
            progressed = self._step_tools(delta) if self._state == _TOOLS else self._step_text(delta)
            if not progressed:
                break
        if self._state == _DONE:
            self._pending = ""
        return delta

    def finish(self) -> ParserDelta:
        """Release what was held back: a partial marker that turned out to be text becomes text,
        except an unfinished special-token marker (it has the full-width bar), which is dropped;
        an unfinished invoke is dropped."""
        delta = ParserDelta()
        if self._state in _TEXT_MARKERS and "｜" not in self._pending:
            self._emit_text(delta, self._pending)
        self._pending = ""
        self._state = _DONE
        return delta

    def finish_reason(self, reason: str) -> str:
        """The choice's finish reason: `tool_calls` instead of `stop` once calls were emitted."""
        return "tool_calls" if self.tool_calls and reason == "stop" else reason

    def _emit_text(self, delta: ParserDelta, text: str) -> None:
        if self._state == _REASONING:
            delta.reasoning += text
        else:
            delta.content += text

    def _step_text(self, delta: ParserDelta) -> bool:
        markers = _TEXT_MARKERS[self._state]
        pos, marker = _first_marker(self._pending, markers)
        if marker is None:
            keep = _held_tail(self._pending, markers)
            self._emit_text(delta, self._pending[: len(self._pending) - keep])
            self._pending = self._pending[len(self._pending) - keep :]
            return False
        self._emit_text(delta, self._pending[:pos])
        self._pending = self._pending[pos + len(marker) :]
        self._state = markers[marker]
        return True

    def _step_tools(self, delta: ParserDelta) -> bool:
        # Only the new end of the buffer can complete a marker: skip what was already searched,
        # so a long argument fed token by token is not rescanned from its start every time.
        start = self._scanned
        pos, marker = _first_marker(self._pending[start:], _TOOL_MARKERS)
        if marker is None:
            self._scanned = max(0, len(self._pending) - _TOOL_MARKER_MAX + 1)
            return False
        pos += start
        if marker != T.EOS:  # at EOS an unfinished invoke is dropped, not guessed at
            self._add_call(delta, self._pending[:pos])
        self._pending = self._pending[pos + len(marker) :]
        self._scanned = 0
        if marker != T.INVOKE_END:
            self._state = _DONE
        return True

    def _add_call(self, delta: ParserDelta, segment: str) -> None:
        parsed = parse_invoke(segment)
        if parsed is None:  # whitespace between invokes, or a malformed invoke: nothing to call
            return
        call = ToolCall(len(self.tool_calls), self._new_id(), parsed[0], parsed[1])
        self.tool_calls.append(call)
        delta.tool_calls.append(call)


@dataclass
class ParsedCompletion:
    reasoning: str
    content: str
    tool_calls: list[ToolCall]


def parse_completion(text: str, thinking: bool, id_factory: Callable[[], str] | None = None) -> ParsedCompletion:
    """The whole output of one assistant turn, split (the same rules as streaming)."""
    parser = StreamParser(thinking, id_factory)
    first, last = parser.feed(text), parser.finish()
    return ParsedCompletion(first.reasoning + last.reasoning, first.content + last.content, parser.tool_calls)
