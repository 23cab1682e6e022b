"""`kev bench fairness` on the tiny model: both scenarios run, print their tables and ratios, and every
answer is the same under every policy."""

import json

from kev_async.cli import main

pytest_plugins = ["serve_fixtures"]


def test_kev_bench_fairness_runs_the_flood_and_the_shares_side_by_side(tiny_model_dir, tmp_path, capsys):
    assert main(["bench", "fairness", "--model", str(tiny_model_dir), "--flood", "12", "--flood-tokens", "12",
                 "--small", "2", "--small-tokens", "4", "--after", "0.05", "--backlog", "12", "--backlog-tokens", "12",
                 "--batch-size", "4", "--threads", "2", "--output-json", str(tmp_path / "fairness.json")]) == 0
    out = capsys.readouterr().out
    assert "| chat alone |" in out and "| fcfs |" in out and "| fair |" in out
    assert "answers identical under every policy: True" in out
    assert "| 3:1 |" in out and "| 1:1 |" in out
    result = json.loads((tmp_path / "fairness.json").read_text())
    assert set(result["flood"]["policies"]) == {"fcfs", "fair"} and result["flood"]["identical"]
    assert all(row["errors"] == 0 for row in result["flood"]["policies"].values())
    assert [run["promised"] for run in result["shares"]["runs"]] == [1.0, 3.0]


def test_an_unknown_scenario_is_a_clear_error(capsys):
    assert main(["bench", "fairness", "--scenarios", "nope"]) == 2
    assert "give flood, shares or both" in capsys.readouterr().err
