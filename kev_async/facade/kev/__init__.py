"""`import kev`: the seeds' Python API, a facade over Kev's engine (it lives in kev_async/facade/).

    engine = kev.Engine.from_config("kev.yaml")
    results = engine.wait(engine.submit(queries, isolation="strict", max_parallel=4), timeout=15.0)
    for r in results: print(r.channel_id, r.elapsed_ms, r.tokens, r.text)

    from kev.pipeline import IsolatedBatchPipeline
    from kev.models import load_kev_model
    answers = IsolatedBatchPipeline(load_kev_model("smollm2-135m-instruct")).run(questions, max_new_tokens=64)

The seeds' names (channel_id, elapsed_ms, tokens, hash_bucket, started_at, ended_at) live in kev.Result
only; each Result carries Kev's AnswerEvent, whose wire names are documented in docs/events.md.
"""

from kev.models import load_kev_model
from kev.pipeline import IsolatedBatchPipeline
from kev.request import WaitTimeout
from kev.result import Result
from kev.sync_engine import Engine

__all__ = ["Engine", "IsolatedBatchPipeline", "Result", "WaitTimeout", "load_kev_model"]
