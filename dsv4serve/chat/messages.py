"""OpenAI-style chat messages checked and turned into DeepSeek-V4 turns.

DeepSeek-V4 has no tool role: tool results become `<tool_result>` blocks of a user turn, in the
order of the calls that asked for them, and consecutive user messages share one turn. This module
does that merge the way DeepSeek's encoder (`encoding_dsv4.merge_tool_messages` and
`sort_tool_results_by_call_order`) does, after checking every message; a bad message raises
ChatFormatError naming its index.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

PUBLIC_ROLES = ("system", "user", "assistant", "tool")
INTERNAL_ROLES = ("developer", "latest_reminder")


class ChatFormatError(ValueError):
    """A request the chat format cannot express; the API answers it with a 400."""


@dataclass
class ToolCallIn:
    """An earlier assistant tool call: its id (may be empty), name and decoded arguments object."""

    call_id: str
    name: str
    arguments: dict[str, Any]


@dataclass
class Block:
    """One part of a user turn: plain text, or the result of the tool call `call_id`."""

    text: str
    is_tool_result: bool = False
    call_id: str = ""


@dataclass
class Turn:
    role: str  # system | user | assistant | developer | latest_reminder
    text: str = ""
    reasoning: str | None = None
    calls: list[ToolCallIn] = field(default_factory=list)
    blocks: list[Block] = field(default_factory=list)  # user turns only
    functions: list[dict[str, Any]] | None = None  # tool schemas carried by system/developer
    response_format: Any = None
    task: str | None = None


def _text_of(content: Any, where: str, joiner: str = "\n") -> str:
    """Message content as text: a string, None, or a list of OpenAI text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ChatFormatError(f"{where}: content must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ChatFormatError(
                f"{where}: content part {j} of type {kind!r} is not supported (this model reads text only)"
            )
    return joiner.join(texts)


def _decode_arguments(raw: Any, where: str) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    if raw is None or raw == "":
        return {}
    if not isinstance(raw, str):
        raise ChatFormatError(f"{where}: function.arguments must be a JSON string")
    try:
        value = json.loads(raw)
    except ValueError:
        # DeepSeek's encoder keeps undecodable arguments as one string parameter.
        return {"arguments": raw}
    if not isinstance(value, dict):
        raise ChatFormatError(f"{where}: function.arguments must encode a JSON object")
    return value


def _tool_calls(raw: Any, where: str) -> list[ToolCallIn]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ChatFormatError(f"{where}: tool_calls must be a list")
    calls = []
    for j, call in enumerate(raw):
        at = f"{where}.tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ChatFormatError(f"{at}: needs function.name")
        call_id = call.get("id") or ""
        if not isinstance(call_id, str):
            raise ChatFormatError(f"{at}: id must be a string")
        calls.append(ToolCallIn(call_id, fn["name"], _decode_arguments(fn.get("arguments"), at)))
    return calls


def check_functions(tools: Any, where: str = "tools") -> list[dict[str, Any]]:
    """The `function` objects of an OpenAI tools list, checked."""
    if not isinstance(tools, list):
        raise ChatFormatError(f"{where}: must be a list")
    functions = []
    for j, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ChatFormatError(f"{where}[{j}]: only type 'function' tools are supported")
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ChatFormatError(f"{where}[{j}]: needs function.name")
        functions.append(fn)
    return functions


def _reasoning_of(msg: dict[str, Any], where: str) -> str | None:
    value = msg.get("reasoning_content")
    if value is None:
        value = msg.get("reasoning")
    if value is not None and not isinstance(value, str):
        raise ChatFormatError(f"{where}: reasoning_content must be a string")
    return value


