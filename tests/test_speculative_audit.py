"""The audit of speculative decoding: real runs whose logs `kev audit check` passes, and tampered logs it
fails: a draft token that is not the question's own, more tokens accepted than drafted, a draft model's
cache block listed for two questions.

Each drafting segment records its drafter and the draft's origin (`draft`), the question's next segment
how it fared (`verified`) -- or, when the question ended right after, its `question.verified` record --
and every row of a question that may draft a keyed digest of its token, from which the checker rebuilds
the question's own token history (docs/speculative.md).
"""

import copy
import json
import random
from pathlib import Path

import pytest
from test_audit_tools import json_log_to
from test_speculative import looping_prompts

from engine.audit import violations
from kev_async.cli import main as kev
from kev_async.observe.audit import check_log, read_audit_log

KIND = "llama"
ALWAYS = dict(speculative_policy="always")  # every chance to draft


def audited_run(harness, model, path: Path, questions, later=None, **options):
    options = harness.tiny_options(audit=True, block_size=4, **ALWAYS, **options)
    with json_log_to(path):
        outcome = harness.run_core(model, questions, options, later=later)
    return outcome


def masks(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            if record["event"] in ("forward.mask", "forward.isolation_violation"):
                out.append(record)
    return out


def audit_events(path: Path) -> list[dict]:
    """Every record `kev audit check` reads, in log order: forward records, question.verified, engine.drained."""
    events = ("forward.mask", "forward.isolation_violation", "question.verified", "engine.drained")
    return [r for r in map(json.loads, filter(lambda line: line.startswith("{"), path.read_text().splitlines()))
            if r["event"] in events]


def write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def check(path: Path, capsys) -> tuple[int, str]:
    code = kev(["audit", "check", str(path)])
    return code, capsys.readouterr().out


@pytest.fixture(scope="module")
def ngram_log(tiny_models, harness, tmp_path_factory):
    """8 looping questions on a shared 20-token prefix (read from the prefix cache), chunked prompts, a
    step budget of 48 rows, a pool of 30 blocks (preemptions): prompt lookup drafts, some kept, some rejected."""
    shared = harness.random_prompt(random.Random(5), 20)
    questions = looping_prompts(harness, 8, seed=41, shared=shared)
    path = tmp_path_factory.mktemp("spec_audit") / "ngram.log"
    outcome = audited_run(harness, tiny_models[KIND].kev, path, questions, speculative="ngram",
                          prefix_caching=True, max_tokens_per_step=48, num_blocks=30)
    assert outcome.core.scheduler.num_preemptions > 0  # questions recomputed after drafting, too
    return path, outcome


def test_a_real_lookup_run_passes_and_every_draft_is_shown_to_be_its_own(ngram_log, capsys):
    path, outcome = ngram_log
    records = masks(path)
    assert records and all(r["event"] == "forward.mask" and not violations(r) for r in records)
    drafts = [seg for r in records for seg in r["segments"] if "draft" in seg]
    assert drafts and all(seg["draft"]["method"] == "ngram" for seg in drafts)
    assert any(seg.get("context_digests") for r in records for seg in r["segments"])  # the prefix cache was read
    verified = [seg["verified"] for r in records for seg in r["segments"] if "verified" in seg]
    assert sum(v["rejected"] for v in verified) > 0 and sum(v["accepted"] for v in verified) > 0
    code, out = check(path, capsys)
    assert code == 0, out
    report = check_log(read_audit_log(path))
    assert report.drafts.drafts == len(drafts) and report.drafts.proven == len(drafts)
    # Every draft's outcome is in the log, the last ones of questions in their question.verified records:
    # the accepted tokens it reports are exactly those the answers kept.
    kept = sum(a.usage.accepted_draft_tokens for a in outcome.answers.values())
    assert report.drafts.accepted_tokens == kept and not report.drafts.pending
    assert "every draft came from its own question" in out
    assert f"{len(drafts)} of {len(drafts)} prompt-lookup drafts shown copied from their own question's tokens" in out


@pytest.fixture(scope="module")
def ending_log(tiny_models, harness, tmp_path_factory):
    """Twelve questions repeating a short phrase (lookups keep finding it, and the model often follows), so
    several end by length in a forward that verified a draft; `qc` is cancelled right after one."""
    rng = random.Random(3)
    questions = [harness.Q(f"q{i}", harness.random_prompt(rng, rng.randint(2, 4)) * 5,
                           dict(max_new_tokens=rng.randint(8, 30), temperature=0.0)) for i in range(12)]
    questions.append(harness.Q("qc", [7, 8, 9] * 5, dict(max_new_tokens=40, temperature=0.0)))

    def cancel_after_a_draft(core):
        seq = next((seq for seq in core.scheduler.running if seq.question_id == "qc"), None)
        if seq is not None and seq.verified is not None:  # its latest forward verified a draft
            core.cancel("qc")

    path = tmp_path_factory.mktemp("spec_audit") / "endings.log"
    outcome = audited_run(harness, tiny_models[KIND].kev, path, questions, speculative="ngram",
                          later={step: [cancel_after_a_draft] for step in range(2, 12)})
    return path, outcome


def test_a_question_whose_last_forward_verified_a_draft_says_how_it_fared_when_it_ends(ending_log, capsys):
    path, outcome = ending_log
    events = audit_events(path)
    endings = {r["question_id"]: r for r in events if r["event"] == "question.verified"}
    assert outcome.answers["qc"].finish_reason == "cancelled" and "qc" in endings
    assert sum(r["finish_reason"] == "length" and r["accepted"] > 0 for r in endings.values()) >= 2
    assert events[-1]["event"] == "engine.drained"  # after every question's ending
    for qid, answer in outcome.answers.items():
        forwards = [(r["forward"], seg) for r in events if r["event"] == "forward.mask" for seg in r["segments"]
                    if seg["question_id"] == qid]
        last_forward, last = forwards[-1]
        if "draft" not in last:
            assert qid not in endings  # a question whose last forward drafted nothing has nothing to report
            continue
        ending = endings[qid]  # it names its last forward and that forward's draft
        assert (ending["forward"], ending["drafted"]) == (last_forward, last["draft"]["tokens"])
        assert ending["accepted"] + ending["rejected"] == ending["drafted"]
        assert ending["finish_reason"] == answer.finish_reason
    code, out = check(path, capsys)
    assert code == 0, out
    # Every draft's outcome is in the log, the questions' last ones in their question.verified records: the
    # accepted tokens `kev audit check` counts are exactly those the answers kept.
    kept = sum(a.usage.accepted_draft_tokens for a in outcome.answers.values())
    in_segments = sum(seg["verified"]["accepted"] for r in events if r["event"] == "forward.mask"
                      for seg in r["segments"] if "verified" in seg)
    assert kept == in_segments + sum(r["accepted"] for r in endings.values()) > in_segments
    assert f", {kept} accepted as reported)" in out
    assert check_log(read_audit_log(path)).drafts.accepted_tokens == kept


@pytest.mark.parametrize("tamper", ["accepted", "drafted", "dropped"])
def test_a_wrong_or_missing_question_verified_record_fails(ending_log, tmp_path, capsys, tamper):
    path, _ = ending_log
    events = copy.deepcopy(audit_events(path))
    ending = next(r for r in events if r["event"] == "question.verified")
    qid, drafted, where = ending["question_id"], ending["drafted"], f"forward {ending['forward']}"
    if tamper == "accepted":
        ending["accepted"] = drafted + 1
        expected = f"{qid}: accepted {drafted + 1} draft tokens of the {drafted} drafted ({where})"
    elif tamper == "drafted":
        ending["drafted"] = drafted + 1
        expected = f"{qid}: verified {drafted + 1} drafted tokens, but its draft ({where}) had {drafted}"
    else:
        events.remove(ending)
        expected = (f"{qid}: its draft of {drafted} tokens ({where}) is never reported verified, though every "
                    f"question had ended by forward {events[-1]['forward']}")
    code, out = check(write(tmp_path / f"{tamper}.log", events), capsys)
    assert code == 1 and expected in out, out


def test_a_log_cut_off_before_its_questions_ended_is_no_violation(ending_log, tmp_path, capsys):
    """Its last drafts are never settled, but nothing says their questions had ended: no alarm."""
    path, _ = ending_log
    events = audit_events(path)
    cut = events.index(next(r for r in events if r["event"] == "question.verified"))
    code, out = check(write(tmp_path / "cut.log", events[:cut]), capsys)
    assert code == 0, out


def test_a_draft_token_taken_from_another_question_fails(ngram_log, tmp_path, capsys):
    path, _ = ngram_log
    records = copy.deepcopy(masks(path))
    victim = next(seg for r in records for seg in r["segments"] if "draft" in seg)
    # A digest of a token another question fed: what a draft copied from a neighbour would carry.
    foreign = next(d for r in records for seg in r["segments"] if seg["question_id"] != victim["question_id"]
                   for d in seg.get("token_digests") or () if d not in victim["token_digests"])
    victim["token_digests"][1] = foreign
    code, out = check(write(tmp_path / "foreign.log", records), capsys)
    assert code == 1
    assert f"{victim['question_id']}: draft token 0 is not its own token at position" in out
    assert "did not come from this question's tokens" in out


def test_a_draft_said_to_come_from_elsewhere_in_its_history_fails(ngram_log, tmp_path, capsys):
    path, _ = ngram_log
    records = copy.deepcopy(masks(path))
    victim = next(seg for r in records for seg in r["segments"] if "draft" in seg and seg["draft"]["source"] > 4)
    victim["draft"]["source"] -= 1
    code, out = check(write(tmp_path / "moved.log", records), capsys)
    assert code == 1 and victim["question_id"] in out and "ngram draft" in out


def test_more_accepted_than_drafted_fails(ngram_log, tmp_path, capsys):
    path, _ = ngram_log
    records = copy.deepcopy(masks(path))
    seg = next(seg for r in records for seg in r["segments"] if "verified" in seg)
    seg["verified"]["accepted"] = seg["verified"]["drafted"] + 1
    code, out = check(write(tmp_path / "accepted.log", records), capsys)
    assert code == 1
    assert f"{seg['question_id']}: {seg['verified']['drafted'] + 1} draft tokens accepted of " in out
    assert f"accepted {seg['verified']['drafted'] + 1} draft tokens of the {seg['verified']['drafted']} drafted" in out


def test_an_accepted_count_the_next_forward_contradicts_fails(ngram_log, tmp_path, capsys):
    path, _ = ngram_log
    records = copy.deepcopy(masks(path))
    seg = next(seg for r in records for seg in r["segments"]
               if "verified" in seg and seg["verified"]["accepted"] < seg["verified"]["drafted"])
    seg["verified"]["accepted"] += 1
    seg["verified"]["rejected"] -= 1
    code, out = check(write(tmp_path / "contradicted.log", records), capsys)
    assert code == 1 and "but its next forward starts at" in out


def test_digests_tell_nothing_across_questions(tiny_models, harness, tmp_path):
    """Two questions with the same prompt: equal tokens, unequal digests (keyed per question); no token id
    of the prompt is in the log."""
    prompt = [201, 222, 243, 201, 222, 243, 201, 222]
    questions = [harness.Q(qid, prompt, dict(max_new_tokens=6, temperature=0.0)) for qid in ("a", "b")]
    path = tmp_path / "twins.log"
    audited_run(harness, tiny_models[KIND].kev, path, questions, speculative="ngram")
    first = {seg["question_id"]: seg["token_digests"] for r in masks(path) for seg in r["segments"]
             if seg["positions"][0] == 0}
    assert len(set(first["a"])) == 3 and not set(first["a"]) & set(first["b"])
    assert "201, 222" not in path.read_text() and "222, 243" not in path.read_text()


@pytest.fixture(scope="module")
def model_log(tiny_models, harness, tmp_path_factory):
    """A draft model made of the target's first layer, six looping questions packed together."""
    path = tmp_path_factory.mktemp("spec_audit") / "draft_model.log"
    outcome = audited_run(harness, tiny_models[KIND].kev, path, looping_prompts(harness, 6, seed=43),
                          speculative="draft_model", draft_layers=1, max_tokens_per_step=64)
    return path, outcome


def test_a_real_draft_model_run_passes(model_log, capsys):
    path, _ = model_log
    records = masks(path)
    assert all(r["event"] == "forward.mask" for r in records)
    drafts = [seg for r in records for seg in r["segments"] if "draft" in seg]
    assert drafts and all(seg["draft"]["method"] == "draft_model" for seg in drafts)
    assert all(seg["draft"]["context"] == seg["positions"][0] + 1 for seg in drafts)  # fed all its own tokens
    assert any(seg["draft"]["kept"] > 0 for seg in drafts)  # and reused its own K/V from earlier drafts
    code, out = check(path, capsys)
    assert code == 0, out
    assert f"{len(drafts)} draft-model drafts fed their own question's token count" in out
    assert "every draft's recorded origin is its own question" in out  # not "came from": nothing to copy


def test_a_draft_model_block_listed_for_two_questions_fails(model_log, tmp_path, capsys):
    path, _ = model_log
    records = copy.deepcopy(masks(path))
    record = next(r for r in records if sum("draft" in seg for seg in r["segments"]) >= 2)
    first, second = [seg for seg in record["segments"] if "draft" in seg][:2]
    second["draft"]["blocks"][0] = first["draft"]["blocks"][0]
    code, out = check(write(tmp_path / "shared_block.log", records), capsys)
    assert code == 1
    assert (f"draft model block {first['draft']['blocks'][0]} is held for both {first['question_id']} and "
            f"{second['question_id']}") in out


def test_a_draft_model_fed_other_than_its_own_tokens_fails(model_log, tmp_path, capsys):
    path, _ = model_log
    records = copy.deepcopy(masks(path))
    seg = next(seg for r in records for seg in r["segments"] if "draft" in seg)
    seg["draft"]["context"] += 3
    code, out = check(write(tmp_path / "fed.log", records), capsys)
    assert code == 1 and f"{seg['question_id']}: draft model fed {seg['draft']['context']} tokens" in out
