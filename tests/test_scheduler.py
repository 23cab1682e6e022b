"""The iteration-level scheduler, with the test playing the runner: one made-up token per sampled chunk."""

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from engine.kv.block_pool import BlockPool
from engine.schedule.scheduler import Overloaded, PromptTooLong, Scheduler, SchedulerLimits, StepPlan
from engine.sequence import SamplingParams, Sequence, Status

TOKEN, EOS = 7, 2


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make(num_blocks: int = 64, block_size: int = 4, clock: FakeClock | None = None, **limits) -> Scheduler:
    """A scheduler over a small pool; FCFS unless `policy` says otherwise (policy fair: tests/test_fairness.py)."""
    limits.setdefault("max_context", 1024)
    limits.setdefault("policy", "fcfs")
    return Scheduler(BlockPool(num_blocks, block_size), SchedulerLimits(**limits), clock=clock or FakeClock())


def question(qid: str, prompt_len: int, *, max_new: int = 100, priority: int = 0, arrival: float = 0.0,
             deadline: float | None = None) -> Sequence:
    params = SamplingParams(max_new_tokens=max_new, stop_token_ids=(EOS,))
    return Sequence(qid, list(range(100, 100 + prompt_len)), params, priority=priority, arrival=arrival,
                    deadline=deadline)


def add(sched: Scheduler, *seqs: Sequence) -> None:
    for seq in seqs:
        sched.add(seq)


def step(sched: Scheduler, tokens: dict[str, int] | None = None) -> StepPlan:
    """One engine step; `tokens` picks a question's draw (default TOKEN)."""
    plan = sched.schedule()
    sampled = [(tokens or {}).get(c.seq.question_id, TOKEN) for c in plan.sampled_chunks]
    sched.update(plan, sampled)
    return plan


def shape(plan: StepPlan) -> list[tuple[str, int, int, bool]]:
    return [(c.seq.question_id, c.start, c.length, c.sample) for c in plan.chunks]


def finished_ids(sched: Scheduler) -> list[tuple[str, Status]]:
    return [(s.question_id, s.status) for s in sched.take_finished()]


# -- admission and exact blocks ----------------------------------------------------------------------
def test_fresh_prompts_get_one_full_chunk_each_and_exact_blocks():
    sched = make(num_blocks=16, block_size=4)
    a, b, c = question("a", 5, arrival=1), question("b", 3, arrival=2), question("c", 8, arrival=3)
    add(sched, a, b, c)
    plan = sched.schedule()
    assert shape(plan) == [("a", 0, 5, True), ("b", 0, 3, True), ("c", 0, 8, True)]
    assert [ch.token_ids for ch in plan.chunks] == [a.prompt_ids, b.prompt_ids, c.prompt_ids]
    assert (a.block_ids, b.block_ids, c.block_ids) == ([0, 1], [2], [3, 4])
    assert [s.status for s in (a, b, c)] == [Status.RUNNING] * 3
    assert sched.pool.num_free == 11
    assert sched.update(plan, [TOKEN, TOKEN, TOKEN]) == [(a, TOKEN), (b, TOKEN), (c, TOKEN)]
    assert a.output_ids == b.output_ids == c.output_ids == [TOKEN]
    assert [s.num_computed_tokens for s in (a, b, c)] == [5, 3, 8]

    plan = step(sched)  # decodes: c's 9th token needs a third block, right behind its second
    assert shape(plan) == [("a", 5, 1, True), ("b", 3, 1, True), ("c", 8, 1, True)]
    assert plan.chunks[0].token_ids == [TOKEN]
    assert (a.block_ids, b.block_ids, c.block_ids) == ([0, 1], [2], [3, 4, 5])
    step(sched)  # b's 5th token: 3 is c's, so the first free block
    assert b.block_ids == [2, 6]
    step(sched)
    assert a.block_ids == [0, 1]  # 8 tokens computed fill two blocks exactly
    step(sched)  # a's 9th token: 2 is b's, so the first free block
    assert (a.block_ids, b.block_ids, c.block_ids) == ([0, 1, 7], [2, 6], [3, 4, 5])
    assert sched.pool.num_free == 8


