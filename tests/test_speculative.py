"""Speculative decoding (speculative.method: ngram): more tokens per forward, and not one answer changed.

Drafts come from a question's own tokens only; verification rows share the packed forward with other
questions' prompt chunks and decodes; rejected drafts leave no KV that a later step reads.
"""

import json
import random

import msgspec
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.audit import violations
from engine.kv.prefix_cache import chain_hashes, prefix_salt
from engine.speculate import NgramDrafter, ngram_draft
from schemas import Params

KIND = "llama"
SPEC = dict(speculative="ngram", speculative_policy="always")  # every chance to draft: the strictest test


# -- the drafter: pure prompt lookup ------------------------------------------------------------------

def test_the_most_recent_occurrence_of_the_longest_tail_is_copied():
    #            0  1  2  3  4  5  6  7  8  9 10
    tokens = [5, 1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert ngram_draft(tokens, 2, 1, 3) == [7, 8]  # [1, 2, 3] last seen at 5..7, followed by 7, 8
    assert ngram_draft(tokens, 9, 1, 3) == [7, 8, 1, 2, 3]  # up to the end: fewer than k
    assert ngram_draft([4, 6, 1, 2, 0, 2], 3, 1, 3) == [0, 2]  # no 3- or 2-gram match: the 1-gram [2]
    assert ngram_draft([1, 2, 3, 4], 3, 1, 3) == []  # the tail occurs nowhere earlier
    assert ngram_draft([7], 3, 1, 3) == []
    assert ngram_draft([1, 2, 1, 2], 3, 2, 2) == [1, 2]


def test_token_ids_past_one_byte_match_only_whole_tokens():
    # 256 = bytes 00 01 00 00; 1 = 01 00 00 00: a byte-level hit across two tokens is no match.
    assert ngram_draft([256, 0, 5, 1], 2, 1, 1) == []
    assert ngram_draft([70000, 12, 70000], 2, 1, 1) == [12, 70000]


def test_the_drafter_caps_drafts_and_refuses_bad_settings():
    drafter = NgramDrafter(2, 1, 3)
    assert drafter.propose([1, 2, 3, 1, 2], limit=5) == [3, 1]
    assert drafter.propose([1, 2, 3, 1, 2], limit=1) == [3]
    with pytest.raises(ValueError, match="ngram_min"):
        NgramDrafter(4, 3, 2)


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 6), max_size=40), k=st.integers(1, 6),
       lo=st.integers(1, 3), extra=st.integers(0, 2))
def test_a_draft_is_what_followed_an_earlier_copy_of_the_tail(tokens, k, lo, extra):
    hi = lo + extra
    draft = ngram_draft(tokens, k, lo, hi)
    assert len(draft) <= k
    if not draft:
        return
    found = [(n, j) for n in range(hi, lo - 1, -1) for j in range(len(tokens) - n - 1, -1, -1)
             if n < len(tokens) and tokens[j:j + n] == tokens[-n:]]
    n, j = found[0]  # the longest n, then the latest start: what the drafter must have picked
    assert draft == tokens[j + n : j + n + k]


# -- the scheduler: what a verified draft leaves behind, on exact block ids -------------------------------

def test_rejected_drafts_roll_back_positions_and_blocks():
    from engine.kv.block_pool import BlockPool
    from engine.schedule.scheduler import Scheduler
    from engine.sequence import SamplingParams, Sequence
    from engine.speculate.speculation import Speculation

    pool = BlockPool(8, 4)
    sched = Scheduler(pool, speculation=Speculation(NgramDrafter(4, 1, 3)))
    seq = Sequence("q", [1, 2, 3, 1, 2, 3, 1], SamplingParams(max_new_tokens=10, temperature=0.0))
    sched.add(seq)
    sched.update(sched.schedule(), [2])  # the prefill draws 2: ... 3, 1, 2 repeats the start
    plan = sched.schedule()
    (chunk,) = plan.chunks
    assert (chunk.start, chunk.draft, chunk.token_ids) == (7, (3, 1, 2), [2, 3, 1, 2])
    assert len(seq.block_ids) == 3  # 11 positions: the drafts' third block taken for this step
    assert sched.update(plan, [9, 1, 2, 3]) == [(seq, 9)]  # the first draft is wrong: the model's 9 instead
    # 8 computed tokens fill 2 blocks: the third, taken for the drafts, is back in the pool.
    assert (seq.num_computed_tokens, seq.num_tokens, len(seq.block_ids), pool.num_used) == (8, 9, 2, 2)
    plan = sched.schedule()  # 9 at position 8, over the rejected draft's slot
    assert plan.chunks[0].start == 8 and len(seq.block_ids) == 3
    sched.update(plan, [7] * plan.chunks[0].num_sample_rows)
    assert seq.num_computed_tokens == 9 and seq.output_ids[:2] == [2, 9]


