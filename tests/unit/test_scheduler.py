"""The tensor-free scheduler: budgets, fairness to decodes, admission, pages, preemption, abort."""

import pytest

from dsv4serve.ipc.messages import AddRequest, TokenOut
from dsv4serve.worker.sampling_params import SamplingParams
from dsv4serve.worker.scheduler import Scheduler, SchedulerLimits

EOS = 1


def limits(**kw):
    base = dict(max_running=4, max_waiting=8, kv_capacity_tokens=1024, page_tokens=16, max_model_len=1024,
                eos_token_id=EOS)
    return SchedulerLimits(**{**base, **kw})


def add(s, rid, n_prompt, max_tokens=4, **sampling):
    return s.add(AddRequest(rid, list(range(10, 10 + n_prompt)), SamplingParams(max_tokens=max_tokens, **sampling)))


def run_step(s, chunk, token=7):
    plan = s.schedule(chunk)
    sampled = {r.request_id: TokenOut(token) for r in plan.rows if r.sample}
    return plan, s.complete(plan, sampled)


def test_long_prefill_is_chunked_and_decodes_wait_at_most_one_chunk():
    s = Scheduler(limits())
    add(s, "short", 3, max_tokens=50)
    run_step(s, 64)  # short prefilled, now decoding
    add(s, "long", 300)
    decode_gaps, since = [], 0
    for _ in range(12):
        plan, _ = run_step(s, 64)
        ids = [r.request_id for r in plan.rows]
        assert plan.num_tokens <= 64
        since = 0 if "short" in ids else since + 1
        decode_gaps.append(since)
        long_rows = [r for r in plan.rows if r.request_id == "long"]
        assert all(len(r.token_ids) <= 63 for r in long_rows)
    assert max(decode_gaps) == 0  # the decode ran in every step, beside each prompt chunk
    assert s.requests["long"].num_computed_tokens >= 300  # prompt done (then decoding)


def test_chunks_continue_where_the_last_one_stopped():
    s = Scheduler(limits())
    add(s, "a", 100)
    positions = []
    while s.requests["a"].num_computed_tokens < 100:
        plan, _ = run_step(s, 32)
        positions += [(r.start_position, len(r.token_ids), r.sample) for r in plan.rows]
    assert positions == [(0, 32, False), (32, 32, False), (64, 32, False), (96, 4, True)]


def test_max_running_and_queue_bound():
    s = Scheduler(limits(max_running=2, max_waiting=2))
    for i in range(4):
        assert add(s, f"r{i}", 5) is None
    rejected = add(s, "r4", 5)
    assert rejected is not None and rejected.status == 503 and "--max-queued-requests" in rejected.message
    plan, _ = run_step(s, 1000)
    assert {r.request_id for r in plan.rows} == {"r0", "r1"} and len(s.waiting) == 2


def test_prompt_larger_than_the_pool_is_rejected_not_queued_forever():
    s = Scheduler(limits(kv_capacity_tokens=64))
    rejected = add(s, "big", 100)
    assert rejected is not None and rejected.status == 400 and "64" in rejected.message


def test_stop_conditions():
    s = Scheduler(limits())
    add(s, "len", 3, max_tokens=2)
    add(s, "eos", 3, max_tokens=10)
    add(s, "stopid", 3, max_tokens=10, stop_token_ids=(7,))
    add(s, "ignore", 3, max_tokens=3, ignore_eos=True)
    plan = s.schedule(100)
    done = s.complete(plan, {"len": TokenOut(5), "eos": TokenOut(EOS), "stopid": TokenOut(7),
                             "ignore": TokenOut(EOS)})
    reasons = {r.request_id: r.finish_reason for r in done}
    assert reasons == {"len": None, "eos": "stop", "stopid": "stop", "ignore": None}
    plan, done = run_step(s, 100, token=5)
    assert {r.request_id: r.finish_reason for r in done} == {"len": "length", "ignore": None}


def test_abort_frees_pages_and_state_within_a_step():
    s = Scheduler(limits())
    add(s, "a", 40)
    run_step(s, 100)
    assert s.kv_usage > 0
    assert s.abort("a").finish_reason == "abort"
    assert s.kv_usage == 0
    assert s.schedule(100).dropped == ("a",)


def test_full_pool_preempts_the_newest_and_recomputes_it_later():
    s = Scheduler(limits(kv_capacity_tokens=64, page_tokens=16, max_model_len=64))
    add(s, "old", 30, max_tokens=40)
    add(s, "new", 30, max_tokens=40)
    run_step(s, 100)  # both prefilled: 2 pages each, pool full
    for _ in range(3):
        run_step(s, 100)  # both decode to 33 tokens: old needs a third page
    new = s.requests["new"]
    assert new.num_computed_tokens == 0 and new in s.waiting  # preempted, state dropped
    assert s.requests["old"].num_pages == 3
    while s.requests["old"].finish_reason is None:
        run_step(s, 100)
    plan, _ = run_step(s, 100)  # the pool is free again: new resumes with prompt + outputs so far
    row = next(r for r in plan.rows if r.request_id == "new")
    # the row recomputes the prompt and the 3 tokens it had produced, then samples the 4th
    assert row.start_position == 0 and row.token_ids == tuple(range(10, 40)) + (7, 7, 7) and row.sample
    assert len(new.output) == 4


def test_reset_after_failed_step_recomputes_from_scratch():
    s = Scheduler(limits())
    add(s, "a", 50)
    plan = s.schedule(32)
    s.reset([r.request_id for r in plan.rows])
    plan2 = s.schedule(32)
    assert "a" in plan2.dropped and plan2.rows[0].start_position == 0


@pytest.mark.parametrize("chunk", [1, 3, 17])
def test_tiny_chunks_still_make_progress(chunk):
    s = Scheduler(limits())
    add(s, "a", 20, max_tokens=2)
    for _ in range(40):
        run_step(s, chunk)
    assert s.requests["a"].finish_reason == "length"


def test_a_request_that_outgrows_the_pool_finishes_instead_of_hanging():
    s = Scheduler(limits(kv_capacity_tokens=32, page_tokens=16, max_model_len=1024))
    add(s, "a", 20, max_tokens=100)
    for _ in range(30):
        run_step(s, 100)
    req = s.requests["a"]
    assert req.finish_reason == "length" and req.num_tokens == 33 and s.kv_usage == 0
    assert req in s.finished_without_step