def test_admission_stops_at_max_running_and_resumes_when_one_ends():
    sched = make(max_parallel_queries=2)
    a, b, c = question("a", 3, arrival=1), question("b", 3, arrival=2), question("c", 3, arrival=3)
    add(sched, a, b, c)
    plan = step(sched)
    assert [ch.seq.question_id for ch in plan.chunks] == ["a", "b"]
    assert c.status == Status.WAITING and sched.waiting == [c]
    plan = step(sched, {"a": EOS})
    assert [ch.seq.question_id for ch in plan.chunks] == ["a", "b"]
    assert a.status == Status.STOPPED
    plan = step(sched)
    assert shape(plan) == [("b", 4, 1, True), ("c", 0, 3, True)]
    assert c.status == Status.RUNNING


# -- chunked prefill -----------------------------------------------------------------------------------
def test_a_long_prompt_is_split_over_steps_and_samples_only_on_its_last_chunk():
    sched = make(max_tokens_per_step=4)
    a = question("a", 10)
    add(sched, a)
    plans = [sched.schedule()]
    assert sched.update(plans[-1], []) == []
    plans.append(sched.schedule())
    assert sched.update(plans[-1], []) == []
    assert a.output_ids == [] and a.first_token_at is None
    plans.append(sched.schedule())
    assert sched.update(plans[-1], [TOKEN]) == [(a, TOKEN)]
    assert [shape(p) for p in plans] == [[("a", 0, 4, False)], [("a", 4, 4, False)], [("a", 8, 2, True)]]
    assert [ch.token_ids for p in plans for ch in p.chunks] == [a.prompt_ids[0:4], a.prompt_ids[4:8],
                                                                a.prompt_ids[8:10]]
    assert a.output_ids == [TOKEN]
    assert shape(step(sched)) == [("a", 10, 1, True)]


@pytest.mark.parametrize("newcomer_priority", [0, 5])
def test_a_long_prefill_never_stalls_a_running_decode(newcomer_priority):
    sched = make(max_tokens_per_step=8, policy="priority")
    a = question("a", 3, arrival=1)
    add(sched, a)
    step(sched)
    b = question("b", 40, arrival=2, priority=newcomer_priority)
    add(sched, b)
    b_chunks = []
    while not b.output_ids:
        outputs_before = len(a.output_ids)
        plan = step(sched)
        assert plan.num_tokens <= 8
        a_chunks = [ch for ch in plan.chunks if ch.seq is a]
        assert len(a_chunks) == 1 and a_chunks[0].length == 1 and a_chunks[0].sample
        assert len(a.output_ids) == outputs_before + 1
        b_chunks += [(ch.start, ch.length, ch.sample) for ch in plan.chunks if ch.seq is b]
    assert sum(length for _, length, _ in b_chunks) == 40
    assert [sample for _, _, sample in b_chunks] == [False] * (len(b_chunks) - 1) + [True]
    assert all(length == 7 for _, length, _ in b_chunks[:-1])  # the budget less a's decode


def test_chunk_starts_follow_each_other_without_gaps():
    sched = make(max_tokens_per_step=5)
    a = question("a", 12)
    add(sched, a)
    starts = []
    for _ in range(4):
        plan = step(sched)
        starts += [(ch.start, ch.length) for ch in plan.chunks]
    assert starts == [(0, 5), (5, 5), (10, 2), (12, 1)]


# -- endings ---------------------------------------------------------------------------------------------
def test_a_stop_token_ends_only_that_question_and_frees_its_blocks_that_step():
    sched = make(num_blocks=16, block_size=4)
    a, b = question("a", 5, arrival=1), question("b", 5, arrival=2)
    add(sched, a, b)
    step(sched)
    free_before = sched.pool.num_free
    plan = sched.schedule()
    assert sched.update(plan, [EOS, TOKEN]) == [(a, EOS), (b, TOKEN)]
    assert a.status == Status.STOPPED and a.status.finish_reason == "stop"
    assert a.output_ids == [TOKEN, EOS]
    assert a.block_ids == [] and a.audit_blocks == (0, 1)
    assert sched.pool.num_free == free_before + 2
    assert sched.pool.owner_of(0) is None
    assert finished_ids(sched) == [("a", Status.STOPPED)]
    assert finished_ids(sched) == []
    assert shape(step(sched)) == [("b", 6, 1, True)]
    assert b.status == Status.RUNNING


def test_max_new_tokens_ends_with_length():
    sched = make()
    a, b = question("a", 4, max_new=3, arrival=1), question("b", 4, arrival=2)
    add(sched, a, b)
    step(sched)
    step(sched)
    assert a.status == Status.RUNNING
    step(sched)
    assert a.status == Status.LENGTH and a.status.finish_reason == "length"
    assert a.output_ids == [TOKEN] * 3
    assert a.block_ids == []
    assert finished_ids(sched) == [("a", Status.LENGTH)]
    assert b.status == Status.RUNNING and len(b.output_ids) == 3