def test_accepted_drafts_advance_and_stop_exactly_at_the_budget():
    from engine.kv.block_pool import BlockPool
    from engine.schedule.scheduler import Scheduler
    from engine.sequence import SamplingParams, Sequence, Status
    from engine.speculate.speculation import Speculation

    pool = BlockPool(8, 4)
    sched = Scheduler(pool, speculation=Speculation(NgramDrafter(4, 1, 3)))
    seq = Sequence("q", [5, 6, 7, 8, 5, 6], SamplingParams(max_new_tokens=4, temperature=0.0))
    sched.add(seq)
    sched.update(sched.schedule(), [7])  # ... 5, 6, 7: drafts 8, 5, 6 would follow
    plan = sched.schedule()
    assert plan.chunks[0].draft == (8, 5)  # 4 new tokens at most: 1 drawn + 2 drafts + the model's own
    new = sched.update(plan, [8, 5, 4])
    assert [t for _, t in new] == [8, 5, 4] and seq.output_ids == [7, 8, 5, 4]
    assert seq.status == Status.LENGTH and seq.accepted_draft_tokens == 2 and pool.num_used == 0


# -- the engine: answers unchanged --------------------------------------------------------------------

def looping_prompts(harness, count: int, seed: int, shared: list[int] | None = None) -> list:
    """Prompts that repeat a short phrase (so lookups find something), with varied budgets and stops."""
    rng = random.Random(seed)
    questions = []
    for i in range(count):
        phrase = harness.random_prompt(rng, rng.randint(2, 6))
        prompt = (shared or []) + phrase * rng.randint(2, 6) + harness.random_prompt(rng, rng.randint(0, 5))
        questions.append(harness.Q(f"q{i}", prompt, dict(max_new_tokens=rng.randint(1, 40), temperature=0.0)))
    return questions


def run_both(harness, model, questions, **options):
    off = harness.run_core(model, questions, harness.tiny_options(**options))
    on = harness.run_core(model, questions, harness.tiny_options(**{**SPEC, **options}))
    for q in questions:
        a, b = off.answers[q.qid], on.answers[q.qid]
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason), q.qid
        assert a.usage.accepted_draft_tokens == 0
    return off, on


def accepted(outcome) -> int:
    return sum(a.usage.accepted_draft_tokens for a in outcome.answers.values())


@pytest.mark.parametrize("count", [1, 8, 32])
def test_greedy_answers_are_unchanged_with_fewer_forwards(tiny_models, harness, count):
    questions = looping_prompts(harness, count, seed=count)
    off, on = run_both(harness, tiny_models[KIND].kev, questions)
    assert accepted(on) > 0
    assert len(on.plans) < len(off.plans)
    assert on.core.scheduler.speculation.num_accepted_draft_tokens == accepted(on)
    prompt_len = {q.qid: len(q.prompt_ids) for q in questions}
    verifying = [plan for plan in on.plans  # a forward with a drafting chunk: the last token + drafts
                 if any(length > 1 and start >= prompt_len[qid] for qid, start, length, _ in plan)]
    assert max(len(plan) for plan in verifying) >= min(count, 4)  # verify rows share the forward with others


@pytest.mark.parametrize("count", [8, 32])
def test_chunked_prefill_and_tight_budgets(tiny_models, harness, count):
    """16 tokens per forward: drafts compete with prompt chunks and with the token kept for each decode."""
    off, on = run_both(harness, tiny_models[KIND].kev, looping_prompts(harness, count, seed=40 + count),
                       max_tokens_per_step=16)
    assert max(sum(length for _, _, length, _ in plan) for plan in on.plans) <= 16
    assert accepted(on) > 0


@pytest.mark.parametrize("count", [8, 32])
def test_preemption_with_drafts_changes_no_answer(tiny_models, harness, count):
    """A pool of a few 4-token blocks: questions are preempted and recomputed, drafts take spare blocks only."""
    questions = looping_prompts(harness, count, seed=60 + count)
    off, on = run_both(harness, tiny_models[KIND].kev, questions, num_blocks=24, block_size=4)
    assert on.core.scheduler.num_preemptions > 0
    assert accepted(on) > 0
    assert on.core.pool.num_used == 0  # every block back, the ones drafts took included


