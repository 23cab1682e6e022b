"""The prefix cache on exact block ids: reuse, tenant scoping, eviction, references (no model here).

The model-level proof that the cache changes no answer is tests/test_prefix_answers.py.
"""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.audit import violations
from engine.kv.block_pool import BlockPool
from engine.kv.prefix_cache import chain_hashes, prefix_salt
from engine.schedule.scheduler import Scheduler, SchedulerLimits
from engine.sequence import SamplingParams, Sequence, Status

TOKEN, EOS = 7, 2
SYSTEM = list(range(1000, 1010))  # 10 tokens: two full blocks of 4 and half a third


def make(num_blocks: int = 16, block_size: int = 4, **limits) -> Scheduler:
    limits.setdefault("max_context", 1024)
    return Scheduler(BlockPool(num_blocks, block_size), SchedulerLimits(**limits), clock=lambda: 0.0)


def question(qid: str, prompt: list[int], *, tenant: str | None = "acme", adapter=None, max_new: int = 100,
             arrival: float = 0.0) -> Sequence:
    seq = Sequence(qid, list(prompt), SamplingParams(max_new_tokens=max_new, stop_token_ids=(EOS,)), arrival=arrival)
    seq.cache_salt = prefix_salt("model", tenant, None, adapter)
    return seq


def step(sched: Scheduler, tokens: dict[str, int] | None = None):
    plan = sched.schedule()
    sched.update(plan, [(tokens or {}).get(c.seq.question_id, TOKEN) for c in plan.sampled_chunks])
    return plan


def shape(plan) -> list[tuple[str, int, int, bool]]:
    return [(c.seq.question_id, c.start, c.length, c.sample) for c in plan.chunks]


# -- hashing -------------------------------------------------------------------------------------------
def test_a_block_hash_names_the_whole_prefix_and_the_salt():
    salt = prefix_salt("m", "acme", None, None)
    base = chain_hashes(salt, list(range(10)), 4)
    assert len(base) == 2  # the partial third block has no name
    assert chain_hashes(salt, list(range(8)) + [99, 98], 4) == base  # tokens past the full blocks: no matter
    changed_first = chain_hashes(salt, [5] + list(range(1, 10)), 4)
    assert changed_first[0] != base[0] and changed_first[1] != base[1]  # the parent is in the child's hash
    for other in (prefix_salt("m", "other", None, None), prefix_salt("m", "acme", "s1", None),
                  prefix_salt("m", "acme", None, ("lora", 1)), prefix_salt("m", "acme", None, ("lora", 2)),
                  prefix_salt("m2", "acme", None, None), prefix_salt("m", None, None, None)):
        assert not set(chain_hashes(other, list(range(10)), 4)) & set(base)


# -- reuse ---------------------------------------------------------------------------------------------
def test_a_later_question_reads_the_leading_full_blocks_and_computes_the_rest():
    sched = make()
    a = question("a", SYSTEM + [1, 2])
    sched.add(a)
    assert shape(step(sched)) == [("a", 0, 12, True)]
    assert a.block_ids == [0, 1, 2] and sched.pool.num_cached == 3  # 12 prompt tokens: three full blocks
    b = question("b", SYSTEM + [3, 4, 5])
    sched.add(b)
    plan = step(sched)
    assert shape(plan) == [("a", 12, 1, True), ("b", 8, 5, True)]
    assert b.block_ids == [0, 1, 4, 5] and a.block_ids == [0, 1, 2, 3]
    assert b.cached_prompt_tokens == 8 and a.cached_prompt_tokens == 0
    assert sched.pool.holders_of(0) == ("a", "b") and sched.pool.holders_of(4) == ("b",)
    assert sched.shared_prefix(b) == b.prefix_hashes[:3]  # its own filled prompt block 4 is cached now
    assert (sched.prompt_tokens_admitted, sched.cached_tokens_admitted) == (25, 8)