@pytest.mark.parametrize("limit", ["capacity_tokens", "max_context"])
def test_the_kv_or_context_limit_ends_only_the_question_that_reaches_it(limit):
    sched = make(num_blocks=32, block_size=4, **{limit: 10})
    a, b = question("a", 8, arrival=1), question("b", 2, arrival=2)
    add(sched, a, b)
    step(sched)  # a: 9 tokens
    assert a.status == Status.RUNNING
    used_before = sched.pool.num_used
    step(sched)  # a: 10 tokens, the limit
    assert a.status == Status.LENGTH
    assert a.num_tokens == 10 and a.output_ids == [TOKEN, TOKEN]
    assert a.block_ids == []
    assert sched.pool.num_used == used_before - 2
    assert finished_ids(sched) == [("a", Status.LENGTH)]
    for _ in range(5):
        assert shape(step(sched))[0][0] == "b"
    assert b.status == Status.RUNNING and len(b.output_ids) == 7
    step(sched)
    assert b.status == Status.LENGTH and b.num_tokens == 10
    assert sched.pool.num_free == 32


def test_a_deadline_ends_with_timeout_and_keeps_its_output():
    clock = FakeClock(1000.0)
    sched = make(num_blocks=16, clock=clock)
    a = question("a", 4, arrival=1000.0, deadline=1000.5)
    b = question("b", 4, arrival=1000.0)
    add(sched, a, b)
    for _ in range(3):
        step(sched)
        clock.advance(0.1)
    assert a.status == Status.RUNNING and a.output_ids == [TOKEN] * 3
    clock.advance(0.2)  # 1000.5: the deadline
    free_before = sched.pool.num_free
    plan = step(sched)
    assert [ch.seq.question_id for ch in plan.chunks] == ["b"]
    assert a.status == Status.TIMEOUT and a.status.finish_reason == "timeout"
    assert a.output_ids == [TOKEN] * 3
    assert a.finished_at == pytest.approx(1000.5)
    assert sched.pool.num_free == free_before + 2
    assert finished_ids(sched) == [("a", Status.TIMEOUT)]
    assert b.status == Status.RUNNING and len(b.output_ids) == 4


def test_a_waiting_question_past_its_deadline_times_out_without_running():
    clock = FakeClock(10.0)
    sched = make(clock=clock, max_parallel_queries=1)
    a, b = question("a", 4, arrival=10.0), question("b", 4, arrival=10.0, deadline=10.2)
    add(sched, a, b)
    step(sched)
    clock.advance(0.5)
    assert [ch.seq.question_id for ch in step(sched).chunks] == ["a"]
    assert b.status == Status.TIMEOUT and b.output_ids == [] and b.admitted_at is None
    assert finished_ids(sched) == [("b", Status.TIMEOUT)]


def test_cancel_ends_a_running_question_at_once():
    sched = make(num_blocks=16)
    a, b = question("a", 6, arrival=1), question("b", 6, arrival=2)
    add(sched, a, b)
    step(sched)
    step(sched)
    free_before = sched.pool.num_free
    assert sched.cancel("a")
    assert a.status == Status.CANCELLED and a.status.finish_reason == "cancelled"
    assert a.output_ids == [TOKEN, TOKEN]
    assert a.block_ids == []
    assert sched.pool.num_free == free_before + 2  # before the next step, not after it
    assert not sched.cancel("a")
    assert not sched.cancel("nobody")
    assert [ch.seq.question_id for ch in step(sched).chunks] == ["b"]
    assert finished_ids(sched) == [("a", Status.CANCELLED)]
    assert b.status == Status.RUNNING


def test_cancel_of_a_waiting_question():
    sched = make(max_parallel_queries=1)
    a, b = question("a", 3, arrival=1), question("b", 3, arrival=2)
    add(sched, a, b)
    step(sched)
    assert sched.cancel("b")
    assert b.status == Status.CANCELLED and sched.waiting == []
    assert finished_ids(sched) == [("b", Status.CANCELLED)]
    assert sched.wait_time() == 0.0


def test_an_ending_not_yet_reported_is_work_and_is_reported_once():
    sched = make()
    a = question("a", 3)
    add(sched, a)
    step(sched)
    sched.cancel("a")
    assert sched.has_work and sched.wait_time() == 0.0
    assert not sched.schedule()
    assert finished_ids(sched) == [("a", Status.CANCELLED)]
    assert not sched.has_work
    assert sched.wait_time() is None
    assert sched.pool.num_free == sched.pool.num_blocks


