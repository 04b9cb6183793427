"""The HTTP API against a real server process on dsv4-tiny (random weights: structure, not content)."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from .api_server import ONE_TORCH_THREAD, running_server

MAX_MODEL_LEN = 2048
HELLO = [{"role": "user", "content": "Hello!"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def server(tiny_cache, tmp_path_factory):
    log = tmp_path_factory.mktemp("api") / "server.log"
    args = ("--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "4")
    with running_server(tiny_cache, log, *args, env=ONE_TORCH_THREAD) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def sdk(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0)


def sse_events(raw: str) -> list[str]:
    """The payloads of `data: ...\\n\\n` events; asserts the framing on the way."""
    assert raw.endswith("data: [DONE]\n\n")
    events = raw.split("\n\n")[:-1]
    for event in events:
        assert event.startswith("data: ") and "\n" not in event, event
    return [e[len("data: ") :] for e in events]


def test_startup_report_health_version_models(server, http):
    log = server.log()
    assert "checkpoint validated" in log and "--max-model-len" in log
    assert "KV capacity" in log and "prefill chunk" in log and "bound by" in log
    assert http.get("/health").json() == {"status": "ok"}
    assert isinstance(http.get("/version").json()["version"], str)
    models = http.get("/v1/models").json()
    assert models["object"] == "list" and len(models["data"]) == 1
    card = models["data"][0]
    assert card["id"] == "dsv4-tiny" and card["object"] == "model" and card["max_model_len"] == MAX_MODEL_LEN
    assert isinstance(card["created"], int) and card["owned_by"]


def test_chat_non_stream_with_the_sdk(sdk):
    out = sdk.chat.completions.create(
        model="dsv4-tiny",
        messages=HELLO,
        max_tokens=4,
        logprobs=True,
        top_logprobs=2,
        extra_body={"some_unknown_field": 1},
    )
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-") and len(out.choices) == 1
    choice = out.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.message.role == "assistant"
    extra = choice.message.model_extra
    assert isinstance(extra["reasoning_content"], str) and extra["reasoning"] == extra["reasoning_content"]
    assert "<think>" not in (choice.message.content or "")
    assert out.usage.prompt_tokens > 0 and 1 <= out.usage.completion_tokens <= 4
    assert out.usage.prompt_tokens_details.cached_tokens is not None
    entries = choice.logprobs.content
    assert len(entries) == out.usage.completion_tokens and all(len(e.top_logprobs) == 2 for e in entries)


def test_chat_stream_n2_with_the_async_sdk(server):
    async def run():
        client = openai.AsyncOpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0)
        stream = await client.chat.completions.create(
            model="dsv4-tiny", messages=HELLO, max_tokens=3, n=2, stream=True, stream_options={"include_usage": True}
        )
        return [chunk async for chunk in stream]

    chunks = asyncio.run(run())
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 2
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens is not None
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks[:-1] if c.choices[0].index == index]
        assert mine[0].delta.role == "assistant"
        assert sum(c.finish_reason is not None for c in mine) == 1 and mine[-1].finish_reason is not None


def test_sse_framing_and_continuous_usage(http):
    body = {
        "messages": HELLO,
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        raw = resp.read().decode()
    events = [json.loads(e) for e in sse_events(raw)[:-1]]
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert all("usage" in e for e in events[1:])
    assert events[-1]["choices"] == [] and events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


@pytest.mark.parametrize(
    "controls",
    [
        {"reasoning_effort": "none"},
        {"chat_template_kwargs": {"thinking": False}},
        {"thinking": {"type": "disabled"}},
        {"chat_template_kwargs": {"reasoning_effort": "none"}},
    ],
)
def test_thinking_off_controls(http, controls):
    out = http.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 1, **controls}).json()
    message = out["choices"][0]["message"]
    assert message["reasoning_content"] is None and message["reasoning"] is None


def test_default_thinking_opens_reasoning_in_the_prompt(http):
    on = http.post("/tokenize", json={"messages": HELLO}).json()["tokens"]
    off = http.post("/tokenize", json={"messages": HELLO, "chat_template_kwargs": {"thinking": False}}).json()
    assert on[-1] == 128821 and off["tokens"][-1] == 128822  # <think> / </think>


def test_tools_request_shape(sdk):
    out = sdk.chat.completions.create(
        model="dsv4-tiny",
        messages=[{"role": "user", "content": "Paris?"}],
        tools=TOOLS,
        tool_choice="auto",
        max_tokens=4,
    )
    choice = out.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert "DSML" not in (choice.message.content or "")
    assert isinstance(choice.message.tool_calls, list)


def test_named_tool_choice_forces_a_call_of_that_function(http):
    # thinking off, so the call opens at once (after reasoning it opens after </think>: tests/unit/test_tool_choice.py)
    body = {
        "model": "dsv4-tiny",
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": 24,
        "logprobs": True,
        "chat_template_kwargs": {"thinking": False},
    }
    choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    text = "".join(c["token"] for c in choice["logprobs"]["content"])
    assert text.startswith('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n')
    assert "DSML" not in (choice["message"].get("content") or "")  # the markup never reaches content


def test_completions_text_and_token_prompts(sdk):
    out = sdk.completions.create(model="dsv4-tiny", prompt="The sky is", max_tokens=3, echo=True, logprobs=1)
    choice = out.choices[0]
    assert out.object == "text_completion" and choice.text.startswith("The sky is")
    # echo + logprobs: the prompt's tokens come first, each with its logprob (the first has none)
    lp = choice.logprobs
    assert len(lp.tokens) == out.usage.prompt_tokens + out.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and all(len(t) >= 1 for t in lp.top_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert "".join(lp.tokens[: out.usage.prompt_tokens]) == "The sky is"
    ids = sdk.completions.create(model="dsv4-tiny", prompt=[33310, 2058], max_tokens=2)
    assert ids.usage.prompt_tokens == 2 and ids.usage.prompt_tokens_details.cached_tokens is not None
    chunks = list(sdk.completions.create(model="dsv4-tiny", prompt="Hi", max_tokens=2, stream=True))
    assert sum(c.choices[0].finish_reason is not None for c in chunks) == 1


def test_stop_string_cuts_and_never_leaks_into_the_stream(http):
    body = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    full = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    k = next(i for i in range(1, len(full) - 2) if full.find(full[i : i + 3]) == i)
    stop = full[k : k + 3]
    cut = http.post("/v1/completions", json={**body, "stop": [stop]}).json()["choices"][0]
    assert cut["text"] == full[:k] and cut["finish_reason"] == "stop"
    with http.stream("POST", "/v1/completions", json={**body, "stop": stop, "stream": True}) as resp:
        events = [json.loads(e) for e in sse_events(resp.read().decode())[:-1]]
    assert "".join(e["choices"][0]["text"] for e in events) == full[:k]


def test_seeded_requests_repeat(http):
    body = {"messages": HELLO, "max_tokens": 3, "seed": 7, "temperature": 1.0, "n": 2}
    a, b = (http.post("/v1/chat/completions", json=body).json() for _ in range(2))
    assert [c["message"] for c in a["choices"]] == [c["message"] for c in b["choices"]]


def test_tokenize_and_detokenize(http):
    tok = http.post("/tokenize", json={"prompt": "hello world"}).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == MAX_MODEL_LEN
    assert http.post("/detokenize", json={"tokens": tok["tokens"]}).json() == {"prompt": "hello world"}
    chat = http.post("/tokenize", json={"messages": HELLO, "add_generation_prompt": True}).json()
    assert chat["tokens"][0] == 0 and chat["count"] > 3  # BOS first


def test_metrics_names(http):
    text = http.get("/metrics").text
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "time_to_first_token_seconds_bucket",
        "inter_token_latency_seconds_bucket",
        "e2e_request_latency_seconds_bucket",
        "prompt_tokens_total",
        "generation_tokens_total",
        'request_success_total{finished_reason="length"}',
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
        "kv_cache_usage_perc",
        "prefill_chunk_tokens",
        "oom_recoveries_total",
        "worker_restarts_total",
    ):
        assert "dsv4serve:" + name in text, name


CHAT_400 = [
    ({"messages": HELLO, "max_tokens": "many"}, "max_tokens"),
    ({"messages": "hi"}, "messages"),
    ({}, "messages"),
    ({"messages": HELLO, "stream_options": {"include_usage": True}}, "stream_options"),
    (
        {"messages": HELLO, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
    ),
    ({"messages": HELLO, "tool_choice": "auto"}, "tool_choice"),
    ({"messages": HELLO, "top_k": -2}, "top_k"),
    ({"messages": HELLO, "model": 5}, "model"),
    ({"messages": HELLO, "stop_token_ids": [10**7]}, "stop_token_ids"),
    ({"messages": HELLO, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": HELLO, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": HELLO, "n": 0}, "n"),
    ({"messages": HELLO, "temperature": -0.5}, "temperature"),
    ({"messages": HELLO, "top_p": 0}, "top_p"),
    ({"messages": HELLO, "top_p": 1.5}, "top_p"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "assistant", "content": "x"}]}, "messages"),
    ({"messages": HELLO, "reasoning_effort": "extreme"}, None),
    ({"messages": HELLO, "thinking": {"type": "maybe"}}, "thinking"),
    ({"messages": HELLO, "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ({"messages": HELLO, "max_completion_tokens": MAX_MODEL_LEN, "max_tokens": 1}, "max_tokens"),
    ({"messages": HELLO, "max_tokens": 0}, "max_tokens"),
]


@pytest.mark.parametrize("body,param", CHAT_400)
def test_chat_bad_input_is_400_with_the_envelope(http, body, param):
    resp = http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param:
        assert error["param"] == param, error


@pytest.mark.parametrize(
    "raw",
    [
        b"{not json",
        b"[1, 2]",
        b"",
        b'{"prompt": "\\ud800", "messages": [{"role": "user", "content": "\\ud800"}]}',
        b"\xff\xfe",
    ],
)
def test_undecodable_bodies_are_400_never_422(http, raw):
    for path in ("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"):
        resp = http.post(path, content=raw, headers={"content-type": "application/json"})
        assert resp.status_code == 400, (path, resp.text)


def test_context_limits_name_the_context_length(http):
    long_prompt = {"prompt": [100] * MAX_MODEL_LEN, "max_tokens": 1}
    for body in (long_prompt, {"prompt": "hi", "max_tokens": MAX_MODEL_LEN}):
        resp = http.post("/v1/completions", json=body)
        assert resp.status_code == 400 and str(MAX_MODEL_LEN) in resp.json()["error"]["message"]
    resp = http.post("/v1/completions", json={"prompt": [10**7], "max_tokens": 1})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt"


def test_404_405(http):
    resp = http.post("/v1/chat/completions", json={"model": "gpt-4", "messages": HELLO})
    assert resp.status_code == 404 and resp.json()["error"]["param"] == "model"
    assert http.get("/v1/models/gpt-4").status_code == 404
    assert http.get("/v1/nothing-here").status_code == 404 and "error" in http.get("/nope").json()
    resp = http.get("/v1/chat/completions")
    assert resp.status_code == 405 and "error" in resp.json()
