"""The tensor-free scheduler: budgets, fairness to decodes, admission, pages, preemption, abort."""

import pytest

from dsv4serve.ipc.messages import AddRequest, TokenOut
from dsv4serve.ipc.sampling import SamplingParams
from dsv4serve.worker.scheduler import Scheduler, SchedulerLimits
from dsv4serve.worker.step import StepOutput

EOS = 1


def limits(**kw):
    base = dict(
        max_running=4, max_waiting=8, kv_capacity_tokens=1024, page_tokens=16, max_model_len=1024, eos_token_id=EOS
    )
    return SchedulerLimits(**{**base, **kw})


def add(s, rid, n_prompt, max_tokens=4, first=10, **sampling):
    return s.add(
        AddRequest(rid, list(range(first, first + n_prompt)), SamplingParams(max_tokens=max_tokens, **sampling))
    )


def run_step(s, chunk, token=7):
    plan = s.schedule(chunk)
    sampled = {r.request_id: TokenOut(token) for r in plan.rows if r.sample}
    return plan, s.complete(plan, StepOutput(sampled))


def test_long_prefill_is_chunked_and_decodes_wait_at_most_one_chunk():
    s = Scheduler(limits())
    add(s, "short", 3, max_tokens=50)
    run_step(s, 64)  # short prefilled, now decoding
    add(s, "long", 300)
    long = s.requests["long"]
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
    assert long.num_computed_tokens >= 300  # prompt done (then decoding)


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
    sampled = {"len": TokenOut(5), "eos": TokenOut(EOS), "stopid": TokenOut(7), "ignore": TokenOut(EOS)}
    done = s.complete(plan, StepOutput(sampled))
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
    add(s, "new", 30, max_tokens=40, first=500)
    new = s.requests["new"]
    for _ in range(10):  # both prefill and decode until the 4-page pool cannot hold both
        run_step(s, 100)
        if new in s.waiting:
            break
    assert new in s.waiting and new.num_computed_tokens == 0 and new.output  # preempted, state dropped
    assert len(s.requests["old"].pages) == 3 and not s.prefix.entries  # cached prefixes went first
    produced = len(new.output)
    old = s.requests["old"]
    while old.finish_reason is None:
        run_step(s, 100)
    fed = []
    while len(new.output) == produced:  # the pool is free again: new recomputes prompt + outputs so far
        plan, _ = run_step(s, 100)
        fed += [t for r in plan.rows if r.request_id == "new" for t in r.token_ids]
    assert fed == list(range(500, 530)) + [7] * produced


def test_reset_after_failed_step_recomputes_from_scratch():
    s = Scheduler(limits())
    add(s, "a", 50)
    plan = s.schedule(32)
    s.reset(plan)
    plan2 = s.schedule(32)
    assert "a" in plan2.dropped and plan2.rows[0].start_position == 0


@pytest.mark.parametrize("chunk", [1, 3, 17])
def test_tiny_chunks_still_make_progress(chunk):
    s = Scheduler(limits())
    add(s, "a", 20, max_tokens=2)
    req = s.requests["a"]
    for _ in range(40):
        run_step(s, chunk)
    assert req.finish_reason == "length"


def test_a_request_that_outgrows_the_pool_finishes_instead_of_hanging():
    s = Scheduler(limits(kv_capacity_tokens=32, page_tokens=16, max_model_len=1024))
    add(s, "a", 20, max_tokens=100)
    req = s.requests["a"]
    finished_now = []
    for _ in range(30):
        plan, outs = run_step(s, 100)
        finished_now += [o for o in outs if o.request_id in plan.finished_now]
    assert req.finish_reason == "length" and req.num_tokens == 33 and s.kv_usage == 0
    assert [o.finish_reason for o in finished_now] == ["length"]  # finished while a step was planned, sent once


def test_prefix_reuse_starts_from_the_last_shared_whole_page():
    s = Scheduler(limits(page_tokens=16))
    add(s, "first", 40, max_tokens=1)
    plan, _ = run_step(s, 100)
    row = plan.rows[0]
    assert len(row.token_ids) == 32 and row.snapshot_slot is not None and not row.sample  # cut at the page
    first_pages = row.new_pages
    assert len(first_pages) == 2 and row.snapshot_slot >= 4  # snapshot slots follow the 4 running slots
    plan, _ = run_step(s, 100)
    assert plan.rows[0].start_position == 32 and plan.rows[0].sample
    add(s, "again", 40, max_tokens=1)  # same prompt
    add(s, "longer", 70, max_tokens=1)  # shares the first two pages
    add(s, "other", 40, max_tokens=1, first=900)
    again, other = s.requests["again"], s.requests["other"]
    plan, _ = run_step(s, 200)
    by_id = {r.request_id: r for r in plan.rows}
    assert by_id["again"].start_position == 32 and by_id["again"].restore_slot == row.snapshot_slot
    assert by_id["longer"].start_position == 32 and by_id["longer"].restore_slot == row.snapshot_slot
    assert by_id["other"].start_position == 0 and by_id["other"].restore_slot is None
    # the cached pages are shared, not copied: the entry and both requests hold a reference on them
    assert by_id["again"].new_pages[:2] == first_pages == by_id["longer"].new_pages[:2]
    assert all(s.pages.refs(p) == 3 for p in first_pages)
    assert not set(by_id["other"].new_pages) & set(first_pages)
    assert len({r.slot for r in plan.rows}) == 3
    assert again.num_cached_tokens == 32 and other.num_cached_tokens == 0
    assert s.prefix_hits_tokens == 64 and s.prefix_queries_tokens == 40 + 40 + 70 + 40


def test_cached_prefixes_are_evicted_before_anyone_is_preempted():
    s = Scheduler(limits(kv_capacity_tokens=96, page_tokens=16))
    add(s, "a", 40, max_tokens=1)
    while s.requests.get("a") and s.requests["a"].finish_reason is None:
        run_step(s, 100)
    (entry,) = s.prefix.entries.values()
    assert len(entry.pages) == 2 and s.kv_usage == 0  # cached pages are free to take
    assert s.pages.num_free == 4 and s.snapshot_slots.num_free == 3
    add(s, "big", 80, max_tokens=1, first=900)  # needs 5 of the 6 pages: the cached prefix must go
    big = s.requests["big"]
    plan, _ = run_step(s, 100)
    assert plan.rows[0].request_id == "big" and plan.rows[0].start_position == 0
    assert len(plan.rows[0].token_ids) == 64  # cut at its own last whole page, which it keeps cached
    plan, _ = run_step(s, 100)
    assert plan.rows[0].start_position == 64 and big.output  # done, never preempted
    (entry,) = s.prefix.entries.values()  # "a"'s prefix was evicted for big's fifth page
    assert entry.num_tokens == 64 and s.snapshot_slots.num_free == 3


def test_a_snapshot_of_a_failed_step_is_never_offered():
    s = Scheduler(limits(page_tokens=16))
    add(s, "a", 40, max_tokens=1)
    plan = s.schedule(100)
    assert plan.rows[0].snapshot_slot is not None
    s.reset(plan)
    assert not s.prefix.entries and s.pages.num_free == s.num_pages_total
    add(s, "b", 40, max_tokens=1)
    plan = s.schedule(100)
    assert all(r.restore_slot is None for r in plan.rows)
