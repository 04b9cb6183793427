"""The streaming reasoning / DSML tool-call parser.

Expected splits come from DeepSeek's `encoding/README.md` and `test_encoding_dsv4.py` (the
completions cut out of golden case 1) and from vLLM's `tests/tool_parsers/test_deepseekv4_tool_parser.py`
(its `build_tool_call` strings written out literally). The fuzz tests check the property streaming
must have: however the text is cut into pieces, the result is the one the whole text gives.
"""

from __future__ import annotations

import itertools
import json
import random

import pytest

from dsv4serve.chat.parser import StreamParser, parse_completion

EOS = "<｜end▁of▁sentence｜>"


def _ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def _calls(parsed) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


# --- DeepSeek's examples ----------------------------------------------------------------------


def test_readme_parse_example():
    # encoding/README.md "Quick Start".
    parsed = parse_completion("Simple arithmetic.</think>2 + 2 = 4." + EOS, thinking=True)
    assert (parsed.reasoning, parsed.content, parsed.tool_calls) == ("Simple arithmetic.", "2 + 2 = 4.", [])


CASE1_TOOL_TURN = (
    "The user wants to know the weather in Beijing. I should use the get_weather tool.</think>\n\n"
    "<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="location" string="true">Beijing</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="unit" string="true">celsius</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>" + EOS
)
CASE1_FINAL_TURN = (
    "Got the weather data. Let me format a nice response.</think>The weather in Beijing "
    "is currently sunny with a temperature of 22°C and 45% humidity." + EOS
)


def test_official_case_1_tool_turn():
    # test_encoding_dsv4.py test_case_1: the first assistant turn of test_output_1.txt.
    parsed = parse_completion(CASE1_TOOL_TURN, thinking=True, id_factory=_ids())
    assert parsed.reasoning == ("The user wants to know the weather in Beijing. I should use the get_weather tool.")
    assert parsed.content == ""
    assert [c.to_openai() for c in parsed.tool_calls] == [
        {
            "id": "call_0",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"location": "Beijing", "unit": "celsius"}'},
        }
    ]


def test_official_case_1_final_turn():
    parsed = parse_completion(CASE1_FINAL_TURN, thinking=True)
    assert parsed.reasoning == "Got the weather data. Let me format a nice response."
    assert "22°C" in parsed.content and parsed.tool_calls == []


# --- vLLM's deepseek_v4 tool-parser examples ---------------------------------------------------

# build_tool_call("get_weather", {"location": "Beijing", "unit": "celsius"}) in the vLLM test.
VLLM_WEATHER = (
    "<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="location" string="true">Beijing</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="unit" string="true">celsius</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>"
)
# build_tool_call("search", {"query": "deepseek v4"}).
VLLM_SEARCH = (
    "<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="search">\n'
    '<｜DSML｜parameter name="query" string="true">deepseek v4</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>"
)


def test_vllm_extract_tool_calls():
    parsed = parse_completion("Let me check. " + VLLM_WEATHER, thinking=False)
    assert parsed.content == "Let me check. "
    assert _calls(parsed) == [("get_weather", {"location": "Beijing", "unit": "celsius"})]


def test_vllm_function_calls_block_is_not_accepted():
    # The V3.2 block name is not V4's: the text stays content.
    text = VLLM_SEARCH.replace("tool_calls", "function_calls")
    parsed = parse_completion(text, thinking=False)
    assert parsed.content == text and parsed.tool_calls == []


def test_vllm_streaming_extracts_complete_invokes():
    parser = StreamParser(thinking=False, id_factory=_ids())
    deltas = [parser.feed(VLLM_SEARCH[i : i + 5]) for i in range(0, len(VLLM_SEARCH), 5)]
    deltas.append(parser.finish())
    calls = [c for d in deltas for c in d.tool_calls]
    assert [(c.index, c.id, c.name, json.loads(c.arguments)) for c in calls] == [
        (0, "call_0", "search", {"query": "deepseek v4"})
    ]
    assert "".join(d.content for d in deltas) == ""
    assert parser.finish_reason("stop") == "tool_calls"
    assert parser.finish_reason("length") == "length"


# --- argument encoding ------------------------------------------------------------------------


def _invoke(name: str, *params: tuple[str, str, str]) -> str:
    body = "".join(f'<｜DSML｜parameter name="{k}" string="{s}">{v}</｜DSML｜parameter>\n' for k, s, v in params)
    return f'<｜DSML｜invoke name="{name}">\n{body}</｜DSML｜invoke>\n'


