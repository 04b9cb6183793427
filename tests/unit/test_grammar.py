"""Structured output in the worker (worker/grammar.py) on the real DeepSeek-V4 vocabulary, decoded from
random logits through the real sampler: whatever the logits, the text must be what the constraint says,
judged by independent oracles (jsonschema, json.loads, the DSML parser of chat/)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from dsv4serve.chat.constraints import forced_call_constraint, response_format_constraint
from dsv4serve.chat.parser import parse_completion
from dsv4serve.ipc.sampling import SamplingParams, StructuredOutput
from dsv4serve.worker.grammar import GrammarBook, vocabulary_bytes
from dsv4serve.worker.sampling import SamplingRow, sample

VOCAB, EOS, THINK_END = 129280, 1, 128822
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},  # xgrammar's loose string class (strict_json_strings)
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
WEATHER = {
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 10},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "days"],
    },
}


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The steps here are small ops over one vocabulary row: with two threads on a busy 2-core machine
    torch's thread handoffs cost more than the work (a step 7 ms on one thread, up to 150 ms on two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def book() -> GrammarBook:
    return GrammarBook("", VOCAB, EOS)


@pytest.fixture(scope="module")
def vocab(book) -> list[bytes]:
    from tokenizers import Tokenizer

    return vocabulary_bytes(Tokenizer.from_file(book.tokenizer_path), VOCAB)


def _decode(vocab: list[bytes], ids: list[int]) -> str:
    return b"".join(vocab[t] for t in ids).decode("utf-8")


_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def _is_compact(text: str) -> bool:
    """Outside its strings the text is json.dumps' own spelling: no whitespace beyond ", " and ": "."""
    canonical = json.dumps(json.loads(text), ensure_ascii=False)
    return _JSON_STRING.sub('""', text) == _JSON_STRING.sub('""', canonical)


def _run(book: GrammarBook, params: list[SamplingParams], steps: int, seed: int, first: list[list[int]] | None = None):
    """Decode every row from random logits (scale 4: peaked, far from the grammar) until EOS or `steps`."""
    gen = torch.Generator().manual_seed(seed)
    grammars = [book.start(p) for p in params]
    outputs = [list(f) for f in first] if first else [[] for _ in params]
    for g, out in zip(grammars, outputs):
        for t in out if g is not None else ():
            g.advance(t)
    for _ in range(steps):
        live = [i for i, out in enumerate(outputs) if out[-1:] != [EOS]]
        if all(grammars[i] is None for i in live):  # done: a row without a grammar runs on, never ending
            break
        rows = [SamplingRow(params[i], [0], outputs[i], EOS) for i in live]
        logits = torch.randn(len(live), VOCAB, generator=gen) * 4
        picked = sample(logits, rows, gen, token_mask=book.step_mask([grammars[i] for i in live]))
        for j, i in enumerate(live):
            token = int(picked.token_ids[j])
            outputs[i].append(token)
            if grammars[i] is not None:
                grammars[i].advance(token)
    return outputs, grammars


def test_vocabulary_bytes_spell_what_the_tokenizer_decodes(book, vocab):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(book.tokenizer_path)
    text = 'Hé, {"a": [1, 2.5e-3]} \t\n 漢字 ｜DSML｜ 😀'
    ids = tok.encode(text, add_special_tokens=False).ids
    assert _decode(vocab, ids) == tok.decode(ids, skip_special_tokens=False) == text
    assert vocab[EOS] == b"" and vocab[THINK_END] == b""  # never allowed inside a constrained reply


