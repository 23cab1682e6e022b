"""`kev bench batch` on the tiny model: the three phases run through a live gateway and worker on the embedded
broker, the batch runs through the middle one and is cancelled, and the table and ratio are printed."""

import pytest

from kev_async.cli import main

pytest_plugins = ["serve_fixtures"]


@pytest.mark.kafka
def test_kev_bench_batch_measures_interactive_latency_beside_a_running_batch(tiny_model_dir, capsys):
    assert main(["bench", "batch", "--model", str(tiny_model_dir), "--requests", "3", "--max-new-tokens", "4",
                 "--lines", "200", "--batch-max-tokens", "48", "--in-flight", "4", "--threads", "2"]) == 0
    out = capsys.readouterr().out
    for phase in ("| alone, before | 3 |", "| beside the batch | 3 |", "| alone, after | 3 |"):
        assert phase in out, out
    assert "beside the batch / alone (p50): " in out and "FINISHED" not in out