def test_a_second_ending_of_a_finished_question_changes_nothing():
    sched = make()
    a = question("a", 3)
    add(sched, a)
    step(sched, {"a": EOS})
    sched.finish(a, Status.CANCELLED)
    assert a.status == Status.STOPPED
    assert finished_ids(sched) == [("a", Status.STOPPED)]


# -- early_stop=False: the static batch ----------------------------------------------------------------
def test_without_early_stop_a_finished_question_lingers_until_the_batch_drains():
    sched = make(num_blocks=16, block_size=4, early_stop=False)
    a, b = question("a", 4, arrival=1), question("b", 4, arrival=2, max_new=4)
    add(sched, a, b)
    step(sched)
    plan = step(sched, {"a": EOS})
    assert a.status == Status.STOPPED and a.output_ids == [TOKEN, EOS]
    assert finished_ids(sched) == [("a", Status.STOPPED)]
    assert (a.block_ids, b.block_ids) == ([0, 2], [1, 3])
    assert sched.pool.owner_of(0) == sched.pool.owner_of(2) == "a"  # kept, not freed
    late = question("late", 3, arrival=3)
    add(sched, late)
    plan = step(sched)  # still computed with the batch, never answered, and nobody is admitted
    assert shape(plan) == [("b", 5, 1, True), ("a", 5, 1, True)]
    assert a.output_ids == [TOKEN, EOS]
    assert late.status == Status.WAITING
    step(sched)
    assert b.status == Status.LENGTH and a.status == Status.STOPPED
    assert finished_ids(sched) == [("b", Status.LENGTH)]
    assert b.block_ids == [1, 3] and a.block_ids == [0, 2]
    assert sched.pool.num_used == 4
    plan = step(sched)  # the batch has drained: everyone leaves at once
    assert a.block_ids == [] and b.block_ids == [] and sched.lingering == []
    assert sched.pool.num_free == 16 - len(late.block_ids)
    assert finished_ids(sched) == []
    if not plan:  # the waiting question comes in with the next batch at the latest
        plan = step(sched)
    assert shape(plan) == [("late", 0, 3, True)]
    assert late.block_ids == [0]


def test_without_early_stop_a_cancel_still_ends_the_question_once():
    sched = make(early_stop=False)
    a, b = question("a", 4, arrival=1), question("b", 4, arrival=2, max_new=3)
    add(sched, a, b)
    step(sched)
    assert sched.cancel("a")
    assert not sched.cancel("a")
    ended = finished_ids(sched)
    while sched.has_work:
        step(sched)
        ended += finished_ids(sched)
    assert ended == [("a", Status.CANCELLED), ("b", Status.LENGTH)]
    assert a.output_ids == [TOKEN]
    assert sched.pool.num_free == sched.pool.num_blocks


def test_a_question_cancelled_mid_prefill_lingers_within_the_step_budget():
    sched = make(max_tokens_per_step=8, early_stop=False)
    a, b = question("a", 3, arrival=1), question("b", 40, arrival=2)
    add(sched, a, b)
    step(sched)
    step(sched)
    assert b.num_computed_tokens == 12
    sched.cancel("b")
    for _ in range(3):
        plan = step(sched)
        assert plan.num_tokens <= 8
        assert shape(plan)[0] == ("a", a.num_computed_tokens - 1, 1, True)
    assert b.output_ids == [] and b.status == Status.CANCELLED


