"""speculative.policy auto: drafts only where the step's expected tokens per second rise.

The decision is plain arithmetic over a measured cost table (engine/speculate/cost.py), tested here on
made-up tables; then the engine: the table it measures at start is logged, decides who drafts, and no
answer changes.
"""

import random

import pytest

from engine.sequence import SamplingParams, Sequence
from engine.speculate.acceptance import PRIOR_RATE, KindRates, Odds, odds, record
from engine.speculate.cost import MIN_DRAFT_PROB, StepCosts, draft_lengths

ROWS = (1, 2, 4, 8, 16, 32, 64)
COMPUTE_BOUND = StepCosts(ROWS, tuple(0.001 * n for n in ROWS))  # every row costs the same
MEMORY_BOUND = StepCosts(ROWS, tuple(0.020 + 0.00002 * n for n in ROWS))  # reading the weights dominates
KNEE = StepCosts(ROWS, tuple(0.010 * max(1.0, n / 16) for n in ROWS))  # flat to 16 rows, then compute-bound


def offer(p: float, most: int) -> Odds:
    """A question whose every draft token is kept with chance p."""
    return Odds(p, p, most)


def test_a_compute_bound_step_drafts_nothing_whatever_the_acceptance():
    assert draft_lengths(COMPUTE_BOUND, 8, [offer(0.95, 4)] * 8) == [0] * 8
    assert draft_lengths(COMPUTE_BOUND, 1, [offer(0.99, 8)]) == [0]


def test_a_memory_bound_step_drafts_where_drafts_are_kept():
    assert draft_lengths(MEMORY_BOUND, 4, [offer(0.9, 4)] * 4) == [4] * 4
    # Draft j is worth p^j tokens: 0.3 pays for one draft, 0.3^2 is below MIN_DRAFT_PROB.
    assert draft_lengths(MEMORY_BOUND, 2, [offer(0.9, 4), offer(0.3, 4)]) == [4, 1]
    assert draft_lengths(MEMORY_BOUND, 2, [offer(MIN_DRAFT_PROB / 2, 4), offer(0.8, 0)]) == [0, 0]


def test_past_the_knee_only_the_likeliest_drafts_are_verified():
    lengths = draft_lengths(KNEE, 8, [offer(0.9, 8)] * 4 + [offer(0.4, 8)] * 4)
    assert sum(lengths) >= 8  # the free rows below the knee are used
    assert min(lengths[:4]) > max(lengths[4:])  # by the likelier questions first
    assert 8 + sum(lengths) < 8 + 8 * 8  # and the compute-bound part is mostly left alone


def test_a_draft_models_own_forwards_count_against_its_drafts():
    one = StepCosts((1, 64), (0.010, 0.011))
    as_costly = StepCosts((1, 64), (0.010, 0.011))  # a draft forward as dear as the target's
    cheap = StepCosts((1, 64), (0.001, 0.0011))
    assert draft_lengths(one, 1, [offer(0.9, 4)], as_costly) == [0]
    assert draft_lengths(one, 1, [offer(0.9, 4)], cheap) == [4]
    assert draft_lengths(one, 1, [offer(0.9, 4)]) == [4]  # a lookup drafter costs nothing


def test_no_table_counts_rows_as_free():
    assert draft_lengths(None, 64, [offer(0.8, 4), offer(0.2, 4)]) == [4, 1]


def test_the_table_is_monotone_and_extends_its_last_slope():
    table = StepCosts((1, 4, 8), (0.010, 0.008, 0.012))  # a noisy probe: 4 rows timed faster than 1
    assert table.seconds == (0.010, 0.010, 0.012)
    assert table.time(2) == 0.010 and table.time(6) == pytest.approx(0.011)
    assert table.time(16) == pytest.approx(0.016) and table.time(0) == 0.0
    with pytest.raises(ValueError):
        StepCosts((4, 1), (0.1, 0.2))


def test_later_draft_tokens_are_priced_at_their_own_chance():
    # A first token kept 9 times in 10 pays in a memory-bound step; the second, kept 1 time in 10
    # after it (0.09 expected tokens), does not.
    assert draft_lengths(MEMORY_BOUND, 1, [Odds(0.9, 0.1, 4)]) == [1]
    assert draft_lengths(MEMORY_BOUND, 1, [Odds(0.3, 0.9, 4)]) == [4]


def test_a_questions_odds_start_at_the_engines_rate_for_that_kind_of_draft():
    engine = KindRates()
    seq = Sequence("q", [1, 2, 3], SamplingParams())
    assert odds(seq, 1, engine, 4) == Odds(PRIOR_RATE, PRIOR_RATE, 4)
    for i in range(40):  # other questions' one-token matches: first tokens mostly rejected
        record(Sequence(f"o{i}", [1], SamplingParams()), 1, engine, 4, 1 if i % 5 == 0 else 0)
    fresh = Sequence("fresh", [1, 2, 3], SamplingParams())
    assert odds(fresh, 1, engine, 4).first < 0.3  # a new question's 1-token matches start where the engine's are
    assert odds(fresh, 3, engine, 4).first == PRIOR_RATE  # its 3-token matches do not
    for _ in range(8):  # its own one-token matches keep being right: its odds leave the engine's behind
        record(fresh, 1, engine, 4, 4)
    assert odds(fresh, 1, engine, 4).first > 0.6
    assert odds(fresh, 1, engine, 4).then > 0.8


