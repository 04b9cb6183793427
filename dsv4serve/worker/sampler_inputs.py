"""What the sampler needs on the device, packed on the host and copied in one transfer; the results back in one.

    inputs = pack_inputs(rows, vocab_size, device, token_mask, staging)   # host work, one H2D copy
    inputs.temperature, inputs.shared_rows, ...                           # device views (None: not needed)
    values = HostReader(device).read(packed)                              # the step's one D2H copy

The per-row parameters (temperatures, top-k / top-p / min-p, penalties, logit_bias, stop and allowed tokens,
forced tokens, the step's grammar bitmask) are written into one int32 buffer on the host:
fp32 values as their bit patterns, int64 indices as word pairs (little-endian; both the host and the device
are). `HostStaging` copies it from pinned memory without blocking the host, and every parameter is a view of
that one device buffer. A torch.tensor(host list, device=...) per parameter would block the host on each
(a pageable copy is synchronous), and a GPU decode step would then wait for the whole forward several times.

Which sections exist depends only on what the rows ask for, never on a device value: the sampler's launches
are decided on the host, and with the same kinds of rows a step issues the same ops whatever the batch size.
Scattered (row, token) positions travel as flat indices row * V + token into the [B, V] logits.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Protocol

import torch

from dsv4serve.ipc.sampling import SamplingParams
from dsv4serve.model.batch import HostStaging

_WORD = "i"  # array code of an int32 word (4 bytes on every platform torch runs on)


class TokenMask(Protocol):
    """A step's grammar bitmask (worker/grammar.TokenMask): rows `rows` of `bitmask` are filled."""

    bitmask: torch.Tensor  # [B, ceil(V / 32)] int32 on the host; bit 1 = allowed
    rows: list[int]  # the constrained rows


@dataclass(frozen=True)
class SamplingRow:
    """What the sampler needs to know about one request at this step."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]  # repetition_penalty looks at prompt + output
    output_token_ids: Sequence[int]  # presence/frequency penalties and min_tokens count these only
    eos_token_id: int | None
    generator: torch.Generator | None = None  # required when params.seed is set; on the logits' device

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


def forced_token(params: SamplingParams, output_token_ids: Sequence[int]) -> int | None:
    """The token this row must produce next (SamplingParams.forced_tokens), or None."""
    if not params.forced_tokens:
        return None
    start = 0
    if params.forced_after is not None:
        try:
            start = list(output_token_ids).index(params.forced_after) + 1
        except ValueError:
            return None  # the trigger has not come yet
    done = len(output_token_ids) - start
    return params.forced_tokens[done] if done < len(params.forced_tokens) else None


def stop_tokens_to_mask(row: SamplingRow) -> list[int]:
    """EOS while ignore_eos or below min_tokens; stop_token_ids below min_tokens."""
    below_min = row.num_output_tokens < row.params.min_tokens
    banned = list(row.params.stop_token_ids) if below_min else []
    if row.eos_token_id is not None and (below_min or row.params.ignore_eos):
        banned.append(row.eos_token_id)
    return banned


class _Packer:
    """Sections of one int32 word buffer, each remembered as (offset, words, dtype, shape)."""

    def __init__(self) -> None:
        self.words = array(_WORD)
        self.sections: dict[str, tuple[int, int, torch.dtype, tuple[int, ...]]] = {}

    def _put(self, name: str, raw: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        if dtype == torch.int64 and len(self.words) % 2:
            self.words.append(0)  # an int64 view needs an even word offset
        start = len(self.words)
        self.words.frombytes(raw)
        self.sections[name] = (start, len(self.words) - start, dtype, shape)

    def raw32(self, name: str, raw: bytes, shape: tuple[int, ...]) -> None:
        self._put(name, raw, torch.int32, shape)

    def int32(self, name: str, values: Sequence[int], shape: tuple[int, ...] | None = None) -> None:
        self._put(name, array(_WORD, values).tobytes(), torch.int32, shape or (len(values),))

    def int64(self, name: str, values: Sequence[int], shape: tuple[int, ...] | None = None) -> None:
        self._put(name, array("q", values).tobytes(), torch.int64, shape or (len(values),))

    def fp32(self, name: str, values: Sequence[float], shape: tuple[int, ...] | None = None) -> None:
        self._put(name, array("f", values).tobytes(), torch.float32, shape or (len(values),))

    def upload(self, device: torch.device, staging: HostStaging | None) -> dict[str, torch.Tensor]:
        """One copy of the whole buffer; every section a view of it."""
        if not self.words:
            return {}
        host = torch.frombuffer(self.words, dtype=torch.int32)  # shares the array's memory: no copy, no op
        dev = staging.upload(host) if staging is not None else host.to(device)
        views = {}
        for name, (start, n, dtype, shape) in self.sections.items():
            part = dev[start : start + n]
            views[name] = (part if dtype == torch.int32 else part.view(dtype)).view(shape)
        return views


@dataclass(frozen=True)
class SamplerInputs:
    """The device views of one step's sampler parameters (module doc); None where no row needs the stage."""

    all_greedy: bool
    greedy: torch.Tensor | None  # [B] int32, 1 = greedy row (only when greedy and sampled rows mix)
    penalty_rows: torch.Tensor | None  # [P] int64, rows with penalties
    output_ids: torch.Tensor | None  # [P, Lo] int64, their output tokens, padded with V
    prompt_ids: torch.Tensor | None  # [P, Lp] int64, their prompt tokens (rows with a repetition penalty), V padded
    repetition: torch.Tensor | None  # [P] fp32
    frequency: torch.Tensor | None  # [P] fp32
    presence: torch.Tensor | None  # [P] fp32
    stop_flat: torch.Tensor | None  # [S] int64, row * V + token to mask (EOS / stop tokens)
    restricted_rows: torch.Tensor | None  # [R] int64, rows with allowed_token_ids
    allowed_flat: torch.Tensor | None  # [A] int64, row * V + token they allow
    bias_flat: torch.Tensor | None  # [L] int64, row * V + token of each logit_bias entry
    bias: torch.Tensor | None  # [L] fp32
    constrained: tuple[int, ...]  # the rows under a grammar, on the host
    constrained_rows: torch.Tensor | None  # [C] int32, the same on the device
    bitmask: torch.Tensor | None  # [B, ceil(V / 32)] int32 (rows not constrained: stale, never read)
    forced_rows: torch.Tensor | None  # [F] int64
    forced_tokens: torch.Tensor | None  # [F] int64
    temperature: torch.Tensor | None  # [B] fp32 (1 for greedy rows); None when every row is greedy
    top_k: torch.Tensor | None  # [B] int32 (0: off)
    top_k_index: torch.Tensor | None  # [B] int64, k - 1 (0 when off)
    top_k_max: int
    top_p: torch.Tensor | None  # [B] fp32
    min_p: torch.Tensor | None  # [B] fp32
    shared_rows: torch.Tensor | None  # [S] int64, rows drawing from the step's shared generator (when not all)
    num_shared: int
    asked_rows: torch.Tensor | None  # [A] int64, rows that asked for logprobs
    num_top: int  # alternatives to return: the most any row asked for (0: none)


