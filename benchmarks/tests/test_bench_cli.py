"""The kept benchmarks stay runnable: `kev bench structured` and `kev bench spec` print their tables and ratios
(tiny model, tiny sizes), and `kev bench kafka` refuses bad arguments before loading a model.

Speed itself is never asserted here; the numbers live in docs/speed.md, measured with the real model.
"""

import pytest

from kev_async.cli import main

pytest_plugins = ["serve_fixtures"]


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