def _check_tool_result(msg: dict[str, Any], index: int, messages: list[Any], answered: set[str]) -> str:
    """The tool_call_id of tool message `index`, which must answer a call of the assistant
    message just before this run of tool messages."""
    where = f"messages[{index}]"
    call_id = msg.get("tool_call_id")
    if not isinstance(call_id, str) or not call_id:
        raise ChatFormatError(f"{where}: a tool message needs tool_call_id")
    j = index - 1
    while j >= 0 and isinstance(messages[j], dict) and messages[j].get("role") == "tool":
        j -= 1
    prev = messages[j] if j >= 0 else None
    ids = [c.get("id") for c in (prev or {}).get("tool_calls") or [] if isinstance(c, dict)]
    if not isinstance(prev, dict) or prev.get("role") != "assistant" or call_id not in ids:
        raise ChatFormatError(
            f"{where}: tool_call_id {call_id!r} does not match a tool call of the assistant message before it"
        )
    if call_id in answered:
        raise ChatFormatError(f"{where}: tool call {call_id!r} already has a result")
    answered.add(call_id)
    return call_id


def _one_turn(msg: Any, index: int, internal: bool) -> Turn:
    where = f"messages[{index}]"
    if not isinstance(msg, dict):
        raise ChatFormatError(f"{where}: must be an object with a role")
    role = msg.get("role")
    if role in INTERNAL_ROLES and not internal:
        raise ChatFormatError(f"{where}: role {role!r} is not accepted by this API")
    if role not in PUBLIC_ROLES + INTERNAL_ROLES:
        raise ChatFormatError(f"{where}: unknown role {role!r} (expected one of {', '.join(PUBLIC_ROLES)})")
    turn = Turn(role=role, text=_text_of(msg.get("content"), where))
    if role == "assistant":
        turn.reasoning = _reasoning_of(msg, where)
        turn.calls = _tool_calls(msg.get("tool_calls"), where)
    elif msg.get("tool_calls"):
        raise ChatFormatError(f"{where}: only assistant messages may carry tool_calls")
    if role == "developer" and not turn.text:
        raise ChatFormatError(f"{where}: a developer message needs content")
    if internal:  # tools, response_format and tasks per message: DeepSeek-internal usage only
        if msg.get("tools"):
            turn.functions = check_functions(msg["tools"], f"{where}.tools")
        turn.response_format = msg.get("response_format")
        turn.task = msg.get("task")
    return turn


def to_turns(messages: Any, internal: bool = False) -> list[Turn]:
    """Checked turns, tool results merged into user turns and ordered like the calls.

    With `internal`, the DeepSeek-internal roles and per-message fields are accepted and tool
    results are not matched to calls (the official test data has results without ids).
    """
    if not isinstance(messages, list) or not messages:
        raise ChatFormatError("messages: must be a non-empty list")
    turns: list[Turn] = []
    answered: set[str] = set()
    for index, msg in enumerate(messages):
        if isinstance(msg, dict) and msg.get("role") == "tool":
            where = f"messages[{index}]"
            if internal:
                call_id = str(msg.get("tool_call_id") or "")
            else:
                call_id = _check_tool_result(msg, index, messages, answered)
            block = Block(_text_of(msg.get("content"), where, "\n\n"), True, call_id)
            if turns and turns[-1].role == "user":
                turns[-1].blocks.append(block)
            else:
                turns.append(Turn(role="user", blocks=[block]))
            continue
        turn = _one_turn(msg, index, internal)
        if turn.role == "user":
            block = Block(turn.text)
            if turns and turns[-1].role == "user" and turns[-1].task is None:
                turns[-1].blocks.append(block)
                continue
            turn.blocks = [block]
        turns.append(turn)
    _order_tool_results(turns)
    return turns


def _order_tool_results(turns: list[Turn]) -> None:
    """Put each user turn's tool results in the order of the latest assistant's calls (a stable
    sort; results with unknown ids sort as if first), leaving text blocks where they are."""
    order: dict[str, int] = {}
    for turn in turns:
        if turn.role == "assistant" and turn.calls:
            order = {c.call_id: i for i, c in enumerate(turn.calls) if c.call_id}
        elif turn.role == "user" and order:
            slots = [i for i, b in enumerate(turn.blocks) if b.is_tool_result]
            if len(slots) > 1:
                ordered = sorted((turn.blocks[i] for i in slots), key=lambda b: order.get(b.call_id, 0))
                for i, block in zip(slots, ordered):
                    turn.blocks[i] = block
