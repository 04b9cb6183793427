"""The API in-process over a scripted engine: known model output, so the chat split (reasoning,
content, tool calls), stop handling, logprobs and engine failures can be checked exactly."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from dsv4serve.api import state as state_module
from dsv4serve.api.app import ServeOptions, create_app
from dsv4serve.api.tokenizer import TextTokenizer
from dsv4serve.chat.tools import render_tool_calls
from dsv4serve.ipc.messages import Ready, RequestOutput, TokenLogprob, TokenOut
from dsv4serve.memory.chunk_planner import ChunkPlan
from dsv4serve.supervisor import RequestRejected, WorkerDied

EOS = 1
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
CHAT = {"model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS}
REASONING, CONTENT = "Let me look it up.", "Checking."
OUTPUT = REASONING + "</think>" + CONTENT + render_tool_calls([("get_weather", {"city": "Paris"})])


class ScriptedEngine:
    """Emits `script` one token per output, then EOS; or fails as told."""

    healthy = True
    stats = None
    worker_restarts_total = 0

    def __init__(self, script: list[int]):
        self.script = script
        self.fail: Exception | None = None
        self.fail_after = 0
        self.ready_info = Ready("cpu", 4096, 4, 1024, ChunkPlan(None, 512, "kv-pool", "test"), None, 129280, EOS)
        self.requests = []

    async def generate(self, request_id, prompt, sampling):
        self.requests.append(sampling)
        tokens = self.script + [EOS]
        if sampling.max_tokens is not None:
            tokens = tokens[: sampling.max_tokens]
        for i, token in enumerate(tokens):
            if self.fail is not None and i == self.fail_after:
                raise self.fail
            last = i == len(tokens) - 1
            reason = ("stop" if token == EOS else "length") if last else None
            top = [TokenLogprob(token, -0.5)] * (sampling.logprobs or 0)
            yield RequestOutput(request_id, [TokenOut(token, -0.5, top)], len(prompt), 0, reason)


@pytest.fixture(scope="module")
def tokenizer() -> TextTokenizer:
    return TextTokenizer.for_model(Path("/nonexistent"))


@pytest.fixture
def setup(tokenizer):
    engine = ScriptedEngine(tokenizer.encode(OUTPUT))
    return engine, TestClient(create_app(engine, tokenizer, ServeOptions("m", True)))


def test_non_streamed_reasoning_content_and_tool_calls(setup):
    _, client = setup
    out = client.post("/v1/chat/completions", json=CHAT).json()
    choice = out["choices"][0]
    message = choice["message"]
    assert message["reasoning_content"] == message["reasoning"] == REASONING
    assert message["content"] == CONTENT and choice["finish_reason"] == "tool_calls"
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def test_streamed_split_never_leaks_markup(setup):
    engine, client = setup
    with client.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
        raw = resp.read().decode()
    assert raw.endswith("data: [DONE]\n\n")
    chunks = [json.loads(e[6:]) for e in raw.split("\n\n")[:-2]]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert "".join(d.get("reasoning_content", "") for d in deltas) == REASONING
    assert "".join(d.get("reasoning", "") for d in deltas) == REASONING
    assert "".join(d.get("content", "") for d in deltas) == CONTENT
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert len(calls) == 1 and calls[0]["index"] == 0 and calls[0]["function"]["name"] == "get_weather"
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert finishes == ["tool_calls"]


def test_stop_string_inside_reasoning_and_logprobs(setup):
    _, client = setup
    body = {**CHAT, "stop": ["look"], "logprobs": True, "top_logprobs": 1}
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["message"]["reasoning_content"] == "Let me " and choice["finish_reason"] == "stop"
    assert all(len(e["top_logprobs"]) == 1 for e in choice["logprobs"]["content"])


def test_max_completion_tokens_wins_and_n_seeds_follow_vllm(setup):
    engine, client = setup
    body = {**CHAT, "max_tokens": 50, "max_completion_tokens": 3, "n": 2, "seed": 10}
    out = client.post("/v1/chat/completions", json=body).json()
    assert [c["finish_reason"] for c in out["choices"]] == ["length", "length"]
    assert out["usage"]["completion_tokens"] == 6 and out["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert [s.max_tokens for s in engine.requests] == [3, 3] and sorted(s.seed for s in engine.requests) == [10, 11]


@pytest.mark.parametrize(
    "failure, status",
    [
        (WorkerDied("the worker process died"), 503),
        (RequestRejected(503, "the queue is full"), 503),
        (RuntimeError("an engine bug"), 503),
    ],
)
def test_engine_failures_are_503_json_or_an_error_event(setup, failure, status):
    engine, client = setup
    engine.fail, engine.fail_after = failure, 0
    resp = client.post("/v1/chat/completions", json=CHAT)
    assert resp.status_code == status and resp.json()["error"]["message"]
    engine.fail_after = 2  # mid-stream: an error event, then [DONE]
    with client.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
        events = resp.read().decode().split("\n\n")[:-1]
    assert resp.status_code == 200 and events[-1] == "data: [DONE]"
    assert set(json.loads(events[-2][6:])["error"]) == {"message", "type", "param", "code"}


def test_unknown_fields_are_ignored_and_logged_once(setup, caplog):
    _, client = setup
    body = {**CHAT, "max_tokens": 1, "frobnicate": True, "stream_options": None}
    with caplog.at_level("WARNING", logger="dsv4serve.api"):
        for _ in range(2):
            assert client.post("/v1/chat/completions", json=body).status_code == 200
    assert sum("frobnicate" in r.getMessage() for r in caplog.records) == 1


def test_completions_batch_prompts_n_and_echo(setup, tokenizer):
    engine, client = setup
    engine.script = tokenizer.encode(" world")
    body = {"model": "m", "prompt": ["Hello", "hello"], "n": 2, "echo": True, "max_tokens": 5, "logprobs": 0}
    out = client.post("/v1/completions", json=body).json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in out["choices"]] == ["Hello world", "Hello world", "hello world", "hello world"]
    assert all(c["finish_reason"] == "stop" for c in out["choices"])
    assert out["usage"]["prompt_tokens"] == 2  # each prompt once, not once per choice
    assert out["choices"][0]["logprobs"]["tokens"][0] == " world"
    with client.stream("POST", "/v1/completions", json={**body, "prompt": "Hi", "n": 1, "stream": True}) as resp:
        events = [json.loads(e[6:]) for e in resp.read().decode().split("\n\n")[:-2]]
    assert "".join(e["choices"][0]["text"] for e in events) == "Hi world"
    assert events[0]["object"] == "text_completion"


class ThreadNotingTokenizer:
    """The real tokenizer, noting the thread of every encode."""

    def __init__(self, inner: TextTokenizer):
        self.inner, self.threads = inner, []

    def encode(self, text, add_special_tokens=False):
        self.threads.append(threading.current_thread().name)
        return self.inner.encode(text, add_special_tokens)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_rendering_tokenizing_and_large_bodies_never_run_on_the_event_loop(tokenizer, monkeypatch):
    """The structural half of the e2e pacing test: every route that tokenizes a prompt, and the parse of
    a large body, runs on the text pool's threads, whatever the machine's speed."""
    noting = ThreadNotingTokenizer(tokenizer)
    engine = ScriptedEngine(tokenizer.encode(" ok"))
    client = TestClient(create_app(engine, noting, ServeOptions("m", True)))
    parsed_on = []
    parse = state_module.parse_json
    monkeypatch.setattr(
        state_module, "parse_json", lambda raw: parsed_on.append(threading.current_thread().name) or parse(raw)
    )
    anthropic = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    big = {**CHAT, "max_tokens": 1, "messages": [{"role": "user", "content": "a " * state_module.PARSE_ON_LOOP_BYTES}]}
    for path, body in (
        ("/v1/chat/completions", CHAT),
        ("/v1/completions", {"model": "m", "prompt": "Hello", "max_tokens": 2}),
        ("/tokenize", {"prompt": "Hello"}),
        ("/v1/messages", anthropic),
        ("/v1/messages/count_tokens", anthropic),
    ):
        noting.threads.clear()
        resp = client.post(path, json=body)
        assert resp.status_code == 200, (path, resp.text[:300])
        assert noting.threads and all(t.startswith("dsv4serve-text") for t in noting.threads), (path, noting.threads)
    parsed_on.clear()  # small bodies are parsed on the loop, by design (PARSE_ON_LOOP_BYTES)
    resp = client.post("/v1/chat/completions", json=big)  # parsed, then refused by its length alone
    assert resp.status_code == 400 and "maximum context length" in resp.text
    assert len(parsed_on) == 1 and parsed_on[0].startswith("dsv4serve-text"), parsed_on
