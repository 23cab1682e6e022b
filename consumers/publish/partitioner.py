"""The producer-side partitioner: which partition of the questions topic a question is sent to.

Any producer may use it (`kev route` does, so may the gateway or a client):

    partitioner = Partitioner("prefix_hash", num_partitions=await producer.partitions_for(topic))
    await producer.send(topic, value, key=question_id.encode(), partition=partitioner.partition(question))

The record key stays the question id (answers are keyed by it too); the partition is explicit.
Every rule but semantic_hash's is in `schemas.routing` and written out in docs/scale-out.md, so a client in
another language gets the same partition. semantic_hash needs the model's embedding layer, which this
package never loads: its caller passes `semantic`, a function of (question, partitions) to a partition
(engine.routing_embedding.EmbeddingHash, which `kev route` builds). One consumer group member owns each
partition, so "same partition" means "same worker" until a rebalance.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection

from schemas.routing import (
    LENGTH_BOUNDS,
    STRATEGIES,
    VIRTUAL_NODES,
    HashRing,
    affinity_key,
    class_partitions,
    kafka_partition,
    length_class,
    prefix_key,
)

Semantic = Callable[[object, int], int]  # (a schemas.QuestionEvent, partitions) -> its partition


class Partitioner:
    def __init__(self, strategy: str, num_partitions: int | Collection[int], *,
                 length_bounds: tuple[int, ...] = LENGTH_BOUNDS, vnodes: int = VIRTUAL_NODES,
                 semantic: Semantic | None = None) -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"router.strategy {strategy!r} is not one of {', '.join(STRATEGIES)}")
        if strategy == "semantic_hash" and semantic is None:
            raise ValueError("router.strategy semantic_hash routes by the model's embedding layer: pass semantic= "
                             "(engine.routing_embedding.EmbeddingHash); to route by a hash of the system prompt's "
                             "text, use prefix_hash")
        if not isinstance(num_partitions, int):  # aiokafka's partitions_for() gives a set of ids 0..n-1
            num_partitions = len(num_partitions)
        if num_partitions < 1:
            raise ValueError(f"a topic has at least one partition, got {num_partitions}")
        self.strategy = strategy
        self.num_partitions = num_partitions
        self.length_bounds = tuple(length_bounds)
        self.semantic = semantic
        self._turn = itertools.count()
        self._ring = HashRing(num_partitions, vnodes) if strategy == "consistent_hash" else None

    def partition(self, question) -> int:
        """The partition for `question` (a schemas.QuestionEvent)."""
        n = self.num_partitions
        if self.strategy == "round_robin":
            return next(self._turn) % n
        if self.strategy == "prefix_hash":
            return kafka_partition(prefix_key(question).encode(), n)
        if self.strategy == "semantic_hash":
            return self.semantic(question, n)
        if self.strategy == "consistent_hash":
            return self._ring.partition(affinity_key(question).encode())
        # length_aware: the class picks a contiguous set of partitions, the question id spreads within it.
        share = class_partitions(length_class(question, self.length_bounds), len(self.length_bounds) + 1, n)
        return share[kafka_partition(question.question_id.encode(), len(share))]

    def fallback(self, question_id: str | None) -> int:
        """For an event that is not a valid question but names its id: where the worker will answer it."""
        return kafka_partition((question_id or "").encode(), self.num_partitions)
