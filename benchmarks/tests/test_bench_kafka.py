"""`kev bench kafka`: the Kafka path and the engine alone give the same answers and count the same tokens.

The bench runs the real model through both paths (the engine alone, then `kev serve` on an embedded
broker); speed is never asserted here (docs/speed.md holds the figures), agreement is.
"""

import math

import msgspec
import pytest

from kev_async.bench.kafka import bench_kafka
from kev_async.bench.kafka_delivery import delivery_report
from kev_async.bench.kafka_paths import PathRun, arrival_offsets
from schemas import KevConfig, MetricsConfig

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"  # aiokafka


async def test_both_paths_give_the_same_answers_and_token_counts(smollm2, tmp_path):
    cfg = msgspec.structs.replace(KevConfig(), metrics=MetricsConfig(port=0))
    lines = []
    result = await bench_kafka(cfg, smollm2, num_questions=6, max_new_tokens=6, rate=20.0,
                               timeline=str(tmp_path / "timeline.png"), out=lines.append)
    engine, kafka = result["engine"], result["kafka"]
    assert set(engine.tokens) == set(kafka.tokens) == {f"bench-{i}" for i in range(6)}
    assert result["identical"] == 6 and engine.completion_tokens == kafka.completion_tokens
    assert all(0 < s < 60 for s in list(engine.latency_s.values()) + list(kafka.latency_s.values()))
    assert any("answers identical: 6/6; completion tokens equal" in line for line in lines), lines
    # The profile: every question placed, its stages in order on the wall clock, summing to publish -> commit.
    profile = result["profile"]
    assert profile["questions"] == 6 and (tmp_path / "timeline.png").stat().st_size > 10_000
    assert [name for name in profile["stages"]] == ["fetch", "intake", "tokenize", "admission", "prefill", "decode",
                                                    "hand-off", "send", "ack", "commit"]
    totals = [sum(stage[i] for stage in profile["stages"].values()) for i in range(6)]
    assert all(0 < total < 60 for total in totals)
    assert all(d > 0 for d in profile["stages"]["decode"])  # 6 tokens each: decoding took time
    assert any(line.startswith("| ack |") for line in lines) and any(line.startswith("| total |") for line in lines)


def test_arrivals_are_spaced_by_the_rate_or_all_at_once():
    assert arrival_offsets(3, 2.0) == [0.0, 0.5, 1.0]
    assert arrival_offsets(3, math.inf) == [0.0, 0.0, 0.0]


def _run(seconds: float, latencies: list[float], errors: int = 0) -> PathRun:
    run = PathRun("through Kafka", seconds=seconds, errors=errors)
    for i, latency in enumerate(latencies):
        run.tokens[f"bench-{i}"], run.latency_s[f"bench-{i}"] = [7, 8, 9, 10], latency
    return run


def test_delivery_report_gives_each_pairs_ratios_their_medians_and_names_runs_with_errors():
    least = [_run(2.0, [1.0, 2.0]), _run(4.0, [2.0, 4.0]), _run(2.0, [1.0, 1.0])]
    exactly = [_run(2.5, [1.2, 2.2]), _run(4.0, [2.0, 4.0]), _run(1.0, [1.5, 1.5], errors=1)]
    exactly[1].tokens["bench-1"] = [7, 8]  # a different answer in one run: not identical everywhere
    lines = []
    result = delivery_report(least, exactly, out=lines.append)
    assert result["pairs"]["goodput"] == pytest.approx([0.8, 0.75, 2.0])  # tokens over each run's seconds
    assert result["goodput"] == pytest.approx(0.8)
    assert result["pairs"]["e2e_p50"] == pytest.approx([1.7 / 1.5, 1.0, 1.5])
    assert result["e2e_p99"] == pytest.approx(2.19 / 1.99)  # p99 of two: 99% of the way to the larger
    assert result["identical"] == 1 and result["errored"] == ["exactly_once pair 2"]
    assert "| 2 | exactly_once | 8 | 1 | 1.00 | 8.0 | 1500 | 1500 |" in lines
    assert "medians: goodput 0.800x (target >= 0.95), e2e p50 1.133x" in lines[-3]
    assert lines[-2] == "answers identical in every run: 1/2"
    assert lines[-1].endswith(": exactly_once pair 2")
