"""Sharing the engine between principals: fair share (VTC), priority then earliest deadline within a principal,
tenant quotas, hopeless deadlines answered before compute, and steps that never stall a decoding stream.

The scheduler is driven torch-free, the test playing the runner (one made-up token per sampled chunk),
as in tests/test_scheduler.py; the engine tests use the tiny random models.
"""

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from engine.kv.block_pool import BlockPool
from engine.schedule.quotas import BUCKET_S
from engine.schedule.scheduler import Scheduler, SchedulerLimits
from engine.schedule.tenants import Tenants
from engine.sequence import SamplingParams, Sequence, Status
from schemas.config import TenantConfig
from schemas.principal import Principal

TOKEN, EOS = 7, 2
BULK, CHAT, THIRD = Principal("k", "bulk"), Principal("k", "chat"), Principal("k", "third")


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make(num_blocks: int = 256, block_size: int = 4, clock=None, tenants: dict | None = None, **limits) -> Scheduler:
    limits.setdefault("max_context", 1024)
    limits.setdefault("policy", "fair")
    named = {name: TenantConfig(**rules) for name, rules in (tenants or {}).items()}
    return Scheduler(BlockPool(num_blocks, block_size), SchedulerLimits(tenants=Tenants(named), **limits),
                     clock=clock or FakeClock())


def question(qid: str, principal: Principal, prompt_len: int = 4, *, max_new: int = 8, priority: int = 0,
             arrival: float = 0.0, deadline: float | None = None) -> Sequence:
    params = SamplingParams(max_new_tokens=max_new, stop_token_ids=(EOS,))
    return Sequence(qid, list(range(100, 100 + prompt_len)), params, priority=priority, arrival=arrival,
                    deadline=deadline, principal=principal)


def step(sched: Scheduler, seconds: float | None = None):
    plan = sched.schedule()
    sched.update(plan, [TOKEN] * len(plan.sampled_chunks), seconds)
    return plan


def drain(sched: Scheduler, limit: int = 2000) -> list[Sequence]:
    ended = []
    for _ in range(limit):
        if not sched.has_work:
            return ended
        step(sched)
        ended += sched.take_finished()
    pytest.fail("the scheduler did not drain")


def admitted_order(plans) -> list[str]:
    seen = []
    for plan in plans:
        seen += [c.seq.question_id for c in plan.chunks if c.start == 0 and c.seq.question_id not in seen]
    return seen


# -- fair share ----------------------------------------------------------------------------------------
def test_a_newcomer_beside_a_flood_that_holds_every_channel_gets_one_at_once():
    sched = make(max_parallel_queries=4)
    flood = [question(f"b{i}", BULK, max_new=50, arrival=i) for i in range(12)]
    for seq in flood:
        sched.add(seq)
    for _ in range(3):
        step(sched)
    assert [s.principal for s in sched.running] == [BULK] * 4
    chat = question("chat", CHAT, arrival=20)
    sched.add(chat)
    plan = step(sched)
    assert chat.status == Status.RUNNING and [c.seq for c in plan.chunks if c.start == 0] == [chat]
    victim = plan.preempted[0]
    assert victim.principal == BULK and victim in sched.waiting  # it recomputes later, nothing is lost
    ended = drain(sched)
    assert {s.question_id for s in ended} | {"chat"} >= {s.question_id for s in flood}
    assert all(s.status == Status.LENGTH and len(s.output_ids) == s.params.max_new_tokens for s in flood + [chat])


def test_an_idle_engine_gives_everything_to_whoever_asks():
    sched = make(max_parallel_queries=4, tenants={"bulk": {"weight": 1}, "chat": {"weight": 9}})
    for i in range(6):
        sched.add(question(f"b{i}", BULK, arrival=i))
    step(sched)
    assert len(sched.running) == 4 and sched.num_preemptions == 0


def test_a_principal_back_from_idle_banks_no_credit():
    sched = make(max_parallel_queries=2)
    for i in range(4):
        sched.add(question(f"c{i}", CHAT, max_new=4, arrival=i))
    drain(sched)
    for i in range(4):  # bulk alone for a while: its counter runs far ahead of chat's
        sched.add(question(f"b{i}", BULK, max_new=20, arrival=10 + i))
    for _ in range(30):
        step(sched)
    sched.add(question("c-late", CHAT, max_new=4, arrival=50))
    # Lifted to the busy one's counter: chat is not owed the time it was idle.
    assert sched.sharing.fair.counter(CHAT) == sched.sharing.fair.counter(BULK)


