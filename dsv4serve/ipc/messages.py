"""Typed, tagged messages between the API process and the worker (msgspec msgpack, never pickle).

Every message is a frozen msgspec Struct with a tag; decoding an unknown tag or a malformed field is
an error, not a guess. Only plain data crosses: token ids, numbers, strings.

This package is a leaf: it imports nothing else of dsv4serve, so the API process can speak to the
worker without importing torch or the model (tests/unit/test_imports.py holds both).
"""

from __future__ import annotations

from typing import Generic, TypeVar

import msgspec

from dsv4serve.ipc.sampling import SamplingParams

T = TypeVar("T")

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


class ChunkReport(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The chunk planner's decision as it crosses to the API process (memory/chunk_planner.ChunkPlan)."""

    requested: int | None  # the user's --max-prefill-length, None for auto
    effective_tokens: int
    binding: str  # which limit bound the chunk: memory, user-cap, kv-pool, context, ...
    reason: str
    warning: str | None = None
    safe_tokens: int = 0  # the memory bound (aligned)
    activation_bytes_per_token: int = 0
    alignment_tokens: int = 1


class Ready(msgspec.Struct, frozen=True, tag="ready", forbid_unknown_fields=True):
    """What the worker actually allocated, not what was asked for."""

    device: str
    kv_capacity_tokens: int
    max_running_requests: int
    max_model_len: int
    chunk: ChunkReport  # requested, effective, binding, reason, ...
    expert_slots: int | None  # None: every expert resident
    vocab_size: int
    eos_token_id: int
    expert_bank: str | None = None  # where the offloaded experts live (pinned / pageable / on disk), and why
    kv_pages: int = 0  # the paged KV pool: pages of `page_tokens` tokens and sequence slots
    page_tokens: int = 0
    sequence_slots: int = 0
    decode_graphs: str = ""  # how decode steps run: CUDA graphs per batch bucket (capture time, memory), or eager
    ranks: list[str] = []  # --tensor-parallel-size N > 1: one line per rank (device, weights held, KV pool)


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
    expert_cache_queries_total: int = 0  # routed-expert uses (step, layer, expert)
    expert_cache_hits_total: int = 0  # uses read from a slot (the rest read the host bank in place)
    expert_cache_cpu_uses_total: int = 0  # uses computed on the CPU by kt-kernel (--moe-backend hybrid)
    expert_cache_h2d_bytes_total: int = 0  # expert bytes copied host -> device (promotions, streamed prefill)
    expert_cache_stalls_total: int = 0  # waits for promotion copies, and staging syncs (slot_cache.py)
    expert_cache_prefetches_total: int = 0  # experts promoted into slots between steps
    # speculative decoding (worker/spec_sampling.SpecDecodeStats, vLLM's meanings); all 0 with --speculative-tokens 0
    spec_decode_num_drafts_total: int = 0  # rows verified with drafts (one per row per verify step)
    spec_decode_num_draft_tokens_total: int = 0  # draft tokens proposed
    spec_decode_num_accepted_tokens_total: int = 0  # draft tokens accepted (bonus tokens not counted)


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


class Sourced(msgspec.Struct, Generic[T], frozen=True, forbid_unknown_fields=True):
    """A setting as resolved (config.Setting on the wire): its value and where it came from, a
    config.Source value ("default", "env", "cli", "model-rule", "measured")."""

    value: T
    source: str = "default"

    @property
    def explicit(self) -> bool:
        """The user chose this value: the worker honours it exactly or refuses to start."""
        return self.source in ("env", "cli")


class WorkerLaunch(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Everything a worker needs to start, copied from the frozen config (passed as bytes); every
    setting keeps its source, so the worker knows which values it may plan and which it must honour."""

    to_worker: str  # ipc endpoints
    from_worker: str
    model_path: str
    device: str  # cpu | cuda (resolved from --device auto)
    max_num_seqs: Sourced[int]
    max_queued_requests: Sourced[int]
    max_model_len: Sourced[int]
    max_prefill_length: Sourced[int | None]  # None = planned
    num_tokens: Sourced[int | None]  # KV capacity; None = planned
    moe_cache_size: Sourced[int | None] = Sourced(None)  # GPU expert slots; None = planned / all resident
    memory_ratio: Sourced[float] = Sourced(0.9)
    kernels: Sourced[str] = Sourced("auto")  # --kernels: the model's kernel backends (model/backends.py)
    batch_invariant: Sourced[bool] = Sourced(False)  # --batch-invariant: bitwise batch invariance (slower)
    enforce_eager: Sourced[bool] = Sourced(False)  # --enforce-eager: no CUDA graphs
    moe_backend: Sourced[str] = Sourced("auto")  # --moe-backend: auto | gpu | offload | hybrid
    speculative_tokens: Sourced[int] = Sourced(0)  # --speculative-tokens: MTP drafts per step (0 = off)
    tensor_parallel_size: Sourced[int] = Sourced(1)  # --tensor-parallel-size: ranks, one process each
    expert_parallel: Sourced[bool] = Sourced(False)  # --expert-parallel: routed experts owned whole by one rank
    rank: int = 0  # this process's rank in the group (0: the scheduler's, the one talking to the API process)
    rendezvous_port: int = 0  # the group's env:// rendezvous on 127.0.0.1 (tensor_parallel_size > 1)
    log_level: str = "info"
    tokenizer_path: str = ""  # the tokenizer.json the API uses (structured output compiles against it); "": bundled
