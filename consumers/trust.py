"""The trust boundary for a question's server-side fields: who may set tenant, cache_salt, priority,
reply_topic and a long timeout_ms.

A record signed by a configured key (schemas/signing.py, purpose QUESTION) is trusted and keeps them.
Anyone else who can produce to the questions topic must not read another tenant's prefix cache,
jump the queue, pick where answers go, or hold a partition's commit position for a day, so an
untrusted record (unsigned, or signed by no configured key: forged) is, per
`kafka.trust.unsigned_questions`:

- clear: served with tenant, cache_salt and reply_topic None, priority 0, timeout_ms capped at
  `max_unsigned_timeout_ms`
- refuse: not served; the asker gets an error answer with code "unsigned"

Every reply_topic, trusted or not, must also fullmatch `reply_topic_pattern`; one that does not is
cleared and the answer goes to the answers topic. One log line per untrusted record: a warning for
a forged signature (with the key id it named), info when fields were cleared, debug otherwise.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import msgspec
import structlog

from schemas import QuestionEvent, TrustConfig
from schemas.signing import QUESTION, Headers, Verification, Verifier

log = structlog.get_logger("kev.consumers.trust")


@dataclass(frozen=True)
class Admitted:
    """A question as it may be served (server-side fields cleared where not trusted), or refused."""

    question: QuestionEvent
    verification: Verification
    refused: str | None = None  # the error message for the asker, when refused


class QuestionGate:
    def __init__(self, trust: TrustConfig) -> None:
        self.trust = trust
        self.verifier = Verifier.from_config(trust)  # reads keys_file once; a bad key fails the start
        self.reply_topic = re.compile(trust.reply_topic_pattern)

    def admit(self, question: QuestionEvent, value: bytes, headers: Headers, bound=log) -> Admitted:
        verification = self.verifier.verify(value, headers, QUESTION)
        if not verification.trusted and self.trust.unsigned_questions == "refuse":
            self._log(bound, verification, question, refused=True)
            return Admitted(question, verification, refused=(
                f"this topic takes signed questions only (kafka.trust.unsigned_questions: refuse); "
                f"the question was {verification.verdict}"))
        changes = {} if verification.trusted else self._untrusted_changes(question)
        if question.reply_topic is not None and "reply_topic" not in changes \
                and not self.reply_topic.fullmatch(question.reply_topic):
            changes["reply_topic"] = None
            bound.info("question.reply_topic_refused", question_id=question.question_id,
                       reply_topic=question.reply_topic[:100], pattern=self.trust.reply_topic_pattern)
        if not verification.trusted:
            self._log(bound, verification, question, cleared=sorted(changes))
        if changes:
            question = msgspec.structs.replace(question, **changes)
        return Admitted(question, verification)

    def _untrusted_changes(self, question: QuestionEvent) -> dict:
        """The server-side fields an untrusted question set, with what it gets instead."""
        changes: dict = {name: None for name in ("tenant", "cache_salt", "reply_topic")
                         if getattr(question, name) is not None}
        if question.priority != 0:
            changes["priority"] = 0
        ceiling = self.trust.max_unsigned_timeout_ms
        if question.timeout_ms is not None and question.timeout_ms > ceiling:
            changes["timeout_ms"] = ceiling
        return changes

    @staticmethod
    def _log(bound, verification: Verification, question: QuestionEvent, *, cleared=(), refused=False) -> None:
        fields = {"question_id": question.question_id, "verdict": verification.verdict,
                  **({"refused": True} if refused else {"cleared": cleared})}
        if verification.verdict == "forged":
            bound.warning("question.forged_signature", key_id=verification.key_id, **fields)
        elif cleared or refused:
            bound.info("question.untrusted", **fields)
        else:
            bound.debug("question.untrusted", **fields)