@pytest.mark.parametrize("weights", [(1, 1), (3, 1)])
def test_two_backlogged_principals_are_served_by_weight(weights):
    sched = make(max_parallel_queries=8, max_tokens_per_step=64,
                 tenants={"bulk": {"weight": weights[0]}, "chat": {"weight": weights[1]}})
    for i in range(200):
        sched.add(question(f"b{i}", BULK, prompt_len=6, max_new=12, arrival=i))
        sched.add(question(f"c{i}", CHAT, prompt_len=6, max_new=12, arrival=i))
    served = {BULK: 0, CHAT: 0}
    for _ in range(300):
        for chunk in step(sched).chunks:
            served[chunk.seq.principal] += chunk.length
    assert sched.waiting  # both were backlogged throughout
    assert served[BULK] / served[CHAT] == pytest.approx(weights[0] / weights[1], rel=0.05)


def test_preemption_takes_from_the_most_served_principal_its_cheapest_question():
    sched = make(num_blocks=9, block_size=4, max_parallel_queries=4)
    old = question("bulk-old", BULK, prompt_len=8, max_new=30, arrival=1)
    new = question("bulk-new", BULK, prompt_len=3, max_new=30, arrival=2)
    chat = question("chat", CHAT, prompt_len=7, max_new=30, arrival=3)
    for seq in (old, new, chat):
        sched.add(seq)
    victims = []
    for _ in range(12):
        victims += step(sched).preempted
        if victims:
            break
    assert victims and victims[0] is new  # bulk was served more; of its two, the newer holds fewer tokens


def test_while_a_less_served_principal_decodes_a_more_served_ones_prompts_wait():
    sched = make(max_parallel_queries=8, max_tokens_per_step=64, prompt_chunk_tokens=64)
    for i in range(3):
        sched.add(question(f"b{i}", BULK, prompt_len=4, max_new=60, arrival=i))
    for _ in range(5):
        step(sched)
    chat = question("chat", CHAT, prompt_len=4, max_new=20, arrival=10)
    sched.add(chat)
    for _ in range(3):  # chat joins, lifted to bulk's counter; bulk's three streams soon put bulk ahead
        step(sched)
    late = question("b-late", BULK, prompt_len=30, arrival=11)
    sched.add(late)
    held = 0
    while chat.status == Status.RUNNING:
        chat_behind = sched.sharing.fair.counter(CHAT) < sched.sharing.fair.counter(BULK)
        plan = step(sched)
        if chat_behind:  # bulk, served more, does not slow chat's stream with its prompt
            assert all(c.seq is not late for c in plan.chunks)
            held += 1
    assert held >= 10
    while late.status == Status.WAITING:
        step(sched)
    assert late.admitted_at is not None


@pytest.mark.parametrize("fixed_rows, paced", [(5, True), (1000, False)])
def test_beside_a_light_principal_a_backlogged_ones_rows_are_paced_where_rows_make_a_step_dearer(fixed_rows, paced):
    # Forwards timed as a CPU runs them (the fixed part worth 5 rows) or a GPU (worth 1000): PACE 1.5 lets
    # bulk add half of what the step's fixed part and chat's 2 rows cost, 3.5 rows on the CPU.
    sched = make(max_parallel_queries=8)

    def timed_step():
        plan = sched.schedule()
        sched.update(plan, [TOKEN] * len(plan.sampled_chunks), 0.001 * (fixed_rows + plan.num_tokens))
        return plan

    for i in range(12):
        sched.add(question(f"b{i}", BULK, max_new=200, arrival=i))
    for _ in range(20):  # the step costs are measured (16 forwards) before chat comes
        timed_step()
    chat = [question(f"c{i}", CHAT, max_new=12, arrival=50 + i) for i in range(2)]
    for seq in chat:
        sched.add(seq)
    beside = []  # bulk's rows in the steps where chat decoded, served less than bulk
    while any(not seq.status.finished for seq in chat):
        chat_behind = sched.sharing.fair.counter(CHAT) < sched.sharing.fair.counter(BULK)
        plan = timed_step()
        if chat_behind and all(c.seq.decoding for c in plan.chunks):
            assert {id(c.seq) for c in plan.chunks} >= {id(seq) for seq in chat if seq.status == Status.RUNNING}
            beside.append(sum(c.seq.principal == BULK for c in plan.chunks))
    assert len(beside) >= 8
    assert set(beside) == ({3} if paced else {6})
    assert len([c for c in timed_step().chunks if c.seq.principal == BULK]) == 8  # chat gone: every bulk row