@pytest.mark.parametrize("count", [8, 32])
def test_prefix_cache_with_drafts(tiny_models, harness, count):
    """A shared 20-token prefix read from the cache; drafts past it never enter a block's hash."""
    shared = harness.random_prompt(random.Random(5), 20)
    questions = looping_prompts(harness, count, seed=80 + count, shared=shared)
    off, on = run_both(harness, tiny_models[KIND].kev, questions, prefix_caching=True, block_size=4)
    assert sum(a.usage.cached_prompt_tokens for a in on.answers.values()) > 0
    assert accepted(on) > 0
    # Every cached block is named by a hash of prompt tokens alone: none covers output or drafts.
    salt = prefix_salt(str(on.core.model.path), None, None, None)
    prompt_hashes = {h for q in questions for h in chain_hashes(salt, q.prompt_ids, 4)}
    named = {on.core.pool.cache.hash_of(b) for b in range(on.core.pool.num_blocks)} - {None}
    assert named and named <= prompt_hashes


def test_int8_kv_with_drafts(tiny_models, harness):
    """Rejected drafts' int8 rows and scales are never read either."""
    off, on = run_both(harness, tiny_models[KIND].kev, looping_prompts(harness, 8, seed=31), kv_dtype="int8")
    assert accepted(on) > 0


def test_questions_on_adapters_draft_and_keep_their_answers(tiny_models, harness, tmp_path):
    """Verify rows carry their question's LoRA adapter like any of its rows."""
    from test_lora import ALL_LINEAR, QV, make_adapter

    hf = tiny_models[KIND].hf
    dirs = {"qv": make_adapter(hf, tmp_path / "qv", QV, seed=1),
            "all": make_adapter(hf, tmp_path / "all", ALL_LINEAR, rslora=True, seed=2)}
    questions = looping_prompts(harness, 6, seed=37)
    for i, q in enumerate(questions):
        q.event["adapter"] = [None, "qv", "all"][i % 3]
    outcomes = {}
    for name, options in (("off", {}), ("on", SPEC)):
        core = _core(tiny_models[KIND].kev, harness.tiny_options(**options))
        for adapter, directory in dirs.items():
            core.load_adapter(adapter, directory)
        outcomes[name] = harness.run_core(tiny_models[KIND].kev, questions, core=core)
    for q in questions:
        assert outcomes["on"].tokens(q.qid) == outcomes["off"].tokens(q.qid), q.qid
    assert accepted(outcomes["on"]) > 0


def test_policy_auto_stops_verifying_drafts_that_keep_failing(tiny_models, harness, reference):
    q, plain = reference
    answer = list(plain.answers["q"].token_ids)
    runs = {}
    for policy in ("always", "auto"):
        core = _core(tiny_models[KIND].kev, harness.tiny_options(block_size=4, **{**SPEC, "speculative_policy": policy}))
        core.scheduler.speculation.drafter = ScriptedDrafter(len(q.prompt_ids), answer, [0], 3)  # always wrong at once
        runs[policy] = harness.run_core(tiny_models[KIND].kev, [q], core=core).answers["q"]
    assert runs["auto"].token_ids == runs["always"].token_ids == tuple(answer)
    assert runs["always"].audit.drafted_tokens > 2 * runs["auto"].audit.drafted_tokens > 0
    assert runs["auto"].audit.accepted_draft_tokens == 0


def test_stop_tokens_stop_strings_and_budgets_are_exact(tiny_models, harness):
    """Drafts past a stop token, a stop string or max_new_tokens are never emitted, though computed."""
    free = looping_prompts(harness, 9, seed=7)
    for q in free:
        q.params["max_new_tokens"] = 40
    plain = harness.run_core(tiny_models[KIND].kev, free, harness.tiny_options())
    # A stop token the model draws mid-answer: one of q0's, as the model's EOS.
    eos = plain.answers["q0"].token_ids[6]
    hf = harness.build_hf_tiny(KIND, seed=100 + list(harness.TINY_KINDS).index(KIND), eos_token_id=eos)
    model = harness.kev_model_from_hf(hf, tiny_models[KIND].kev.tokenizer, name="tiny-eos")
    questions = []
    for i, q in enumerate(free):
        answer, params = plain.answers[q.qid], dict(q.params)
        if i % 3 == 1 and len(answer.text) > 8:
            params["stop"] = [answer.text[4:7]]
        elif i % 3 == 2:
            params["max_new_tokens"] = 3 + i
        questions.append(harness.Q(q.qid, q.prompt_ids, params))
    off, on = run_both(harness, model, questions)
    for q in questions:
        assert len(on.answers[q.qid].token_ids) <= q.params["max_new_tokens"]
        assert eos not in on.answers[q.qid].token_ids[:-1]
    assert on.answers["q0"].finish_reason == "stop" and len(on.answers["q0"].token_ids) <= 7
    assert {a.finish_reason for a in on.answers.values()} >= {"stop", "length"}
    assert accepted(on) > 0


