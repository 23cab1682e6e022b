"""IsolatedBatchPipeline: answer a list of questions in packed forwards, each as if it were alone."""

from __future__ import annotations

import dataclasses

from engine.core import EngineCore
from engine.intake import QuestionRejected
from engine.options import EngineOptions
from engine.output.answers import rejected_answer
from engine.prompt import as_question
from schemas import AnswerEvent

Answer = AnswerEvent  # text, token_ids, finish_reason, usage, timings, audit


class IsolatedBatchPipeline:
    """Blocking, one call at a time: `run(questions, **params) -> [Answer]` in input order."""

    def __init__(self, model, *, max_batch_size: int = EngineOptions.max_batch_size,
                 kv_slot_capacity: int | None = None,
                 early_stop: bool = EngineOptions.early_stop, options: EngineOptions | None = None, **option_overrides):
        options = options or EngineOptions()
        self.options = dataclasses.replace(options, max_batch_size=max_batch_size,
                                           kv_slot_capacity=kv_slot_capacity or options.kv_slot_capacity,
                                           early_stop=early_stop, batch_window_ms=0.0, max_waiting=1 << 30,
                                           overflow_policy="queue", **option_overrides)
        self.core = EngineCore(model, self.options)

    def run(self, questions, **params) -> list[Answer]:
        """Strings, dicts or QuestionEvents; `params` (max_new_tokens, temperature, ...) fill in defaults."""
        questions = [as_question(q, i, **params) for i, q in enumerate(questions)]
        answers: dict[str, Answer] = {}
        for question in questions:
            try:
                self.core.add(question)
            except QuestionRejected as exc:
                answers[question.question_id] = rejected_answer(question, exc)
        while self.core.has_work:
            for answer in self.core.step().answers:
                answers[answer.question_id] = answer
        return [answers[q.question_id] for q in questions]
