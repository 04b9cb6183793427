"""The API app in-process with a stand-in engine: keys, readiness, text helpers. No worker, no model."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from dsv4serve.api.app import ServeOptions, create_app
from dsv4serve.api.detokenize import IncrementalDetokenizer
from dsv4serve.api.generation import StopStrings
from dsv4serve.api.tokenizer import TextTokenizer

HELLO = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


class NotReadyEngine:
    """What the API sees while the worker loads or restarts."""

    healthy = False
    ready_info = None
    stats = None
    worker_restarts_total = 0


@pytest.fixture(scope="module")
def tokenizer() -> TextTokenizer:
    return TextTokenizer.for_model(Path("/nonexistent"))  # the bundled DeepSeek-V4 tokenizer


def client(tokenizer, api_key=None) -> TestClient:
    return TestClient(create_app(NotReadyEngine(), tokenizer, ServeOptions("m", True, api_key)))


def test_api_key_guards_v1_and_tokenize_but_not_health_or_metrics(tokenizer):
    c = client(tokenizer, api_key="sekret")
    for method, path in (
        ("get", "/v1/models"),
        ("post", "/v1/chat/completions"),
        ("post", "/tokenize"),
        ("post", "/detokenize"),
    ):
        resp = getattr(c, method)(path)
        assert resp.status_code == 401 and resp.json()["error"]["code"] == 401, path
        bad = getattr(c, method)(path, headers={"Authorization": "Bearer wrong"})
        assert bad.status_code == 401
    assert c.get("/v1/models", headers={"Authorization": "Bearer sekret"}).status_code == 200
    assert c.get("/metrics").status_code == 200 and c.get("/health").status_code == 503
    assert c.get("/version").status_code == 200


def test_not_ready_is_503_and_checks_come_first(tokenizer):
    c = client(tokenizer)
    health = c.get("/health")
    assert health.status_code == 503 and "error" in health.json()
    resp = c.post("/v1/chat/completions", json=HELLO)
    assert resp.status_code == 503 and resp.json()["error"]["type"]
    assert c.post("/v1/chat/completions", json={**HELLO, "n": 0}).status_code == 400
    assert c.post("/v1/completions", json={"prompt": "x", "model": "other"}).status_code == 404


def test_detokenizer_never_emits_part_of_a_character(tokenizer):
    text = "Grüße 🦙🦙 from 北京, naïve café ✓"
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push([i]) for i in ids] + [detok.flush()]
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
    assert len(ids) > len([p for p in pieces if p])  # some tokens completed no character alone


def test_detokenizer_keeps_the_markers_the_chat_parser_needs(tokenizer):
    ids = tokenizer.encode("a</think>b<｜DSML｜tool_calls>")
    assert IncrementalDetokenizer(tokenizer, skip_special_tokens=True).push(ids) == "a</think>b<｜DSML｜tool_calls>"


@pytest.mark.parametrize(
    "pieces", [["hello wor", "ld STOP here"], ["hello world S", "T", "OP here"], ["hello world STOP", " here"]]
)
def test_stop_strings_hold_back_partial_matches(pieces):
    stops = StopStrings(("STOP",), include=False)
    out, matched = "", False
    for piece in pieces:
        text, matched = stops.push(piece)
        out += text
        assert "S" not in text.replace("hello world", "")  # never a partial "STOP"
        if matched:
            break
    assert matched and out == "hello world "


def test_stop_string_kept_when_asked_and_released_when_not_matched():
    keep = StopStrings(("END",), include=True)
    assert keep.push("abcEN") == ("abc", False) and keep.push("Dxyz") == ("END", True)
    loose = StopStrings(("END",), include=False)
    assert loose.push("abE") == ("a", False) and loose.flush() == "bE"