def test_streamed_tokens_and_text_stop_where_they_stop_without_drafts(tiny_models, harness):
    """Several tokens per step stream as several deltas; none after the one that completes a stop string."""
    from schemas import QuestionEvent

    free = looping_prompts(harness, 6, seed=29)
    plain = harness.run_core(tiny_models[KIND].kev, free, harness.tiny_options())
    streams = {}
    for name, options in (("off", {}), ("on", SPEC)):
        core = _core(tiny_models[KIND].kev, harness.tiny_options(**options))
        for q in free:
            text = plain.answers[q.qid].text
            stop = [text[3:6]] if len(text) > 8 else []
            core.add(QuestionEvent(question_id=q.qid, prompt="(ids)", params=Params(**q.params, stop=stop)),
                     prompt_ids=q.prompt_ids)
        deltas, answers = {q.qid: [] for q in free}, {}
        while core.has_work:
            events = core.step()
            for delta in events.deltas:
                deltas[delta.question_id].append(delta)
            answers.update((a.question_id, a) for a in events.answers)
        for qid, got in deltas.items():
            shown = "".join(d.text for d in got)
            assert answers[qid].text.startswith(shown)
        streams[name] = ({qid: [d.token_id for d in got] for qid, got in deltas.items()},
                         {qid: (a.text, a.token_ids) for qid, a in answers.items()})
    assert streams["on"] == streams["off"]


def test_seeded_sampling_draws_exactly_what_it_draws_without_drafts(tiny_models, harness):
    """A sampled row's draw uses the noise of its position; a draft is kept iff the row drew it."""
    questions = looping_prompts(harness, 8, seed=9)
    for i, q in enumerate(questions):
        q.params.update(temperature=0.3 + 0.1 * i, seed=i, top_k=0 if i % 2 else 20, top_p=1.0 if i % 3 else 0.9,
                        repetition_penalty=1.0 if i % 4 else 1.2, max_new_tokens=30)
    off, on = run_both(harness, tiny_models[KIND].kev, questions)
    assert sum(a.audit.drafted_tokens for a in on.answers.values()) > 0


def test_sampled_tokens_after_a_draft_follow_the_targets_distribution(tiny_models, harness):
    """Chi-square: 600 seeds of one prompt at temperature 0.5, the second token (drawn by a row that
    verified a draft, for nearly every seed) against its exact marginal under the target, the sum over
    the first token t1 of P(t1) P(t2 | t1), both from transformers' forward on the same weights. The
    same counts reject the marginal at temperature 0.4 or 0.6, so the test can tell."""
    tiny = tiny_models[KIND]
    prompt = random.Random(21).sample(range(harness.VOCAB), harness.VOCAB)  # every token once: any t1 finds a lookup
    seeds, temperature = 600, 0.5
    questions = [harness.Q(f"s{i}", prompt, dict(max_new_tokens=3, temperature=temperature, top_k=0, top_p=1.0,
                                                 seed=i)) for i in range(seeds)]
    out = harness.run_core(tiny.kev, questions, harness.tiny_options(**SPEC, ngram_min=1, max_parallel_queries=64))
    assert sum(a.audit.drafted_tokens for a in out.answers.values()) > 0.9 * seeds  # t2 verified a draft
    seen = torch.bincount(torch.tensor([out.answers[q.qid].token_ids[1] for q in questions]),
                          minlength=harness.VOCAB).double()
    with torch.no_grad():
        first = tiny.hf(torch.tensor([prompt])).logits[0, -1].double()
        second = tiny.hf(torch.tensor([prompt + [t] for t in range(harness.VOCAB)])).logits[:, -1].double()

    def beyond_chance(t: float) -> bool:
        marginal = (torch.softmax(first / t, -1)[:, None] * torch.softmax(second / t, -1)).sum(0)
        return chi_square_rejects(seen, marginal * seeds)

    assert not beyond_chance(temperature)
    assert beyond_chance(0.4) and beyond_chance(0.6)


