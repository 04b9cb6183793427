"""The agent-facing APIs and structured output through a real server on dsv4-tiny (issues #17, #20).

The weights are random, so a reply that validates against its JSON schema can only come from
constrained decoding; the official `anthropic` and `openai` SDKs are the clients, `jsonschema` the judge.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import anthropic
import httpx
import jsonschema
import openai
import pytest

from dsv4serve.api.tokenizer import tokenizer_file

from .api_server import ONE_TORCH_THREAD, running_server

MAX_MODEL_LEN = 1024
THINK_END = 128822
# a small schema, so that a reply from random weights ends within a few dozen tokens
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tag": {"enum": ["x", "y"]},
    },
    "required": ["ok", "n", "tag"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
HELLO = [{"role": "user", "content": "Answer in JSON."}]
TOOLS = [
    {
        "name": "get_weather",
        "description": "Weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]},
    }
]


@pytest.fixture(scope="module")
def server(tiny_cache, tmp_path_factory):
    log = tmp_path_factory.mktemp("agents") / "server.log"
    args = ("--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "16")
    with running_server(tiny_cache, log, *args, env=ONE_TORCH_THREAD) as srv:
        yield srv


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.base, api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=300)


def _chat_body(n: int, thinking: bool, stream: bool) -> dict:
    body = {"messages": HELLO, "n": n, "max_tokens": 120, "response_format": RESPONSE_FORMAT, "stream": stream}
    body["chat_template_kwargs"] = {"thinking": thinking}
    if thinking:  # random weights rarely close their reasoning: a bias on </think> makes it a few tokens long
        body["logit_bias"] = {str(THINK_END): 12}
    return body


async def _contents(client: httpx.AsyncClient, body: dict) -> list[tuple[str, str]]:
    """(finish_reason, content) of every choice, streamed or not."""
    if not body["stream"]:
        resp = await client.post("/v1/chat/completions", json=body)
        assert resp.status_code == 200, resp.text
        return [(c["finish_reason"], c["message"]["content"]) for c in resp.json()["choices"]]
    content, finish = [""] * body["n"], [""] * body["n"]
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    content[choice["index"]] += choice["delta"].get("content") or ""
                    finish[choice["index"]] = choice["finish_reason"] or finish[choice["index"]]
    return list(zip(finish, content))


@pytest.mark.slow
def test_every_json_schema_reply_validates(server):
    """Streamed and not, n = 1 and 3, thinking on and off: 8 requests (16 replies) at once."""
    cases = [(n, thinking, stream) for n in (1, 3) for thinking in (False, True) for stream in (False, True)]

    async def run():
        async with httpx.AsyncClient(base_url=server.base, timeout=600) as client:
            return await asyncio.gather(*[_contents(client, _chat_body(*case)) for case in cases])

    for case, replies in zip(cases, asyncio.run(run())):
        assert len(replies) == case[0]
        for finish, content in replies:
            assert finish == "stop", (case, content)
            jsonschema.validate(json.loads(content), SCHEMA)


def test_a_schema_the_compiler_rejects_is_a_400_naming_it(server):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}
    for stream in (False, True):
        resp = httpx.post(
            server.base + "/v1/chat/completions",
            json={"messages": HELLO, "max_tokens": 4, "response_format": bad, "stream": stream},
            timeout=60,
        )
        assert resp.status_code == 400 and "strin" in resp.json()["error"]["message"]


@pytest.mark.slow
def test_anthropic_sdk_round_trip(claude):
    kwargs = {"model": "dsv4-tiny", "messages": [{"role": "user", "content": "Hi"}]}
    msg = claude.messages.create(**kwargs, max_tokens=6, thinking={"type": "disabled"})
    assert msg.type == "message" and msg.stop_reason in ("end_turn", "max_tokens") and msg.content[0].type == "text"
    assert msg.usage.input_tokens == claude.messages.count_tokens(**kwargs, thinking={"type": "disabled"}).input_tokens
    thinking = {"type": "enabled", "budget_tokens": 2048}
    with claude.messages.stream(**kwargs, max_tokens=6, thinking=thinking) as stream:
        types = [event.type for event in stream]
        final = stream.get_final_message()
    assert types[0] == "message_start" and types[-1] == "message_stop" and "content_block_delta" in types
    assert final.content and final.content[0].type == "thinking" and final.usage.output_tokens <= 6
    forced = claude.messages.create(
        model="dsv4-tiny",
        max_tokens=300,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=TOOLS,
        tool_choice={"type": "tool", "name": "get_weather"},
        thinking={"type": "disabled"},
    )
    (call,) = forced.content
    assert forced.stop_reason == "tool_use" and call.type == "tool_use" and call.name == "get_weather"
    jsonschema.validate(call.input, TOOLS[0]["input_schema"])


@pytest.mark.slow
def test_openai_responses_round_trip(oai):
    out = oai.responses.create(model="dsv4-tiny", input="Hi", max_output_tokens=5, reasoning={"effort": "none"})
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.output[0].type == "message" and out.output_text and out.usage.output_tokens == 5
    fmt = {"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA}}
    events = list(
        oai.responses.create(
            model="dsv4-tiny", input="Answer in JSON.", text=fmt, reasoning={"effort": "none"}, stream=True
        )
    )
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-1].response.output_text
    jsonschema.validate(json.loads(text), SCHEMA)


def test_request_body_limit_through_the_server(server):
    limit = 4 * 2**20 + 48 * MAX_MODEL_LEN  # the default for this max_model_len
    body = b'{"messages": [{"role": "user", "content": "' + b"a" * limit + b'"}]}'
    for path, kind in (("/v1/chat/completions", "RequestTooLargeError"), ("/v1/messages", "request_too_large")):
        resp = httpx.post(server.base + path, content=body, headers={"content-type": "application/json"}, timeout=60)
        assert resp.status_code == 413, resp.text
        assert (resp.json()["error"]["type"]) == kind
    assert httpx.get(server.base + "/health", timeout=5).status_code == 200


# the control window's load: the same tokenization in a process of its own, so that neither this test's
# event loop nor its GIL shares in it, and through the tokenizers library, not the server's code
CONTROL_TOKENIZER = """
import statistics, sys, time
from tokenizers import Tokenizer
tokenizer, text, window_s = Tokenizer.from_file(sys.argv[1]), sys.stdin.read(), float(sys.argv[2])
print("start", flush=True)
start, seconds = time.monotonic(), []
while time.monotonic() < start + window_s:
    began = time.monotonic()
    tokenizer.encode(text)
    seconds.append(time.monotonic() - began)
