"""`KeptAnswers`: the final answers of streams that had to end with a `stream_restarted` error, kept a
short while so their client can still fetch the whole answer by the stream's id:

    GET /v1/chat/completions/{id}     GET /v1/completions/{id}     (the same API key as the stream's)

A question redelivered to a second worker (its first died mid-answer) is computed again; if the new
answer does not extend the text already streamed, the stream cannot go on without splicing two
answers, so it ends with the error and the answer waits here. Kept for KEEP_S, at most MAX_KEPT answers
and MAX_KEPT_BYTES in all, the oldest dropped first; only for the tenant that asked (anonymous callers
share one scope: the id's 128 random bits are what keeps theirs apart). In memory, in the gateway
process that served the stream: with `--processes N`, fetch it on the same connection.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from schemas import AnswerEvent

KEEP_S = 300.0
MAX_KEPT = 256
MAX_KEPT_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class KeptAnswer:
    tenant: str | None
    answer: AnswerEvent
    model: str
    created: int
    chat: bool
    until: float  # monotonic seconds
    size: int


class KeptAnswers:
    def __init__(self, *, keep_s: float = KEEP_S, max_count: int = MAX_KEPT, max_bytes: int = MAX_KEPT_BYTES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.keep_s, self.max_count, self.max_bytes, self._clock = keep_s, max_count, max_bytes, clock
        self._kept: OrderedDict[str, KeptAnswer] = OrderedDict()
        self._bytes = 0

    def keep(self, answer_id: str, answer: AnswerEvent, *, tenant: str | None, model: str, created: int,
             chat: bool) -> bool:
        """Keep it (True), unless it alone is larger than the whole store."""
        size = len(answer.text.encode()) + 8 * len(answer.token_ids) + 512  # what it costs in memory, roughly
        if size > self.max_bytes:
            return False
        self._forget(answer_id)
        self._kept[answer_id] = KeptAnswer(tenant, answer, model, created, chat, self._clock() + self.keep_s, size)
        self._bytes += size
        self._expire()
        return True

    def get(self, answer_id: str, tenant: str | None) -> KeptAnswer | None:
        self._expire()
        kept = self._kept.get(answer_id)
        return kept if kept is not None and kept.tenant == tenant else None

    def _expire(self) -> None:
        now = self._clock()
        while self._kept and (len(self._kept) > self.max_count or self._bytes > self.max_bytes
                              or next(iter(self._kept.values())).until <= now):
            self._forget(next(iter(self._kept)))

    def _forget(self, answer_id: str) -> None:
        kept = self._kept.pop(answer_id, None)
        if kept is not None:
            self._bytes -= kept.size
