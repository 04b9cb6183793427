"""Anthropic Messages requests, checked and translated into a chat completion request.

What the official `anthropic` SDK and Claude Code send: a system prompt (a string or text blocks),
user / assistant turns whose content is a string or blocks (`text`, `thinking`, `tool_use`,
`tool_result`), `tools` with an `input_schema`, `tool_choice` auto / any / tool / none, `thinking`
enabled / disabled (its token budget picks the reasoning effort), `stop_sequences`, temperature /
top_p / top_k. The translation gives the DSV4 prompt exactly what an OpenAI request with the same
conversation would: tool_use blocks become assistant tool calls, tool_result blocks tool messages.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import StrictInt, StrictStr

from dsv4serve.api.errors import bad_request
from dsv4serve.api.protocol import ChatCompletionRequest, _Model

# thinking.budget_tokens from which the reply thinks at DeepSeek's "max" effort (Claude Code's
# "ultrathink" asks for 31,999; its plain "think" 4,000)
MAX_EFFORT_BUDGET_TOKENS = 16_384
ANTHROPIC_MAX_TEMPERATURE = 1.0  # Anthropic's documented range is [0, 1]


class MessagesRequest(_Model):
    model: StrictStr | None = None
    messages: list[Any]
    max_tokens: StrictInt | None = None  # required by /v1/messages, not by count_tokens
    system: StrictStr | list[Any] | None = None
    stop_sequences: list[StrictStr] | None = None
    stream: bool | None = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: StrictInt | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None


def _block_text(block: Any, where: str) -> str:
    if isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str):
        return block["text"]
    kind = block.get("type") if isinstance(block, dict) else type(block).__name__
    raise bad_request(f"{where}: a block of type {kind!r} is not supported here (this model reads text)", "messages")


def _text(content: Any, where: str) -> str:
    """A string, or text blocks joined (system prompts, tool results)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}: content must be a string or a list of blocks", "messages")
    return "\n".join(_block_text(b, f"{where}[{j}]") for j, b in enumerate(content))


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad_request(f"{where}: content must be a string or a list of blocks", "messages")
    for j, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise bad_request(f"{where}[{j}]: a content block must be an object with a type", "messages")
    return content


def _user_messages(content: Any, where: str) -> list[dict[str, Any]]:
    """Tool results first (each a tool message, as the DSV4 format orders them), then the text."""
    tools, texts = [], []
    for j, block in enumerate(_blocks(content, where)):
        at = f"{where}[{j}]"
        if block["type"] == "tool_result":
            result = _text(block.get("content"), f"{at}.content")
            if block.get("is_error"):
                result = f"Error: {result}"
            tools.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": result})
        else:
            texts.append(_block_text(block, at))
    return tools + ([{"role": "user", "content": "\n\n".join(texts)}] if texts else [])


def _assistant_message(content: Any, where: str) -> dict[str, Any]:
    text, reasoning, calls = [], [], []
    for j, block in enumerate(_blocks(content, where)):
        kind = block["type"]
        if kind == "text":
            text.append(_block_text(block, f"{where}[{j}]"))
        elif kind == "thinking":
            reasoning.append(str(block.get("thinking") or ""))
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use":
            arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)
            fn = {"name": block.get("name"), "arguments": arguments}
            calls.append({"id": block.get("id"), "type": "function", "function": fn})
        else:
            raise bad_request(f"{where}[{j}]: an assistant block of type {kind!r} is not supported", "messages")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message


def chat_messages(req: MessagesRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if req.system:
        out.append({"role": "system", "content": _text(req.system, "system")})
    for i, msg in enumerate(req.messages):
        where = f"messages[{i}]"
        role = msg.get("role") if isinstance(msg, dict) else None
        if role == "user":
            out += _user_messages(msg.get("content"), f"{where}.content")
        elif role == "assistant":
            out.append(_assistant_message(msg.get("content"), f"{where}.content"))
        else:
            raise bad_request(f"{where}: role must be user or assistant, got {role!r}", "messages")
    return out


def chat_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """Anthropic client tools as OpenAI function tools; server tools (web search, ...) are refused."""
    if not tools:  # Anthropic accepts an empty list: no tools
        return None
    out = []
    for j, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or kind not in (None, "custom") or not isinstance(tool.get("name"), str):
            raise bad_request(f"tools[{j}]: only client tools with a name and an input_schema are supported", "tools")
        fn = {"name": tool["name"]}  # in OpenAI's key order: the schema is rendered into the prompt as JSON
        if tool.get("description"):
            fn["description"] = tool["description"]
        fn["parameters"] = tool.get("input_schema") or {"type": "object"}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: dict[str, Any] | None) -> tuple[Any, bool | None]:
    """(OpenAI tool_choice, parallel_tool_calls) for Anthropic's tool_choice."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise bad_request('tool_choice must be {"type": "auto" | "any" | "none"} or {"type": "tool", "name": ...}')


def thinking_fields(thinking: dict[str, Any] | None) -> dict[str, Any]:
    """Anthropic's `thinking` as the chat request's thinking controls."""
    if thinking is None:
        return {}
    kind = thinking.get("type")
    if kind == "disabled":
        return {"thinking": {"type": "disabled"}}
    if kind not in ("enabled", "adaptive"):
        raise bad_request('thinking.type must be "enabled", "adaptive" or "disabled"', "thinking")
    budget = thinking.get("budget_tokens")
    if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 1):
        raise bad_request("thinking.budget_tokens must be a positive integer", "thinking")
    effort = "max" if budget is not None and budget >= MAX_EFFORT_BUDGET_TOKENS else "high"
    return {"thinking": {"type": "enabled"}, "reasoning_effort": effort}


def to_chat_request(req: MessagesRequest, need_max_tokens: bool = True) -> ChatCompletionRequest:
    """The chat completion request that generates this message (checked by the chat route's checks)."""
    if need_max_tokens and req.max_tokens is None:
        raise bad_request("max_tokens is required", "max_tokens")
    if req.temperature is not None and not 0.0 <= req.temperature <= ANTHROPIC_MAX_TEMPERATURE:
        raise bad_request(f"temperature must be in [0, 1], got {req.temperature!r}", "temperature")
    tool_choice, parallel = chat_tool_choice(req.tool_choice)
    fields: dict[str, Any] = {
        "model": req.model,
        "messages": chat_messages(req),
        "max_tokens": req.max_tokens,
        "stop": req.stop_sequences,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "tools": chat_tools(req.tools),
        "tool_choice": tool_choice if req.tools else None,
        "parallel_tool_calls": parallel,
        **thinking_fields(req.thinking),
    }
    return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
