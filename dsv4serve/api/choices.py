"""Choice builders: engine events -> the OpenAI choice dicts of chat and text completions."""

from __future__ import annotations

from dsv4serve.api.generation import ChoiceEvent
from dsv4serve.api.tokenizer import TextTokenizer
from dsv4serve.chat import StreamParser, ToolCall
from dsv4serve.ipc.messages import TokenOut

NO_LOGPROB = -9999.0  # vLLM's stand-in where a logprob is missing (never expected)


def _lp(value: float | None) -> float:
    return NO_LOGPROB if value is None else max(float(value), NO_LOGPROB)


class ChatChoice:
    """One chat choice: reasoning, content and tool calls split by the DSV4 stream parser."""

    def __init__(self, index: int, tokenizer: TextTokenizer, opens_reasoning: bool, logprobs: bool):
        self.index = index
        self._tok = tokenizer
        self._parser = StreamParser(opens_reasoning)
        self._thinking = opens_reasoning
        self._logprobs = logprobs
        self.reasoning, self.content = "", ""
        self.tool_calls: list[ToolCall] = []
        self.logprob_entries: list[dict] = []
        self.finish_reason: str | None = None

    def start(self) -> dict:
        return {
            "index": self.index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }

    def _entry(self, token_id: int, logprob: float | None) -> dict:
        text = self._tok.token_text(token_id)
        return {"token": text, "logprob": _lp(logprob), "bytes": list(text.encode("utf-8"))}

    def _logprobs_of(self, tokens: list[TokenOut]) -> list[dict]:
        entries = []
        for t in tokens:
            entry = self._entry(t.token_id, t.logprob)
            entry["top_logprobs"] = [self._entry(a.token_id, a.logprob) for a in (t.top or [])]
            entries.append(entry)
        return entries

    def on_event(self, event: ChoiceEvent) -> dict | None:
        parsed = self._parser.feed(event.text)
        if event.finish_reason is not None:
            last = self._parser.finish()
            parsed.reasoning += last.reasoning
            parsed.content += last.content
            parsed.tool_calls += last.tool_calls
            self.finish_reason = self._parser.finish_reason(event.finish_reason)
        delta: dict = {}
        if parsed.reasoning:
            delta["reasoning_content"] = delta["reasoning"] = parsed.reasoning
            self.reasoning += parsed.reasoning
        if parsed.content:
            delta["content"] = parsed.content
            self.content += parsed.content
        if parsed.tool_calls:
            delta["tool_calls"] = [{"index": c.index, **c.to_openai()} for c in parsed.tool_calls]
            self.tool_calls += parsed.tool_calls
        entries = self._logprobs_of(event.tokens) if self._logprobs else []
        self.logprob_entries += entries
        if not delta and not entries and event.finish_reason is None:
            return None
        return {
            "index": self.index,
            "delta": delta,
            "logprobs": {"content": entries} if self._logprobs else None,
            "finish_reason": self.finish_reason,
        }

    def result(self) -> dict:
        message = {
            "role": "assistant",
            "content": self.content if (self.content or not self.tool_calls) else None,
            "reasoning_content": self.reasoning if self._thinking else None,
            "reasoning": self.reasoning if self._thinking else None,
            "tool_calls": [c.to_openai() for c in self.tool_calls],
        }
        return {
            "index": self.index,
            "message": message,
            "logprobs": {"content": self.logprob_entries} if self._logprobs else None,
            "finish_reason": self.finish_reason,
            "stop_reason": None,
        }


class TextChoice:
    """One text-completion choice (legacy logprobs: tokens, token_logprobs, top_logprobs, text_offset)."""

    def __init__(
        self,
        index: int,
        tokenizer: TextTokenizer,
        logprobs: int | None,
        echo_text: str = "",
        echo_ids: list[int] | None = None,
    ):
        self.index = index
        self._tok = tokenizer
        self._logprobs = logprobs
        self._pending_echo = echo_text
        self._echo_ids = echo_ids
        self.text = ""
        self.finish_reason: str | None = None
        self._lp: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        self._offset = len(echo_text)

    def start(self) -> None:
        return None

    def _add_logprobs(self, tokens: list[TokenOut], into: dict) -> None:
        for t in tokens:
            text = self._tok.token_text(t.token_id)
            into["tokens"].append(text)
            into["token_logprobs"].append(_lp(t.logprob))
            top = {self._tok.token_text(a.token_id): _lp(a.logprob) for a in (t.top or [])}
            into["top_logprobs"].append(top)
            into["text_offset"].append(self._offset)
            self._offset += len(text)

    def _add_prompt_logprobs(self, entries: list[TokenOut | None], into: dict) -> None:
        """The echoed prompt's tokens with their logprobs (the first has none), as vLLM returns them."""
        ids, self._echo_ids = self._echo_ids or [], None
        self._offset = 0
        for token_id, entry in zip(ids, entries):
            text = self._tok.token_text(token_id)
            into["tokens"].append(text)
            into["token_logprobs"].append(None if entry is None else _lp(entry.logprob))
            into["top_logprobs"].append(
                None if entry is None else {self._tok.token_text(a.token_id): _lp(a.logprob) for a in (entry.top or [])}
            )
            into["text_offset"].append(self._offset)
            self._offset += len(text)

    def on_event(self, event: ChoiceEvent) -> dict | None:
        text = self._pending_echo + event.text
        self._pending_echo = ""
        self.text += text
        if event.finish_reason is not None:
            self.finish_reason = event.finish_reason
        step: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        if self._logprobs is not None and self._echo_ids is not None and event.prompt_logprobs is not None:
            self._add_prompt_logprobs(event.prompt_logprobs, step)
        if self._logprobs is not None:
            self._add_logprobs(event.tokens, step)
            for key, values in step.items():
                self._lp[key] += values
        if not text and not step["tokens"] and event.finish_reason is None:
            return None
        return {
            "index": self.index,
            "text": text,
            "logprobs": step if self._logprobs is not None else None,
            "finish_reason": self.finish_reason,
            "stop_reason": None,
        }

    def result(self) -> dict:
        return {
            "index": self.index,
            "text": self.text,
            "logprobs": self._lp if self._logprobs is not None else None,
            "finish_reason": self.finish_reason,
            "stop_reason": None,
        }
