"""Prometheus metrics, one registry per app, names as in the contract (prefix `dsv4serve:`).

Request-level histograms and counters are recorded by the API as requests finish; the engine's own
numbers (running / waiting, KV usage, prefix cache, chunk, OOM recoveries, restarts, the expert-slot
cache, speculative decoding) are read from the EngineClient at scrape time by a collector, so they are
never stale copies. The expert-slot cache's hit rate is `expert_cache_hits_total /
expert_cache_queries_total`, as for the prefix cache; under --moe-backend hybrid the CPU's share of the uses is
`expert_cache_cpu_uses_total / expert_cache_queries_total`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from dsv4serve.api.engine import Engine

P = "dsv4serve:"
# vLLM's buckets
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)

EXPERT_CACHE_COUNTERS = (
    ("expert_cache_queries", "Routed-expert uses (step, layer, expert) with the GPU expert-slot cache."),
    ("expert_cache_hits", "Routed-expert uses read from a GPU slot (the rest read the host bank in place)."),
    ("expert_cache_cpu_uses", "Routed-expert uses computed on the CPU by kt-kernel (--moe-backend hybrid)."),
    ("expert_cache_h2d_bytes", "Expert weight bytes copied host -> device (slot promotions, streamed prefill)."),
    ("expert_cache_stalls", "Times the compute waited for expert copies or staged an unpinned layer."),
    ("expert_cache_prefetches", "Experts promoted into GPU slots between steps."),
)

# vLLM's names: mean accepted length = 1 + accepted / drafts, acceptance rate = accepted / draft tokens
SPEC_DECODE_COUNTERS = (
    ("spec_decode_num_drafts", "Rows verified with draft tokens (one per row per verify step)."),
    ("spec_decode_num_draft_tokens", "Draft tokens proposed by the MTP drafter."),
    ("spec_decode_num_accepted_tokens", "Draft tokens accepted by verification."),
)


class _EngineCollector:
    """Gauges and counters read from the EngineClient at scrape time."""

    def __init__(self, engine: Engine):
        self._engine = engine

    def collect(self):
        stats = self._engine.stats
        ready = self._engine.ready_info

        def gauge(name: str, doc: str, value: float):
            g = GaugeMetricFamily(P + name, doc)
            g.add_metric([], value)
            return g

        def counter(name: str, doc: str, value: float):
            c = CounterMetricFamily(P + name, doc)
            c.add_metric([], value)
            return c

        yield gauge("num_requests_running", "Requests running in the engine.", stats.num_running if stats else 0)
        yield gauge("num_requests_waiting", "Requests waiting to run.", stats.num_waiting if stats else 0)
        yield gauge("kv_cache_usage_perc", "KV-cache usage, a fraction from 0 to 1.", stats.kv_usage if stats else 0)
        chunk = stats.prefill_chunk_tokens if stats else (ready.chunk.effective_tokens if ready else 0)
        yield gauge("prefill_chunk_tokens", "The prefill chunk the planner allows now (tokens).", chunk)
        yield counter(
            "prefix_cache_queries", "Prefix-cache queries (tokens).", stats.prefix_cache_queries_total if stats else 0
        )
        yield counter("prefix_cache_hits", "Prefix-cache hits (tokens).", stats.prefix_cache_hits_total if stats else 0)
        yield counter(
            "oom_recoveries",
            "Out-of-memory errors recovered from by shrinking the chunk.",
            stats.oom_recoveries_total if stats else 0,
        )
        yield counter(
            "worker_restarts", "Worker processes restarted after a death.", self._engine.worker_restarts_total
        )
        for name, doc in EXPERT_CACHE_COUNTERS + SPEC_DECODE_COUNTERS:
            yield counter(name, doc, getattr(stats, f"{name}_total") if stats else 0)


class Metrics:
    def __init__(self, engine: Engine):
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            P + "time_to_first_token_seconds", "Time to first token.", registry=r, buckets=TTFT_BUCKETS
        )
        self.itl = Histogram(
            P + "inter_token_latency_seconds", "Time between output tokens.", registry=r, buckets=ITL_BUCKETS
        )
        self.e2e = Histogram(
            P + "e2e_request_latency_seconds", "End-to-end request latency.", registry=r, buckets=E2E_BUCKETS
        )
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens processed.", registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Tokens generated.", registry=r)
        self.request_success = Counter(
            P + "request_success", "Finished requests by finish reason.", ["finished_reason"], registry=r
        )
        for reason in ("stop", "length", "abort"):
            self.request_success.labels(finished_reason=reason)
        r.register(_EngineCollector(engine))

    def render(self) -> bytes:
        return generate_latest(self.registry)
