"""The solo greedy reference of `kev bench load`: each question answered alone by Kev (batch size 1),
greedy; the "identical to solo" column compares every system's answers with these. Cached on disk per
question, keyed by everything that decides the answer."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from engine import IsolatedBatchPipeline
from kev_async.bench.load.report import Reference
from kev_async.bench.load.trace import TraceQuestion, question_event


def solo_reference(model, options, trace: list[TraceQuestion], cache_path: Path | None, out=print) -> Reference:
    """Each question answered alone by Kev (batch size 1), greedy; answers already in the cache are reused."""
    cache = json.loads(cache_path.read_text()) if cache_path and cache_path.exists() else {}
    keys = {q.qid: _reference_key(model, options, q) for q in trace}
    missing = [q for q in trace if keys[q.qid] not in cache]
    if missing:
        out(f"solo reference: answering {len(missing)} questions one at a time "
            f"({len(trace) - len(missing)} cached)")
        solo = dataclasses.replace(options, batch_window_ms=0.0)
        pipe = IsolatedBatchPipeline(model, max_batch_size=1, options=solo)
        for i, q in enumerate(missing):
            answer = pipe.run([question_event(q)])[0]
            cache[keys[q.qid]] = {"token_ids": list(answer.token_ids), "text": answer.text}
            if cache_path and (i % 8 == 7 or i == len(missing) - 1):  # an interrupted run keeps what it did
                cache_path.parent.mkdir(parents=True, exist_ok=True)
                cache_path.write_text(json.dumps(cache))
    return Reference({q.qid: cache[keys[q.qid]]["token_ids"] for q in trace},
                     {q.qid: cache[keys[q.qid]]["text"] for q in trace})


def _reference_key(model, options, q: TraceQuestion) -> str:
    """Everything that decides a solo greedy answer: weights, precision, matmul kernel, prompt, budget."""
    knobs = {k: str(getattr(options, k)) for k in ("deterministic", "kv_dtype") if hasattr(options, k)}
    knobs["matmul"] = model.weights.matmul_kernel
    text = json.dumps([str(model.path.resolve()), str(model.dtype), getattr(model, "weight_format", "full"), knobs,
                       q.system, q.prompt, q.max_new_tokens])
    return hashlib.sha256(text.encode()).hexdigest()[:32]
