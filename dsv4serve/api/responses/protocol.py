"""OpenAI Responses requests (stateless), checked and translated into a chat completion request.

`input` is a string or a list of items: messages (roles user / system / developer / assistant, text
parts), `function_call` and `function_call_output` items, and `reasoning` items (their text goes back
as the next assistant turn's reasoning). `instructions` become the system prompt; function `tools`,
`tool_choice`, `reasoning.effort`, `max_output_tokens` and `text.format` map to their chat fields.
The server keeps no responses: `previous_response_id` and `store: true` are 400s.
"""

from __future__ import annotations

from typing import Any

from pydantic import StrictInt, StrictStr

from dsv4serve.api.errors import bad_request
from dsv4serve.api.protocol import ChatCompletionRequest, _Model

STATELESS = "this server keeps no state: send the whole conversation in `input` (store false, no previous_response_id)"
EFFORTS = {"xhigh": "max"}  # Responses effort names DeepSeek-V4 reads differently; the rest pass through
TEXT_PART_TYPES = ("input_text", "output_text", "text", "reasoning_text", "summary_text")


class ResponsesRequest(_Model):
    model: StrictStr | None = None
    input: StrictStr | list[Any]
    instructions: StrictStr | None = None
    tools: list[Any] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning: dict[str, Any] | None = None
    max_output_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] | None = None
    stream: bool | None = False
    store: bool | None = None
    previous_response_id: StrictStr | None = None
    metadata: dict[str, Any] | None = None


def _text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise bad_request(f"{where}: content must be a string or a list of text parts", "input")
    texts = []
    for j, part in enumerate(content):
        if (
            not isinstance(part, dict)
            or part.get("type") not in TEXT_PART_TYPES
            or not isinstance(part.get("text"), str)
        ):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad_request(
                f"{where}[{j}]: a part of type {kind!r} is not supported (this model reads text)", "input"
            )
        texts.append(part["text"])
    return "".join(texts)


class _Conversation:
    """Input items -> chat messages; function calls and reasoning join the assistant turn they belong to."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self._reasoning = ""  # reasoning items waiting for their assistant turn

    def _assistant(self, new: bool) -> dict[str, Any]:
        last = self.messages[-1] if self.messages else None
        if new or last is None or last["role"] != "assistant":
            last = {"role": "assistant", "content": ""}
            self.messages.append(last)
        if self._reasoning:
            last["reasoning_content"], self._reasoning = self._reasoning, ""
        return last

    def add(self, item: Any, where: str) -> None:
        if not isinstance(item, dict):
            raise bad_request(f"{where}: an input item must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"{where}: role must be user, system, developer or assistant, got {role!r}", "input")
            text = _text(item.get("content"), f"{where}.content")
            if role == "assistant":
                self._assistant(new=True)["content"] = text
            else:
                self.messages.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function"}
            call["function"] = {"name": item.get("name"), "arguments": item.get("arguments") or "{}"}
            self._assistant(new=False).setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = _text(item.get("output"), f"{where}.output")
            self.messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": output})
        elif kind == "reasoning":
            self._reasoning += _text(item.get("content") or item.get("summary"), f"{where}.content")
        else:
            raise bad_request(f"{where}: input items of type {kind!r} are not supported", "input")


def chat_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    conversation = _Conversation()
    if req.instructions:
        conversation.messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        conversation.messages.append({"role": "user", "content": req.input})
    else:
        for i, item in enumerate(req.input):
            conversation.add(item, f"input[{i}]")
    return conversation.messages


def chat_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for j, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            raise bad_request(f"tools[{j}]: only function tools with a name are supported", "tools")
        fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request('tool_choice must be "auto", "none", "required" or {"type": "function", "name": ...}')


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as chat's response_format."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise bad_request('text.format.type must be "text", "json_object" or "json_schema"', "text")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    if "schema" not in fmt:
        raise bad_request("text.format needs a schema when its type is json_schema", "text")
    inner = {"name": fmt.get("name", "response"), "schema": fmt["schema"], "strict": fmt.get("strict")}
    return {"type": "json_schema", "json_schema": inner}


def to_chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    if req.previous_response_id is not None:
        raise bad_request(f"previous_response_id is not supported: {STATELESS}", "previous_response_id")
    if req.store:
        raise bad_request(f"store: true is not supported: {STATELESS}", "store")
    effort = (req.reasoning or {}).get("effort")
    if effort is not None and not isinstance(effort, str):
        raise bad_request("reasoning.effort must be a string", "reasoning")
    fields: dict[str, Any] = {
        "model": req.model,
        "messages": chat_messages(req),
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "tools": chat_tools(req.tools),
        "tool_choice": chat_tool_choice(req.tool_choice) if req.tools else None,
        "parallel_tool_calls": req.parallel_tool_calls,
        "reasoning_effort": EFFORTS.get(effort, effort) if effort is not None else None,
        "response_format": response_format(req.text),
    }
    return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