# -- within a principal: priority, then the earliest deadline ------------------------------------------
def test_within_a_principal_priority_comes_first_then_the_earliest_deadline():
    sched = make(max_parallel_queries=1)
    sched.add(question("late", BULK, arrival=1, deadline=5000.0))
    sched.add(question("none", BULK, arrival=0))
    sched.add(question("soon", BULK, arrival=2, deadline=4000.0))
    sched.add(question("urgent", BULK, arrival=3, priority=2, deadline=9000.0))
    plans = [step(sched) for _ in range(60)]
    assert admitted_order(plans) == ["urgent", "soon", "late", "none"]


# -- quotas -------------------------------------------------------------------------------------------
def test_a_tenant_over_its_token_rate_waits_and_is_never_failed():
    clock = FakeClock(0.0)
    sched = make(clock=clock, batch_window_s=0.0, tenants={"bulk": {"max_tokens_per_second": 20}})
    seqs = [question(f"b{i}", BULK, prompt_len=20, max_new=4, arrival=0.0) for i in range(3)]
    chat = question("chat", CHAT, prompt_len=20, max_new=4, arrival=0.0)
    for seq in seqs + [chat]:
        sched.add(seq)
    ended = []
    while sched.has_work:
        wait = sched.wait_time()
        clock.now += wait if wait else 0.05  # a step takes 50 ms; an idle engine sleeps until the bucket drains
        if not wait:
            step(sched)
        ended += sched.take_finished()
        assert clock.now < 60
    assert {s.status for s in ended} == {Status.LENGTH}
    assert chat.throttled_s == 0 and chat.admitted_at == pytest.approx(0.05)  # another tenant is not held up
    admitted = sorted(s.admitted_at for s in seqs)
    assert admitted[0] == pytest.approx(0.05)
    rate = 20.0
    # Each 24-token question fills the bucket past its second's worth: the next waits for it to drain.
    assert admitted[1] - admitted[0] >= (24 - rate * BUCKET_S) / rate - 0.1
    assert sum(s.throttled_s > 0 for s in seqs) == 2
    assert sched.sharing.counts["bulk"].throttled == 2 and sched.sharing.counts["bulk"].throttled_s > 0


def test_max_in_flight_bounds_a_tenants_questions_in_the_batch():
    sched = make(max_parallel_queries=8, tenants={"bulk": {"max_in_flight": 2}})
    for i in range(5):
        sched.add(question(f"b{i}", BULK, max_new=6, arrival=i))
    sched.add(question("chat", CHAT, max_new=6, arrival=9))
    most = 0
    while sched.has_work:
        step(sched)
        most = max(most, sum(s.principal == BULK for s in sched.running))
        sched.take_finished()
    assert most == 2


# -- deadlines that cannot be met ---------------------------------------------------------------------
def measured(sched: Scheduler, per_row_s: float) -> None:
    """Feed the scheduler's step cost what forwards of this speed took."""
    for rows in (1, 2, 4, 8, 16, 32, 64, 128) * 3:
        sched.costs.observe(rows, rows * 50, 0.002 + per_row_s * rows)


def test_a_question_that_cannot_meet_its_deadline_is_answered_timeout_before_any_compute():
    clock = FakeClock(100.0)
    sched = make(clock=clock)
    measured(sched, per_row_s=0.01)  # 200 prompt tokens take about 2 s here
    hopeless = question("hopeless", BULK, prompt_len=200, arrival=100.0, deadline=100.5)
    fine = question("fine", BULK, prompt_len=200, arrival=100.0, deadline=105.0)
    sched.add(hopeless)
    sched.add(fine)
    plan = step(sched)
    assert [c.seq for c in plan.chunks] == [fine]
    assert hopeless.status == Status.TIMEOUT and hopeless.num_computed_tokens == 0 and not hopeless.block_ids
    assert hopeless.error_code == "deadline_unreachable" and "could not be met" in hopeless.error
    assert [s.question_id for s in sched.take_finished()] == ["hopeless"]


def test_without_measurements_no_deadline_is_judged_hopeless():
    sched = make(clock=FakeClock(100.0))
    seq = question("q", BULK, prompt_len=200, arrival=100.0, deadline=100.01)
    sched.add(seq)
    step(sched)
    assert seq.status == Status.RUNNING