# -- KV pressure: preemption ---------------------------------------------------------------------------
def test_kv_pressure_preempts_the_newest_question_which_recomputes_later():
    sched = make(num_blocks=4, block_size=4)
    a, b = question("a", 7, arrival=1, max_new=4), question("b", 7, arrival=2, max_new=5)
    add(sched, a, b)
    step(sched)
    assert (a.block_ids, b.block_ids) == ([0, 1], [2, 3])
    step(sched)
    assert sched.pool.num_free == 0
    plan = step(sched)  # a's 9th token needs a block: b, the newest, makes room
    assert plan.preempted == [b]
    assert shape(plan) == [("a", 8, 1, True)]
    assert b.status == Status.PREEMPTED and b.num_computed_tokens == 0 and b.block_ids == []
    assert b.output_ids == [TOKEN, TOKEN]  # its answer so far is kept
    assert b in sched.waiting and b not in sched.running
    assert a.block_ids == [0, 1, 2]
    assert sched.num_preemptions == 1
    assert finished_ids(sched) == []
    plan = step(sched)  # b needs three blocks to come back, only one is free
    assert shape(plan) == [("a", 9, 1, True)]
    assert a.status == Status.LENGTH
    plan = step(sched)  # re-admitted: prompt and output computed again, then the next token drawn
    assert shape(plan) == [("b", 0, 9, True)]
    assert plan.chunks[0].token_ids == b.prompt_ids + [TOKEN, TOKEN]
    assert b.status == Status.RUNNING and b.block_ids == [0, 1, 2]
    assert b.output_ids == [TOKEN] * 3
    while sched.has_work:
        step(sched)
        sched.take_finished()
    assert b.status == Status.LENGTH and b.output_ids == [TOKEN] * 5
    assert sched.num_preemptions == 1
    assert sched.pool.num_free == 4


def test_kv_pressure_preempts_the_lowest_priority_before_the_newest():
    sched = make(num_blocks=4, block_size=4, policy="priority")
    low, high = question("low", 7, arrival=1, priority=0), question("high", 7, arrival=2, priority=3)
    add(sched, low, high)
    plan = step(sched)
    assert [ch.seq.question_id for ch in plan.chunks] == ["high", "low"]
    assert (high.block_ids, low.block_ids) == ([0, 1], [2, 3])
    step(sched)
    plan = step(sched)  # high's 9th token needs a block: low, though older, makes room
    assert plan.preempted == [low]
    assert shape(plan) == [("high", 8, 1, True)]
    assert low.status == Status.PREEMPTED and low.block_ids == []
    assert high.status == Status.RUNNING and high.block_ids == [0, 1, 2]


def test_a_question_that_cannot_grow_preempts_itself_when_it_is_last():
    sched = make(num_blocks=4, block_size=4)
    a, b = question("a", 7, arrival=1), question("b", 8, arrival=2)
    add(sched, a, b)
    step(sched)  # a [0, 1], b [2, 3]; b's 9th token does not fit and b is the least important
    plan = step(sched)
    assert shape(plan) == [("a", 7, 1, True)]
    assert plan.preempted == [b]
    assert b.status == Status.PREEMPTED and b.block_ids == [] and a.block_ids == [0, 1]


@pytest.mark.parametrize("policy", ["fcfs", "shortest_prompt_first", "priority"])
def test_a_preempted_question_is_admitted_before_any_fresh_one(policy):
    sched = make(num_blocks=4, block_size=4, max_parallel_queries=2, policy=policy)
    a, b = question("a", 7, arrival=1, max_new=3), question("b", 7, arrival=2)
    add(sched, a, b)
    step(sched)
    step(sched)
    step(sched)  # a's 9th token preempts b; a then ends at its third token
    assert (a.status, b.status) == (Status.LENGTH, Status.PREEMPTED)
    eager = question("eager", 2, arrival=0, priority=9)  # earlier, shorter and more urgent than b
    add(sched, eager)
    assert shape(step(sched)) == [("b", 0, 9, True), ("eager", 0, 2, True)]
    assert (b.block_ids, eager.block_ids) == ([0, 1, 2], [3])


def test_a_preempted_question_comes_back_only_with_a_free_block_margin():
    """Back with its 3 blocks into a pool with exactly 3 free, c would be preempted again as soon as b
    grows (thrash); it waits for its blocks plus one per running question."""
    sched = make(num_blocks=6, block_size=4)
    a, b = question("a", 7, arrival=1, max_new=3), question("b", 7, arrival=2, max_new=7)
    c = question("c", 7, arrival=3, max_new=8)
    add(sched, a, b, c)
    step(sched)
    step(sched)
    plan = step(sched)  # a's and b's 9th tokens: c, the newest, makes room; a then ends
    assert plan.preempted == [c] and (a.status, b.block_ids) == (Status.LENGTH, [2, 3, 5])
    for _ in range(3):  # 3 blocks free, c needs 3 + 1 for running b: it waits while b runs
        assert shape(step(sched)) == [("b", b.num_computed_tokens - 1, 1, True)] and sched.pool.num_free == 3
    step(sched)
    assert b.status == Status.LENGTH and c.status == Status.PREEMPTED
    plan = step(sched)
    assert shape(plan) == [("c", 0, 9, True)] and c.block_ids == [0, 1, 2]
    while sched.has_work:
        step(sched)
        sched.take_finished()
    assert sched.num_preemptions == 1 and c.output_ids == [TOKEN] * 8


