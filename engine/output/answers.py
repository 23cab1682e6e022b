"""AnswerEvents: a finished question's text, tokens, usage, timings and audit, or an error answer."""

from __future__ import annotations

import time

import msgspec

from engine.intake import QuestionRejected
from engine.output.detokenizer import TextStream
from engine.output.logprobs import TokenTexts
from engine.sequence import Sequence, Status
from schemas import AnswerEvent, Audit, ErrorInfo, QuestionEvent, Timings, Usage, error_answer


def finished_answer(question: QuestionEvent, seq: Sequence, stream: TextStream, worker: str,
                    texts: TokenTexts) -> AnswerEvent:
    """The answer of a question's sample that ended in the engine; `stream` has had its last token."""
    # A stop string's tokens are not part of the answer: token_ids and usage count what `text` keeps.
    output_ids = tuple(seq.output_ids[:stream.kept_tokens] if stream.stopped else seq.output_ids)
    return AnswerEvent(
        question_id=question.question_id,
        index=seq.sample,
        logprobs=None if seq.logprobs is None else texts.wire(seq.logprobs[:len(output_ids)]),
        request_id=question.request_id,
        error=_error(seq),
        text=stream.text,
        token_ids=output_ids,
        finish_reason=seq.status.finish_reason,
        usage=Usage(prompt_tokens=seq.num_prompt_tokens, completion_tokens=len(output_ids),
                    cached_prompt_tokens=seq.cached_prompt_tokens,
                    accepted_draft_tokens=_accepted_drafts(seq, len(output_ids))),
        timings=_timings(seq),
        audit=Audit(worker=worker, channel=seq.channel, blocks=seq.audit_blocks,
                    steps=seq.steps, batch_sizes=_compact(seq.batch_sizes), adapter=seq.adapter,
                    routing_bucket=seq.routing_bucket, normalized=seq.normalized,
                    defaults_version=seq.params.defaults_version,
                    cached_prompt_tokens=seq.cached_prompt_tokens,
                    constraint=seq.constraint.spec.label if seq.constraint is not None else None,
                    ignored_fields=seq.ignored_fields,
                    drafted_tokens=seq.drafted_tokens, accepted_draft_tokens=seq.accepted_draft_tokens),
        incomplete=_incomplete(seq, stream),
    )


def _accepted_drafts(seq: Sequence, completion_tokens: int) -> int:
    """Accepted drafts among the tokens the answer keeps (a stop string may cut some off the end)."""
    return min(seq.accepted_draft_tokens, completion_tokens)


def rejected_answers(question: QuestionEvent, exc: QuestionRejected) -> list[AnswerEvent]:
    """The error answers of a question that never ran, one per sample: taken and ended in the same instant."""
    now = round(time.time() * 1000)
    answer = error_answer(question.question_id, question.request_id, exc.code, exc.message)
    return [msgspec.structs.replace(answer, timings=Timings(started_ms=now, finished_ms=now), index=index)
            for index in range(question.params.n)]


def _incomplete(seq: Sequence, stream: TextStream) -> bool:
    """A constrained answer that does not parse as asked: it ended before its grammar was complete
    (max_new_tokens, a timeout, a cancel), or a stop string cut its text."""
    constraint = seq.constraint
    if constraint is None:
        return False
    return stream.stopped or constraint.failed is not None or not constraint.accepting


def _error(seq: Sequence) -> ErrorInfo | None:
    if seq.status == Status.ERROR and seq.constraint is not None and seq.constraint.failed:
        return ErrorInfo("constraint_failed", seq.error or seq.constraint.failed)
    if seq.status == Status.ERROR:
        return ErrorInfo(seq.error_code or "internal_error", seq.error or "")
    if seq.status == Status.TIMEOUT and seq.error:  # never computed: say why the answer is empty
        return ErrorInfo(seq.error_code or "deadline_expired", seq.error)
    return None


def _timings(seq: Sequence) -> Timings:
    """Milliseconds from when the question reached this worker (`arrival`), not from its publish time:
    queued_ms until it was first admitted to the batch (0 if never; throttled_ms of it over its tenant's
    quotas), ttft_ms until its first token,
    e2e_ms until it ended; started_ms and finished_ms are those two instants since the epoch. Its
    deadline, unlike these, counts from the publish time."""

    def ms(t):
        return None if t is None else round((t - seq.arrival) * 1000, 3)

    # The stamps are monotonic readings moved onto the wall clock by one offset, read once: a wall-clock
    # step between them (NTP) cannot make finished_ms - started_ms differ from e2e_ms.
    to_wall = time.time() - time.monotonic()

    def epoch_ms(t):
        return None if t is None else round((t + to_wall) * 1000)

    return Timings(queued_ms=ms(seq.admitted_at) or 0.0, ttft_ms=ms(seq.first_token_at),
                   e2e_ms=ms(seq.finished_at) or 0.0,
                   started_ms=epoch_ms(seq.arrival), finished_ms=epoch_ms(seq.finished_at),
                   throttled_ms=round(seq.throttled_s * 1000, 3))


def _compact(sizes: list[int]) -> tuple[int, ...]:
    """Batch sizes seen, one entry per change, so a long answer's audit stays short."""
    out: list[int] = []
    for size in sizes:
        if not out or out[-1] != size:
            out.append(size)
    return tuple(out)
