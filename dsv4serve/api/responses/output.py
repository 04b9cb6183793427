"""A Responses API response assembled from a chat choice's deltas: output items, and while streaming the
events that build them (each with its `sequence_number`).

    response.created, response.in_progress,
    per item: response.output_item.added -> (its deltas) -> response.output_item.done
      reasoning      response.reasoning_text.delta* / .done
      message        response.content_part.added, response.output_text.delta* / .done, response.content_part.done
      function_call  response.function_call_arguments.delta / .done (a DSML call is parsed whole)
    response.completed, or response.incomplete (max_output_tokens)
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from dsv4serve.api.single_choice import ChoiceEnd


def sse_event(obj: dict[str, Any]) -> str:
    return f"event: {obj['type']}\ndata: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseAssembler:
    def __init__(self, response_id: str, model: str, echo: dict[str, Any], input_tokens: int):
        self.id, self.model, self.echo, self.input_tokens = response_id, model, echo, input_tokens
        self.created_at = int(time.time())
        self.items: list[dict[str, Any]] = []
        self._open: str | None = None  # "reasoning" | "message": the item whose text is streaming
        self._seq = 0

    def _ev(self, kind: str, **fields: Any) -> dict[str, Any]:
        self._seq += 1
        return {"type": f"response.{kind}", "sequence_number": self._seq - 1, **fields}

    def response(self, status: str, usage: dict | None = None, incomplete: str | None = None) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "model": self.model,
            "output": [dict(item) for item in self.items],
            "usage": usage,
            "store": False,
            "previous_response_id": None,
            **self.echo,
        }

    def start(self) -> list[dict]:
        snapshot = self.response("in_progress")
        return [self._ev("created", response=snapshot), self._ev("in_progress", response=snapshot)]

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def _close(self, status: str = "completed") -> list[dict]:
        kind, self._open = self._open, None
        if kind is None:
            return []
        item = self.items[-1]
        item["status"] = status
        if kind == "reasoning":
            text = item["content"][0]["text"]
            events = [self._ev("reasoning_text.done", **self._where(), content_index=0, text=text)]
        else:
            part = item["content"][0]
            events = [
                self._ev("output_text.done", **self._where(), content_index=0, text=part["text"], logprobs=[]),
                self._ev("content_part.done", **self._where(), content_index=0, part=dict(part)),
            ]
        return events + [self._ev("output_item.done", output_index=len(self.items) - 1, item=item)]

    def _open_item(self, kind: str) -> list[dict]:
        events = self._close()
        item: dict[str, Any]
        if kind == "reasoning":
            item = {"id": item_id("rs"), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
        else:
            item = {
                "id": item_id("msg"),
                "type": "message",
                "role": "assistant",
                "status": "in_progress",
                "content": [],
            }
        self.items.append(item)
        self._open = kind
        events.append(
            self._ev("output_item.added", output_index=len(self.items) - 1, item=json.loads(json.dumps(item)))
        )
        if kind == "reasoning":
            item["content"].append({"type": "reasoning_text", "text": ""})
        else:
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item["content"].append(part)
            events.append(self._ev("content_part.added", **self._where(), content_index=0, part=dict(part)))
        return events

    def _text(self, kind: str, text: str) -> list[dict]:
        events = self._open_item(kind) if self._open != kind else []
        self.items[-1]["content"][0]["text"] += text
        name = "reasoning_text.delta" if kind == "reasoning" else "output_text.delta"
        extra: dict[str, Any] = {} if kind == "reasoning" else {"logprobs": []}
        return events + [self._ev(name, **self._where(), content_index=0, delta=text, **extra)]

    def _call(self, call: dict[str, Any]) -> list[dict]:
        events = self._close()
        fn = call["function"]
        item = {"id": item_id("fc"), "type": "function_call", "call_id": call["id"], "name": fn["name"]}
        self.items.append({**item, "arguments": fn["arguments"], "status": "completed"})
        at = {"item_id": item["id"], "output_index": len(self.items) - 1}
        return events + [
            self._ev(
                "output_item.added",
                output_index=at["output_index"],
                item={**item, "arguments": "", "status": "in_progress"},
            ),
            self._ev("function_call_arguments.delta", **at, delta=fn["arguments"]),
            self._ev("function_call_arguments.done", **at, name=fn["name"], arguments=fn["arguments"]),
            self._ev("output_item.done", output_index=at["output_index"], item=dict(self.items[-1])),
        ]

    def on_delta(self, delta: dict[str, Any]) -> list[dict]:
        events = []
        if delta.get("reasoning"):
            events += self._text("reasoning", delta["reasoning"])
        if delta.get("content"):
            events += self._text("message", delta["content"])
        for call in delta.get("tool_calls") or ():
            events += self._call(call)
        return events

    def _usage(self, output_tokens: int, cached_tokens: int) -> dict[str, Any]:
        return {
            "input_tokens": self.input_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": self.input_tokens + output_tokens,
        }

    def finish(self, end: ChoiceEnd) -> tuple[list[dict], dict]:
        """The closing events, and the final response object (what a non-streamed reply is)."""
        cut = end.finish_reason == "length"
        events = self._close("incomplete" if cut else "completed")
        usage = self._usage(end.num_output_tokens, end.num_cached_tokens)
        final = self.response("incomplete" if cut else "completed", usage, "max_output_tokens" if cut else None)
        return events + [self._ev("incomplete" if cut else "completed", response=final)], final
