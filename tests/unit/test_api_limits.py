"""Request limits at the API boundary (issue #20 and the contract's Fine print), in-process: the body
limit while it streams in, the early reject by character count, and the inputs that must be 400s."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from dsv4serve.api.app import ServeOptions, create_app
from dsv4serve.api.tokenizer import TextTokenizer
from dsv4serve.ipc.messages import Ready, RequestOutput, TokenOut
from dsv4serve.memory.chunk_planner import ChunkPlan

LIMIT = 64 * 1024
MAX_MODEL_LEN = 1024
HELLO = {"model": "m", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}


class CountingTokenizer(TextTokenizer):
    def __init__(self, inner: TextTokenizer):
        super().__init__(inner._tok)
        self.encoded_chars = 0

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        self.encoded_chars += len(text)
        return super().encode(text, add_special_tokens)


class OneTokenEngine:
    healthy, stats, worker_restarts_total = True, None, 0
    ready_info = Ready("cpu", 4096, 4, MAX_MODEL_LEN, ChunkPlan(None, 512, "kv-pool", "test"), None, 129280, 1)

    async def generate(self, request_id, prompt, sampling):
        yield RequestOutput(request_id, [TokenOut(1)], len(prompt), 0, "stop")


@pytest.fixture(scope="module")
def tokenizer() -> CountingTokenizer:
    return CountingTokenizer(TextTokenizer.for_model(Path("/nonexistent")))


@pytest.fixture
def client(tokenizer) -> TestClient:
    return TestClient(create_app(OneTokenEngine(), tokenizer, ServeOptions("m", True, max_request_bytes=LIMIT)))


def test_a_declared_body_over_the_limit_is_413_in_each_envelope(client):
    body = b"{" + b" " * LIMIT + b"}"
    resp = client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert resp.status_code == 413
    error = resp.json()["error"]
    assert error["type"] == "RequestTooLargeError" and f"at most {LIMIT}" in error["message"]
    resp = client.post("/v1/messages", content=body, headers={"content-type": "application/json"})
    assert resp.status_code == 413 and resp.json()["error"]["type"] == "request_too_large"
    assert client.post("/v1/chat/completions", json=HELLO).status_code == 200  # under the limit: served


def test_a_chunked_body_is_cut_off_as_it_passes_the_limit(client, tokenizer):
    chunks = [b'{"model": "m", "messages": [{"role": "user", "content": "'] + [b"a" * 8192] * 12 + [b'"}]}']
    before = tokenizer.encoded_chars
    resp = client.post("/v1/chat/completions", content=iter(chunks), headers={"content-type": "application/json"})
    assert resp.status_code == 413 and f"passed {LIMIT} bytes" in resp.json()["error"]["message"]
    assert tokenizer.encoded_chars == before  # refused before anything was parsed or tokenized


def test_a_prompt_whose_length_proves_it_too_long_is_refused_before_tokenizing(client, tokenizer):
    limit_chars = (MAX_MODEL_LEN - 1) * tokenizer.max_token_chars
    assert tokenizer.max_token_chars >= 16  # the bound is a real one: DeepSeek-V4's longest token is 128 spaces
    text = "word " * (limit_chars // 5 + 1)
    wide = TestClient(create_app(OneTokenEngine(), tokenizer, ServeOptions("m", True)))
    before = tokenizer.encoded_chars
    resp = wide.post("/v1/chat/completions", json={**HELLO, "messages": [{"role": "user", "content": text}]})
    assert resp.status_code == 400 and "characters" in resp.json()["error"]["message"]
    assert tokenizer.encoded_chars == before
    prompt = wide.post("/v1/completions", json={"model": "m", "prompt": text})
    assert prompt.status_code == 400 and tokenizer.encoded_chars == before
    # just under the bound it is tokenized (and then refused by the token count, a real 400 too)
    short = "word " * (limit_chars // 5 - 100)
    resp = wide.post("/v1/chat/completions", json={**HELLO, "messages": [{"role": "user", "content": short}]})
    assert resp.status_code == 400 and "input tokens" in resp.json()["error"]["message"]
    assert tokenizer.encoded_chars > before


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"temperature": 2.5}, "temperature"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"tools": []}, "tools"),
        ({"stop": ["x", ""]}, "stop"),
        ({"stop": ""}, "stop"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {str(i): 1 for i in range(128_000, 131_000)}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"allowed_token_ids": [5, 129_280]}, "allowed_token_ids"),
        ({"seed": 2**80}, "seed"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
    ],
)
def test_out_of_range_inputs_are_400s_naming_the_field(client, extra, param):
    resp = client.post("/v1/chat/completions", json={**HELLO, **extra})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text


def test_seed_message_reads_well(client):
    message = client.post("/v1/chat/completions", json={**HELLO, "seed": 2**80}).json()["error"]["message"]
    assert message.startswith("seed must be an integer in [") and "integer a" not in message
