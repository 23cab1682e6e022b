"""Routing buckets: which of `buckets` channel groups a question belongs to, by the configured strategy.

Inside one worker every question gets its own KV blocks whatever its bucket; the bucket is recorded
in the answer's audit so operators can see how a strategy spreads load. The keys are the ones the
producer-side partitioner (`consumers.publish.partitioner`, `kev route`) uses to pick a Kafka partition;
both come from `schemas.routing`, so the audit and the partition agree on what groups questions.
semantic_hash's bucket comes from the model's embedding layer (engine/routing_embedding.py), the same rule
`kev route` uses, handed in as `semantic`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from schemas import QuestionEvent
from schemas.routing import STRATEGIES, HashRing, RoutingStrategy, affinity_key, kafka_partition, prefix_key

__all__ = ["STRATEGIES", "Router", "jump_hash"]


class Router:
    def __init__(self, strategy: RoutingStrategy, buckets: int,
                 semantic: Callable[[QuestionEvent, int], int] | None = None):
        if strategy not in STRATEGIES:
            raise ValueError(f"router.strategy {strategy!r} is not one of {', '.join(STRATEGIES)}")
        if strategy == "semantic_hash" and semantic is None:
            raise ValueError("semantic_hash needs the model's embedding layer: pass semantic=EmbeddingHash(...)")
        self.semantic = semantic
        self.strategy = strategy
        self.buckets = buckets
        self._turn = itertools.count()
        self._ring = HashRing(buckets) if strategy == "consistent_hash" else None

    def bucket(self, question, num_prompt_tokens: int) -> int:
        if self.strategy == "round_robin":
            return next(self._turn) % self.buckets
        if self.strategy == "length_aware":  # one bucket per power-of-two length class (tokens are known here)
            return min(self.buckets - 1, num_prompt_tokens.bit_length())
        if self.strategy == "prefix_hash":  # the same system prompt / prompt start, however spaced or cased
            return kafka_partition(prefix_key(question).encode(), self.buckets)
        if self.strategy == "semantic_hash":
            return self.semantic(question, self.buckets)
        return self._ring.partition(affinity_key(question).encode())


def jump_hash(key: int, buckets: int) -> int:
    """Jump consistent hash (Lamping & Veach): growing `buckets` moves only 1/buckets of the keys."""
    b, j = -1, 0
    while j < buckets:
        b = j
        key = (key * 2862933555777941757 + 1) & 0xFFFFFFFFFFFFFFFF
        j = int((b + 1) * (1 << 31) / ((key >> 33) + 1))
    return b