def test_failures_fade_and_a_kind_of_draft_is_tried_again():
    engine = KindRates()
    seq = Sequence("q", [1, 2, 3], SamplingParams())
    for _ in range(6):
        odds(seq, 2, engine, 4)
        record(seq, 2, engine, 3, 0)  # wholly rejected drafts
    assert odds(seq, 2, engine, 4).first < 0.3
    assert odds(Sequence("new", [1], SamplingParams()), 2, engine, 4).first < 0.3
    for _ in range(300):  # steps in which nobody verifies such drafts: the engine's record fades too
        engine.fade()
        late = odds(seq, 2, engine, 4).first
    assert late > 0.4


# -- the engine ------------------------------------------------------------------------------------

KIND = "llama"


def _looping(harness, count, seed):
    from test_speculative import looping_prompts

    return looping_prompts(harness, count, seed)


def _drafting_plans(outcome, questions):
    prompt_len = {q.qid: len(q.prompt_ids) for q in questions}
    return [plan for plan in outcome.plans
            if any(length > 1 and start >= prompt_len[qid] for qid, start, length, _ in plan)]


@pytest.mark.parametrize("count", [1, 8])
def test_auto_measures_its_table_and_keeps_every_greedy_answer(tiny_models, harness, logs, count):
    from test_speculative import accepted, run_both

    questions = _looping(harness, count, seed=70 + count)
    off, on = run_both(harness, tiny_models[KIND].kev, questions)  # policy always: the strictest
    auto = harness.run_core(tiny_models[KIND].kev, questions, harness.tiny_options(speculative="ngram",
                                                                                  speculative_policy="auto"))
    for q in questions:
        assert auto.tokens(q.qid) == off.tokens(q.qid), q.qid
    (table,) = [r for r in logs if r["event"] == "speculative.cost_model"]
    assert table["forward"]["rows"][:3] == [1, 2, 4] and all(ms > 0 for ms in table["forward"]["ms"])
    costs = auto.core.scheduler.speculation.costs
    assert costs is not None
    # Whether a draft pays is the measured table's call, and a busy host can price `count` rows plus
    # drafts above what they would gain. Where the table says a fresh question's odds (the prior) pay
    # at this many rows, auto must draft.
    prior = [Odds(PRIOR_RATE, PRIOR_RATE, auto.core.options.max_draft_tokens)] * count
    if accepted(on) > 0 and any(draft_lengths(costs, count, prior)):
        assert auto.core.scheduler.speculation.num_draft_tokens > 0


def test_auto_follows_the_table_it_is_given(tiny_models, harness):
    """The same questions: a compute-bound table stops every draft, a memory-bound one lets them run."""
    from engine import EngineCore

    questions = _looping(harness, 8, seed=91)
    outcomes = {}
    for name, table in (("compute", COMPUTE_BOUND), ("memory", MEMORY_BOUND)):
        core = EngineCore(tiny_models[KIND].kev, harness.tiny_options(speculative="ngram", speculative_policy="auto"))
        core.scheduler.speculation.costs = table
        outcomes[name] = harness.run_core(tiny_models[KIND].kev, questions, core=core)
    assert outcomes["compute"].core.scheduler.speculation.num_draft_tokens == 0
    assert not _drafting_plans(outcomes["compute"], questions)
    assert outcomes["memory"].core.scheduler.speculation.num_accepted_draft_tokens > 0
    assert len(outcomes["memory"].plans) < len(outcomes["compute"].plans)
    for q in questions:
        assert outcomes["memory"].tokens(q.qid) == outcomes["compute"].tokens(q.qid), q.qid


def test_off_and_always_measure_nothing(tiny_models, harness, logs):
    for options in (dict(speculative="ngram", speculative_policy="always"), dict(speculative="off")):
        core = harness.run_core(tiny_models[KIND].kev, _looping(harness, 1, seed=3), harness.tiny_options(**options)).core
        assert core.scheduler.speculation is None or core.scheduler.speculation.costs is None
    assert not [r for r in logs if r["event"] == "speculative.cost_model"]


def test_random_seeded_sampling_under_auto_is_unchanged(tiny_models, harness):
    questions = _looping(harness, 6, seed=57)
    rng = random.Random(4)
    for i, q in enumerate(questions):
        q.params.update(temperature=0.5 + rng.random(), seed=i, max_new_tokens=24)
    off = harness.run_core(tiny_models[KIND].kev, questions, harness.tiny_options())
    auto = harness.run_core(tiny_models[KIND].kev, questions, harness.tiny_options(speculative="ngram"))
    for q in questions:
        assert auto.tokens(q.qid) == off.tokens(q.qid), q.qid
