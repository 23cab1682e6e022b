"""Which reply topics not to try now: an illegal name, or one the broker refused a moment ago.

A reply topic is where a signed question's replies go, and nowhere else: a topic that cannot be used
is never swapped for another (any other topic is one that a different principal may read). Not trying
it only makes its records fail fast to their fallback (a dead letter without the answer's text), so a
topic the broker just refused does not hold each of its answers for the question's whole deadline.
"""

from __future__ import annotations

import re

import anyio

_MAX_AVOIDED = 1024  # reply topics remembered as refused; the oldest is forgotten first
_LEGAL_TOPIC = re.compile(r"[A-Za-z0-9._-]{1,249}")


class UnusableReplyTopic(Exception):
    """A reply topic not tried: its record's fallback ends the question at once."""


class ReplyTopics:
    def __init__(self, avoid_s: float) -> None:
        self.avoid_s = avoid_s
        self._avoided: dict[str, float] = {}  # refused reply topic -> until when its records fail fast

    def unusable(self, topic: str) -> UnusableReplyTopic | None:
        """Why `topic` is not to be tried now, or None to try it."""
        if not _LEGAL_TOPIC.fullmatch(topic):
            # aiokafka would retry an illegal name's metadata for request_timeout_ms (40 s) first.
            return UnusableReplyTopic("not a legal topic name")
        if (left := self._avoided_for(topic)) > 0:
            return UnusableReplyTopic(f"refused by the broker a moment ago; tried again in {left:.1f}s")
        return None

    def avoid(self, topic: str) -> None:
        """The broker refused `topic`: its records fail fast for `avoid_s`."""
        self._avoided.pop(topic, None)
        while len(self._avoided) >= _MAX_AVOIDED:
            del self._avoided[next(iter(self._avoided))]
        self._avoided[topic] = anyio.current_time() + self.avoid_s

    def _avoided_for(self, topic: str) -> float:
        until = self._avoided.get(topic)
        if until is None:
            return 0.0
        if until <= anyio.current_time():
            del self._avoided[topic]  # the topic may have been created or allowed since: try it again
            return 0.0
        return until - anyio.current_time()
