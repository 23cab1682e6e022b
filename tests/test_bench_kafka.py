"""`kev bench kafka`: the Kafka path and the engine alone give the same answers and count the same tokens.

The bench runs the real model through both paths (the engine alone, then `kev serve` on an embedded
broker); speed is never asserted here (docs/speed.md holds the figures), agreement is.
"""

import math

import msgspec
import pytest

from kev_async.bench.kafka import arrival_offsets, bench_kafka
from schemas import KevConfig, MetricsConfig

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"  # aiokafka


async def test_both_paths_give_the_same_answers_and_token_counts(smollm2):
    cfg = msgspec.structs.replace(KevConfig(), metrics=MetricsConfig(port=0))
    lines = []
    result = await bench_kafka(cfg, smollm2, num_questions=6, max_new_tokens=6, rate=20.0, out=lines.append)
    engine, kafka = result["engine"], result["kafka"]
    assert set(engine.tokens) == set(kafka.tokens) == {f"bench-{i}" for i in range(6)}
    assert result["identical"] == 6 and engine.completion_tokens == kafka.completion_tokens
    assert all(0 < s < 60 for s in list(engine.latency_s.values()) + list(kafka.latency_s.values()))
    assert any("answers identical: 6/6; completion tokens equal" in line for line in lines), lines


def test_arrivals_are_spaced_by_the_rate_or_all_at_once():
    assert arrival_offsets(3, 2.0) == [0.0, 0.5, 1.0]
    assert arrival_offsets(3, math.inf) == [0.0, 0.0, 0.0]
