"""Answer events, the output side of the wire: the final answer with its usage, timings and audit
trail, and the streaming deltas before it."""

from __future__ import annotations

from typing import Literal

import msgspec
from msgspec import Struct

from schemas.wire import SCHEMA_VERSION

FinishReason = Literal["stop", "length", "timeout", "cancelled", "error"]


class ErrorInfo(Struct, frozen=True):
    code: str
    message: str


class Usage(Struct, frozen=True):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens read from the prefix cache (OpenAI: prompt_tokens_details.cached_tokens)
    accepted_draft_tokens: int = 0  # completion tokens that came from speculative drafts (docs/speculative.md)


class Timings(Struct, frozen=True):
    queued_ms: float = 0.0
    ttft_ms: float | None = None
    e2e_ms: float = 0.0
    # Wall-clock ms since the epoch: when the engine took the question and when it ended (None when it
    # never reached an engine); finished_ms - started_ms is e2e_ms within a millisecond's rounding.
    started_ms: int | None = None
    finished_ms: int | None = None
    # Of queued_ms, the time its tenant was over a quota (tenants.<name>.max_tokens_per_second, max_in_flight)
    throttled_ms: float = 0.0


class Audit(Struct, frozen=True):
    """Where and how an answer was computed, for debugging isolation after the fact."""

    worker: str = ""
    channel: int | None = None
    blocks: tuple[int, ...] = ()
    steps: int = 0
    batch_sizes: tuple[int, ...] = ()
    routing_bucket: int | None = None
    adapter: str | None = None
    defaults_version: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens whose KV came from the (tenant-scoped) prefix cache
    # params.response_format that held the answer: its kind and the first 16 hex digits of its SHA-256
    # ("json_schema:3f2a..."); None when the answer was free text
    constraint: str | None = None
    ignored_fields: tuple[str, ...] = ()  # keys of the question Kev did not know (intake.unknown_fields: report)
    # speculative decoding: draft tokens verified for it, and those kept (each copied from its own tokens)
    drafted_tokens: int = 0
    accepted_draft_tokens: int = 0
    # Who asked (schemas/principal.py): "<verified key id>/<tenant>", or "unsigned/-"; "" when not known
    principal: str = ""
    # This worker's attempt at the question (a redelivered question is a new attempt): its deltas carry the same
    attempt: str = ""
    normalized: bool = False  # router.normalize changed the question's user text before it was tokenized


class TopLogprob(Struct, frozen=True):
    """One of the most likely tokens at an answer's place: its text (alone, as decoded), id and logprob."""

    token: str
    id: int
    logprob: float


class TokenLogprob(Struct, frozen=True, omit_defaults=True):
    """An answer token's logprob (params.logprobs) and the top alternatives there, most likely first."""

    token: str
    id: int
    logprob: float
    top: tuple[TopLogprob, ...] = ()


class AnswerEvent(Struct, frozen=True):
    question_id: str
    request_id: str | None = None
    text: str = ""
    token_ids: tuple[int, ...] = ()
    finish_reason: FinishReason = "stop"
    error: ErrorInfo | None = None
    usage: Usage = Usage()
    timings: Timings = Timings()
    audit: Audit = Audit()
    schema: int = SCHEMA_VERSION
    # True when text and token_ids were cut so the answer fits the broker's record size limit: the
    # answer is the beginning of what was generated (usage still counts every token).
    truncated: bool = False
    # True when the answer had a response_format and ended before its grammar was complete (max_new_tokens,
    # a stop string, a timeout): the text does not parse as asked.
    incomplete: bool = False
    # Which of the question's params.n samples this is (0..n-1); each sample is an answer event of its own.
    index: int = 0
    # One per token of token_ids, when params.logprobs asked (cut with them when the answer is truncated).
    logprobs: tuple[TokenLogprob, ...] | None = None


class AnswerDelta(Struct, frozen=True):
    question_id: str
    seq: int
    text: str
    done: bool = False
    # The worker's attempt at the question (its answer's audit.attempt). A question redelivered to another
    # worker streams again under a new attempt, from seq 0: a reader relays one attempt's deltas only.
    attempt: str = ""
    index: int = 0  # the sample it belongs to (params.n); seq counts within the sample
    logprobs: tuple[TokenLogprob, ...] | None = None  # those of the tokens settled since the sample's last delta


_ANSWER_DECODER = msgspec.json.Decoder(AnswerEvent)
_DELTA_DECODER = msgspec.json.Decoder(AnswerDelta)


def decode_answer(raw: bytes | str) -> AnswerEvent:
    return _ANSWER_DECODER.decode(raw)


def decode_delta(raw: bytes | str) -> AnswerDelta:
    return _DELTA_DECODER.decode(raw)


def error_answer(question_id: str, request_id: str | None, code: str, message: str) -> AnswerEvent:
    return AnswerEvent(
        question_id=question_id,
        request_id=request_id,
        finish_reason="error",
        error=ErrorInfo(code=code, message=message),
    )
