"""Routing buckets: each strategy spreads questions as documented, and is stable where it promises."""

import pytest

from engine.schedule.routing import STRATEGIES, Router, jump_hash
from schemas import QuestionEvent


def q(qid: str, prompt: str = "hi", tenant: str | None = None) -> QuestionEvent:
    return QuestionEvent(question_id=qid, prompt=prompt, tenant=tenant)


def test_round_robin_cycles_through_every_bucket():
    router = Router("round_robin", buckets=4)
    assert [router.bucket(q(f"q{i}"), 10) for i in range(6)] == [0, 1, 2, 3, 0, 1]


def test_length_aware_groups_by_power_of_two_length():
    router = Router("length_aware", buckets=64)
    assert router.bucket(q("a"), 100) == router.bucket(q("b"), 120) != router.bucket(q("c"), 300)


def test_prefix_hash_ignores_case_and_spacing():
    router = Router("prefix_hash", buckets=1024)
    assert router.bucket(q("a", "Why is the  sky blue?"), 9) == router.bucket(q("b", "why is the sky blue?"), 9)


def test_prefix_hash_buckets_as_the_text_hash_did_before_the_rename():
    # HEAD 14a63d8's semantic_hash at 16 buckets: issue 40's refund pairs split, 4 and 7, 4 and 12.
    router = Router("prefix_hash", buckets=16)
    texts = ["How do I get a refund?", "How can I get my money back?", "怎么退款", "如何退款"]
    assert [router.bucket(q(f"q{i}", text), 9) for i, text in enumerate(texts)] == [4, 7, 4, 12]


def test_semantic_hash_needs_the_embedding_layer():
    with pytest.raises(ValueError, match="embedding"):
        Router("semantic_hash", buckets=8)


def test_consistent_hash_keeps_a_tenant_together_and_moves_few_keys_when_growing():
    router = Router("consistent_hash", buckets=16)
    assert router.bucket(q("a", tenant="acme"), 5) == router.bucket(q("b", tenant="acme"), 50)
    moved = sum(jump_hash(key, 16) != jump_hash(key, 17) for key in range(10_000))
    assert moved < 10_000 * 2 / 17  # about 1/17 of the keys move, never a reshuffle


def test_every_strategy_stays_in_range_and_unknown_ones_are_refused():
    for strategy in set(STRATEGIES) - {"semantic_hash"}:  # test_routing_embedding.py: semantic_hash's
        router = Router(strategy, buckets=8)
        assert all(0 <= router.bucket(q(f"q{i}", f"text {i}"), i * 37) < 8 for i in range(200))
    with pytest.raises(ValueError, match="round_robin"):
        Router("random", buckets=8)


def test_config_maps_routing_and_default_deadline_and_shared_isolation():
    from engine import EngineOptions
    from schemas import config_from_dict

    options = EngineOptions.from_config(config_from_dict(
        {"router": {"strategy": "semantic_hash", "buckets": 8}, "aggregator": {"timeout_ms": 1234}}))
    assert (options.routing_strategy, options.routing_buckets, options.default_timeout_ms) == ("semantic_hash", 8, 1234)
    shared = EngineOptions.from_config(config_from_dict({"isolation": {"level": "shared"}}))
    assert (shared.prefix_caching, shared.prefix_scope) == (True, "tenant")
    assert not EngineOptions.from_config(config_from_dict({})).prefix_caching


def test_config_maps_router_normalize():
    from engine import EngineOptions
    from schemas import config_from_dict

    assert EngineOptions.from_config(config_from_dict({"router": {"normalize": True}})).normalize
    assert not EngineOptions.from_config(config_from_dict({})).normalize
