"""Routing buckets: which of `buckets` channels-groups a question belongs to, by the configured strategy.

Inside one worker every question gets its own KV blocks whatever its bucket; the bucket is recorded
in the answer's audit so operators can see how a strategy spreads load (and producers can use the
same function to pick a Kafka partition key).
"""

from __future__ import annotations

import hashlib
import itertools
import re

STRATEGIES = ("round_robin", "length_aware", "semantic_hash", "consistent_hash")


class Router:
    def __init__(self, strategy: str = "round_robin", buckets: int = 64):
        if strategy not in STRATEGIES:
            raise ValueError(f"router.strategy {strategy!r} is not one of {', '.join(STRATEGIES)}")
        self.strategy = strategy
        self.buckets = buckets
        self._turn = itertools.count()

    def bucket(self, question, num_prompt_tokens: int) -> int:
        if self.strategy == "round_robin":
            return next(self._turn) % self.buckets
        if self.strategy == "length_aware":  # one bucket per power-of-two length class
            return min(self.buckets - 1, num_prompt_tokens.bit_length())
        if self.strategy == "semantic_hash":  # the same question, however spaced or cased, lands together
            return _hash(_normalise(question.prompt or " ".join(m.content for m in question.messages or ()))) % self.buckets
        return jump_hash(_hash(question.tenant or question.question_id), self.buckets)


def jump_hash(key: int, buckets: int) -> int:
    """Jump consistent hash (Lamping & Veach): growing `buckets` moves only 1/buckets of the keys."""
    b, j = -1, 0
    while j < buckets:
        b = j
        key = (key * 2862933555777941757 + 1) & 0xFFFFFFFFFFFFFFFF
        j = int((b + 1) * (1 << 31) / ((key >> 33) + 1))
    return b


def _normalise(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")
