"""The producer-side partitioner: the documented key scheme, reproducible by any Kafka client."""

import random

import pytest
from aiokafka.partitioner import DefaultPartitioner
from aiokafka.partitioner import murmur2 as aiokafka_murmur2

from consumers.publish.partitioner import Partitioner
from schemas import Message, QuestionEvent
from schemas.routing import STRATEGIES, HashRing, kafka_partition, murmur2, prefix_key


def q(qid: str, prompt: str = "hi", **fields) -> QuestionEvent:
    return QuestionEvent(question_id=qid, prompt=prompt, **fields)


def test_murmur2_is_kafkas():
    rng = random.Random(7)
    keys = [b"", b"a", b"ab", b"abc", b"abcd", b"kev.questions", "ünïcode".encode()]
    keys += [rng.randbytes(rng.randrange(1, 40)) for _ in range(500)]
    for key in keys:
        assert murmur2(key) & 0x7FFFFFFF == aiokafka_murmur2(key) & 0x7FFFFFFF, key
        all_partitions = list(range(7))
        assert kafka_partition(key, 7) == DefaultPartitioner()(key, all_partitions, all_partitions)


def test_round_robin_cycles():
    partitioner = Partitioner("round_robin", 3)
    assert [partitioner.partition(q(f"q{i}")) for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_prefix_hash_keeps_a_system_prompt_on_one_partition():
    partitioner = Partitioner("prefix_hash", 8)
    systems = [f"You are assistant number {i}. Answer briefly." for i in range(4)]
    for system in systems:
        placed = {partitioner.partition(q(f"{system}-{i}", f"question {i}", system=system)) for i in range(50)}
        assert len(placed) == 1
    # The key is the same whether the system prompt comes as a field or as the first message,
    # and case or spacing does not split it.
    as_message = q("m", None, messages=(Message("system", "Be  TERSE."), Message("user", "hi")))
    assert prefix_key(as_message) == prefix_key(q("f", "other", system="be terse."))
    # A client that sends key=prefix_key with Kafka's default partitioner lands on the same partition.
    question = q("x", "hello", system=systems[0])
    assert partitioner.partition(question) == DefaultPartitioner()(prefix_key(question).encode(),
                                                                    list(range(8)), list(range(8)))
    # Without a system prompt, the start of the prompt is the key.
    long_start = "Summarise this contract. " * 20
    assert (partitioner.partition(q("a", long_start + "Clause 1")) ==
            partitioner.partition(q("b", long_start + "Clause 2")))


def test_prefix_hash_spreads_four_system_prompts_over_two_partitions():
    # The measurement setting (4 system prompts, 2 workers): both partitions get some.
    partitioner = Partitioner("prefix_hash", 2)
    placed = [partitioner.partition(q("x", "hi", system=f"System prompt {i}: you are agent {i}.")) for i in range(4)]
    assert set(placed) == {0, 1}, placed


# Where the text hash put these questions when it was called semantic_hash (HEAD 14a63d8), by partition count;
# the refunds at 16 are issue 40's: 4 and 7, 4 and 12.
BEFORE_THE_RENAME = {
    2: [0, 0, 1, 1, 0, 1, 0, 0, 0, 1, 0, 0],
    4: [2, 2, 3, 3, 2, 1, 0, 0, 0, 3, 0, 0],
    8: [2, 2, 3, 3, 6, 5, 4, 4, 4, 7, 4, 0],
    16: [2, 2, 11, 11, 6, 5, 4, 12, 4, 7, 12, 8],
    64: [34, 34, 43, 43, 22, 37, 4, 44, 52, 23, 12, 40],
}


def fixed_questions() -> list[QuestionEvent]:
    return [
        q("a", "Why is the sky blue?"), q("b", "why is the   SKY blue?"),
        q("c", "hi", system="You are a travel agent."), q("d", "other", system="you are a  TRAVEL agent."),
        q("e", None, messages=(Message("system", "Be terse."), Message("user", "hi"))),
        q("f", "Summarise this contract. " * 20 + "Clause 1"),
        q("g", "怎么退款"), q("h", "如何退款"),
        q("i", "How do I get a refund?"), q("j", "How can I get my money back?"),
        q("k", None, messages=(Message("user", "first"), Message("assistant", "ok"), Message("user", "second"))),
        q("l", ""),
    ]


def test_prefix_hash_routes_exactly_as_the_text_hash_did_before_the_rename():
    for partitions, expected in BEFORE_THE_RENAME.items():
        partitioner = Partitioner("prefix_hash", partitions)
        assert [partitioner.partition(question) for question in fixed_questions()] == expected, partitions


def test_semantic_hash_without_the_embedding_layer_is_refused_naming_prefix_hash():
    with pytest.raises(ValueError, match="prefix_hash"):
        Partitioner("semantic_hash", 4)


def test_length_aware_keeps_long_prompts_off_short_prompts_partitions():
    partitioner = Partitioner("length_aware", 6)
    short = {partitioner.partition(q(f"s{i}", "x" * 100)) for i in range(200)}
    medium = {partitioner.partition(q(f"m{i}", "x" * 1000)) for i in range(200)}
    long = {partitioner.partition(q(f"l{i}", "x" * 5000)) for i in range(200)}
    assert short == {0, 1} and medium == {2, 3} and long == {4, 5}
    two = Partitioner("length_aware", 2)  # fewer partitions than classes: long prompts still alone
    assert {two.partition(q(f"s{i}", "x" * 100)) for i in range(50)} == {0}
    assert {two.partition(q(f"l{i}", "x" * 5000)) for i in range(50)} == {1}


def test_consistent_hash_moves_few_keys_when_a_partition_is_added():
    keys = [f"tenant-{i}".encode() for i in range(20_000)]
    before, after = HashRing(8), HashRing(9)
    moved = sum(before.partition(k) != after.partition(k) for k in keys) / len(keys)
    modulo_moved = sum(kafka_partition(k, 8) != kafka_partition(k, 9) for k in keys) / len(keys)
    print(f"\nconsistent_hash 8->9 partitions: {moved:.1%} of keys moved (murmur2 % n: {modulo_moved:.1%})")
    assert moved < 0.2  # ideal 1/9 = 11%
    assert modulo_moved > 0.8
    # Keys that move only move to the new partition.
    assert all(after.partition(k) in (before.partition(k), 8) for k in keys[:2000])
    # Load is roughly even.
    counts = [0] * 8
    for k in keys:
        counts[before.partition(k)] += 1
    assert max(counts) < 2 * min(counts), counts


def test_consistent_hash_keeps_a_tenant_together():
    partitioner = Partitioner("consistent_hash", 5)
    assert len({partitioner.partition(q(f"q{i}", tenant="acme")) for i in range(30)}) == 1


def test_every_strategy_in_range_and_bad_input_refused():
    for strategy in set(STRATEGIES) - {"semantic_hash"}:  # test_routing_embedding.py: semantic_hash's
        partitioner = Partitioner(strategy, {0, 1, 2})  # partitions_for() returns a set
        assert all(0 <= partitioner.partition(q(f"q{i}", "w" * (i * 37))) < 3 for i in range(200))
    with pytest.raises(ValueError, match="round_robin"):
        Partitioner("random", 3)
    with pytest.raises(ValueError, match="at least one"):
        Partitioner("round_robin", 0)