def test_json_schema_replies_validate_from_random_logits(book, vocab):
    kind, spec = response_format_constraint({"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    params = SamplingParams(temperature=1.0, structured=StructuredOutput(kind, spec))
    outputs, grammars = _run(book, [params] * 3 + [SamplingParams(temperature=1.0)], steps=120, seed=0)
    for out in outputs[:3]:
        assert out[-1] == EOS
        text = _decode(vocab, out[:-1])
        jsonschema.validate(json.loads(text), PERSON)  # json.loads is strict: no raw control characters
        assert _is_compact(text), text
    assert grammars[3] is None


def test_json_object_takes_any_object_in_compact_spelling_and_nothing_else(book):
    """json_object: every object as json.dumps spells it (the oracle) is accepted and may end there; a
    value that is not an object, free whitespace and trailing text are refused."""
    kind, spec = response_format_constraint({"type": "json_object"})
    params = SamplingParams(structured=StructuredOutput(kind, spec))
    objects = [{}, {"a": [1, {"b": None}], "c": "x"}, {"k": -2.5e-3, "t": True, "u": "é\\n"}]
    refused = [json.dumps(v) for v in ([1], "x", 3, None)] + ['{"a": 1} x', '{"a": 1,}', '{ "a": 1}', '{"a":1}']

    def accepts(text: str) -> bool:
        matcher = book.start(params).matcher
        return matcher.accept_string(text) and matcher.accept_token(EOS)

    assert all(accepts(json.dumps(obj, ensure_ascii=False)) for obj in objects)
    assert not any(accepts(text) for text in refused)


def test_grammar_starts_after_think_end(book, vocab):
    kind, spec = response_format_constraint({"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    params = SamplingParams(temperature=1.0, structured=StructuredOutput(kind, spec, after_token=THINK_END))
    reasoning = [19, 2057, 1358]  # free text before </think>, not JSON
    outputs, _ = _run(book, [params], steps=150, seed=3, first=[reasoning + [THINK_END]])
    (out,) = outputs
    assert out[: len(reasoning) + 1] == reasoning + [THINK_END] and out[-1] == EOS
    jsonschema.validate(json.loads(_decode(vocab, out[len(reasoning) + 1 : -1])), PERSON)


def test_bitmask_agrees_with_the_matcher(book):
    """Each allowed bit is a token the matcher accepts, each cleared bit one it refuses (sampled ids)."""
    kind, spec = response_format_constraint({"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    grammar = book.start(SamplingParams(structured=StructuredOutput(kind, spec)))
    grammar.matcher.accept_string('{"name": "x", "age": 1')
    mask = book.step_mask([None, grammar])
    assert mask is not None and mask.rows == [1]
    bits = mask.bitmask[1]
    allowed = [t for t in range(VOCAB) if (int(bits[t // 32]) >> (t % 32)) & 1]
    assert 0 < len(allowed) < VOCAB
    for t in allowed[:40] + [t for t in range(0, VOCAB, 997) if t not in set(allowed)][:40]:
        fork = grammar.matcher.fork()
        assert fork.accept_token(t) == (t in set(allowed)), t


def test_forced_tool_call_parses_and_validates(book, vocab):
    """The DSML block a named tool_choice forces: the chat parser reads one call whose arguments follow
    the tool's schema."""
    kind, spec = forced_call_constraint([WEATHER], {"type": "function", "function": {"name": "get_weather"}})
    params = SamplingParams(temperature=1.0, structured=StructuredOutput(kind, spec))
    outputs, _ = _run(book, [params], steps=400, seed=5)
    for out in outputs:
        assert out[-1] == EOS
        parsed = parse_completion(_decode(vocab, out[:-1]), thinking=False)
        (call,) = parsed.tool_calls
        assert call.name == "get_weather" and parsed.content == ""
        jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])


def test_a_schema_the_compiler_rejects_is_named(book):
    bad = SamplingParams(structured=StructuredOutput("json_schema", '{"type": "strin"}'))
    assert "strin" in book.check(bad) and "cannot be enforced" in book.check(bad)
    regex = SamplingParams(structured=StructuredOutput("json_schema", '{"type": "string", "pattern": "(("}'))
    assert "parenthesis" in book.check(regex)
    assert book.check(SamplingParams()) is None
