"""The trust boundary for a question's server-side fields: who may set tenant, cache_salt, priority,
reply_topic and a long timeout_ms.

A record signed for this topic and record key by a configured key whose scopes hold `questions`
(schemas/signing.py, purpose QUESTION) is trusted and keeps them. Anyone else who can produce to the
questions topic must not read another tenant's prefix cache, jump the queue, pick where answers go,
or hold a partition's commit position for a day, so an untrusted record (unsigned; forged: signed by
no configured key, for another topic or key, or by scheme v1; out_of_scope: by a key that may not sign
questions) is, per `kafka.trust.unsigned_questions`:

- clear: served with tenant, cache_salt and reply_topic None, priority 0, timeout_ms capped at
  `max_unsigned_timeout_ms`
- refuse: not served; the asker gets an error answer with code "unsigned"

A signed question whose signing time (`kev-signed-at`, part of what is signed) is further than
`kafka.trust.max_age_ms` from this worker's clock, older or ahead, is refused with error answer
`stale_signature` whatever the mode: a signed record published again later gets no fresh deadline
(replays within that age on the same partition are the ledger's duplicates).

A signed question's reply_topic must fullmatch `reply_topic_pattern`; one that does not is refused
with error answer `reply_topic_refused` (on the answers topic, no text): answered there in full, a
tenant's answer would be readable by every principal of the shared topic. An untrusted question's
reply_topic is cleared with its other server-side fields. One log line per untrusted record: a warning for
a forged or out-of-scope signature (with the key id it named and the reason), info when fields were
cleared, debug otherwise.

A producer publishing through `kev route` signs for the questions topic (where the question is
answered), not the router's intake topic: the router forwards the record unchanged.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import structlog

from schemas import QuestionEvent, TrustConfig
from schemas.signing import QUESTION, Headers, Verification, Verifier

log = structlog.get_logger("kev.consumers.intake.trust")


@dataclass(frozen=True)
class Admitted:
    """A question as it may be served (server-side fields cleared where not trusted), or refused."""

    question: QuestionEvent
    verification: Verification
    refused: str | None = None  # the error message for the asker, when refused
    code: str = "unsigned"  # the error answer's code, when refused: unsigned | stale_signature | reply_topic_refused


class QuestionGate:
    def __init__(self, trust: TrustConfig, now_ms: Callable[[], float] = lambda: time.time() * 1000) -> None:
        self.trust = trust
        self.verifier = Verifier.from_config(trust)  # reads keys_file once; a bad key fails the start
        self.reply_topic = re.compile(trust.reply_topic_pattern)
        self.now_ms = now_ms

    def admit(self, question: QuestionEvent, value: bytes, headers: Headers, bound=log, *, topic: str = "",
              key: bytes | None = None) -> Admitted:
        """The question as it may be served, given the record's value, headers, topic and key (what its
        signature binds)."""
        verification = self.verifier.verify(QUESTION, topic, key, value, headers)
        if verification.trusted and (stale := self._stale(verification.stamp)) is not None:
            bound.warning("question.stale_signature", question_id=question.question_id, key_id=verification.key_id,
                          age_ms=stale, max_age_ms=self.trust.max_age_ms)
            return Admitted(question, verification, code="stale_signature", refused=(
                f"the question was signed {_age(stale)}, beyond kafka.trust.max_age_ms ({self.trust.max_age_ms} ms): "
                f"a signed question is served only near the time it was signed (publish it again, signed now)"))
        if not verification.trusted and self.trust.unsigned_questions == "refuse":
            self._log(bound, verification, question, refused=True)
            return Admitted(question, verification, refused=(
                f"this topic takes signed questions only (kafka.trust.unsigned_questions: refuse); "
                f"the question was {verification.verdict}"
                + (f" ({verification.reason})" if verification.verdict != "unsigned" else "")))
        if verification.trusted and question.reply_topic is not None \
                and not self.reply_topic.fullmatch(question.reply_topic):
            # Not cleared: its answer would then go to the shared answers topic, which other principals read.
            bound.warning("question.reply_topic_refused", question_id=question.question_id,
                          reply_topic=question.reply_topic[:100], pattern=self.trust.reply_topic_pattern)
            return Admitted(question, verification, code="reply_topic_refused", refused=(
                f"reply_topic {question.reply_topic[:100]!r} does not match kafka.trust.reply_topic_pattern "
                f"({self.trust.reply_topic_pattern}): a signed question is answered on its own reply topic or not "
                f"at all"))
        changes = {} if verification.trusted else self._untrusted_changes(question)
        if not verification.trusted:
            self._log(bound, verification, question, cleared=sorted(changes))
        if changes:
            question = msgspec.structs.replace(question, **changes)
        return Admitted(question, verification)

    def _stale(self, signed_at: int | None) -> int | None:
        """How far the signing time is from now (ms; negative: ahead), when beyond max_age_ms; else None."""
        age = int(self.now_ms()) - (signed_at or 0)
        return age if abs(age) > self.trust.max_age_ms else None

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
        if verification.verdict in ("forged", "out_of_scope"):
            event = "question.forged_signature" if verification.verdict == "forged" else "question.out_of_scope"
            bound.warning(event, key_id=verification.key_id, reason=verification.reason, **fields)
        elif cleared or refused:
            bound.info("question.untrusted", **fields)
        else:
            bound.debug("question.untrusted", **fields)


def _age(age_ms: int) -> str:
    return f"{age_ms / 1000:.0f} s ago" if age_ms >= 0 else f"{-age_ms / 1000:.0f} s ahead of this worker's clock"
