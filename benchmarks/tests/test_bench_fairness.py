"""`kev bench fairness` on the tiny model: both scenarios run, print their tables and ratios, and every
answer is the same under every policy."""

import json

import pytest

from kev_async.cli import main

pytest_plugins = ["serve_fixtures"]


def test_kev_bench_fairness_runs_the_flood_and_the_shares_side_by_side(tiny_model_dir, tmp_path, capsys):
    assert main(["bench", "fairness", "--paths", "in_process", "--model", str(tiny_model_dir), "--flood", "12",
                 "--flood-tokens", "12",
                 "--small", "2", "--small-tokens", "4", "--after", "0.05", "--backlog", "12", "--backlog-tokens", "12",
                 "--batch-size", "4", "--threads", "2", "--output-json", str(tmp_path / "fairness.json")]) == 0
    out = capsys.readouterr().out
    assert "| chat alone |" in out and "| fcfs |" in out and "| fair |" in out
    assert "answers identical under every policy: True" in out
    assert "| 3:1 |" in out and "| 1:1 |" in out
    result = json.loads((tmp_path / "fairness.json").read_text())
    flood = result["flood"]["in process"]
    assert set(flood["policies"]) == {"fcfs", "fair"} and flood["identical"]
    assert all(row["errors"] == 0 for row in flood["policies"].values())
    assert [run["promised"] for run in result["shares"]["in process"]["runs"]] == [1.0, 3.0]
    assert result["commit"] and result["cpu"]  # stamped for docs/results/: this test runs from a clone


@pytest.mark.kafka
def test_kev_bench_fairness_runs_the_flood_through_kafka_beside_in_process(tiny_model_dir, tmp_path, capsys):
    assert main(["bench", "fairness", "--scenarios", "flood", "--model", str(tiny_model_dir), "--flood", "12",
                 "--flood-tokens", "12", "--small", "2", "--small-tokens", "4", "--after", "0.05", "--batch-size", "4",
                 "--read-ahead", "4", "--threads", "2", "--output-json", str(tmp_path / "fairness.json")]) == 0
    out = capsys.readouterr().out
    assert "== flood, through Kafka" in out and "kafka.read_ahead 4 per partition, router.channel_pool_size 16" in out
    assert "| through Kafka |" in out and "| in process |" in out
    result = json.loads((tmp_path / "fairness.json").read_text())
    kafka = result["flood"]["through Kafka"]
    assert kafka["identical"] and all(row["errors"] == 0 for row in kafka["policies"].values())
    assert "answers identical in process and through Kafka: 14/14" in out


def test_an_unknown_scenario_is_a_clear_error(capsys):
    assert main(["bench", "fairness", "--scenarios", "nope"]) == 2
    assert "give flood, shares or both" in capsys.readouterr().err
