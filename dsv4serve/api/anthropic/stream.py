"""An Anthropic message assembled from a chat choice's deltas: content blocks, and while streaming the
events that build them.

    message_start -> (content_block_start -> content_block_delta* -> content_block_stop)* ->
    message_delta (stop_reason, stop_sequence, usage) -> message_stop

Reasoning becomes a `thinking` block (thinking_delta), content a `text` block (text_delta), each tool
call a `tool_use` block whose input arrives as one input_json_delta (the DSML parser emits a call
whole). Events are framed `event: <type>\\ndata: <json>\\n\\n`, as Anthropic's API frames them.
"""

from __future__ import annotations

import json
from typing import Any

from dsv4serve.api.errors import anthropic_error_body
from dsv4serve.api.single_choice import ChoiceEnd

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}


def event(obj: dict[str, Any]) -> str:
    return f"event: {obj['type']}\ndata: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"


def error_event(status: int, message: str) -> str:
    return event(anthropic_error_body(status, message))


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def stop_reason(finish_reason: str | None, stop_str: str | None) -> str:
    if finish_reason == "stop" and stop_str is not None:
        return "stop_sequence"
    return STOP_REASONS.get(finish_reason or "stop", "end_turn")


class MessageAssembler:
    def __init__(self, message_id: str, model: str, input_tokens: int):
        self.id, self.model, self.input_tokens = message_id, model, input_tokens
        self.blocks: list[dict[str, Any]] = []
        self._open: str | None = None  # the type of the block being written (streaming)

    def _envelope(self, content: list, stop: str | None, stop_str: str | None, output_tokens: int) -> dict:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop,
            "stop_sequence": stop_str,
            "usage": {"input_tokens": self.input_tokens, "output_tokens": output_tokens},
        }

    def start(self) -> list[dict]:
        return [{"type": "message_start", "message": self._envelope([], None, None, 0)}]

    def _close(self) -> list[dict]:
        if self._open is None:
            return []
        self._open = None
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]

    def _text(self, kind: str, text: str) -> list[dict]:
        """Text for a thinking or text block, opening one when another kind is open."""
        events = []
        field = "thinking" if kind == "thinking" else "text"
        if self._open != kind:
            events += self._close()
            block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else {"type": "text"}
            block[field] = ""
            self.blocks.append(block)
            self._open = kind
            events.append({"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": dict(block)})
        self.blocks[-1][field] += text
        delta = {"type": f"{field}_delta", field: text}
        return events + [{"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}]

    def _tool_use(self, call: dict[str, Any]) -> list[dict]:
        events = self._close()
        fn = call["function"]
        block = {"type": "tool_use", "id": tool_use_id(call["id"]), "name": fn["name"], "input": {}}
        index = len(self.blocks)
        self.blocks.append({**block, "input": json.loads(fn["arguments"])})
        delta = {"type": "input_json_delta", "partial_json": fn["arguments"]}
        return events + [
            {"type": "content_block_start", "index": index, "content_block": block},
            {"type": "content_block_delta", "index": index, "delta": delta},
            {"type": "content_block_stop", "index": index},
        ]

    def on_delta(self, delta: dict[str, Any]) -> list[dict]:
        """The events for one chat delta (reasoning, content, finished tool calls)."""
        events = []
        if delta.get("reasoning"):
            events += self._text("thinking", delta["reasoning"])
        if delta.get("content"):
            events += self._text("text", delta["content"])
        for call in delta.get("tool_calls") or ():
            events += self._tool_use(call)
        return events

    def finish(self, end: ChoiceEnd) -> tuple[list[dict], dict]:
        """The closing events, and the whole message (what a non-streamed reply is)."""
        stop = stop_reason(end.finish_reason, end.stop_str)
        delta = {"stop_reason": stop, "stop_sequence": end.stop_str}
        events = self._close() + [
            {"type": "message_delta", "delta": delta, "usage": {"output_tokens": end.num_output_tokens}},
            {"type": "message_stop"},
        ]
        return events, self._envelope(self.blocks, stop, end.stop_str, end.num_output_tokens)