def chi_square_rejects(seen: torch.Tensor, expected: torch.Tensor, z: float = 3.09) -> bool:
    """Whether counts `seen` differ from `expected` beyond chance at p = 0.001 (z), by Pearson's statistic
    over bins expected at least 5 times (the rest pooled) against Wilson and Hilferty's approximation of
    the chi-square quantile."""
    big = expected >= 5
    observed = torch.cat([seen[big], seen[~big].sum()[None]])
    wanted = torch.cat([expected[big], expected[~big].sum()[None]])
    statistic = ((observed - wanted) ** 2 / wanted).sum().item()
    df = observed.numel() - 1
    return statistic > df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


def test_constrained_questions_do_not_draft(tiny_models, harness):
    fmt = msgspec.convert({"response_format": {"type": "json_object"}}, Params).response_format
    questions = looping_prompts(harness, 4, seed=11)
    questions.append(harness.Q("json", [10, 20, 30] * 4, dict(max_new_tokens=24, response_format=fmt)))
    off, on = run_both(harness, tiny_models[KIND].kev, questions)
    assert on.answers["json"].audit.drafted_tokens == 0
    assert sum(a.audit.drafted_tokens for a in on.answers.values()) > 0


def test_a_neighbour_holding_the_victims_answer_changes_none_of_its_drafts(tiny_models, harness):
    model = tiny_models[KIND].kev
    victim = looping_prompts(harness, 1, seed=13)[0]
    victim.params["max_new_tokens"] = 40
    solo = harness.run_core(model, [victim], harness.tiny_options(**SPEC)).answers["q0"]
    answer = list(solo.token_ids)
    # Its prompt ends with the victim's prompt tail, then holds the victim's whole answer: a drafter
    # reading across questions would find it and draft it.
    bait = harness.Q("bait", victim.prompt_ids[-6:] + answer + victim.prompt_ids[-6:] + answer[:3],
                     dict(max_new_tokens=40, temperature=0.0))
    packed = harness.run_core(model, [bait, victim], harness.tiny_options(**SPEC)).answers["q0"]
    assert (packed.token_ids, packed.audit.drafted_tokens, packed.audit.accepted_draft_tokens) == (
        solo.token_ids, solo.audit.drafted_tokens, solo.audit.accepted_draft_tokens)


def test_the_audit_is_clean_and_counts_drafts(tiny_models, harness, tmp_path, capsys):
    """A drafting question is one segment of its forward (draft_rows: k), and `kev audit check` accepts
    the next forward starting back at its first rejected draft's position."""
    from test_audit_tools import json_log_to

    from kev_async.cli import main

    questions = looping_prompts(harness, 8, seed=17)
    path = tmp_path / "run.log"
    with json_log_to(path):
        on = harness.run_core(tiny_models[KIND].kev, questions, harness.tiny_options(audit=True, block_size=4, **SPEC))
    records = [json.loads(line) for line in path.read_text().splitlines()[1:]]
    masks = [r for r in records if r["event"] in ("forward.mask", "forward.isolation_violation")]
    assert masks and all(r["event"] == "forward.mask" and not violations(r) for r in masks)
    drafting = [seg for r in masks for seg in r["segments"] if seg.get("draft_rows")]
    assert drafting and all(seg["rows"][1] - seg["rows"][0] == seg["draft_rows"] + 1 for seg in drafting)
    assert all(len({seg["question_id"] for seg in r["segments"]}) == len(r["segments"]) for r in masks)
    assert main(["audit", "check", str(path)]) == 0, capsys.readouterr().out
    assert "OK:" in capsys.readouterr().out
    for answer in on.answers.values():
        assert answer.audit.accepted_draft_tokens <= answer.audit.drafted_tokens
        assert answer.usage.accepted_draft_tokens <= answer.usage.completion_tokens
    assert sum(a.audit.drafted_tokens - a.audit.accepted_draft_tokens for a in on.answers.values()) > 0  # rolled back


def test_metrics_count_drafted_and_accepted_tokens(tiny_models, harness):
    from types import SimpleNamespace

    from prometheus_client.parser import text_string_to_metric_families

    from kev_async.observe.metrics import Metrics

    on = harness.run_core(tiny_models[KIND].kev, looping_prompts(harness, 4, seed=19), harness.tiny_options(**SPEC))
    metrics = Metrics()
    metrics.live.attach_engine(SimpleNamespace(core=on.core))
    scraped = {s.name: s.value for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples}
    assert scraped["kev_draft_tokens_total"] == sum(a.audit.drafted_tokens for a in on.answers.values()) > 0
    assert scraped["kev_accepted_draft_tokens_total"] == accepted(on) > 0


