"""The audit of speculative decoding: real runs whose logs `kev audit check` passes, and tampered logs it
fails: a draft token that is not the question's own, more tokens accepted than drafted, a draft model's
cache block listed for two questions.

Each drafting segment records its drafter and the draft's origin (`draft`), the question's next segment
how it fared (`verified`), and every row of a question that may draft a keyed digest of its token, from
which the checker rebuilds the question's own token history (docs/speculative.md).
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


def audited_run(harness, model, path: Path, questions, **options):
    with json_log_to(path):
        outcome = harness.run_core(model, questions, harness.tiny_options(audit=True, block_size=4, **ALWAYS, **options))
    return outcome


def masks(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            if record["event"] in ("forward.mask", "forward.isolation_violation"):
                out.append(record)
    return out


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
    # Every kept draft token is in some answer; the ones of a question's last forward have no next record.
    assert sum(v["accepted"] for v in verified) <= sum(a.usage.accepted_draft_tokens for a in outcome.answers.values())
    code, out = check(path, capsys)
    assert code == 0, out
    report = check_log(read_audit_log(path))
    assert report.drafts.drafts == len(drafts) and report.drafts.proven == len(drafts)
    assert "every draft came from its own question" in out
    assert f"{len(drafts)} of {len(drafts)} prompt-lookup drafts shown copied from their own question's tokens" in out


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