def _block(*invokes: str) -> str:
    return "\n\n<｜DSML｜tool_calls>\n" + "".join(invokes) + "</｜DSML｜tool_calls>"


def test_string_flag_and_order_are_honoured():
    text = "ok" + _block(
        _invoke(
            "f",
            ("z", "true", "5"),
            ("a", "false", "5"),
            ("m", "false", '{"k": [1, "é"]}'),
            ("t", "true", 'say "hi"\nbye'),
            ("b", "false", "true"),
            ("n", "false", "null"),
        )
    )
    parsed = parse_completion(text, thinking=False)
    assert parsed.content == "ok"
    assert parsed.tool_calls[0].arguments == (
        '{"z": "5", "a": 5, "m": {"k": [1, "é"]}, "t": "say \\"hi\\"\\nbye", "b": true, "n": null}'
    )


def test_invalid_json_with_string_false_becomes_a_string():
    text = _block(_invoke("f", ("x", "false", "not json"), ("y", "false", "NaN"), ("w", "false", "")))
    args = json.loads(parse_completion(text, thinking=False).tool_calls[0].arguments)
    assert args == {"x": "not json", "y": "NaN", "w": ""}


def test_several_invokes_in_order_with_fresh_ids():
    text = _block(_invoke("a", ("p", "false", "1")), _invoke("b"), _invoke("c", ("q", "true", "x")))
    parsed = parse_completion(text + EOS, thinking=False, id_factory=_ids())
    assert [(c.index, c.id, c.name, c.arguments) for c in parsed.tool_calls] == [
        (0, "call_0", "a", '{"p": 1}'),
        (1, "call_1", "b", "{}"),
        (2, "call_2", "c", '{"q": "x"}'),
    ]


def test_default_ids_are_call_hex():
    parsed = parse_completion(_block(_invoke("a"), _invoke("b")), thinking=False)
    ids = [c.id for c in parsed.tool_calls]
    assert len(set(ids)) == 2
    assert all(i.startswith("call_") and int(i[5:], 16) >= 0 for i in ids)


# --- modes and edge cases ---------------------------------------------------------------------


def test_chat_mode_is_all_content():
    parsed = parse_completion("plain answer" + EOS, thinking=False)
    assert (parsed.reasoning, parsed.content) == ("", "plain answer")


def test_tool_block_inside_unclosed_reasoning_leaves_reasoning():
    parsed = parse_completion("thinking..." + _block(_invoke("f", ("a", "true", "b"))), thinking=True)
    assert parsed.reasoning == "thinking..."
    assert parsed.content == ""
    assert _calls(parsed) == [("f", {"a": "b"})]


def test_unclosed_reasoning_is_all_reasoning():
    parsed = parse_completion("still thinking <thi", thinking=True)
    assert (parsed.reasoning, parsed.content) == ("still thinking <thi", "")


def test_near_markers_are_released_as_text():
    text = "a <thi b </thinking> c\n\n<｜DSML｜tool d \n\n<｜DSML｜function_calls> <｜Userx"
    assert parse_completion(text, thinking=False).content == text


def test_stray_think_tags_and_text_after_the_block_are_dropped():
    parsed = parse_completion("r<think>r2</think>c</think>c2" + _block(_invoke("f")) + "\ntrailing", thinking=True)
    assert (parsed.reasoning, parsed.content) == ("rr2", "cc2")
    assert len(parsed.tool_calls) == 1


def test_truncated_output_drops_unfinished_markup():
    assert parse_completion("answer\n\n<｜DSML｜tool_ca", thinking=False).content == "answer"
    parsed = parse_completion("x" + _block(_invoke("f"))[: -len("</｜DSML｜tool_calls>")], thinking=False)
    assert parsed.content == "x" and len(parsed.tool_calls) == 1
    parsed = parse_completion('x\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜par', thinking=False)
    assert (parsed.content, parsed.tool_calls) == ("x", [])


def test_eos_inside_a_tool_block_ends_it():
    text = "x" + _block(_invoke("f", ("a", "true", "1")))[: -len("</｜DSML｜tool_calls>")]
    parsed = parse_completion(text + '<｜DSML｜invoke name="g">\n' + EOS + "junk", thinking=False)
    assert (parsed.content, _calls(parsed)) == ("x", [("f", {"a": "1"})])