def test_questions_arriving_together_compute_their_common_prefix_once():
    sched = make(max_tokens_per_step=8)
    a, b = question("a", SYSTEM + [1, 2], arrival=1), question("b", SYSTEM + [3], arrival=2)
    c = question("c", list(range(50, 55)), arrival=3)  # shares nothing: not held back
    for seq in (a, b, c):
        sched.add(seq)
    assert shape(step(sched)) == [("a", 0, 8, False)]  # b waits for the blocks a is computing; c: no budget
    assert shape(step(sched)) == [("a", 8, 4, True), ("b", 8, 3, True), ("c", 0, 1, False)]
    assert b.block_ids[:2] == a.block_ids[:2] == [0, 1] and b.cached_prompt_tokens == 8


def test_a_prompt_is_never_served_whole_its_last_token_is_computed():
    sched = make()
    a = question("a", SYSTEM[:8])
    sched.add(a)
    step(sched)
    b = question("b", SYSTEM[:8])  # the same 8 tokens: two full cached blocks, only the first is read
    sched.add(b)
    assert shape(step(sched)) == [("a", 8, 1, True), ("b", 4, 4, True)]
    assert b.block_ids == [0, 3] and b.cached_prompt_tokens == 4


def test_generated_tokens_are_never_cached():
    sched = make()
    a = question("a", SYSTEM[:6], max_new=10)
    sched.add(a)
    for _ in range(6):
        step(sched)
    assert a.num_computed_tokens == 11 and len(a.block_ids) == 3
    assert sched.pool.num_cached == 1  # only [0, 4): blocks holding generated tokens have no name


def test_different_tenants_and_adapters_never_share_a_block():
    sched = make(num_blocks=32)
    seqs = [question("a", SYSTEM + [1]), question("other-tenant", SYSTEM + [1], tenant="beta"),
            question("no-tenant", SYSTEM + [1], tenant=None), question("lora", SYSTEM + [1], adapter=("x", 1)),
            question("lora-v2", SYSTEM + [1], adapter=("x", 2))]
    sched.add(seqs[0])
    step(sched)
    for seq in seqs[1:]:
        sched.add(seq)
    step(sched)
    blocks = [set(s.block_ids) for s in seqs]
    assert all(not (blocks[i] & blocks[j]) for i in range(5) for j in range(i + 1, 5))
    assert [s.cached_prompt_tokens for s in seqs] == [0] * 5
    same = question("same-tenant", SYSTEM + [9])
    sched.add(same)
    step(sched)
    assert same.block_ids[:2] == seqs[0].block_ids[:2] and same.cached_prompt_tokens == 8


def test_strict_questions_neither_read_nor_fill_the_cache():
    sched = make()
    a = question("a", SYSTEM + [1])
    a.cache_salt = None
    sched.add(a)
    step(sched)
    b = question("b", SYSTEM + [1])
    b.cache_salt = None
    sched.add(b)
    step(sched)
    assert sched.pool.num_cached == 0 and b.cached_prompt_tokens == 0 and not set(a.block_ids) & set(b.block_ids)


# -- lifetime: finish, cancel, preempt, evict ------------------------------------------------------------
def test_blocks_outlive_their_last_holder_as_idle_cache_and_are_read_again():
    sched = make()
    a = question("a", SYSTEM + [1], max_new=1)
    sched.add(a)
    step(sched)
    assert a.status == Status.LENGTH and a.block_ids == []
    pool = sched.pool
    assert pool.num_free == 16 and pool.num_used == 0 and pool.num_cached == 2 and pool.cache.num_idle == 2
    b = question("b", SYSTEM + [2])
    sched.add(b)
    assert shape(step(sched)) == [("b", 8, 3, True)]
    assert b.block_ids == [0, 1, 2] and pool.cache.num_idle == 0


def test_cancel_and_preemption_drop_only_their_own_references():
    sched = make(num_blocks=6)
    a, b = question("a", SYSTEM + [1], arrival=1), question("b", SYSTEM + [2], arrival=2)
    sched.add(a)
    step(sched)
    sched.add(b)
    step(sched)
    assert (a.block_ids, b.block_ids) == ([0, 1, 2], [0, 1, 3])
    step(sched)
    step(sched)  # a at 13 tokens, b at 12: a's next token takes block 4, b's takes 5
    assert sched.pool.num_free == 0 and (a.block_ids, b.block_ids) == ([0, 1, 2, 4], [0, 1, 3, 5])
    plan = step(sched)
    assert plan.preempted == [] and len(a.block_ids) == 4
    for _ in range(3):
        plan = step(sched)
        if plan.preempted:
            break
    assert plan.preempted == [b] and b.block_ids == []
    assert sched.pool.holders_of(0) == ("a",) and sched.pool.holders_of(1) == ("a",)
    assert sched.cancel("a")
    assert sched.pool.num_used == 0 and sched.pool.num_free == 6
    assert sched.pool.cache.num_idle == 2  # the two prefix blocks, kept for later questions


