"""kev.pipeline.IsolatedBatchPipeline: seed 000's pipeline — Kev's, with answers under the seed's names.

`run` returns the answers in input order, as a list that also answers `.items()` and `.get(i)` with
each question's index (0..n-1) as its key, the way the seed's aggregator reads them; each is a
kev.Result (str() is its text), whose `answer` is Kev's AnswerEvent.
"""

from __future__ import annotations

from engine import EngineOptions
from engine.pipeline import Answers
from engine.pipeline import IsolatedBatchPipeline as _KevPipeline
from kev.result import Result
from kev_async.settings import load_config


class IsolatedBatchPipeline(_KevPipeline):
    def __init__(self, model, *, max_batch_size: int | None = None, kv_slot_capacity: int | None = None,
                 early_stop: bool | None = None, options: EngineOptions | None = None, **option_overrides):
        """Without `options`, the engine's knobs come from the config as `kev ask` reads them (defaults plus
        KEV_* environment): intake.unknown_fields among them."""
        options = options or EngineOptions.from_config(load_config(), worker="kev-python")
        super().__init__(model, max_batch_size=max_batch_size or options.max_parallel_queries,
                         kv_slot_capacity=kv_slot_capacity,
                         early_stop=options.early_stop if early_stop is None else early_stop,
                         options=options, **option_overrides)

    def run(self, questions, **params) -> Answers:
        return Answers(Result.of(answer, slot) for slot, answer in enumerate(super().run(questions, **params)))
