"""The scheduler's side of speculative decoding (tensor-free): draft rows, several tokens per row with stops
checked per token, the token budget and pages of drafts, the counters."""

from dsv4serve.ipc.messages import AddRequest, TokenOut
from dsv4serve.ipc.sampling import SamplingParams
from dsv4serve.worker.scheduler import Scheduler, SchedulerLimits
from dsv4serve.worker.step import StepOutput

EOS, PAGE = 1, 16


def _sched(n_spec=3, **kw) -> Scheduler:
    base = dict(max_running=4, max_waiting=8, kv_capacity_tokens=64 * PAGE, page_tokens=PAGE, max_model_len=1024)
    return Scheduler(SchedulerLimits(eos_token_id=EOS, speculative_tokens=n_spec, **{**base, **kw}))


def _decoding(s: Scheduler, rid: str, n_prompt: int, drafts: tuple[int, ...], **sampling) -> None:
    """Prefill `rid` and let the runner propose `drafts` with its first token (7)."""
    params = SamplingParams(temperature=0.0, **{"max_tokens": 50, **sampling})
    assert s.add(AddRequest(rid, list(range(10, 10 + n_prompt)), params)) is None
    plan = s.schedule(4096)
    s.complete(plan, StepOutput({rid: TokenOut(7)}, drafts={rid: drafts}))


def test_a_decode_row_carries_the_drafts_and_the_budget_counts_them():
    s = _sched()
    _decoding(s, "a", 5, (20, 21, 22))
    assert s.add(AddRequest("b", list(range(40)), SamplingParams(temperature=0.0))) is None
    plan = s.schedule(10)
    a, b = plan.rows
    assert (a.token_ids, a.num_draft_tokens, a.start_position, a.sample) == ((7, 20, 21, 22), 3, 5, True)
    assert len(b.token_ids) == 10 - 4  # the prompt chunk gets what the decode row with its drafts left


def test_accepted_tokens_are_appended_and_a_stop_drops_what_follows():
    s = _sched()
    _decoding(s, "a", 5, (20, 21, 22), stop_token_ids=(21,))
    plan = s.schedule(4096)
    # the runner accepted 20 and 21 and sampled 99 after them; 21 is a stop token: 99 is dropped
    out = StepOutput({"a": TokenOut(20)}, more={"a": (TokenOut(21), TokenOut(99))}, drafts={"a": (1, 2, 3)})
    (msg,) = s.complete(plan, out)
    assert [t.token_id for t in msg.tokens] == [20, 21] and msg.finish_reason == "stop"
    assert s.spec_stats_fields() == {
        "spec_decode_num_drafts_total": 1,
        "spec_decode_num_draft_tokens_total": 3,
        "spec_decode_num_accepted_tokens_total": 2,
    }


def test_the_computed_tokens_follow_the_accepted_drafts():
    s = _sched()
    _decoding(s, "a", 5, (20, 21, 22))
    req = s.requests["a"]
    plan = s.schedule(4096)
    s.complete(plan, StepOutput({"a": TokenOut(20)}, more={"a": (TokenOut(30),)}, drafts={"a": (40, 41, 42)}))
    # kept: the last token 7 and the accepted draft 20; the output is 7, 20, 30; 30 is the next to run
    assert req.output_token_ids == [7, 20, 30] and req.num_computed_tokens == 5 + 2 == req.num_tokens - 1
    (row,) = s.schedule(4096).rows
    assert row.token_ids == (30, 40, 41, 42) and row.start_position == 7


def test_drafts_are_capped_by_max_tokens_and_the_model_length():
    s = _sched()
    _decoding(s, "a", 5, (20, 21, 22), max_tokens=3)  # one output so far: two more at most
    assert s.schedule(4096).rows[0].num_draft_tokens == 1
    s = _sched(max_model_len=8)
    _decoding(s, "b", 5, (20, 21, 22))  # 6 tokens: positions 6 and 7 remain
    assert s.schedule(4096).rows[0].num_draft_tokens == 1


def test_pages_taken_for_rejected_drafts_go_back():
    s = _sched()
    _decoding(s, "a", PAGE - 2, (20, 21, 22))  # the last token at position PAGE - 2; drafts run into page 2
    req = s.requests["a"]
    free = s.pages.num_free
    plan = s.schedule(4096)
    assert len(req.pages) == 2 and s.pages.num_free == free - 1
    s.complete(plan, StepOutput({"a": TokenOut(9)}, drafts={"a": (1, 2, 3)}))  # every draft rejected
    assert len(req.pages) == 1 and s.pages.num_free == free  # positions <= PAGE - 1: one page
    (row,) = s.schedule(4096).rows
    assert row.num_pages == 1 and row.new_pages == tuple(req.pages[1:])  # the runner cuts, then appends


def test_without_speculation_no_drafts_are_scheduled():
    s = _sched(n_spec=0)
    _decoding(s, "a", 5, (20, 21))  # (a runner never proposes any then; the limit is the scheduler's too)
    (row,) = s.schedule(4096).rows
    assert row.num_draft_tokens == 0 and row.token_ids == (7,)