def test_eviction_takes_idle_cached_blocks_oldest_first_and_never_a_held_one():
    sched = make(num_blocks=8)
    old = question("old", list(range(2000, 2008)) + [1], max_new=1)  # two cached blocks, then it ends
    sched.add(old)
    step(sched)
    keep = question("keep", SYSTEM + [1], max_new=50)
    sched.add(keep)
    step(sched)
    assert keep.block_ids == [2, 3, 4] and sched.pool.cache.num_idle == 2
    big = question("big", list(range(3000, 3015)), tenant="beta", max_new=5)  # needs 4 blocks, 3 plain free
    sched.add(big)
    plan = step(sched)
    assert ("big", 0, 15, True) in shape(plan)
    assert big.block_ids == [1, 5, 6, 7]  # 0 and 1 were idle: 1 (old's tail, released first) went
    assert keep.block_ids[:3] == [2, 3, 4] and sched.pool.num_evicted == 1
    assert sched.pool.cache.hash_of(0) is not None and sched.pool.cache.hash_of(1) is not None  # 1 is big's now
    assert sched.pool.lookup(old.prefix_hashes) == [0]  # the chain's head survives its evicted tail


# -- admission with the cache ---------------------------------------------------------------------------
def test_reading_idle_cached_blocks_counts_against_free_blocks_at_admission():
    sched = make(num_blocks=6)
    a = question("a", SYSTEM + [1], max_new=1)
    sched.add(a)
    step(sched)  # a ends: blocks 0, 1 idle cached, 2..5 free
    filler = question("filler", list(range(4000, 4004)), tenant="beta", max_new=100)
    sched.add(filler)
    step(sched)
    assert filler.block_ids == [2] and sched.pool.num_free == 5
    b = question("b", SYSTEM + list(range(12)))  # reads 0, 1 and needs 4 more blocks for 22 tokens
    sched.add(b)
    plan = step(sched)  # filler's 5th token takes block 3: 2 plain free + 2 idle, which b would read
    assert [c.seq.question_id for c in plan.chunks] == ["filler"] and b.status == Status.WAITING
    assert filler.block_ids == [2, 3] and sched.pool.num_free == 4
    assert b.num_computed_tokens == 0 and b.block_ids == [] and sched.pool.cache.num_idle == 2


# -- the audit -----------------------------------------------------------------------------------------
def record(*segments, block_size=4):
    rows, segs = 0, []
    for qid, start, end, blocks, chain in segments:
        seg = {"question_id": qid, "rows": [rows, rows + end - start], "positions": [start, end], "kv_len": end,
               "blocks": blocks}
        if chain:
            seg.update(shared_prefix_len=len(chain) * block_size, prefix_chain=chain)
        segs.append(seg)
        rows += end - start
    return {"forward": 1, "tokens": rows, "block_size": block_size, "segments": segs}


def test_the_audit_allows_a_shared_block_only_on_both_readers_own_prefix_chain():
    ok = record(("a", 8, 9, [0, 1, 2], ["h0", "h1"]), ("b", 8, 11, [0, 1, 3], ["h0", "h1"]))
    assert violations(ok) == []
    other_chain = record(("a", 8, 9, [0, 1, 2], ["h0", "h1"]), ("b", 8, 11, [0, 1, 3], ["h0", "x1"]))
    assert violations(other_chain) == ["block 1 is read by a and b under different prefixes"]
    not_on_chain = record(("a", 8, 9, [0, 1, 2], ["h0", "h1"]), ("b", 4, 11, [0, 1], ["h0"]))
    assert "block 1 is held by both a and b" in violations(not_on_chain)
    private = record(("a", 8, 9, [0, 1, 2], ["h0", "h1"]), ("b", 0, 3, [2], None))
    assert violations(private) == ["block 2 is held by both a and b"]
    writes_shared = record(("a", 4, 9, [0, 1, 2], ["h0", "h1"]))
    assert violations(writes_shared) == ["a: writes position 4 inside its read-only shared prefix"]