_SCALARS = {"all_greedy", "constrained", "top_k_max", "num_shared", "num_top"}  # the fields that are no device views


def _padded(sequences: list[Sequence[int]], pad: int) -> tuple[list[int], tuple[int, int]]:
    width = max((len(s) for s in sequences), default=0)
    flat: list[int] = []
    for s in sequences:
        flat.extend(s)
        flat.extend([pad] * (width - len(s)))
    return flat, (len(sequences), width)


def _pack_penalties(p: _Packer, rows: Sequence[SamplingRow], vocab_size: int) -> None:
    picked = [i for i, row in enumerate(rows) if row.params.has_penalties]
    if not picked:
        return
    params = [rows[i].params for i in picked]
    p.int64("penalty_rows", picked)
    flat, shape = _padded([rows[i].output_token_ids for i in picked], vocab_size)
    p.int64("output_ids", flat, shape)
    if any(x.repetition_penalty != 1.0 for x in params):
        prompts = [rows[i].prompt_token_ids if x.repetition_penalty != 1.0 else () for i, x in zip(picked, params)]
        flat, shape = _padded(prompts, vocab_size)
        p.int64("prompt_ids", flat, shape)
        p.fp32("repetition", [x.repetition_penalty for x in params])
    if any(x.frequency_penalty != 0.0 or x.presence_penalty != 0.0 for x in params):
        p.fp32("frequency", [x.frequency_penalty for x in params])
        p.fp32("presence", [x.presence_penalty for x in params])


def _pack_token_limits(p: _Packer, rows: Sequence[SamplingRow], vocab_size: int) -> None:
    stop = [i * vocab_size + t for i, row in enumerate(rows) for t in stop_tokens_to_mask(row) if 0 <= t < vocab_size]
    if stop:
        p.int64("stop_flat", stop)
    restricted = [i for i, row in enumerate(rows) if row.params.allowed_token_ids is not None]
    if restricted:
        p.int64("restricted_rows", restricted)
        allowed = {
            i * vocab_size + t for i in restricted for t in rows[i].params.allowed_token_ids or () if t < vocab_size
        }
        p.int64("allowed_flat", sorted(allowed))
    bias = [(i * vocab_size + t, b) for i, row in enumerate(rows) for t, b in row.params.logit_bias if t < vocab_size]
    if bias:
        p.int64("bias_flat", [x[0] for x in bias])
        p.fp32("bias", [x[1] for x in bias])


