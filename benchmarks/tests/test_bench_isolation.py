"""`kev bench isolation` stays runnable and counts what it says (tiny model, tiny sizes)."""

from kev_async.cli import main

pytest_plugins = ["serve_fixtures"]


def test_bench_isolation_counts_answers_identical_alone_and_packed(tiny_model_dir, capsys):
    assert main(["bench", "isolation", "--model", str(tiny_model_dir), "--questions", "3", "--seeded", "1",
                 "--max-new-tokens", "4", "--variants", "fp32,bf16", "--threads", "2"]) == 0
    out = capsys.readouterr().out
    assert '"event"' not in out and "[info" not in out and "[debug" not in out  # stdout is the table; logs: stderr
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[1:-1]]
            for line in out.splitlines() if line.startswith("| fp32") or line.startswith("| bf16")}
    assert set(rows) == {"fp32", "bf16"}
    for name, dtype in (("fp32", "float32"), ("bf16", "bfloat16")):
        variant, got_dtype, kv, kernel, greedy, seeded, _seconds = rows[name]
        assert (got_dtype, kv, kernel) == (dtype, "auto", "row_linear")
        assert (greedy, seeded) == ("3/3", "1/1")  # row_linear and the prompt grid: nothing moves


def test_bench_isolation_refuses_an_unknown_variant(capsys):
    assert main(["bench", "isolation", "--variants", "fp32,fp8"]) == 2
    assert "unknown variant(s) fp8" in capsys.readouterr().out