# -- the property: random admit / cancel / finish / evict ----------------------------------------------
def check_references(sched: Scheduler) -> None:
    pool = sched.pool
    live = sched.running + sched.lingering
    counts: dict[int, list[str]] = {}
    for seq in live:
        assert len(seq.block_ids) == len(set(seq.block_ids)), "a question lists a block twice"
        for block_id in seq.block_ids:
            counts.setdefault(block_id, []).append(seq.question_id)
    for block_id in range(pool.num_blocks):
        holders = pool.holders_of(block_id)
        assert sorted(holders) == sorted(counts.get(block_id, [])), f"block {block_id}: references drifted"
        assert pool.is_free(block_id) == (not holders), f"block {block_id} is both free and held (or neither)"
        if len(holders) > 1:  # shared: only a cached prefix block, at the same index of every holder
            assert pool.cache.hash_of(block_id) is not None
            assert len({next(s for s in live if s.question_id == q).block_ids.index(block_id) for q in holders}) == 1
        if pool.cache.is_idle(block_id):
            assert not holders and pool.cache.hash_of(block_id) is not None
    assert pool.num_used == len(counts) and pool.num_free == pool.num_blocks - len(counts)
    assert pool.cache.num_idle <= pool.num_free
    assert all(not s.block_ids and s.num_computed_tokens == 0 for s in sched.waiting)


op_st = st.tuples(st.sampled_from(["add", "add", "add", "cancel", "eos", "step", "step", "step"]),
                  st.integers(0, 5), st.integers(0, 2), st.integers(1, 14))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op_st, min_size=1, max_size=60), num_blocks=st.integers(4, 14),
       block_size=st.sampled_from([1, 2, 4]), budget=st.integers(3, 16), max_parallel_queries=st.integers(1, 4),
       split_roles=st.booleans())
def test_random_traffic_keeps_every_reference_exact_and_frees_every_block(ops, num_blocks, block_size, budget,
                                                                        max_parallel_queries, split_roles):
    sched = make(num_blocks, block_size, max_tokens_per_step=budget + max_parallel_queries,
                 max_parallel_queries=max_parallel_queries,
                 max_context=64, split_roles=split_roles, max_overtakes=3)
    prefixes = [list(range(500, 520)), list(range(600, 620)), [500, 501, 502, 503, 9, 9, 9, 9]]
    seqs: list[Sequence] = []
    eos_for: set[str] = set()
    for kind, who, prefix, tail in ops:
        if kind == "add":
            qid = f"q{len(seqs)}"
            prompt = prefixes[prefix][: 4 + 2 * who] + list(range(tail))
            seq = question(qid, prompt, tenant=("t0", "t1")[who % 2], max_new=1 + tail % 5, arrival=len(seqs))
            if seq.num_tokens < sched.max_tokens_per_question - 6:
                sched.add(seq)
                seqs.append(seq)
        elif kind == "cancel" and seqs:
            sched.cancel(seqs[who % len(seqs)].question_id)
        elif kind == "eos" and seqs:
            eos_for.add(seqs[who % len(seqs)].question_id)
        else:
            step(sched, {q: EOS for q in eos_for})
        check_references(sched)
    for _ in range(500):
        if not sched.has_work:
            break
        step(sched)
        sched.take_finished()
        check_references(sched)
    assert not sched.has_work, "the scheduler did not drain"
    assert all(s.status.finished and s.block_ids == [] for s in seqs)
    assert sched.pool.num_used == 0 and sched.pool.num_free == num_blocks
    assert sched.pool.num_cached == sched.pool.cache.num_idle  # what is left is cache, held by nobody


def test_a_release_of_a_block_not_held_changes_nothing():
    pool = BlockPool(4, 2)
    blocks: list[int] = []
    assert pool.grow("a", blocks, 4)
    with pytest.raises(RuntimeError):
        pool.release("b", list(blocks))
    assert pool.holders_of(0) == ("a",) and pool.num_used == 2
    pool.release("a", blocks)
    with pytest.raises(RuntimeError):  # a second release: freed exactly once
        pool.release("a", [0])