print(statistics.median(seconds), flush=True)
"""


def _tokenizing_windows(server, tiny_dir) -> dict[str, float]:
    """One measurement: a stream runs; a control window in which a process of this test's tokenizes the
    largest prompt, then a window of such prompts sent to the server. Returns the worst /health
    latency and the worst gap between the stream's chunks, in the control and in the heavy window,
    and the median time of one tokenization in the control window."""
    chars = (MAX_MODEL_LEN - 1) * 128 - 1000
    text = "ab " * (chars // 3)
    big = {"messages": [{"role": "user", "content": text}], "max_tokens": 1}
    stream_body = {"messages": HELLO, "max_tokens": 1000, "ignore_eos": True, "stream": True}
    window_s = 3.0

    async def run():
        async with httpx.AsyncClient(base_url=server.base, timeout=300) as client:
            arrivals: list[float] = []
            marks: list[float] = []  # control start, heavy start, heavy end
            latencies: list[tuple[float, float]] = []  # (sent at, seconds)
            encodes: list[float] = []  # the median seconds of one control tokenization

            async def stream():
                async with client.stream("POST", "/v1/chat/completions", json=stream_body) as resp:
                    async for line in resp.aiter_lines():
                        if line.startswith("data: {"):
                            arrivals.append(time.monotonic())
                        if len(marks) == 3 and arrivals and arrivals[-1] > marks[2] + 1:
                            return

            async def load():
                while len(arrivals) < 8:  # the stream runs: first its pace alone
                    await asyncio.sleep(0.05)
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-c", CONTROL_TOKENIZER, str(tokenizer_file(tiny_dir)), str(window_s),
                    stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                )  # fmt: skip
                assert proc.stdin is not None and proc.stdout is not None
                proc.stdin.write(text.encode())
                proc.stdin.close()
                assert await proc.stdout.readline() == b"start\n"
                marks.append(time.monotonic())  # control: the same tokenizing, in a process of its own
                encodes.append(float(await proc.stdout.readline()))
                assert await proc.wait() == 0
                marks.append(time.monotonic())
                while time.monotonic() < marks[1] + window_s:  # one maximal prompt after another
                    resp = await client.post("/v1/chat/completions", json=big)
                    assert resp.status_code == 400 and "input tokens" in resp.text  # tokenized, then refused
                marks.append(time.monotonic())

            async def health():
                while len(marks) < 3:
                    start = time.monotonic()
                    assert (await client.get("/health")).status_code == 200
                    latencies.append((start, time.monotonic() - start))
                    await asyncio.sleep(0.02)

            await asyncio.gather(stream(), load(), health())
            return arrivals, marks, latencies, encodes

    arrivals, (control, heavy, end), latencies, encodes = asyncio.run(run())
    assert arrivals[-1] > end, "the stream ended before the heavy window did: raise its max_tokens"

    def worst(pairs, lo, hi):
        return max(value for at, value in pairs if lo <= at < hi)

    gaps = [(b, b - a) for a, b in zip(arrivals, arrivals[1:])]
    return dict(
        health_control=worst(latencies, control, heavy),
        health_heavy=worst(latencies, heavy, end),
        gap_control=worst(gaps, control, heavy),
        gap_heavy=worst(gaps, heavy, end + 0.5),
        encode=encodes[0],
    )


@pytest.mark.slow
def test_health_and_a_stream_keep_answering_while_maximal_prompts_tokenize(server, tiny_dir):
    """The largest prompt the server tokenizes (just under the length that proves it too long: the
    longest DeepSeek-V4 token is 128 characters), one after another for 3 s: /health's worst answer
    stays within a quarter of one tokenization of its worst under the same CPU load alone, and a
    running stream keeps its pace.

    The worker shares the CPU with the tokenizer (2 cores in CI), so its steps slow down whatever the
    server does: the bounds are taken against a control window just before, in which a process of this
    test's tokenizes the same text, loading the CPU the same way without the server's part in it. A
    tokenization that holds the event loop, on it or from a thread through the GIL (tokenizers' encode
    does; encode_batch does not), delays some /health by most of one tokenization: 50-250 ms for this
    text on the machines seen, and the GIL-holding encode 30-50 ms of its 60 here, hence a quarter.
    Where the work runs is also checked without a clock, in tests/unit/test_api_scripted.py; this test
    checks what the clock sees, the GIL included.

    CI runs another test file beside this one on its 2 cores, and what that file does changes from one
    window to the next: once in many runs a single gap was 0.72 s against a 0.05 s control, /health
    fine. A server that holds its loop fails every window, so one passing window of three passes; a
    failure prints all three."""
    seen = []
    for _ in range(3):
        m = _tokenizing_windows(server, tiny_dir)
        seen.append(m)
        health_ok = m["health_heavy"] < m["health_control"] + m["encode"] / 4
        if health_ok and m["gap_heavy"] < 2 * m["gap_control"] + 0.25:
            return
    raise AssertionError(f"/health or the stream stalled in every window: {seen}")
