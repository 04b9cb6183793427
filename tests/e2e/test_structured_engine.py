"""Structured output in a real worker whose KV pool is too small for its requests: they are preempted
and recomputed mid-reply, and each request's grammar matcher (kept beside the runner's request, not its
sequence) must still be where its tokens left it; every reply validates against its schema."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import jsonschema
import pytest

from dsv4serve.api.tokenizer import TextTokenizer
from dsv4serve.ipc.sampling import SamplingParams, StructuredOutput

from .api_server import ONE_TORCH_THREAD
from .conftest import LoopThread, launch_for, start_client

# bounded, so the grammar's end is always reached within max_tokens: at most 46 bytes of JSON (a 6-character
# string of 4-byte characters, 3 digits) plus EOS, each token at least one byte. An unbounded integer
# ([1-9][0-9]*) almost never ends on random weights: ~1,100 digit tokens against one `}` at every step
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "n": {"type": "integer", "minimum": 0, "maximum": 999}},
    "required": ["name", "n"],
    "additionalProperties": False,
}
KV_TOKENS = 128  # 8 pages of 16 tokens
PROMPT_TOKENS = 30  # 2 pages each: four prompts fill the pool, so growing replies must preempt


@pytest.mark.slow
def test_replies_validate_through_preemption(tiny_dir, monkeypatch):
    tokenizer = TextTokenizer.for_model(Path(tiny_dir))
    for name, value in ONE_TORCH_THREAD.items():
        monkeypatch.setenv(name, value)  # read by the worker this test spawns
    lt = LoopThread()
    client = start_client(lt, launch_for(tiny_dir, num_tokens=KV_TOKENS, max_num_seqs=4, max_model_len=KV_TOKENS))
    params = SamplingParams(
        temperature=1.0, max_tokens=90, structured=StructuredOutput("json_schema", json.dumps(SCHEMA))
    )

    async def one(i: int) -> tuple[list[int], str | None]:
        prompt = [0] + list(range(1000 + 40 * i, 1000 + 40 * i + PROMPT_TOKENS - 1))
        tokens, reason = [], None
        async for out in client.generate(f"pre-{i}", prompt, params):
            tokens += [t.token_id for t in out.tokens]
            reason = out.finish_reason or reason
        return tokens, reason

    async def run():
        return await asyncio.gather(*[one(i) for i in range(4)])

    try:
        results = lt.run(run(), timeout=1200)
    finally:
        lt.run(client.shutdown())
        lt.close()
    # the pool cannot hold the four replies at once: at least one request was preempted and recomputed
    assert sum(PROMPT_TOKENS + len(tokens) for tokens, _ in results) > KV_TOKENS
    for tokens, reason in results:
        assert reason == "stop" and tokens[-1] == 1, (reason, tokenizer.decode(tokens, skip_special_tokens=False))
        jsonschema.validate(json.loads(tokenizer.decode(tokens[:-1], skip_special_tokens=False)), SCHEMA)