# -- stall-free steps ---------------------------------------------------------------------------------
def test_while_anyone_decodes_a_step_carries_one_prompt_chunk():
    sched = make(max_tokens_per_step=64, prompt_chunk_tokens=8)
    a = question("a", BULK, prompt_len=3, max_new=40, arrival=1)
    sched.add(a)
    step(sched)
    sched.add(question("b", CHAT, prompt_len=60, max_new=2, arrival=2))
    while a.status == Status.RUNNING:
        plan = step(sched)
        prompt = sum(c.length for c in plan.chunks if c.seq is not a)
        assert prompt <= 8 and any(c.seq is a and c.length == 1 for c in plan.chunks)
    alone = question("c", CHAT, prompt_len=60, max_new=2, arrival=3)
    sched.take_finished()
    drain(sched)
    sched.add(alone)
    assert step(sched).chunks[0].length == 60  # nobody decodes: the whole token budget


def test_prompt_chunks_shrink_where_attention_reads_a_long_context():
    sched = make(max_tokens_per_step=512, prompt_chunk_tokens=64, max_context=4096, num_blocks=1200)
    for rows, keys in [(1, 100), (64, 2080), (64, 40_000), (8, 8_000), (128, 8_256), (128, 200_000)] * 4:
        sched.costs.observe(rows, keys, 0.001 + 0.001 * rows + 0.00001 * keys)  # a key read: 1/100 of a row
    a = question("a", BULK, prompt_len=3, max_new=1000, arrival=1)
    sched.add(a)
    step(sched)
    b = question("b", BULK, prompt_len=3000, max_new=1, arrival=2)  # one principal: only the room decides
    sched.add(b)
    chunks = {}  # start -> length, while a decodes
    while b.num_computed_tokens < 2000:
        chunk = next(c for c in step(sched).chunks if c.seq is b)
        chunks[chunk.start] = chunk.length
    assert a.status == Status.RUNNING
    assert chunks[0] == 64  # a fresh chunk: what prompt_chunk_tokens costs
    late = [length for start, length in chunks.items() if start > 1500]
    assert late and max(late) < 16  # its rows read 1,500+ keys each, a row's worth per 100


# -- the property: random traffic from several principals --------------------------------------------
arrival_st = st.fixed_dictionaries({
    "who": st.sampled_from([BULK, CHAT, THIRD]),
    "step": st.integers(0, 12),
    "prompt_len": st.integers(1, 12),
    "max_new": st.integers(1, 16),
    "priority": st.integers(0, 2),
    "timeout": st.none() | st.floats(0.2, 3.0),
})


