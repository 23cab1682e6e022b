"""`kev pipeline` (seed 000's `kev pipeline --debug`): questions answered packed on the tiny random model, with
each forward's mask summary and token-level routing table in the terminal, as a reader hunting crosstalk
would read them. The printed table is checked by `kev audit check`'s own verifier, and against the engine's
records as `--audit-log` writes them."""

from __future__ import annotations

import re

from kev_async.cli import main
from kev_async.observe.audit import AuditLog, ForwardRecord, check_log, read_audit_log
from schemas import DEFAULT_CONFIG

pytest_plugins = ["serve_fixtures"]

QUESTIONS = ["What is 2+2?", "Hi", "Write a haiku about autumn leaves falling slowly, please."]
FORWARD = re.compile(r"^forward (\d+): (\d+) rows, (\d+) questions .*; (cross-question pairs \d+, every one blocked"
                     r"|ISOLATION VIOLATED:)$")


def run(capsys, *args: str) -> tuple[int, str]:
    code = main(["pipeline", *args])
    return code, capsys.readouterr().out


def values(text: str) -> list[int]:
    """"0-3,8" -> [0, 1, 2, 3, 8]"""
    out = []
    for run_ in text.split(","):
        first, _, last = run_.partition("-")
        out += range(int(first), int(last or first) + 1)
    return out


def tables(out: str) -> list[dict]:
    """The printed forwards as audit records: each table line's rows, positions, kv and blocks, and what it
    says it writes and sees."""
    forwards, lines = [], out.splitlines()
    for i, line in enumerate(lines):
        head = FORWARD.match(line)
        if not head:
            continue
        assert lines[i + 1].split() == ["#", "question", "channel", "rows", "positions", "kv", "blocks", "writes",
                                        "sees"]
        record = {"event": "forward.mask", "forward": int(head[1]), "tokens": int(head[2]),
                  "block_size": DEFAULT_CONFIG.kv_cache.block_size, "segments": [], "verdict": head[4]}
        for row in lines[i + 2: i + 2 + int(head[3])]:
            index, qid, channel, rows, positions, kv, blocks, writes, sees = row.split()
            rows, positions = values(rows), values(positions)
            record["segments"].append({
                "question_id": qid, "index": int(index), "channel": int(channel),
                "rows": [rows[0], rows[-1] + 1], "positions": [positions[0], positions[-1] + 1], "kv_len": int(kv),
                "blocks": values(blocks), "writes": values(writes), "sees": values(sees)})
        forwards.append(record)
    return forwards


def test_pipeline_debug_prints_a_routing_table_the_audit_verifier_accepts(tiny_model_dir, tmp_path, capsys):
    picture, log_path = tmp_path / "mask.png", tmp_path / "audit.log"
    code, out = run(capsys, "--debug", "--model", str(tiny_model_dir), "--max-new-tokens", "4", "--temperature", "0",
                    "--picture", str(picture), "--audit-log", str(log_path), *QUESTIONS)
    assert code == 0, out
    forwards = tables(out)
    assert len(forwards) >= 2, out  # one prefill, then a forward per further token
    first = forwards[0]
    assert [s["question_id"] for s in first["segments"]] == ["q0", "q1", "q2"], out  # all three in one forward
    assert [s["index"] for s in first["segments"]] == [0, 1, 2]
    assert len({s["channel"] for s in first["segments"]}) == 3  # a channel each
    for forward in forwards:
        assert forward["verdict"].endswith("every one blocked"), out
        rows = [r for s in forward["segments"] for r in range(*s["rows"])]
        assert sorted(rows) == list(range(forward["tokens"])), f"token rows overlap or gap: {forward}"
        seen: set[int] = set()
        for seg in forward["segments"]:
            assert seg["positions"][1] == seg["kv_len"]  # positions restart per question, end at its kv
            assert len(seg["sees"]) == seg["kv_len"] and set(seg["writes"]) <= set(seg["sees"])
            assert not seen & set(seg["sees"]), f"{seg['question_id']} sees another question's keys: {forward}"
            seen |= set(seg["sees"])
    # The table, read back from the terminal, passes `kev audit check`'s own verifier ...
    log = AuditLog(records=[ForwardRecord(1, n, f) for n, f in enumerate(forwards, 1)], lines=len(forwards))
    report = check_log(log)
    assert report.clean and report.forwards == len(forwards) and report.questions == 3, report.problems
    assert "OK: every forward keeps its questions isolated" in out
    # ... and is the engine's own records, as `kev audit check` reads them from --audit-log
    logged = read_audit_log(log_path).records
    keys = ("question_id", "rows", "positions", "kv_len", "blocks")
    assert [[{k: s[k] for k in keys} for s in r.data["segments"]] for r in logged] == \
        [[{k: s[k] for k in keys} for s in f["segments"]] for f in forwards]
    assert main(["audit", "check", str(log_path)]) == 0
    # then the answers, one per question, and the picture of the first forward
    answers = out[out.index("[q0] "):]
    assert [line.split("] ")[1] for line in answers.splitlines() if re.match(r"^\[q\d\] ", line)] == QUESTIONS
    assert re.search(r"^3 answers, \d+ tokens in ", answers, re.M), answers
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {picture}: forward 1, 3 questions, {first['tokens']} rows" in out


def test_pipeline_without_debug_just_answers_and_draws_the_forward_asked_for(tiny_model_dir, tmp_path, capsys):
    picture = tmp_path / "decode.png"
    code, out = run(capsys, "--model", str(tiny_model_dir), "--max-new-tokens", "3", "--temperature", "0",
                    "--picture", str(picture), "--forward", "2", *QUESTIONS[:2])
    assert code == 0, out
    assert not re.search(r"^forward \d+:", out, re.M)  # no tables without --debug
    assert "[q0] What is 2+2?" in out and "[q1] Hi" in out
    assert f"wrote {picture}: forward 2, 2 questions, 2 rows" in out  # a decode: one row each
    code, out = run(capsys, "--model", str(tiny_model_dir), "--max-new-tokens", "2", "--picture",
                    str(tmp_path / "none.png"), "--forward", "9", "Hi")
    assert code == 2 and not (tmp_path / "none.png").exists()


def test_pipeline_refuses_bad_flags_before_loading_a_model(capsys):
    assert main(["pipeline", "--temperature", "-1", "Hi"]) == 2
    assert "kev pipeline: --temperature: -1" in capsys.readouterr().err
    assert main(["pipeline", "--forward", "2", "Hi"]) == 2
    assert "give --picture PNG too" in capsys.readouterr().err
    assert main(["pipeline", "--per-token", "Hi"]) == 2
    assert "give --debug too" in capsys.readouterr().err


def test_pipeline_help_explains_the_table(capsys):
    assert main(["pipeline", "--help"]) == 0
    help_text = capsys.readouterr().out
    for word in ("channel", "rows", "positions", "blocks", "writes", "sees", "--picture", "--forward", "--audit-log"):
        assert word in help_text
