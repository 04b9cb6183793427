"""Prompt rendering by the rules `encoding/README.md` states (DeepSeek-V4-Flash checkpoint): thinking and
chat modes, dropped reasoning, the tools section, reasoning effort, response format, tool results and
the prefix-caching round trip; the expected strings are derived from those rules.
"""

from __future__ import annotations

from dsv4serve.chat import render_prompt
from dsv4serve.chat import tokens as T
from dsv4serve.chat.parser import parse_completion
from tests.unit.chat_cases import SYSTEM, TOOLS_SECTION_HEAD, WEATHER_TOOL, tool_call, two_turns


def test_thinking_drops_reasoning_before_last_user():
    assert render_prompt(two_turns()) == (
        "<｜begin▁of▁sentence｜><｜User｜>a<｜Assistant｜></think>A<｜end▁of▁sentence｜>"
        "<｜User｜>b<｜Assistant｜><think>"
    )


def test_drop_thinking_off_keeps_reasoning_and_opens_every_turn():
    assert render_prompt(two_turns(), drop_thinking=False) == (
        "<｜begin▁of▁sentence｜><｜User｜>a<｜Assistant｜><think>ra</think>A<｜end▁of▁sentence｜>"
        "<｜User｜>b<｜Assistant｜><think>"
    )


def test_tools_keep_earlier_reasoning_and_go_after_system_text():
    prompt = render_prompt([SYSTEM] + two_turns(), [WEATHER_TOOL])
    head = "<｜begin▁of▁sentence｜>You are a helpful assistant." + TOOLS_SECTION_HEAD
    assert prompt.startswith(head)
    assert prompt.endswith(
        "<｜User｜>a<｜Assistant｜><think>ra</think>A<｜end▁of▁sentence｜><｜User｜>b<｜Assistant｜><think>"
    )
    schema = (
        '{"name": "get_weather", "description": "Get the weather", "parameters": '
        '{"type": "object", "properties": {"city": {"type": "string"}}}}'
    )
    assert "\n\n" + schema + "\n\n" in prompt


def test_tools_without_system_message_start_right_after_bos():
    prompt = render_prompt([{"role": "user", "content": "hi"}], [WEATHER_TOOL], thinking=False)
    assert prompt.startswith("<｜begin▁of▁sentence｜>" + TOOLS_SECTION_HEAD)
    assert prompt.endswith("calls.\n<｜User｜>hi<｜Assistant｜></think>")


def test_chat_mode_never_writes_reasoning():
    assert render_prompt(two_turns(), thinking=False, drop_thinking=False) == (
        "<｜begin▁of▁sentence｜><｜User｜>a<｜Assistant｜></think>A<｜end▁of▁sentence｜>"
        "<｜User｜>b<｜Assistant｜></think>"
    )


def test_reasoning_effort():
    user = [{"role": "user", "content": "q"}]
    plain = render_prompt([SYSTEM] + user)
    assert render_prompt([SYSTEM] + user, reasoning_effort="high") == plain
    maxed = render_prompt([SYSTEM] + user, reasoning_effort="max")
    assert maxed == (
        "<｜begin▁of▁sentence｜>Reasoning Effort: Absolute maximum with no shortcuts "
        "permitted.\nYou MUST be very thorough in your thinking and comprehensively "
        "decompose the problem to resolve the root cause, rigorously stress-testing your "
        "logic against all potential paths, edge cases, and adversarial scenarios.\n"
        "Explicitly write out your entire deliberation process, documenting every "
        "intermediate step, considered alternative, and rejected hypothesis to ensure "
        "absolutely no assumption is left unchecked.\n\nYou are a helpful assistant."
        "<｜User｜>q<｜Assistant｜><think>"
    )
    # max applies to thinking mode only; none turns thinking off.
    assert render_prompt(user, thinking=False, reasoning_effort="max") == render_prompt(user, thinking=False)
    assert render_prompt(user, reasoning_effort="none").endswith("<｜Assistant｜></think>")


def test_response_format_section():
    fmt = {"type": "json_object"}
    prompt = render_prompt([SYSTEM, {"role": "user", "content": "q"}], response_format=fmt)
    assert prompt == (
        "<｜begin▁of▁sentence｜>You are a helpful assistant.\n\n## Response Format:\n\n"
        "You MUST strictly adhere to the following schema to reply:\n"
        '{"type": "json_object"}<｜User｜>q<｜Assistant｜><think>'
    )
    plain = render_prompt([SYSTEM, {"role": "user", "content": "q"}])
    assert render_prompt([SYSTEM, {"role": "user", "content": "q"}], response_format={"type": "text"}) == plain


def test_tool_results_merge_in_call_order_with_following_user_text():
    messages = [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "r",
            "tool_calls": [tool_call("c1", "f", '{"a": "x"}'), tool_call("c2", "g", '{"n": 5, "b": [true, null]}')],
        },
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "one"}]},
        {"role": "user", "content": "and?"},
    ]
    prompt = render_prompt(messages, [WEATHER_TOOL])
    assert prompt.endswith(
        "<｜User｜>q<｜Assistant｜><think>r</think>\n\n<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="a" string="true">x</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        '<｜DSML｜invoke name="g">\n<｜DSML｜parameter name="n" string="false">5</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="b" string="false">[true, null]</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls><｜end▁of▁sentence｜>"
        "<｜User｜><tool_result>one</tool_result>\n\n<tool_result>two</tool_result>\n\nand?"
        "<｜Assistant｜><think>"
    )


def test_consecutive_user_messages_share_a_turn_and_parts_join():
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "user", "content": "c"},
    ]
    assert render_prompt(messages, thinking=False) == (
        "<｜begin▁of▁sentence｜><｜User｜>a\nb\n\nc<｜Assistant｜></think>"
    )


def test_reasoning_alias_is_read():
    messages = two_turns()
    messages[1] = {"role": "assistant", "content": "A", "reasoning": "ra"}
    assert "<think>ra</think>A" in render_prompt(messages, drop_thinking=False)


def test_tool_call_turn_round_trips_for_prefix_caching():
    """The next turn's prompt extends the previous prompt + the model's own output exactly."""
    messages = [SYSTEM, {"role": "user", "content": "weather?"}]
    first = render_prompt(messages, [WEATHER_TOOL])
    output = (
        "Need weather.</think>Checking.\n\n<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">São "Paulo"\n2</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="opts" string="false">{"a": [1.5, false]}</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
    )
    parsed = parse_completion(output, thinking=True, id_factory=lambda: "call_0")
    assistant = {
        "role": "assistant",
        "content": parsed.content,
        "reasoning_content": parsed.reasoning,
        "tool_calls": [c.to_openai() for c in parsed.tool_calls],
    }
    follow = messages + [assistant, {"role": "tool", "tool_call_id": "call_0", "content": "sunny"}]
    second = render_prompt(follow, [WEATHER_TOOL])
    assert second == first + output + T.EOS + "<｜User｜><tool_result>sunny</tool_result><｜Assistant｜><think>"


def test_arguments_given_as_object_or_bad_json():
    messages = [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "f", "arguments": {"k": 1}}},
                tool_call("b", "g", "not json"),
            ],
        },
    ]
    prompt = render_prompt(messages, thinking=False, add_generation_prompt=False)
    assert '<｜DSML｜parameter name="k" string="false">1</｜DSML｜parameter>' in prompt
    # DeepSeek's encoder keeps undecodable arguments as one string parameter named "arguments".
    assert '<｜DSML｜parameter name="arguments" string="true">not json</｜DSML｜parameter>' in prompt
