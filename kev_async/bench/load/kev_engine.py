"""(a) Kev's async `Engine` in process, replaying a trace open-loop: each question is submitted at its
arrival time whatever the engine is doing, and its latency counts from that scheduled time, so a late
submitter cannot hide queueing. TTFT is the first streamed text; the gaps are between streamed pieces."""

from __future__ import annotations

import time

import anyio

from engine import Engine
from kev_async.bench.load.report import Outcome, SystemRun
from kev_async.bench.load.trace import TraceQuestion, question_event


def run_engine(model, options, trace: list[TraceQuestion], name: str = "kev engine") -> SystemRun:
    outcomes = anyio.run(_engine_trace, model, options, trace)
    return SystemRun(name, outcomes, {"max_parallel_queries": options.max_parallel_queries})


async def _engine_trace(model, options, trace: list[TraceQuestion]) -> list[Outcome]:
    done: dict[str, Outcome] = {}
    async with Engine(model, options) as engine:
        await engine.wait(await engine.submit({"prompt": "Hi", "params": {"max_new_tokens": 2}}))  # warm-up
        t0 = time.monotonic()
        async with anyio.create_task_group() as tg:
            for q in trace:
                tg.start_soon(_engine_question, engine, q, t0, done)
    return [done[q.qid] for q in trace]


async def _engine_question(engine, q: TraceQuestion, t0: float, done: dict) -> None:
    arrival = t0 + q.arrival_s
    await anyio.sleep_until(arrival)  # anyio's clock is time.monotonic() on asyncio and trio
    handle = await engine.submit(question_event(q), arrival=arrival)
    pieces: list[float] = []  # when each piece of text came, as a streaming client sees it
    async for delta in engine.stream(handle):
        if delta.text:
            pieces.append(time.monotonic())
    first = pieces[0] if pieces else None
    done[q.qid] = Outcome.of_answer(q.qid, q.arrival_s, t0, handle.answer, first, time.monotonic(), pieces)
