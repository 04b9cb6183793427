"""The expert-slot cache's counters travel worker -> API in the Stats message and come out of
/metrics under the contract's `dsv4serve:` prefix."""

from __future__ import annotations

from types import SimpleNamespace

from dsv4serve.api.metrics import Metrics
from dsv4serve.experts.slot_cache import ExpertCacheStats
from dsv4serve.ipc.messages import Codec, FromWorker, Stats

BASE = dict(
    num_running=1,
    num_waiting=0,
    kv_usage=0.5,
    prefill_chunk_tokens=256,
    oom_recoveries_total=0,
    prefix_cache_queries_total=10,
    prefix_cache_hits_total=4,
)


def test_cache_counters_cross_the_process_boundary_and_reach_prometheus():
    counted = ExpertCacheStats(queries=40, hits=30, h2d_bytes=10 * 13_369_344, stalls=6, prefetches=4, cpu_uses=7)
    codec = Codec(FromWorker)
    stats = codec.decode(codec.encode(Stats(**BASE, **counted.stats_fields())))
    text = Metrics(SimpleNamespace(stats=stats, ready_info=None, worker_restarts_total=0)).render().decode()
    for line in (
        "dsv4serve:expert_cache_queries_total 40.0",
        "dsv4serve:expert_cache_hits_total 30.0",
        "dsv4serve:expert_cache_cpu_uses_total 7.0",
        "dsv4serve:expert_cache_h2d_bytes_total 1.3369344e+08",
        "dsv4serve:expert_cache_stalls_total 6.0",
        "dsv4serve:expert_cache_prefetches_total 4.0",
    ):
        assert line in text.splitlines()


def test_a_worker_without_the_cache_reports_zeros():
    stats = Codec(FromWorker).decode(Codec(FromWorker).encode(Stats(**BASE)))
    text = Metrics(SimpleNamespace(stats=stats, ready_info=None, worker_restarts_total=0)).render().decode()
    assert "dsv4serve:expert_cache_hits_total 0.0" in text.splitlines()
