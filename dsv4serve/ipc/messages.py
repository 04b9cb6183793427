"""Typed, tagged messages between the API process and the worker (msgspec msgpack, never pickle).

Every message is a frozen msgspec Struct with a tag; decoding an unknown tag or a malformed field is
an error, not a guess. Only plain data crosses: token ids, numbers, strings.
"""

from __future__ import annotations

import msgspec

from dsv4serve.worker.chunk_planner import ChunkPlan  # frozen dataclasses: msgspec carries them
from dsv4serve.worker.sampling_params import SamplingParams

# ------------------------------------------------------------------------------ API -> worker


class AddRequest(msgspec.Struct, frozen=True, tag="add", forbid_unknown_fields=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams


class AbortRequest(msgspec.Struct, frozen=True, tag="abort", forbid_unknown_fields=True):
    request_id: str


class Shutdown(msgspec.Struct, frozen=True, tag="shutdown", forbid_unknown_fields=True):
    pass


ToWorker = AddRequest | AbortRequest | Shutdown


# ------------------------------------------------------------------------------ worker -> API


class Ready(msgspec.Struct, frozen=True, tag="ready", forbid_unknown_fields=True):
    """What the worker actually allocated, not what was asked for."""

    device: str
    kv_capacity_tokens: int
    max_running_requests: int
    max_model_len: int
    chunk: ChunkPlan  # the planner's own frozen dataclass: requested, effective, binding, reason, ...
    expert_slots: int | None  # None: every expert resident
    vocab_size: int
    eos_token_id: int
    expert_bank: str | None = None  # where the offloaded experts live (pinned / pageable / on disk), and why
    kv_pages: int = 0  # the paged KV pool: pages of `page_tokens` tokens and sequence slots
    page_tokens: int = 0
    sequence_slots: int = 0


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    token_id: int
    logprob: float


class TokenOut(msgspec.Struct, frozen=True, array_like=True):
    token_id: int
    logprob: float | None = None
    top: list[TokenLogprob] | None = None


class RequestOutput(msgspec.Struct, frozen=True, tag="out", forbid_unknown_fields=True):
    request_id: str
    tokens: list[TokenOut]  # new tokens since the last output of this request
    num_prompt_tokens: int
    num_cached_tokens: int
    finish_reason: str | None = None  # stop | length | abort | error; None while running
    error: str | None = None
    # with the first output of a request that asked: one entry per prompt token, the first None
    prompt_logprobs: list[TokenOut | None] | None = None


class Rejected(msgspec.Struct, frozen=True, tag="rejected", forbid_unknown_fields=True):
    request_id: str
    status: int  # HTTP status the API should answer with (503: queue full)
    message: str


class Stats(msgspec.Struct, frozen=True, tag="stats", forbid_unknown_fields=True):
    num_running: int
    num_waiting: int
    kv_usage: float  # 0..1
    prefill_chunk_tokens: int
    oom_recoveries_total: int
    prefix_cache_queries_total: int
    prefix_cache_hits_total: int
    # the GPU expert-slot cache (dsv4serve/experts/slot_cache.py); all 0 while every expert is resident
    expert_cache_queries_total: int = 0  # routed-expert lookups by the compute
    expert_cache_hits_total: int = 0  # lookups that found the expert in a slot
    expert_cache_h2d_bytes_total: int = 0  # expert bytes copied host -> device (misses and prefetches)
    expert_cache_stalls_total: int = 0  # the compute waited for a copy (CPU: a miss served synchronously)
    expert_cache_prefetches_total: int = 0  # experts copied ahead for the next layer


class WorkerFailed(msgspec.Struct, frozen=True, tag="failed", forbid_unknown_fields=True):
    """The worker cannot go on (startup or a fatal error); it exits after sending this."""

    message: str


FromWorker = Ready | RequestOutput | Rejected | Stats | WorkerFailed


class Codec:
    """Encoder/decoder pair for one direction; decoding anything but that direction's messages fails."""

    def __init__(self, incoming: object):
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(incoming)

    def encode(self, message: msgspec.Struct) -> bytes:
        return self._encoder.encode(message)

    def decode(self, data: bytes):
        return self._decoder.decode(data)


class WorkerLaunch(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Everything a worker needs to start, copied from the frozen config (passed as bytes)."""

    to_worker: str  # ipc endpoints
    from_worker: str
    model_path: str
    device: str  # cpu | cuda
    max_num_seqs: int
    max_queued_requests: int
    max_model_len: int
    max_model_len_explicit: bool
    max_prefill_length: int | None  # the user's cap; None = planned
    max_prefill_length_source: str  # a config Source value: explicit caps are honoured, never changed
    num_tokens: int | None  # the user's KV capacity; None = planned
    moe_cache_size: int | None = None  # GPU expert slots; None = every routed expert resident
    memory_ratio: float = 0.9
    log_level: str = "info"
    fault_oom_above_bytes: int | None = None  # TESTING ONLY (see FaultInjection)
    kernels: str = "auto"  # --kernels: the model's kernel backends (model/backends.py)
