"""`python -m benchmarks.precision` stays runnable: every variant's row on a tiny model (speed not asserted)."""

from benchmarks import precision
from benchmarks.command import run_alone


def test_bench_precision_prints_every_variant(tmp_path, capsys):
    from serve_fixtures import build_tiny_model_dir

    model = str(build_tiny_model_dir(tmp_path))
    assert run_alone(precision.register, ["--model", model, "--questions", "3", "--max-new-tokens", "4",
                                          "--repeats", "1", "--threads", "2"]) == 0
    out = capsys.readouterr().out
    for variant in ("fp32", "bf16", "int8-weights", "int8-kv"):
        assert f"| {variant} |" in out
    assert "| fp32 | float32 | float32 |" in out and "| 3/3 | - | 0.000 |" in out  # fp32 agrees with itself