def _pack_grammar(p: _Packer, mask: TokenMask | None) -> tuple[int, ...]:
    """The whole [B, W] bitmask (xgrammar's kernels index it by batch row) and the constrained rows."""
    if mask is None or not mask.rows:
        return ()
    p.int32("constrained_rows", mask.rows)
    words = mask.bitmask.numpy()  # [B, W] int32: numpy on the host, no torch op
    p.raw32("bitmask", words.tobytes(), words.shape)
    return tuple(mask.rows)


def _pack_sampling(p: _Packer, rows: Sequence[SamplingRow], vocab_size: int) -> tuple[int, int]:
    """Temperature, top-k / top-p / min-p and the shared rows of the draw. -> (top_k_max, num_shared)"""
    greedy = [row.params.is_greedy for row in rows]
    if all(greedy):
        return 0, 0
    if any(greedy):
        p.int32("greedy", [int(g) for g in greedy])
    # greedy rows divide by 1: their token is the argmax taken before this stage
    p.fp32("temperature", [1.0 if g else row.params.temperature for g, row in zip(greedy, rows)])
    ks = [row.params.top_k if 0 < row.params.top_k < vocab_size else 0 for row in rows]
    if max(ks) > 0:
        p.int32("top_k", ks)
        p.int64("top_k_index", [max(k, 1) - 1 for k in ks])
    if any(row.params.top_p < 1.0 for row in rows):
        p.fp32("top_p", [row.params.top_p for row in rows])
    if any(row.params.min_p > 0.0 for row in rows):
        p.fp32("min_p", [row.params.min_p for row in rows])
    shared = [i for i, row in enumerate(rows) if row.generator is None]
    if 0 < len(shared) < len(rows):
        p.int64("shared_rows", shared)
    return max(ks), len(shared)


def masks_stops_only(x: SamplerInputs) -> bool:
    """Whether the only stage before the greedy argmax is the stop-token mask (`stop_flat`, maybe None):
    no penalties, allowed tokens, logit_bias, grammar bitmask or forced tokens (decided on the host)."""
    others = (x.penalty_rows, x.restricted_rows, x.bias_flat, x.bitmask, x.forced_rows)
    return all(t is None for t in others)


def pack_inputs(
    rows: Sequence[SamplingRow],
    vocab_size: int,
    device: torch.device,
    token_mask: TokenMask | None = None,
    staging: HostStaging | None = None,
) -> SamplerInputs:
    """The step's sampler parameters on `device`, from one buffer (module doc). `staging`: the pinned double
    buffer the copy goes through (a GPU worker's; None: a plain copy, for tests and the CPU)."""
    p = _Packer()
    _pack_penalties(p, rows, vocab_size)
    _pack_token_limits(p, rows, vocab_size)
    constrained = _pack_grammar(p, token_mask)
    forced = [(i, forced_token(row.params, row.output_token_ids)) for i, row in enumerate(rows)]
    forced_pairs = [(i, t) for i, t in forced if t is not None]
    if forced_pairs:
        p.int64("forced_rows", [i for i, _ in forced_pairs])
        p.int64("forced_tokens", [t for _, t in forced_pairs])
    top_k_max, num_shared = _pack_sampling(p, rows, vocab_size)
    asked = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    if asked:
        p.int64("asked_rows", asked)
    num_top = min(max((rows[i].params.logprobs or 0 for i in asked), default=0), vocab_size)
    v = p.upload(device, staging)
    return SamplerInputs(
        all_greedy=all(row.params.is_greedy for row in rows),
        constrained=constrained,
        top_k_max=top_k_max,
        num_shared=num_shared,
        num_top=num_top,
        **{f.name: v.get(f.name) for f in fields(SamplerInputs) if f.name not in _SCALARS},
    )


class HostReader:
    """The step's one device-to-host copy: into a reused pinned buffer, then one wait for it (GPU); on the CPU
    the read is the list conversion itself. Only the sampler's packed results come back this way."""

    def __init__(self, device: torch.device):
        self.device = device
        self._pinned: dict[torch.dtype, torch.Tensor] = {}  # one reused pinned buffer per dtype read

    def read(self, packed: torch.Tensor) -> list:
        """packed [n] (one dtype) -> its values as a Python list; the host waits here, once."""
        if packed.device.type != "cuda":
            return packed.tolist()  # the step's one read (counted as the one sync by bench/census)
        n = packed.numel()
        pinned = self._pinned.get(packed.dtype)
        if pinned is None or pinned.numel() < n:
            pinned = self._pinned[packed.dtype] = torch.empty(max(n, 1024), dtype=packed.dtype).pin_memory()
        host = pinned[:n]
        host.copy_(packed, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        done.synchronize()  # the one wait of the step: the sampled tokens are needed on the host
        return host.tolist()
