"""`python -m benchmarks.step` stays runnable: decode steps against the weight-matmul floor on a tiny model.
Speed itself is never asserted; the numbers live in docs/speed.md."""

from benchmarks import step
from benchmarks.command import run_alone

pytest_plugins = ["serve_fixtures"]


def test_bench_step_times_full_decode_steps_against_the_matmul_floor(tiny_model_dir, capsys):
    assert run_alone(step.register, ["--model", str(tiny_model_dir), "--batch-sizes", "1,4", "--context", "40",
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
    assert run_alone(step.register, ["--model", str(tiny_model_dir), "--batch-sizes", "1,4", "--context", "30",
                                     "--steps", "3", "--threads", "2", "--matmul", "both"]) == 0
    out = capsys.readouterr().out
    assert "core.matmul: row_linear" in out and "core.matmul: library" in out
    assert "matmul row_linear)" in out and "matmul library)" in out
    ratios = [line for line in out.splitlines() if line.startswith(("| 1 | ", "| 4 | ")) and line.count("|") == 4]
    assert len(ratios) == 2 and all(float(line.split("|")[2].strip().rstrip("x")) > 0 for line in ratios)


def test_bench_step_kv_dtype_int8_builds_an_int8_cache_and_counts_its_bytes(tiny_model_dir, capsys):
    kv_ms = {}
    for kv_dtype in ("auto", "int8"):
        assert run_alone(step.register, ["--model", str(tiny_model_dir), "--batch-sizes", "2", "--context", "40",
                                         "--steps", "3", "--threads", "2", "--kv-dtype", kv_dtype]) == 0
        out = capsys.readouterr().out
        row = next(line for line in out.splitlines() if line.startswith("| 2 |"))
        kv_ms[kv_dtype] = float(row.split("|")[5])
    assert "int8 KV" in out
    assert kv_ms["auto"] > 2.5 * kv_ms["int8"]  # the KV read floor counts int8 rows and their scales
