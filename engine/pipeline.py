"""IsolatedBatchPipeline: answer a list of questions in packed forwards, each as if it were alone."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from engine.core import EngineCore
from engine.intake import QuestionRejected
from engine.options import EngineOptions
from engine.output.answers import rejected_answers
from engine.prompt import as_question
from schemas import AnswerEvent, QuestionEvent

Answer = AnswerEvent  # text, token_ids, finish_reason, usage, timings, audit


class Answers(list):
    """`run`'s answers in input order, that also answer as a mapping from each question's index (0..n-1):
    `answers.items()`, `answers.get(i)`, as seed 000's aggregator reads them."""

    def keys(self) -> range:
        return range(len(self))

    def values(self) -> list:
        return list(self)

    def items(self) -> list[tuple[int, object]]:
        return list(enumerate(self))

    def get(self, index: int, default=None):
        return self[index] if isinstance(index, int) and 0 <= index < len(self) else default


class IsolatedBatchPipeline:
    """Blocking, one call at a time: `run(questions, **params) -> Answers` in input order."""

    def __init__(self, model, *, max_batch_size: int = EngineOptions.max_parallel_queries,
                 kv_slot_capacity: int | None = None,
                 early_stop: bool = EngineOptions.early_stop, options: EngineOptions | None = None, **option_overrides):
        options = options or EngineOptions()
        # the seeds' names for router.max_parallel_queries and kv_cache.capacity_tokens, mapped here once
        self.options = dataclasses.replace(options, max_parallel_queries=max_batch_size,
                                           capacity_tokens=kv_slot_capacity or options.capacity_tokens,
                                           early_stop=early_stop, batch_window_ms=0.0, max_waiting=1 << 30,
                                           overflow_policy="queue", **option_overrides)
        self.core = EngineCore(model, self.options)

    def run(self, questions, **params) -> Answers:
        """Strings, dicts or QuestionEvents; `params` (max_new_tokens, temperature, ...) fill in defaults.
        Keys Kev does not know go as intake.unknown_fields says (engine/prompt.py): reported in each
        answer's audit.ignored_fields and logged, or refused with QuestionRejected before anything runs."""
        questions = self._questions(questions, params)
        answers = {(a.question_id, a.index): a for a in self._answers(questions)}  # (question id, sample)
        # In the questions' order; a question with params.n has its n answers side by side, by index.
        return Answers(answers[q.question_id, i] for q in questions for i in range(q.params.n))

    def as_completed(self, questions, **params) -> Iterator[Answer]:
        """As `run`, each answer yielded the step it finishes (a refused question's first), so a caller can
        show the short ones while the long ones still decode."""
        return self._answers(self._questions(questions, params))

    def _questions(self, questions, params: dict) -> list[QuestionEvent]:
        policy = self.options.unknown_fields
        return [as_question(q, i, on_unknown=policy, **params) for i, q in enumerate(questions)]

    def _answers(self, questions: list[QuestionEvent]) -> Iterator[Answer]:
        for question in questions:
            try:
                self.core.add(question)
            except QuestionRejected as exc:
                yield from rejected_answers(question, exc)
        while self.core.has_work:
            yield from self.core.step().answers