def test_long_argument_streamed_piece_by_piece():
    value = "word " * 20000
    text = _block(_invoke("write", ("text", "true", value)))
    parser = StreamParser(thinking=False)
    calls = [c for i in range(0, len(text), 3) for c in parser.feed(text[i : i + 3]).tool_calls]
    assert [json.loads(c.arguments) for c in calls] == [{"text": value}]


def test_held_text_is_released_once_classified():
    parser = StreamParser(thinking=True)
    assert parser.feed("abc</th").reasoning == "abc"
    delta = parser.feed("ink>x\n")
    assert (delta.reasoning, delta.content) == ("", "x")
    assert parser.feed("\n<").content == ""
    assert parser.feed("b>").content == "\n\n<b>"


# --- fuzz: the cut points never change the result ---------------------------------------------

FUZZ_TEXTS = [
    ("Plan: call <thi</th>ngs. 数学 ✓ </think>Answer 🙂 with <b>tags</b>\n\nmore\n" + EOS, True),
    (CASE1_TOOL_TURN, True),
    (CASE1_FINAL_TURN, True),
    ("Let me check. " + VLLM_WEATHER, False),
    (
        "思考</think>文本\n\n\n"
        + _block(
            _invoke("f", ("城市", "true", "北京 ünï\n</think>"), ("n", "false", "[1, 2.5e3]")),
            _invoke("g", ("o", "false", '{"a": {"b": null}}'), ("s", "true", "<｜DSML｜x")),
        )
        + EOS,
        True,
    ),
    ("no markers at all, just < and \n\n and ｜ bars", False),
    ("r" + _block(_invoke("f", ("a", "true", "1"))) + "ignored after", True),
]


def _stream(text: str, thinking: bool, cuts: list[int]):
    parser = StreamParser(thinking, id_factory=_ids())
    reasoning, content, calls = [], [], []
    bounds = [0] + cuts + [len(text)]
    for start, end in zip(bounds, bounds[1:]):
        for delta in (parser.feed(text[start:end]),):
            reasoning.append(delta.reasoning)
            content.append(delta.content)
            calls.extend(delta.tool_calls)
    last = parser.finish()
    reasoning.append(last.reasoning)
    content.append(last.content)
    calls.extend(last.tool_calls)
    return "".join(reasoning), "".join(content), [(c.index, c.id, c.name, c.arguments) for c in calls]


@pytest.mark.parametrize("text, thinking", FUZZ_TEXTS)
def test_random_cuts_give_the_whole_text_result(text, thinking):
    whole = parse_completion(text, thinking, id_factory=_ids())
    expected = (whole.reasoning, whole.content, [(c.index, c.id, c.name, c.arguments) for c in whole.tool_calls])
    for seed in range(300):
        rng = random.Random(seed)
        count = rng.choice([1, 2, 5, len(text) // 3, len(text)])
        cuts = sorted(rng.sample(range(1, len(text)), min(count, len(text) - 1)))
        got = _stream(text, thinking, cuts)
        assert got == expected, f"seed {seed} cuts {cuts}"
    for size in (1, 2, 3, 7):  # every cut point, including inside each marker
        assert _stream(text, thinking, list(range(size, len(text), size))) == expected


@pytest.mark.parametrize("text, thinking", FUZZ_TEXTS)
def test_markup_never_reaches_content(text, thinking):
    parsed = parse_completion(text, thinking)
    for mark in (
        "<think>",
        "</think>",
        "<｜DSML｜tool_calls",
        "</｜DSML｜",
        "<｜DSML｜invoke",
        "<｜DSML｜parameter",
        EOS,
    ):
        assert mark not in parsed.content
        assert mark not in parsed.reasoning
    for call in parsed.tool_calls:
        assert isinstance(json.loads(call.arguments), dict)


def test_fuzz_expected_values():
    # Spot-check what the fuzz texts parse to, so the fuzz compares against the right answer.
    first = parse_completion(*FUZZ_TEXTS[0])
    assert first.reasoning == "Plan: call <thi</th>ngs. 数学 ✓ "
    assert first.content == "Answer 🙂 with <b>tags</b>\n\nmore\n"
    fifth = parse_completion(*FUZZ_TEXTS[4])
    assert fifth.content == "文本\n\n\n"  # only the blank line right before the block goes
    assert _calls(fifth) == [
        ("f", {"城市": "北京 ünï\n</think>", "n": [1, 2500.0]}),
        ("g", {"o": {"a": {"b": None}}, "s": "<｜DSML｜x"}),
    ]
    assert parse_completion(*FUZZ_TEXTS[5]).content == FUZZ_TEXTS[5][0]
