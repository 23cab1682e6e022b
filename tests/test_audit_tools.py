"""`kev audit check` and `kev audit render` on audit logs of real engine runs (a tiny random Llama, so fast)."""

from __future__ import annotations

import json
import logging
import random
from contextlib import contextmanager
from pathlib import Path

import pytest
import structlog

from kev_async.cli import main


@contextmanager
def json_log_to(path: Path):
    """structlog writes JSON lines to `path` (as `kev` does to stderr) for the duration; restored after."""
    old = structlog.get_config()
    with open(path, "w") as file:
        structlog.configure(
            processors=[structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="iso", utc=True),
                        structlog.processors.JSONRenderer()],
            wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),  # the default level: enough
            logger_factory=structlog.WriteLoggerFactory(file), cache_logger_on_first_use=False)
        try:
            file.write("kev starting (a console line, not JSON)\n")
            file.write(json.dumps({"event": "engine.started", "level": "info"}) + "\n")
            yield
        finally:
            structlog.configure(**old)


@pytest.fixture(scope="module")
def tiny_model(harness, smollm2_tokenizer):
    return harness.kev_model_from_hf(harness.build_hf_tiny("llama", seed=7), smollm2_tokenizer)


@pytest.fixture(scope="module")
def run_log(tmp_path_factory, harness, tiny_model) -> Path:
    """A real run: q0, q1 start; q2, q3 arrive at step 2, so forward 3 packs two decodes and two prefills
    (q3's is chunked by the 24-token step budget and finishes in forward 4)."""
    rng = random.Random(0)
    Q = harness.Q
    path = tmp_path_factory.mktemp("audit") / "run.log"
    with json_log_to(path):
        harness.run_core(tiny_model, [Q("q0", harness.random_prompt(rng, 9), dict(max_new_tokens=8)),
                                      Q("q1", harness.random_prompt(rng, 30), dict(max_new_tokens=8))],
                         # prompt_chunk_tokens=0: prompts cut wherever the budget ends, as this scenario needs
                         harness.tiny_options(audit=True, max_tokens_per_step=24, block_size=4, prompt_chunk_tokens=0),
                         later={2: [Q("q2", harness.random_prompt(rng, 17), dict(max_new_tokens=6)),
                                    Q("q3", harness.random_prompt(rng, 22), dict(max_new_tokens=6))]})
    return path