def test_a_question_that_does_not_fit_lets_later_ones_go_a_bounded_number_of_times():
    sched = make(num_blocks=8, block_size=4, max_overtakes=2)
    a = question("a", 17, arrival=1, max_new=50)
    add(sched, a)
    step(sched)
    assert a.block_ids == [0, 1, 2, 3, 4]
    big, s1 = question("big", 14, arrival=2), question("s1", 1, arrival=3)  # big needs 4 blocks, 3 are free
    add(sched, big, s1)
    assert shape(step(sched)) == [("a", 17, 1, True), ("s1", 0, 1, True)]
    assert (s1.block_ids, big.overtaken, big.status) == ([5], 1, Status.WAITING)
    s2 = question("s2", 1, arrival=4)
    add(sched, s2)
    assert shape(step(sched))[-1] == ("s2", 0, 1, True)
    assert (s2.block_ids, big.overtaken) == ([6], 2)
    s3 = question("s3", 1, arrival=5)
    add(sched, s3)
    step(sched)  # block 7 is free and s3 would fit, but big has been passed over twice: s3 waits behind it
    assert s3.status == Status.WAITING and sched.pool.num_free == 1
    step(sched, {"a": EOS})
    plan = step(sched)
    assert shape(plan)[-2:] == [("big", 0, 14, True), ("s3", 0, 1, True)]
    assert (big.block_ids, s3.block_ids) == ([1, 2, 3, 4], [7])


def test_preemption_under_pressure_never_fails_the_batch():
    sched = make(num_blocks=6, block_size=2, max_parallel_queries=4)
    seqs = [question(f"q{i}", 3 + i, arrival=i, max_new=6) for i in range(4)]
    add(sched, *seqs)
    ended = []
    for _ in range(200):
        if not sched.has_work:
            break
        step(sched)
        ended += finished_ids(sched)
    assert sorted(ended) == [(f"q{i}", Status.LENGTH) for i in range(4)]
    assert all(s.output_ids == [TOKEN] * 6 for s in seqs)
    assert sched.num_preemptions > 0
    assert sched.pool.num_free == 6


# -- overflow policies ---------------------------------------------------------------------------------
def test_reject_refuses_once_max_running_questions_are_present():
    sched = make(max_parallel_queries=2, overflow="reject")
    add(sched, question("a", 3, arrival=1), question("b", 3, arrival=2))
    with pytest.raises(Overloaded):
        sched.add(question("c", 3))
    step(sched, {"a": EOS})
    sched.add(question("c", 3))
    assert [s.question_id for s in sched.waiting] == ["c"]


def test_queue_refuses_once_max_waiting_are_waiting():
    sched = make(max_parallel_queries=1, max_waiting=2, overflow="queue")
    add(sched, question("a", 3, arrival=1), question("b", 3, arrival=2))
    assert not sched.has_room()
    with pytest.raises(Overloaded):
        sched.add(question("c", 3))
    step(sched)  # a runs, one place in the queue frees up
    assert sched.has_room()
    sched.add(question("c", 3))
    assert [s.question_id for s in sched.waiting] == ["b", "c"]


@pytest.mark.parametrize(("limits", "longest_ok"), [
    (dict(max_context=16), 15),
    (dict(capacity_tokens=12), 11),
    (dict(num_blocks=2, block_size=4), 7),  # the whole pool is 8 tokens
])
def test_a_prompt_that_cannot_fit_is_refused(limits, longest_ok):
    sched = make(**limits)
    with pytest.raises(PromptTooLong):
        sched.add(question("long", longest_ok + 1))
    assert sched.waiting == []
    sched.add(question("ok", longest_ok))
    plan = step(sched)
    assert shape(plan) == [("ok", 0, longest_ok, True)]
    assert sched.running == [] and plan.chunks[0].seq.status == Status.LENGTH  # one token, then the limit


# -- admission policies and the batch window -----------------------------------------------------------
@pytest.mark.parametrize(("policy", "first"), [("fcfs", "old"), ("shortest_prompt_first", "short"),
                                               ("priority", "urgent")])
def test_admission_policy_picks_the_expected_question(policy, first):
    sched = make(max_parallel_queries=1, policy=policy)
    add(sched, question("short", 2, arrival=3), question("urgent", 9, arrival=2, priority=5),
        question("old", 6, arrival=1))
    assert [ch.seq.question_id for ch in step(sched).chunks] == [first]


