"""The DeepSeek-V4 prompt for a chat request, byte-for-byte as DeepSeek's encoder writes it.

Rules (DeepSeek `encoding/encoding_dsv4.py`, `encode_messages`):
- BOS, then each turn; system text has no role token, a user turn starts with `<｜User｜>`.
- After a user turn comes `<｜Assistant｜>` plus `<think>` (thinking) or `</think>` (chat, or an
  earlier turn whose reasoning is dropped), so the prompt's last token sets the mode.
- An assistant turn is `{reasoning}</think>{content}{DSML tool calls}<｜end▁of▁sentence｜>`; the
  reasoning part is written only in thinking mode, and only after the last user turn unless
  reasoning is kept (it is kept whenever tools are present).
- reasoning_effort "max" puts a fixed paragraph before everything (thinking mode only).
"""

from __future__ import annotations

from typing import Any

from dsv4serve.chat import tokens as T
from dsv4serve.chat.messages import ChatFormatError, Turn, check_functions, to_turns
from dsv4serve.chat.tools import render_response_format_section, render_tool_calls, render_tools_section

EFFORTS_ADDING_NOTHING = ("high", "medium", "low", "minimal")


def resolve_thinking(thinking: bool, reasoning_effort: str | None) -> tuple[bool, bool]:
    """(thinking on, max-effort paragraph on) for the request's controls.

    `none` turns thinking off; `max` adds the paragraph in thinking mode; the other OpenAI effort
    names keep the requested mode and add nothing (DeepSeek-V4 knows only high and max).
    """
    if reasoning_effort is None:
        return thinking, False
    if not isinstance(reasoning_effort, str):
        raise ChatFormatError("reasoning_effort: must be a string")
    if reasoning_effort == "none":
        return False, False
    if reasoning_effort == "max":
        return thinking, thinking
    if reasoning_effort in EFFORTS_ADDING_NOTHING:
        return thinking, False
    raise ChatFormatError(f"reasoning_effort: {reasoning_effort!r} is not one of none, low, medium, high, max")


def _attach_request_fields(turns: list[Turn], tools: Any, response_format: Any) -> None:
    """Request-level tools and response_format go on a leading system (or developer) turn, as
    vLLM does for this model, so the section follows the system text; with no such turn an empty
    system turn is put first."""
    functions = check_functions(tools) if tools else None
    fmt = response_format
    if isinstance(fmt, dict) and fmt.get("type") == "text":
        fmt = None
    if not functions and not fmt:
        return
    if turns[0].role not in ("system", "developer"):
        turns.insert(0, Turn(role="system"))
    if functions:
        turns[0].functions = functions
    if fmt:
        turns[0].response_format = fmt


def _drop_old_reasoning(turns: list[Turn]) -> list[Turn]:
    """Before the last user turn: assistant reasoning removed, developer turns removed."""
    last_user = _last_user_index(turns)
    kept = []
    for i, turn in enumerate(turns):
        if i >= last_user or turn.role in ("user", "system", "latest_reminder"):
            kept.append(turn)
        elif turn.role == "assistant":
            kept.append(Turn(role="assistant", text=turn.text, calls=turn.calls, task=turn.task))
    return kept


def _last_user_index(turns: list[Turn]) -> int:
    for i in range(len(turns) - 1, -1, -1):
        if turns[i].role in ("user", "developer"):
            return i
    return -1


def _sections(turn: Turn) -> str:
    text = ""
    if turn.functions:
        text += "\n\n" + render_tools_section(turn.functions)
    if turn.response_format:
        text += "\n\n" + render_response_format_section(turn.response_format)
    return text


def _user_text(turn: Turn) -> str:
    parts = [f"<tool_result>{b.text}</tool_result>" if b.is_tool_result else b.text for b in turn.blocks]
    return T.USER + "\n\n".join(parts)


def _assistant_text(turns: list[Turn], i: int, thinking: bool, keep_reasoning: bool) -> str:
    turn = turns[i]
    calls = render_tool_calls([(c.name, c.arguments) for c in turn.calls]) if turn.calls else ""
    after_task = i > 0 and turns[i - 1].task is not None
    reasoning = ""
    if thinking and not after_task and (keep_reasoning or i > _last_user_index(turns)):
        reasoning = (turn.reasoning or "") + T.THINK_END
    return reasoning + turn.text + calls + T.EOS


def _transition(turns: list[Turn], i: int, thinking: bool, keep_reasoning: bool) -> str:
    """What follows turn i when the model is to speak next: the assistant prefix, a task token."""
    if i + 1 < len(turns) and turns[i + 1].role not in ("assistant", "latest_reminder"):
        return ""
    turn = turns[i]
    if turn.task is not None:
        token = T.TASK_TOKENS.get(turn.task)
        if token is None:
            raise ChatFormatError(f"task {turn.task!r} is not one of {', '.join(T.TASK_TOKENS)}")
        if turn.task != "action":
            return token
        return T.ASSISTANT + (T.THINK_START if thinking else T.THINK_END) + token
    if turn.role not in ("user", "developer"):
        return ""
    opens = thinking and (keep_reasoning or i >= _last_user_index(turns))
    return T.ASSISTANT + (T.THINK_START if opens else T.THINK_END)


def _render_turn(turns: list[Turn], i: int, thinking: bool, keep_reasoning: bool) -> str:
    turn = turns[i]
    if turn.role == "system":
        body = turn.text + _sections(turn)
    elif turn.role == "developer":
        body = T.USER + turn.text + _sections(turn)
    elif turn.role == "user":
        body = _user_text(turn)
    elif turn.role == "latest_reminder":
        body = T.LATEST_REMINDER + turn.text
    else:
        body = _assistant_text(turns, i, thinking, keep_reasoning)
    return body + _transition(turns, i, thinking, keep_reasoning)


def render_prompt(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    *,
    thinking: bool = True,
    reasoning_effort: str | None = None,
    response_format: Any = None,
    drop_thinking: bool = True,
    add_generation_prompt: bool = True,
    allow_internal_roles: bool = False,
) -> str:
    """The prompt string (BOS included) for OpenAI-style `messages`.

    With `add_generation_prompt` the conversation must end with a user or tool message, so the
    prompt ends in `<｜Assistant｜><think>` or `<｜Assistant｜></think>`; without it the messages
    are rendered as they are (a finished assistant turn ends in EOS), as DeepSeek's encoder does.
    `allow_internal_roles` admits DeepSeek's internal `developer` / `latest_reminder` roles and
    per-message `tools` / `response_format` / `task`; the public API never sets it.
    Raises ChatFormatError (a ValueError) naming the offending message.
    """
    thinking, max_effort = resolve_thinking(thinking, reasoning_effort)
    turns = to_turns(messages, internal=allow_internal_roles)
    if add_generation_prompt:
        last = messages[-1].get("role")
        if last not in ("user", "tool"):
            raise ChatFormatError(
                f"messages[{len(messages) - 1}]: the last message must be from the user or a tool, not {last!r}"
            )
    _attach_request_fields(turns, tools, response_format)
    keep_reasoning = not drop_thinking or any(t.functions for t in turns)
    if thinking and not keep_reasoning:
        turns = _drop_old_reasoning(turns)
    prompt = T.BOS + (T.REASONING_EFFORT_MAX if max_effort else "")
    return prompt + "".join(_render_turn(turns, i, thinking, keep_reasoning) for i in range(len(turns)))


def prompt_opens_reasoning(prompt: str) -> bool:
    """Whether the model's output starts inside reasoning (the prompt ends with `<think>`)."""
    return prompt.endswith(T.THINK_START)
