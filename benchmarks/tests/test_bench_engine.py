"""`python -m benchmarks.engine` and `python -m benchmarks.scaling` stay runnable: each prints its table and
ratios on a tiny model, tiny sizes. Speed itself is never asserted; the numbers live in docs/speed.md."""

from benchmarks import engine, scaling
from benchmarks.command import run_alone

pytest_plugins = ["serve_fixtures"]


def test_bench_engine_prints_all_four_runs_and_the_identity_check(tiny_model_dir, capsys):
    assert run_alone(engine.register, ["--model", str(tiny_model_dir), "--questions", "3",
                                       "--max-new-tokens", "4", "--repeats", "1", "--threads", "2"]) == 0
    out = capsys.readouterr().out
    for row in ("(a) | transformers, one at a time", "(b) | transformers, padded batch",
                "(c) | kev, early eviction", "(d) | kev, no early eviction"):
        assert row in out
    assert "(c)/(a) = " in out and "(c)/(b) = " in out
    assert "(c) answers token-identical to (a): 3/3" in out  # greedy, fp32: Kev equals transformers


def test_bench_engine_deterministic_prints_its_cost(tiny_model_dir, capsys):
    assert run_alone(engine.register, ["--model", str(tiny_model_dir), "--questions", "3", "--max-new-tokens", "4",
                                       "--repeats", "1", "--threads", "2", "--skip-sequential",
                                       "--deterministic"]) == 0
    out = capsys.readouterr().out
    assert "(e) | kev, deterministic mode" in out
    assert "deterministic mode: (e)/(c) = " in out and "answers equal to (c)'s: 3/3" in out


def test_bench_scaling_draws_the_plot(tiny_model_dir, tmp_path, capsys):
    plot = tmp_path / "throughput.png"
    assert run_alone(scaling.register, ["--model", str(tiny_model_dir), "--counts", "1,2",
                                        "--max-new-tokens", "3", "--threads", "2", "-o", str(plot)]) == 0
    assert "2 questions: kev" in capsys.readouterr().out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