def records(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        try:
            data = json.loads(line)
        except ValueError:
            continue
        if data.get("event") == "forward.mask":
            out.append(data)
    return out


def write_log(path: Path, recs: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def segment(rec: dict, qid: str) -> dict:
    return next(s for s in rec["segments"] if s["question_id"] == qid)


def test_the_run_log_holds_a_forward_mixing_decodes_and_prefills(run_log):
    third = records(run_log)[2]
    assert third["forward"] == 3
    kinds = {s["question_id"]: (s["rows"][1] - s["rows"][0], s["positions"][0]) for s in third["segments"]}
    assert kinds["q0"] == (1, 10) and kinds["q1"][0] == 1  # decodes
    assert kinds["q2"] == (17, 0) and kinds["q3"][1] == 0 and kinds["q3"][0] < 22  # a prefill, a chunked one


def test_check_passes_on_a_real_run(run_log, capsys):
    assert main(["audit", "check", str(run_log)]) == 0
    out = capsys.readouterr().out
    assert f"{len(records(run_log))} forwards" in out
    assert "questions:  4" in out and "max batch:  4 questions (forward 3)" in out
    others = sum(1 for line in run_log.read_text().splitlines()
                 if line.startswith("{") and json.loads(line).get("event") != "forward.mask")
    assert others >= 1 and f"skipped:    {others + 1} lines (1 not JSON, {others} other events)" in out
    assert "OK:" in out and "VIOLATIONS" not in out


def test_check_accepts_a_preempted_question_restarting_at_zero(tmp_path, harness, tiny_model, capsys):
    rng = random.Random(1)
    path = tmp_path / "preempt.log"
    with json_log_to(path):
        out = harness.run_core(tiny_model, [harness.Q("a", harness.random_prompt(rng, 9), dict(max_new_tokens=12)),
                                            harness.Q("b", harness.random_prompt(rng, 15), dict(max_new_tokens=12))],
                               harness.tiny_options(audit=True, num_blocks=8, block_size=4))
    assert out.core.scheduler.num_preemptions > 0
    assert main(["audit", "check", str(path)]) == 0
    assert "restarts:   0" not in capsys.readouterr().out


def _share_a_block(recs):
    rec = recs[2]
    segment(rec, "q2")["blocks"][0] = segment(rec, "q1")["blocks"][-1]
    return 3, f"block {segment(rec, 'q1')['blocks'][-1]} is held by both q1 and q2"


def _overlap_rows(recs):
    seg = segment(recs[2], "q2")  # one row earlier: q2's first row is q1's decode row
    seg["rows"] = [seg["rows"][0] - 1, seg["rows"][1] - 1]
    return 3, "q2: rows start at 1, expected 2 (segments overlap or gap)"


def _position_gap(recs):
    seg = segment(recs[4], "q0")  # a decode one position further on: consistent in itself, skips a position
    start = seg["positions"][0]
    seg["positions"] = [start + 1, start + 2]
    seg["kv_len"] += 1
    return 5, f"q0: positions start at {start + 1}, but its previous forward (forward 4) ended at kv_len {start} " \
              f"(position gap)"


def _position_repeat(recs):
    seg = segment(recs[5], "q1")  # a decode one position back: recomputes a position it already holds
    start = seg["positions"][0]
    seg["positions"] = [start - 1, start]
    seg["kv_len"] -= 1
    return 6, f"q1: positions start at {start - 1}, but its previous forward (forward 5) already reached kv_len " \
              f"{start} (positions repeat)"


@pytest.mark.parametrize("plant", [_share_a_block, _overlap_rows, _position_gap, _position_repeat])
def test_check_names_the_forward_and_the_planted_violation(plant, run_log, tmp_path, capsys):
    recs = records(run_log)
    forward, problem = plant(recs)
    path = write_log(tmp_path / "planted.log", recs)
    assert main(["audit", "check", str(path)]) == 1
    out = capsys.readouterr().out
    listed = out.split("VIOLATIONS: ")[1].splitlines()[1:]
    assert listed[0] == f"  forward {forward}: {problem}", out  # a shift also breaks the next forward's continuity
    assert len(listed) <= 2 and len(set(listed)) == len(listed)


def test_check_reports_what_the_engine_itself_flagged(run_log, tmp_path, capsys):
    recs = records(run_log)
    recs[1].update(event="forward.isolation_violation", level="error", problems=["q9: something odd"])
    assert main(["audit", "check", str(write_log(tmp_path / "flagged.log", recs))]) == 1
    assert "forward 2: engine flagged: q9: something odd" in capsys.readouterr().out


def test_check_exits_2_without_records(tmp_path, capsys):
    empty = tmp_path / "empty.log"
    empty.write_text("just text\n" + json.dumps({"event": "other"}) + "\n")
    assert main(["audit", "check", str(empty)]) == 2
    assert "no forward.mask" in capsys.readouterr().err
    assert main(["audit", "check", str(tmp_path / "missing.log")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_render_draws_one_block_per_question(run_log, tmp_path, capsys):
    from matplotlib.image import imread

    png = tmp_path / "mask.png"
    assert main(["audit", "render", str(run_log), "--forward", "3", "-o", str(png)]) == 0
    assert "forward 3, 4 questions" in capsys.readouterr().out
    assert imread(png).shape[:2] == (800, 800)

    from kev_async.observe.mask_picture import render_forward

    drawn = render_forward(records(run_log)[2], tmp_path / "again.png", size_in=4, dpi=50)
    assert (drawn.segments, drawn.width, drawn.height) == (4, 200, 200)
    assert imread(drawn.path).shape[:2] == (200, 200)
    assert [label.split(":")[0] for label in drawn.legend[:4]] == ["q0", "q1", "q2", "q3"]
    assert drawn.legend[0].startswith("q0: decode") and drawn.legend[2].startswith("q2: prefill 17")
    assert drawn.rows == records(run_log)[2]["tokens"]
    assert drawn.keys == sum(s["kv_len"] for s in records(run_log)[2]["segments"])


def test_render_hatches_a_shared_prefix(tmp_path):
    from kev_async.observe.mask_picture import render_forward

    record = {"forward": 1, "tokens": 5, "block_size": 4, "segments": [
        {"question_id": "a", "rows": [0, 3], "positions": [4, 7], "kv_len": 7, "blocks": [0, 1], "shared_prefix_len": 4},
        {"question_id": "b", "rows": [3, 5], "positions": [4, 6], "kv_len": 6, "blocks": [0, 2], "shared_prefix_len": 4}]}
    drawn = render_forward(record, tmp_path / "shared.png")
    assert drawn.segments == 2 and "shared 4" in drawn.legend[0] and "shared read-only prefix" in drawn.legend


def test_each_row_sees_exactly_its_keys_up_to_its_position():
    from kev_async.observe.mask_picture import _Block, _visible

    block = _Block("q", row=5, q_len=3, col=10, cached=2, kv_len=5, shared=0)
    # row 5 (position 2) sees keys 0..2 = columns 10..12, so its right edge is x = 13; the last row sees 0..4
    assert _visible(block, 10, 15) == [(10, 5), (13, 5), (13, 6), (14, 6), (14, 7), (15, 7), (15, 8), (10, 8)]
    assert _visible(block, 12, 15)[:3] == [(12, 5), (13, 5), (13, 6)]  # the new keys only


def test_render_names_a_missing_forward(run_log, tmp_path, capsys):
    n = len(records(run_log))
    assert main(["audit", "render", str(run_log), "--forward", "99", "-o", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert f"forward 99 is not in {run_log}" in err and f"recorded forwards: 1..{n}" in err
    assert not (tmp_path / "x.png").exists()
    assert main(["audit", "render", str(run_log)]) == 2  # --forward is required
    assert "--forward" in capsys.readouterr().err