def test_priority_ties_are_broken_by_arrival():
    sched = make(max_parallel_queries=1, policy="priority")
    add(sched, question("later", 2, arrival=2, priority=1), question("earlier", 2, arrival=1, priority=1))
    assert [ch.seq.question_id for ch in step(sched).chunks] == ["earlier"]


def test_the_batch_window_waits_for_company_only_while_the_batch_is_empty_and_thin():
    clock = FakeClock(50.0)
    sched = make(clock=clock, max_parallel_queries=3, batch_window_s=0.010)
    assert sched.wait_time() is None
    sched.add(question("a", 3, arrival=50.0))
    assert sched.wait_time() == pytest.approx(0.010)
    clock.advance(0.004)
    sched.add(question("b", 3, arrival=clock.now))
    assert sched.wait_time() == pytest.approx(0.006)  # counted from the oldest arrival
    clock.advance(0.006)
    assert sched.wait_time() == 0.0
    clock.advance(1.0)
    assert sched.wait_time() == 0.0


def test_a_full_batch_goes_at_once():
    clock = FakeClock(50.0)
    sched = make(clock=clock, max_parallel_queries=2, batch_window_s=0.010)
    sched.add(question("a", 3, arrival=50.0))
    assert sched.wait_time() > 0
    sched.add(question("b", 3, arrival=50.0))
    assert sched.wait_time() == 0.0


def test_the_window_closes_once_the_waiting_prompts_fill_a_step():
    # A step holds at most max_tokens_per_step tokens: a later arrival could not join it, so waiting is pure delay.
    clock = FakeClock(50.0)
    sched = make(clock=clock, max_parallel_queries=8, batch_window_s=0.010, max_tokens_per_step=10)
    sched.add(question("a", 6, arrival=50.0))
    assert sched.wait_time() == pytest.approx(0.010)
    sched.add(question("b", 4, arrival=50.0))
    assert sched.wait_time() == 0.0


def test_nothing_waits_while_something_runs():
    clock = FakeClock(50.0)
    sched = make(clock=clock, max_parallel_queries=4, batch_window_s=0.010)
    sched.add(question("a", 3, arrival=50.0))
    clock.advance(0.02)
    step(sched)
    sched.add(question("b", 3, arrival=clock.now))
    assert sched.wait_time() == 0.0
    assert sched.wait_time() == 0.0


# -- channels -------------------------------------------------------------------------------------------
def test_running_questions_get_distinct_channels_recycled_when_they_end():
    sched = make(max_parallel_queries=3)
    a, b, c, d = (question(q, 3, arrival=i) for i, q in enumerate("abcd"))
    add(sched, a, b, c, d)
    step(sched)
    assert (a.channel, b.channel, c.channel) == (0, 1, 2)
    sched.cancel("b")
    step(sched)
    assert d.status == Status.RUNNING and d.channel == 1
    assert sorted(s.channel for s in sched.running) == [0, 1, 2]


def test_a_preempted_question_gives_back_its_channel():
    sched = make(num_blocks=4, block_size=4, max_parallel_queries=2)
    a, b = question("a", 7, arrival=1, max_new=3), question("b", 7, arrival=2)
    add(sched, a, b)
    step(sched)
    step(sched)
    step(sched)  # b preempted; a ends at its third token
    assert b.status == Status.PREEMPTED and a.status == Status.LENGTH
    step(sched)
    assert b.status == Status.RUNNING and b.channel == 0


# -- the property: random traffic over a small pool ----------------------------------------------------
FINAL = {Status.STOPPED, Status.LENGTH, Status.TIMEOUT, Status.CANCELLED}

arrival_st = st.fixed_dictionaries({
    "step": st.integers(0, 8),
    "prompt_len": st.integers(1, 12),
    "max_new": st.integers(1, 20),
    "priority": st.integers(0, 2),
    "timeout": st.none() | st.floats(0.0, 1.0),
    "cancel_after": st.none() | st.integers(0, 10),
})


