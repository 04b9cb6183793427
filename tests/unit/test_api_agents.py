"""The Anthropic Messages and OpenAI Responses APIs in-process over a scripted engine, driven by the
official `anthropic` and `openai` SDKs: the model's output is known, so every block, item and event can
be checked exactly; each translated request must give the prompt its hand-written OpenAI equivalent
gives (the chat route is the oracle for the rendering)."""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import openai
import pytest
from fastapi.testclient import TestClient

from dsv4serve.api.app import ServeOptions, create_app
from dsv4serve.api.tokenizer import TextTokenizer
from dsv4serve.chat.tools import render_tool_calls
from dsv4serve.ipc.messages import Ready, RequestOutput, TokenOut
from dsv4serve.memory.chunk_planner import ChunkPlan

EOS = 1
REASONING, CONTENT = "Let me look it up.", "Checking."
OUTPUT = REASONING + "</think>" + CONTENT + render_tool_calls([("get_weather", {"city": "Paris", "days": 2})])
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Weather in a city", "input_schema": SCHEMA}]
OPENAI_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": SCHEMA}}
]


class Engine:
    """Plays `script` (then EOS) one token per output, cut at max_tokens; records what it was asked."""

    healthy, stats, worker_restarts_total = True, None, 0

    def __init__(self, script: list[int]):
        self.script, self.prompts, self.params = script, [], []
        self.ready_info = Ready("cpu", 4096, 4, 1024, ChunkPlan(None, 512, "kv-pool", "test"), None, 129280, EOS)

    async def generate(self, request_id, prompt, sampling):
        self.prompts.append(list(prompt))
        self.params.append(sampling)
        tokens = (self.script + [EOS])[: sampling.max_tokens]
        for i, token in enumerate(tokens):
            end = ("stop" if token == EOS else "length") if i == len(tokens) - 1 else None
            yield RequestOutput(request_id, [TokenOut(token)], len(prompt), 0, end)


@pytest.fixture(scope="module")
def tokenizer() -> TextTokenizer:
    return TextTokenizer.for_model(Path("/nonexistent"))


@pytest.fixture
def engine(tokenizer):
    return Engine(tokenizer.encode(OUTPUT))


def _client(engine, tokenizer, **options) -> TestClient:
    return TestClient(create_app(engine, tokenizer, ServeOptions("m", True, **options)))


@pytest.fixture
def http(engine, tokenizer):
    return _client(engine, tokenizer)


@pytest.fixture
def claude(http):
    return anthropic.Anthropic(base_url=str(http.base_url), api_key="k", http_client=http, max_retries=0)


@pytest.fixture
def oai(http):
    return openai.OpenAI(base_url=str(http.base_url) + "/v1", api_key="k", http_client=http, max_retries=0)


def _chat_prompt(http, engine, body: dict) -> list[int]:
    assert http.post("/v1/chat/completions", json={"max_tokens": 1, **body}).status_code == 200
    return engine.prompts[-1]


# ------------------------------------------------------------------------------ Anthropic Messages

CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": [
            {"type": "thinking", "thinking": "Use the tool.", "signature": "x"},
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
        ],
    },
    {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
            {"type": "text", "text": "And tomorrow?"},
        ],
    },
]
OPENAI_CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "Let me check.",
        "reasoning_content": "Use the tool.",
        "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
    {"role": "user", "content": "And tomorrow?"},
]


def test_messages_render_like_the_openai_conversation(claude, http, engine):
    claude.messages.create(
        model="m",
        max_tokens=1,
        system=[{"type": "text", "text": "Be brief."}],
        messages=CONVERSATION,
        tools=ANTHROPIC_TOOLS,
    )
    expected = _chat_prompt(http, engine, {"messages": OPENAI_CONVERSATION, "tools": OPENAI_TOOLS})
    assert engine.prompts[0] == expected
    count = claude.messages.count_tokens(
        model="m", system="Be brief.", messages=CONVERSATION, tools=ANTHROPIC_TOOLS
    ).input_tokens
    assert count == len(expected)


def test_message_blocks_stop_reason_and_usage(claude, engine):
    msg = claude.messages.create(model="m", max_tokens=200, messages=CONVERSATION[:1], tools=ANTHROPIC_TOOLS)
    assert [b.type for b in msg.content] == ["thinking", "text", "tool_use"]
    assert msg.content[0].thinking == REASONING and msg.content[1].text == CONTENT
    call = msg.content[2]
    assert call.name == "get_weather" and call.input == {"city": "Paris", "days": 2} and call.id.startswith("toolu_")
    assert msg.stop_reason == "tool_use" and msg.usage.output_tokens == len(engine.script) + 1
    assert msg.usage.input_tokens == len(engine.prompts[-1])


def test_stream_helper_builds_the_same_message(claude):
    kwargs = {"model": "m", "max_tokens": 200, "messages": CONVERSATION[:1], "tools": ANTHROPIC_TOOLS}
    whole = claude.messages.create(**kwargs)
    with claude.messages.stream(**kwargs) as stream:
        types = [event.type for event in stream]
        final = stream.get_final_message()
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]
    assert types.count("content_block_start") == types.count("content_block_stop") == 3
    strip = {"id"}  # the message ids and tool-use ids differ between the two requests
    assert final.stop_reason == whole.stop_reason
    assert [b.model_dump(exclude=strip) for b in final.content] == [b.model_dump(exclude=strip) for b in whole.content]


