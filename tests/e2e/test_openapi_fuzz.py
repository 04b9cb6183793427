"""A fuzzer no one here wrote (schemathesis) over /openapi.json: no input may produce a 5xx."""

from __future__ import annotations

import shutil
import subprocess

import httpx
import pytest

from .api_server import ONE_TORCH_THREAD, ServerProcess


@pytest.fixture(scope="module")
def server(tiny_cache, tmp_path_factory):
    # a short context bounds every generation the fuzzer can ask for (longer asks are 400s, or, on the
    # Anthropic and Responses APIs, cut to what the context holds)
    log = tmp_path_factory.mktemp("fuzz") / "server.log"
    srv = ServerProcess(tiny_cache, log, "--max-model-len", "32", env=ONE_TORCH_THREAD)
    srv.wait_healthy()
    yield srv
    srv.stop()


def test_openapi_describes_the_request_bodies(server):
    schema = httpx.get(server.base + "/openapi.json").json()
    body = schema["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"]["$ref"].endswith("/ChatCompletionRequest")
    assert "messages" in schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]


def _fuzz(server, tmp_path, *selection: str) -> None:
    exe = shutil.which("schemathesis") or pytest.fail("schemathesis is not installed (pip install -e '.[test]')")
    out = subprocess.run(
        [
            exe,
            "run",
            server.base + "/openapi.json",
            "--checks",
            "not_a_server_error",
            "--max-examples",
            "5",
            "--workers",
            "1",
            "--request-timeout",
            "60",
            "--generation-deterministic",
            *selection,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    tail = out.stdout[-3000:]
    assert out.returncode == 0, tail  # non-zero when any generated request got a 5xx
    cases = tail.split("Test cases:")[-1].strip().splitlines()[0]
    assert "generated" in cases and "passed" in cases and "failed" not in cases, tail


def test_schemathesis_finds_no_server_error(server, tmp_path):
    _fuzz(server, tmp_path, "--exclude-path", "/v1/responses")


def test_schemathesis_finds_no_server_error_in_responses(server, tmp_path):
    """Most generated Responses requests are valid (any `input` string is) and each one generates to the
    end of the context: the fuzzing phase alone, not the coverage phase's hundred variants."""
    _fuzz(server, tmp_path, "--include-path", "/v1/responses", "--phases", "examples,fuzzing")
