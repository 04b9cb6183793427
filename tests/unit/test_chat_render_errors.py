"""Messages and request fields the prompt renderer refuses, each with a ChatFormatError naming where."""

from __future__ import annotations

import pytest

from dsv4serve.chat import ChatFormatError, render_prompt
from tests.unit.chat_cases import tool_call


@pytest.mark.parametrize(
    "messages, expected",
    [
        ([], "messages"),
        ([{"role": "wizard", "content": "x"}], "messages[0]: unknown role"),
        ([{"role": "developer", "content": "x"}], "messages[0]: role 'developer' is not accepted"),
        ([{"role": "latest_reminder", "content": "x"}], "messages[0]: role 'latest_reminder'"),
        (
            [{"role": "user", "content": "q"}, {"role": "tool", "tool_call_id": "c", "content": "r"}],
            "messages[1]: tool_call_id 'c' does not match",
        ),
        (
            [
                {"role": "user", "content": "q"},
                {"role": "assistant", "tool_calls": [tool_call("c", "f", "{}")]},
                {"role": "tool", "content": "r"},
            ],
            "messages[2]: a tool message needs tool_call_id",
        ),
        (
            [
                {"role": "user", "content": "q"},
                {"role": "assistant", "tool_calls": [tool_call("c", "f", "{}")]},
                {"role": "tool", "tool_call_id": "d", "content": "r"},
            ],
            "messages[2]: tool_call_id 'd'",
        ),
        (
            [
                {"role": "user", "content": "q"},
                {"role": "assistant", "tool_calls": [tool_call("c", "f", "{}")]},
                {"role": "tool", "tool_call_id": "c", "content": "r"},
                {"role": "tool", "tool_call_id": "c", "content": "r"},
            ],
            "messages[3]: tool call 'c' already",
        ),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "messages[0]: content part 0 of type 'image_url'",
        ),
        ([{"role": "user", "content": 5}], "messages[0]: content must be"),
        (
            [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
            "messages[1]: the last message must be from the user or a tool",
        ),
        (
            [
                {"role": "user", "content": "q"},
                {"role": "assistant", "tool_calls": [{"function": {}}]},
                {"role": "user", "content": "q"},
            ],
            "messages[1].tool_calls[0]: needs function.name",
        ),
        (
            [
                {"role": "user", "content": "q"},
                {"role": "assistant", "tool_calls": [tool_call("c", "f", "[1]")]},
                {"role": "user", "content": "q"},
            ],
            "messages[1].tool_calls[0]: function.arguments must encode",
        ),
        (["hello"], "messages[0]: must be an object"),
    ],
)
def test_bad_messages_raise_chat_format_error(messages, expected):
    with pytest.raises(ChatFormatError, match=expected.replace("[", r"\[").replace("]", r"\]")):
        render_prompt(messages)


def test_bad_request_fields_raise_chat_format_error():
    user = [{"role": "user", "content": "q"}]
    with pytest.raises(ChatFormatError, match="reasoning_effort"):
        render_prompt(user, reasoning_effort="extreme")
    with pytest.raises(ChatFormatError, match=r"tools\[0\]"):
        render_prompt(user, [{"type": "function", "function": {"description": "no name"}}])
    with pytest.raises(ChatFormatError, match=r"tools\[0\]"):
        render_prompt(user, [{"type": "retrieval"}])
    assert issubclass(ChatFormatError, ValueError)