def check_ownership(sched: Scheduler) -> None:
    pool, live = sched.pool, sched.running + sched.lingering
    ids = [b for s in live for b in s.block_ids]
    assert len(ids) == len(set(ids)) == pool.num_used, "a block owned twice, or leaked"
    assert pool.num_free + pool.num_used == pool.num_blocks
    for s in live:
        assert all(pool.owner_of(b) == s.question_id for b in s.block_ids)
    assert all(not s.block_ids for s in sched.waiting)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    arrivals=st.lists(arrival_st, min_size=1, max_size=12),
    block_size=st.sampled_from([1, 2, 4]),
    pool_tokens=st.integers(10, 28),
    max_parallel_queries=st.integers(1, 5),
    extra_budget=st.integers(0, 12),
    max_context=st.integers(8, 40),
    capacity=st.none() | st.integers(8, 30),
    policy=st.sampled_from(["fair", "fcfs", "shortest_prompt_first", "priority"]),
    overflow=st.sampled_from(["wait", "queue", "reject"]),
    early_stop=st.booleans(),
    length_aware=st.booleans(),
    p_eos=st.sampled_from([0.0, 0.05, 0.2]),
    rng=st.randoms(use_true_random=False),
)
def test_random_traffic_ends_every_question_once_and_leaks_no_block(
        arrivals, block_size, pool_tokens, max_parallel_queries, extra_budget, max_context, capacity, policy, overflow,
        early_stop, length_aware, p_eos, rng):
    clock = FakeClock(0.0)
    num_blocks = -(-pool_tokens // block_size)
    budget = max_parallel_queries + extra_budget
    sched = make(num_blocks, block_size, clock, max_parallel_queries=max_parallel_queries, max_tokens_per_step=budget,
                 max_context=max_context, capacity_tokens=capacity, policy=policy, overflow=overflow,
                 early_stop=early_stop, length_aware=length_aware, max_waiting=6)
    accepted: dict[str, Sequence] = {}
    cancels: dict[int, list[str]] = {}
    ended: list[Sequence] = []
    for n in range(200):
        for i, spec in enumerate(arrivals):
            if spec["step"] != n:
                continue
            qid = f"q{i}"
            deadline = None if spec["timeout"] is None else clock.now + spec["timeout"]
            seq = question(qid, spec["prompt_len"], max_new=spec["max_new"], priority=spec["priority"],
                           arrival=clock.now, deadline=deadline)
            try:
                sched.add(seq)
            except (Overloaded, PromptTooLong):
                continue
            accepted[qid] = seq
            if spec["cancel_after"] is not None:
                cancels.setdefault(n + spec["cancel_after"], []).append(qid)
        for qid in cancels.pop(n, []):
            was_live = not accepted[qid].status.finished
            assert sched.cancel(qid) == was_live
        if not sched.has_work and n > max(a["step"] for a in arrivals):
            break

        running_before = list(sched.running)
        plan = sched.schedule()
        check_ownership(sched)
        assert plan.num_tokens <= budget
        scheduled = {id(c.seq) for c in plan.chunks}
        assert len(scheduled) == len(plan.chunks)
        for s in sched.running:  # every running question moves every step: no stall
            assert id(s) in scheduled
        for c in plan.chunks:
            assert len(c.seq.block_ids) * block_size >= c.start + c.length
            assert c.start == c.seq.num_computed_tokens and c.length > 0
        for s in plan.preempted:
            assert s in running_before and s.status == Status.PREEMPTED and s.num_computed_tokens == 0

        draws = [EOS if rng.random() < p_eos else TOKEN for _ in plan.sampled_chunks]
        sched.update(plan, draws)
        check_ownership(sched)
        for s in sched.running:
            assert len(s.block_ids) * block_size >= s.num_computed_tokens
            assert s.num_tokens < sched.max_tokens_per_question
            assert len(s.output_ids) < s.params.max_new_tokens
        ended += sched.take_finished()
        clock.advance(0.05)
    else:
        pytest.fail("the scheduler did not drain in 200 steps")

    event(f"preempted: {sched.num_preemptions > 0}")
    event(f"accepted: {min(len(accepted), 4)}")
    for status in FINAL:
        event(f"{status.name}: {any(s.status == status for s in ended)}")
    assert sched.pool.num_free == num_blocks
    assert not (sched.running or sched.waiting or sched.lingering)
    assert sorted(s.question_id for s in ended) == sorted(accepted)
    for s in ended:
        assert s.status in FINAL
        assert s.block_ids == []
        if s.status == Status.STOPPED:
            assert s.output_ids[-1] == EOS
        elif s.status == Status.LENGTH:
            assert len(s.output_ids) == s.params.max_new_tokens or s.num_tokens >= sched.max_tokens_per_question
        elif s.status == Status.TIMEOUT:
            assert s.deadline is not None and s.finished_at >= s.deadline
        assert len(s.output_ids) <= s.params.max_new_tokens
        assert EOS not in s.output_ids[:-1]