# -- no stale KV: every emitted token's logits are those of a run without drafts ----------------------

class ScriptedDrafter:
    """Drafts the reference answer's next tokens, wrong wherever `pattern` says: any accept/reject mix."""

    def __init__(self, prompt_len: int, reference: list[int], pattern: list[int], k: int):
        self.prompt_len, self.reference, self.pattern, self.k, self.calls = prompt_len, reference, pattern, k, 0

    def propose(self, tokens, limit=None):
        done = len(tokens) - self.prompt_len
        code = self.pattern[self.calls % len(self.pattern)]
        self.calls += 1
        draft = self.reference[done : done + min(self.k, limit or self.k)]
        if code < len(draft):  # the draft goes wrong at `code`; code >= k: all right
            draft = draft[:code] + [(draft[code] + 1) % 256] + draft[code + 1:]
        return draft


@pytest.fixture(scope="module")
def reference(tiny_models, harness):
    rng = random.Random(21)
    q = harness.Q("q", harness.random_prompt(rng, 9), dict(max_new_tokens=24, temperature=0.0))
    out = harness.run_core(tiny_models[KIND].kev, [q], harness.tiny_options(block_size=4))
    return q, out


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pattern=st.lists(st.integers(0, 5), min_size=1, max_size=6), k=st.integers(1, 5))
def test_rejected_drafts_leave_no_kv_a_later_step_reads(tiny_models, harness, reference, pattern, k):
    q, plain = reference
    answer = list(plain.answers["q"].token_ids)
    options = harness.tiny_options(block_size=4, **SPEC)
    core = _core(tiny_models[KIND].kev, options)
    core.scheduler.speculation.drafter = ScriptedDrafter(len(q.prompt_ids), answer, pattern, k)
    on = harness.run_core(tiny_models[KIND].kev, [q], core=core)
    assert list(on.answers["q"].token_ids) == answer
    for j in range(len(answer)):
        index = len(q.prompt_ids) + j
        torch.testing.assert_close(on.draws["q"][index], plain.draws["q"][index], rtol=1e-4, atol=1e-4)


def _core(model, options):
    from engine import EngineCore

    return EngineCore(model, options)


# -- deterministic mode: the same bits ----------------------------------------------------------------

def test_deterministic_mode_bitwise_with_and_without_drafts(tiny_models, harness):
    """Each verify row is its own single-row generated segment: it takes the decode path a plain decode
    takes, so every emitted token's logits have the same bits."""
    questions = looping_prompts(harness, 6, seed=23)
    off, on = run_both(harness, tiny_models[KIND].kev, questions, deterministic=True, max_tokens_per_step=32)
    assert accepted(on) > 0
    for q in questions:
        for j in range(len(on.answers[q.qid].token_ids)):
            index = len(q.prompt_ids) + j
            assert torch.equal(on.draws[q.qid][index], off.draws[q.qid][index]), (q.qid, j)


# -- the real model: an answer that quotes its prompt -------------------------------------------------

EXTRACTION = ("Here is a shipping note: 'Order 4471 ships on Tuesday from the Rotterdam warehouse to "
              "Anna Berg, 12 Linden Street, Uppsala, by express courier.' Copy the sentence inside the quotes "
              "exactly, word for word.")


@pytest.mark.slow
def test_smollm2_extraction_answers_unchanged_and_mostly_drafted(smollm2):
    from engine import IsolatedBatchPipeline

    questions = [EXTRACTION, "Write a haiku about autumn."]
    off = IsolatedBatchPipeline(smollm2, max_batch_size=4).run(questions, max_new_tokens=48, temperature=0.0)
    # policy always: what is checked here is exactness and how much a quote drafts, not auto's timing
    # table (probed at start, it reads a busy host's stalls as cost).
    pipeline = IsolatedBatchPipeline(smollm2, max_batch_size=4, speculative="ngram", speculative_policy="always")
    on = pipeline.run(questions, max_new_tokens=48, temperature=0.0)
    assert [a.token_ids for a in on] == [a.token_ids for a in off]
    quoted = on[0]
    assert "Rotterdam" in quoted.text
    # Most of a quoted answer comes from drafts: fewer forwards than tokens.
    assert quoted.usage.accepted_draft_tokens >= quoted.usage.completion_tokens // 3
    assert quoted.audit.steps < quoted.usage.completion_tokens