MAX_CONTEXT = 40  # one question's maximum: prompt and answer together


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    arrivals=st.lists(arrival_st, min_size=6, max_size=50),
    weights=st.tuples(st.sampled_from([1, 2, 3]), st.sampled_from([1, 3])),
    max_parallel_queries=st.integers(1, 6),
    extra_budget=st.integers(0, 12),
    tight_pool=st.none() | st.integers(24, 120),
    block_size=st.sampled_from([1, 2, 4]),
    quota=st.none() | st.integers(20, 200),
)
def test_random_traffic_from_several_principals_is_served_fairly_and_leaks_nothing(
        arrivals, weights, max_parallel_queries, extra_budget, tight_pool, block_size, quota):
    """VTC's bound: while two principals stay backlogged, their service (tokens computed, over their weights)
    differs by at most one step's token budget plus one question's maximum, as long as the KV pool holds
    every question (a `tight_pool` may make a principal's next question wait for blocks while another's
    smaller ones go: then only no starvation, no leak and every question ending once are checked)."""
    clock = FakeClock(0.0)
    budget = max_parallel_queries + extra_budget
    pool_tokens = tight_pool or max_parallel_queries * MAX_CONTEXT * 2
    tenants = {"bulk": {"weight": weights[0]}, "chat": {"weight": weights[1], "max_tokens_per_second": quota}}
    sched = make(-(-pool_tokens // block_size), block_size, clock, tenants, max_parallel_queries=max_parallel_queries,
                 max_tokens_per_step=budget, max_context=MAX_CONTEXT)
    weight = {BULK: weights[0], CHAT: weights[1], THIRD: 1}
    accepted, ended = [], []
    served = dict.fromkeys(weight, 0)
    since: dict[tuple, dict] = {}  # two principals backlogged together -> each one's service when that began
    widest = 0.0
    for n in range(600):
        for i, spec in enumerate(arrivals):
            if spec["step"] == n:
                deadline = None if spec["timeout"] is None else clock.now + spec["timeout"]
                seq = question(f"q{i}", spec["who"], spec["prompt_len"], max_new=spec["max_new"],
                               priority=spec["priority"], arrival=clock.now, deadline=deadline)
                sched.add(seq)
                accepted.append(seq)
        if not sched.has_work and n > 30:
            break
        admissible = {s.principal for s in sched.waiting if sched.sharing.quotas.retry_in(s.principal, clock.now) == 0}
        plan = sched.schedule()
        for chunk in plan.chunks:
            served[chunk.seq.principal] += chunk.length
        sched.update(plan, [EOS if (n + i) % 11 == 0 else TOKEN for i in range(len(plan.sampled_chunks))])
        ended += sched.take_finished()
        check_pool(sched)
        backlogged = {s.principal for s in sched.waiting} & admissible  # over its quota, a principal only waits
        for pair in [(a, b) for a in backlogged for b in backlogged if a < b]:
            start = since.setdefault(pair, {p: served[p] for p in pair})
            a, b = pair
            gap = abs((served[a] - start[a]) / weight[a] - (served[b] - start[b]) / weight[b])
            widest = max(widest, gap / (budget + MAX_CONTEXT))
            assert tight_pool or gap <= budget + MAX_CONTEXT, (pair, gap)
        since = {pair: start for pair, start in since.items() if set(pair) <= backlogged}
        clock.now += 0.05
    else:
        pytest.fail("the scheduler did not drain in 600 steps: a question starved")
    event(f"preempted: {sched.num_preemptions > 0}")
    event(f"widest gap over the bound: {min(1.0, round(widest, 1))}")
    assert sorted(s.question_id for s in ended) == sorted(s.question_id for s in accepted)
    for seq in ended:
        assert seq.status in (Status.STOPPED, Status.LENGTH, Status.TIMEOUT)
        if seq.status == Status.TIMEOUT:
            assert seq.deadline is not None and seq.finished_at >= seq.deadline
    assert sched.pool.num_free == sched.pool.num_blocks


def check_pool(sched: Scheduler) -> None:
    pool, live = sched.pool, sched.running + sched.lingering
    ids = [b for s in live for b in s.block_ids]
    assert len(ids) == len(set(ids)) == pool.num_used, "a block owned twice, or leaked"
    assert all(not s.block_ids for s in sched.waiting)


# -- the engine: fairness changes the order, never the tokens --------------------------------------
def core_run(model, options, arrivals, *, ask=None):
    """Drive an EngineCore: `arrivals` is [(step, principal, Q)]; returns (answers by id, the step each ended)."""
    from engine import EngineCore
    from schemas import Params, QuestionEvent

    core = EngineCore(model, options)
    answers, ended_at, step_no = {}, {}, 0
    pending = sorted(arrivals, key=lambda a: a[0])
    while pending or core.has_work:
        while pending and pending[0][0] <= step_no:
            _, principal, q = pending.pop(0)
            event = QuestionEvent(question_id=q.qid, prompt="(token ids)", params=Params(**q.params), **q.event)
            core.add(event, prompt_ids=list(q.prompt_ids), principal=principal)
        wait = core.wait_time() if core.has_work else None
        if wait:
            import time

            time.sleep(wait)
        for answer in core.step().answers:
            answers[answer.question_id] = answer
            ended_at[answer.question_id] = step_no
        step_no += 1
        assert step_no < 20_000
    return answers, ended_at, core


def test_a_newcomer_is_answered_before_a_floods_tail_with_the_tokens_it_gets_alone(tiny_models, harness):
    import random

    model = tiny_models["llama"].kev
    rng = random.Random(3)
    flood = [(0, BULK, harness.Q(f"b{i}", harness.random_prompt(rng, rng.randint(10, 60)),
                                 dict(max_new_tokens=24, temperature=0.0))) for i in range(16)]
    chat = (4, CHAT, harness.Q("chat", harness.random_prompt(rng, 12), dict(max_new_tokens=6, temperature=0.0)))
    runs = {policy: core_run(model, harness.tiny_options(max_parallel_queries=4, policy=policy), flood + [chat])
            for policy in ("fcfs", "fair")}
    (fcfs, fcfs_end, _), (fair, fair_end, core) = runs["fcfs"], runs["fair"]
    assert {q: a.token_ids for q, a in fair.items()} == {q: a.token_ids for q, a in fcfs.items()}
    assert fcfs_end["chat"] > sorted(fcfs_end.values())[-4]  # FCFS: behind the whole flood
    assert fair_end["chat"] < sorted(fair_end[q] for q in fair_end if q != "chat")[4]  # fair: at once
    assert core.scheduler.num_preemptions >= 1 and core.pool.num_free == core.pool.num_blocks


def test_an_engine_tenant_over_its_rate_is_throttled_and_its_answers_say_how_long(tiny_models, harness):
    import random

    rng = random.Random(4)
    options = harness.tiny_options(tenants={"bulk": TenantConfig(max_tokens_per_second=250)})
    questions = [(0, BULK, harness.Q(f"b{i}", harness.random_prompt(rng, 300), dict(max_new_tokens=4)))
                 for i in range(3)]
    answers, _, core = core_run(tiny_models["llama"].kev, options, questions)
    assert {a.finish_reason for a in answers.values()} == {"length"} and not any(a.error for a in answers.values())
    throttled = sorted(a.timings.throttled_ms for a in answers.values())
    assert throttled[0] == 0 and throttled[1] > 0 and throttled[2] > throttled[1]
    assert all(a.timings.queued_ms >= a.timings.throttled_ms for a in answers.values())
    assert core.scheduler.sharing.counts["bulk"].throttled == 2


def test_an_engine_answers_an_unreachable_deadline_at_once_and_says_why(tiny_models, harness):
    model = tiny_models["llama"].kev
    from engine import EngineCore
    from schemas import Params, QuestionEvent

    core = EngineCore(model, harness.tiny_options())
    measured(core.scheduler, per_row_s=0.05)  # as if each prompt row took 50 ms here
    prompt = list(range(5, 205))
    event = QuestionEvent(question_id="q", prompt="(ids)", params=Params(max_new_tokens=4), timeout_ms=3000)
    core.add(event, prompt_ids=prompt)
    events = core.step()
    assert core.num_forwards == 0  # nothing was computed
    (answer,) = events.answers
    assert answer.finish_reason == "timeout" and answer.token_ids == ()
    assert answer.error.code == "deadline_unreachable" and "200 prompt tokens" in answer.error.message


def test_while_a_stream_decodes_the_engine_carries_one_prompt_chunk_per_step(tiny_models, harness):
    import random

    rng = random.Random(5)
    stream = harness.Q("stream", harness.random_prompt(rng, 8), dict(max_new_tokens=60))
    long = harness.Q("long", harness.random_prompt(rng, 400), dict(max_new_tokens=2))
    options = harness.tiny_options(prompt_chunk_tokens=32)
    alone = harness.run_core(tiny_models["llama"].kev, [long], options)
    out = harness.run_core(tiny_models["llama"].kev, [stream], options, later={3: [long]})
    decoding = [plan for plan in out.plans if any(q == "stream" and n == 1 for q, _, n, _ in plan)]
    assert all(sum(n for q, _, n, _ in plan if q == "long") <= 32 for plan in decoding)
    assert sum(any(q == "long" for q, *_ in plan) for plan in decoding) >= 400 // 32
    assert out.tokens("long") == alone.tokens("long")
    assert [n for plan in alone.plans for q, _, n, _ in plan if q == "long"][0] == 400  # alone: the whole budget


# -- configuration ---------------------------------------------------------------------------------------
def test_kev_yaml_tenants_reach_the_scheduler_under_one_name(tmp_path):
    from engine import EngineOptions
    from engine.assembly import scheduler_limits as _limits
    from kev_async.settings import load_config
    from schemas import ConfigError

    path = tmp_path / "kev.yaml"
    path.write_text("tenants:\n  acme: {weight: 3, max_tokens_per_second: 500, max_in_flight: 8}\n"
                    "  default: {weight: 0.5}\n")
    cfg = load_config(path, env={})
    assert cfg.scheduler.policy == "fair"  # the default
    limits = _limits(EngineOptions.from_config(cfg), 2048)
    acme, other = limits.tenants.rules(Principal("k", "acme")), limits.tenants.rules(Principal("k", "beta"))
    assert (acme.weight, acme.max_tokens_per_second, acme.max_in_flight) == (3, 500, 8)
    assert other.weight == 0.5 and limits.tenants.rules(Principal("unsigned", None)).weight == 0.5
    path.write_text("tenants:\n  acme: {weight: 0}\n")
    with pytest.raises(ConfigError) as error:
        load_config(path, env={})
    assert "tenants.acme.weight" in dict(error.value.problems)
