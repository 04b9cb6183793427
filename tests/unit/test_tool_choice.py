"""tool_choice "required" / named: the reply is forced to open a DSML call, after </think> when the
prompt opened reasoning; "auto" and "none" force nothing."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from dsv4serve.api.chat_routes import force_tool_call
from dsv4serve.api.protocol import ChatCompletionRequest
from dsv4serve.api.tokenizer import TextTokenizer
from dsv4serve.chat.parser import parse_completion
from dsv4serve.chat.tools import forced_call_opening
from dsv4serve.ipc.sampling import SamplingParams

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
THINK_END_ID = 128822


@pytest.fixture(scope="module")
def state():
    return SimpleNamespace(tokenizer=TextTokenizer.for_model(Path("/nonexistent")))  # the bundled tokenizer


def request(tool_choice) -> ChatCompletionRequest:
    return ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "hi"}], tools=TOOLS, tool_choice=tool_choice
    )


@pytest.mark.parametrize("opens_reasoning", [False, True])
def test_a_named_function_forces_its_invoke(state, opens_reasoning):
    named = {"type": "function", "function": {"name": "get_weather"}}
    params = force_tool_call(state, request(named), SamplingParams(), opens_reasoning)
    assert (
        state.tokenizer.decode(list(params.forced_tokens), skip_special_tokens=False)
        == '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
    )
    assert params.forced_after == (THINK_END_ID if opens_reasoning else None)


def test_required_forces_the_block_and_lets_the_model_name_the_function(state):
    params = force_tool_call(state, request("required"), SamplingParams(), False)
    assert state.tokenizer.decode(list(params.forced_tokens), skip_special_tokens=False).endswith(' name="')


@pytest.mark.parametrize("choice", ["auto", "none", None])
def test_auto_and_none_force_nothing(state, choice):
    params = force_tool_call(state, request(choice), SamplingParams(), True)
    assert params.forced_tokens == () and params.forced_after is None


def test_the_forced_opening_plus_the_model_s_rest_parses_as_that_call():
    opening = forced_call_opening({"type": "function", "function": {"name": "get_weather"}})
    rest = '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>'
    parsed = parse_completion(opening + rest, thinking=False)
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("get_weather", '{"city": "Paris"}')]
    assert not parsed.content
