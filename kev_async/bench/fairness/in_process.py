"""A scenario through Kev's async Engine in this process: each question submitted at its arrival time under
its tenant's principal (signed by the bench's key, so the tenant counts), latency from that time; the
scheduler's service per tenant sampled every SAMPLE_S while it runs."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import anyio

from engine import Engine
from kev_async.bench.fairness.scenarios import Asked, Scenario
from schemas.principal import Principal

SAMPLE_S = 0.1
BENCH_KEY = "bench"


@dataclass
class Outcome:
    tenant: str
    qid: str
    arrival_s: float
    finished_s: float
    tokens: int  # completion tokens
    token_ids: tuple[int, ...]
    error: str | None


@dataclass
class Samples:
    """The scheduler's per-tenant report (engine/schedule/sharing.py) over time: (s, {tenant: report})."""

    points: list[tuple[float, dict]] = field(default_factory=list)


def run_in_process(model, options, scenario: Scenario) -> tuple[list[Outcome], Samples]:
    return anyio.run(_run, model, options, scenario)


async def _run(model, options, scenario: Scenario) -> tuple[list[Outcome], Samples]:
    outcomes: list[Outcome] = []
    samples = Samples()
    async with Engine(model, options) as engine:
        await engine.wait(await engine.submit({"prompt": "Hi", "params": {"max_new_tokens": 2}}))  # warm-up
        t0 = time.monotonic()
        async with anyio.create_task_group() as tg:
            tg.start_soon(_sample, engine, t0, samples, len(scenario.asked), outcomes)
            for asked in scenario.asked:
                tg.start_soon(_ask, engine, asked, t0, outcomes)
    return outcomes, samples


async def _ask(engine, asked: Asked, t0: float, outcomes: list[Outcome]) -> None:
    arrival = t0 + asked.arrival_s
    await anyio.sleep_until(arrival)
    handle = await engine.submit(asked.question, arrival=arrival, principal=Principal(BENCH_KEY, asked.tenant))
    answer = await engine.wait(handle)
    outcomes.append(Outcome(asked.tenant, asked.question.question_id, asked.arrival_s, time.monotonic() - t0,
                            answer.usage.completion_tokens, answer.token_ids,
                            answer.error.code if answer.error else None))


async def _sample(engine, t0: float, samples: Samples, expected: int, outcomes: list[Outcome]) -> None:
    scheduler = engine.core.scheduler
    while len(outcomes) < expected:
        now = time.monotonic()
        samples.points.append((now - t0, scheduler.sharing.report(scheduler.running, scheduler.waiting, now)))
        await anyio.sleep(SAMPLE_S)
