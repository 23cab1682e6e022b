"""Where a question's answer goes: its `reply_topic` when that can be used, else the answers topic.

A reply topic with an illegal name, or one the broker refused a moment ago (avoided for `avoid_s`),
is not tried: its answers take the answers topic.
"""

from __future__ import annotations

import re

import anyio
import structlog

log = structlog.get_logger("kev.consumers.publisher")  # the publisher's lines, whichever of its modules writes them

_MAX_AVOIDED = 1024  # reply topics remembered as refused; the oldest is forgotten first
_LEGAL_TOPIC = re.compile(r"[A-Za-z0-9._-]{1,249}")


class ReplyTopics:
    def __init__(self, answers_topic: str, avoid_s: float) -> None:
        self.answers_topic = answers_topic
        self.avoid_s = avoid_s
        self._avoided: dict[str, float] = {}  # refused reply topic -> until when its answers take answers_topic

    def choose(self, requested: str | None) -> str:
        """The topic for an answer whose question asked for `requested`."""
        if requested is None or requested == self.answers_topic:
            return self.answers_topic
        if not _LEGAL_TOPIC.fullmatch(requested) or self._is_avoided(requested):
            # aiokafka would retry an illegal name's metadata for request_timeout_ms (40 s) first.
            log.warning("reply_topic_unusable", topic=requested[:300])
            return self.answers_topic
        return requested

    def avoid(self, topic: str) -> None:
        """The broker refused `topic`: answers take the answers topic for `avoid_s`."""
        self._avoided.pop(topic, None)
        while len(self._avoided) >= _MAX_AVOIDED:
            del self._avoided[next(iter(self._avoided))]
        self._avoided[topic] = anyio.current_time() + self.avoid_s

    def _is_avoided(self, topic: str) -> bool:
        until = self._avoided.get(topic)
        if until is not None and until <= anyio.current_time():
            del self._avoided[topic]  # the topic may have been created or allowed since: try it again
            return False
        return until is not None
