"""Routing keys: which partition a question belongs on, by strategy. Pure, stdlib only.

This is part of the wire contract, so any Kafka client can reproduce it: every partition choice
is Kafka's own default-partitioner arithmetic, `(murmur2(key) & 0x7fffffff) % n`, applied to a
documented key, except round_robin (a counter) and consistent_hash (a ring built from the same
murmur2). `consumers.publish.partitioner` applies it to a topic; `engine.schedule.routing` uses the same keys for
the audit bucket. Lives in `schemas` because both of them may import it and nothing else is shared.

semantic_hash is the one strategy not computed here: it hashes the question's vector from the model's
embedding layer (engine/routing_embedding.py), so only a process holding the model's files can compute
it, and it reaches the partitioner as a callable. The hash of the system prompt's text is prefix_hash.
"""

from __future__ import annotations

import bisect
import re
from typing import Literal, get_args

RoutingStrategy = Literal["round_robin", "length_aware", "prefix_hash", "semantic_hash", "consistent_hash"]
STRATEGIES = get_args(RoutingStrategy)
PREFIX_CHARS = 256  # prefix_hash without a system prompt: this much of the prompt's start is the key
LENGTH_BOUNDS = (512, 2048)  # length_aware classes, in prompt characters: < 512, < 2048, the rest
VIRTUAL_NODES = 64  # points per partition on the consistent-hash ring


def murmur2(data: bytes) -> int:
    """Kafka's murmur2 (org.apache.kafka.common.utils.Utils.murmur2), as an unsigned 32-bit int."""
    m, length = 0x5BD1E995, len(data)
    h = (0x9747B28C ^ length) & 0xFFFFFFFF
    for i in range(0, length - length % 4, 4):
        k = int.from_bytes(data[i:i + 4], "little")
        k = (k * m) & 0xFFFFFFFF
        k ^= k >> 24
        k = (k * m) & 0xFFFFFFFF
        h = ((h * m) & 0xFFFFFFFF) ^ k
    tail = data[length - length % 4:]
    if tail:
        for shift, byte in reversed(list(enumerate(tail))):
            h ^= byte << (8 * shift)
        h = (h * m) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * m) & 0xFFFFFFFF
    return h ^ (h >> 15)


def kafka_partition(key: bytes, num_partitions: int) -> int:
    """What Kafka's default partitioner (Java, librdkafka's murmur2_random, aiokafka) picks for `key`."""
    return (murmur2(key) & 0x7FFFFFFF) % num_partitions


def prompt_text(question) -> str:
    """The question's text as one string: its prompt, or its messages' contents in order."""
    if question.prompt is not None:
        return question.prompt
    return "\n".join(message.content for message in question.messages or ())


def prefix_key(question) -> str:
    """prefix_hash's key: the normalised system prompt, else the normalised start of the prompt.

    Questions that share a system prompt share a KV prefix; on one partition (one worker) a prefix
    cache can serve it once. Case and runs of whitespace do not split a group.
    """
    system = question.system
    if system is None:
        system = next((m.content for m in question.messages or () if m.role == "system"), None)
    if system:
        return "system:" + _normalise(system)
    return "prompt:" + _normalise(prompt_text(question))[:PREFIX_CHARS]


def affinity_key(question) -> str:
    """consistent_hash's key: the tenant (a tenant's questions stay together), else the question id."""
    return question.tenant or question.question_id


def length_class(question, bounds: tuple[int, ...] = LENGTH_BOUNDS) -> int:
    """length_aware's class: how many of `bounds` the prompt's character count reaches (0 = shortest)."""
    return bisect.bisect_right(bounds, len(prompt_text(question)))


def class_partitions(length_class_: int, classes: int, num_partitions: int) -> range:
    """The partitions of one length class: an even, contiguous share; at least one partition each.

    With fewer partitions than classes, neighbouring classes share (short with medium, long alone
    on the last partition), so the longest prompts still never land with the shortest.
    """
    start = length_class_ * num_partitions // classes
    end = (length_class_ + 1) * num_partitions // classes
    start = min(start, num_partitions - 1)
    return range(start, max(end, start + 1))


class HashRing:
    """Partitions on a ring of murmur2 points, `vnodes` each; a key goes to the next point clockwise.

    Adding a partition takes over only the arcs its new points cut, about 1/(n+1) of the keys; the
    default `murmur2 % n` would move about n/(n+1) of them.
    """

    def __init__(self, num_partitions: int, vnodes: int = VIRTUAL_NODES) -> None:
        if num_partitions < 1 or vnodes < 1:
            raise ValueError(f"need num_partitions >= 1 and vnodes >= 1, got {num_partitions}, {vnodes}")
        points = sorted((murmur2(f"partition-{p}#{v}".encode()), p)
                        for p in range(num_partitions) for v in range(vnodes))
        self._hashes = [h for h, _ in points]
        self._owners = [p for _, p in points]

    def partition(self, key: bytes) -> int:
        at = bisect.bisect_left(self._hashes, murmur2(key))
        return self._owners[at % len(self._owners)]


def _normalise(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()