def test_stop_sequence_max_tokens_and_thinking_controls(claude, engine):
    msg = claude.messages.create(model="m", max_tokens=200, messages=CONVERSATION[:1], stop_sequences=["look"])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == "look"
    assert msg.content[0].thinking == "Let me "
    msg = claude.messages.create(model="m", max_tokens=3, messages=CONVERSATION[:1], thinking={"type": "disabled"})
    assert msg.stop_reason == "max_tokens" and engine.prompts[-1][-1] == 128822  # the prompt closes reasoning
    claude.messages.create(
        model="m", max_tokens=3, messages=CONVERSATION[:1], thinking={"type": "enabled", "budget_tokens": 32000}
    )
    assert engine.prompts[-1][-1] == 128821  # <think>: thinking on
    claude.messages.create(model="m", max_tokens=20_000, messages=CONVERSATION[:1])
    assert engine.params[-1].max_tokens == 1024 - len(engine.prompts[-1])  # cut to what the context holds


def test_forced_tool_choice_constrains_the_reply(claude, engine):
    claude.messages.create(
        model="m",
        max_tokens=50,
        messages=CONVERSATION[:1],
        tools=ANTHROPIC_TOOLS,
        tool_choice={"type": "tool", "name": "get_weather"},
        thinking={"type": "disabled"},
    )
    params = engine.params[-1]
    assert params.structured is not None and params.structured.kind == "structural_tag"
    assert "get_weather" in params.structured.spec and params.forced_tokens


def test_anthropic_errors_use_anthropic_envelope(http, engine, tokenizer):
    resp = http.post("/v1/messages", json={"model": "m", "messages": CONVERSATION[:1]})
    assert resp.status_code == 400 and resp.json() == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "max_tokens is required"},
    }
    assert http.post("/v1/messages", json={"model": "x", "max_tokens": 1, "messages": []}).json()["error"]["type"] == (
        "not_found_error"
    )
    keyed = _client(engine, tokenizer, api_key="secret")
    body = {"model": "m", "max_tokens": 1, "messages": CONVERSATION[:1]}
    denied = keyed.post("/v1/messages", json=body, headers={"x-api-key": "wrong"})
    assert denied.status_code == 401 and denied.json()["error"]["type"] == "authentication_error"
    assert keyed.post("/v1/messages", json=body, headers={"x-api-key": "secret"}).status_code == 200
    assert (
        keyed.post("/v1/chat/completions", json={**body, "max_tokens": 1}, headers={"x-api-key": "secret"}).status_code
        == 200
    )


# ------------------------------------------------------------------------------ OpenAI Responses

RESPONSES_INPUT = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "type": "reasoning",
        "id": "rs_1",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": "Use the tool."}],
    },
    {"role": "assistant", "content": [{"type": "output_text", "text": "Let me check."}]},
    {"type": "function_call", "call_id": "toolu_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
    {"type": "function_call_output", "call_id": "toolu_1", "output": "sunny"},
    {"role": "user", "content": [{"type": "input_text", "text": "And tomorrow?"}]},
]
RESPONSES_TOOLS = [
    {"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": SCHEMA}
]


def test_responses_input_renders_like_the_openai_conversation(oai, http, engine):
    oai.responses.create(model="m", instructions="Be brief.", input=RESPONSES_INPUT, tools=RESPONSES_TOOLS)
    expected = _chat_prompt(http, engine, {"messages": OPENAI_CONVERSATION, "tools": OPENAI_TOOLS})
    assert engine.prompts[0] == expected


def test_response_items_and_statuses(oai):
    out = oai.responses.create(model="m", input="Weather in Paris?", tools=RESPONSES_TOOLS)
    assert out.status == "completed" and [i.type for i in out.output] == ["reasoning", "message", "function_call"]
    assert out.output[0].content[0].text == REASONING and out.output_text == CONTENT
    call = out.output[2]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris", "days": 2}
    cut = oai.responses.create(model="m", input="Weather in Paris?", max_output_tokens=3)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"


def test_response_stream_events_build_the_same_output(oai):
    whole = oai.responses.create(model="m", input="Weather in Paris?", tools=RESPONSES_TOOLS)
    events = list(oai.responses.create(model="m", input="Weather in Paris?", tools=RESPONSES_TOOLS, stream=True))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert (reasoning, text) == (REASONING, CONTENT)
    final = events[-1].response
    assert [i.type for i in final.output] == [i.type for i in whole.output]
    assert final.output[2].arguments == whole.output[2].arguments


def test_responses_text_format_and_stateless_400s(oai, engine):
    fmt = {"format": {"type": "json_schema", "name": "w", "schema": SCHEMA}}
    oai.responses.create(model="m", input="Weather?", text=fmt, reasoning={"effort": "none"})
    params = engine.params[-1]
    assert params.structured.kind == "json_schema" and json.loads(params.structured.spec) == SCHEMA
    assert params.structured.after_token is None  # thinking off: the reply is JSON from its first token
    for bad in ({"previous_response_id": "resp_1"}, {"store": True}):
        with pytest.raises(openai.BadRequestError, match="keeps no state"):
            oai.responses.create(model="m", input="Hi", **bad)
