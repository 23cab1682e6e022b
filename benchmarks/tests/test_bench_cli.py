"""The benchmarks stay runnable: each `kev bench` prints its table and ratios (tiny model, tiny sizes).

Speed itself is never asserted here; the numbers live in docs/speed.md, measured with the real model.
"""

import pytest

from kev_async.cli import main

pytest_plugins = ["serve_fixtures"]


def test_bench_engine_prints_all_four_runs_and_the_identity_check(tiny_model_dir, capsys):
    assert main(["bench", "engine", "--model", str(tiny_model_dir), "--questions", "3",
                 "--max-new-tokens", "4", "--repeats", "1", "--threads", "2"]) == 0
    out = capsys.readouterr().out
    for row in ("(a) | transformers, one at a time", "(b) | transformers, padded batch",
                "(c) | kev, early eviction", "(d) | kev, no early eviction"):
        assert row in out
    assert "(c)/(a) = " in out and "(c)/(b) = " in out
    assert "(c) answers token-identical to (a): 3/3" in out  # greedy, fp32: Kev equals transformers


def test_bench_engine_deterministic_prints_its_cost(tiny_model_dir, capsys):
    assert main(["bench", "engine", "--model", str(tiny_model_dir), "--questions", "3", "--max-new-tokens", "4",
                 "--repeats", "1", "--threads", "2", "--skip-sequential", "--deterministic"]) == 0
    out = capsys.readouterr().out
    assert "(e) | kev, deterministic mode" in out
    assert "deterministic mode: (e)/(c) = " in out and "answers equal to (c)'s: 3/3" in out


def test_bench_scaling_draws_the_plot(tiny_model_dir, tmp_path, capsys):
    plot = tmp_path / "throughput.png"
    assert main(["bench", "scaling", "--model", str(tiny_model_dir), "--counts", "1,2",
                 "--max-new-tokens", "3", "--threads", "2", "-o", str(plot)]) == 0
    assert "2 questions: kev" in capsys.readouterr().out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_step_times_full_decode_steps_against_the_matmul_floor(tiny_model_dir, capsys):
    assert main(["bench", "step", "--model", str(tiny_model_dir), "--batch-sizes", "1,4", "--context", "40",
                 "--steps", "3", "--threads", "2", "--profile"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("| 1 |", "| 4 |"))]
    assert len(rows) == 2  # every timed step ran all rows, or bench_step raises
    kv_read = []
    for row in rows:
        step_ms, floor_ms, ratio, kv_ms, floor_ratio = (float(cell.strip().rstrip("x")) for cell in row.split("|")[2:7])
        assert step_ms > 0 and floor_ms > 0 and abs(ratio - step_ms / floor_ms) < 0.1 * ratio
        assert kv_ms > 0 and abs(floor_ratio - step_ms / (floor_ms + kv_ms)) < 0.1 * floor_ratio
        kv_read.append(kv_ms)
    assert 3 < kv_read[1] / kv_read[0] < 5  # 4 rows of the same context read ~4x the cache bytes of 1
    assert "aten::" in out  # --profile: the largest batch's operators


def test_bench_step_compares_row_linear_and_the_library_side_by_side(tiny_model_dir, capsys):
    assert main(["bench", "step", "--model", str(tiny_model_dir), "--batch-sizes", "1,4", "--context", "30",
                 "--steps", "3", "--threads", "2", "--matmul", "both"]) == 0
    out = capsys.readouterr().out
    assert "core.matmul: row_linear" in out and "core.matmul: library" in out
    assert "matmul row_linear)" in out and "matmul library)" in out
    ratios = [line for line in out.splitlines() if line.startswith(("| 1 | ", "| 4 | ")) and line.count("|") == 4]
    assert len(ratios) == 2 and all(float(line.split("|")[2].strip().rstrip("x")) > 0 for line in ratios)


def test_bench_step_kv_dtype_int8_builds_an_int8_cache_and_counts_its_bytes(tiny_model_dir, capsys):
    kv_ms = {}
    for kv_dtype in ("auto", "int8"):
        assert main(["bench", "step", "--model", str(tiny_model_dir), "--batch-sizes", "2", "--context", "40",
                     "--steps", "3", "--threads", "2", "--kv-dtype", kv_dtype]) == 0
        out = capsys.readouterr().out
        row = next(line for line in out.splitlines() if line.startswith("| 2 |"))
        kv_ms[kv_dtype] = float(row.split("|")[5])
    assert "int8 KV" in out
    assert kv_ms["auto"] > 2.5 * kv_ms["int8"]  # the KV read floor counts int8 rows and their scales


def test_bench_structured_prints_both_runs_the_ratio_and_compile_times(tiny_model_dir, capsys):
    assert main(["bench", "structured", "--model", str(tiny_model_dir), "--questions", "9", "--max-new-tokens", "8",
                 "--repeats", "1", "--threads", "2"]) == 0
    out = capsys.readouterr().out
    assert "| free |" in out and "| 8 schemas |" in out
    assert "8 schemas / free: tokens/s " in out and "computed late" in out
    for name in ("sentiment", "entity", "verdict", "keywords", "rating", "translation", "steps", "fact"):
        assert f"| {name} |" in out
    assert "compile: cold median" in out


def test_bench_spec_prints_every_workload_method_ratio_and_identical_answers(tiny_model_dir, capsys):
    assert main(["bench", "spec", "--model", str(tiny_model_dir), "--concurrency", "1,2", "--max-new-tokens", "8",
                 "--repeats", "1", "--threads", "2"]) == 0
    out = capsys.readouterr().out
    assert "| ngram/off |" in out and "| draft_model/off |" in out
    rows = [line for line in out.splitlines() if line.startswith(("| extraction |", "| code |", "| chat |"))]
    assert len(rows) == 6
    assert all(line.rstrip().endswith("| yes |") for line in rows)  # speculation changes no answer


def test_bench_kafka_refuses_a_transaction_interval_out_of_range_before_loading_a_model():
    with pytest.raises(SystemExit, match="--transaction-ms 1 to 60000"):
        main(["bench", "kafka", "--exactly-once", "--model", "no-such-model", "--transaction-ms", "0"])
