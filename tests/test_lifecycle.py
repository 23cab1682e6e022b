"""Graceful shutdown on a real signal: stop intake, drain within the deadline, shielded final step."""

import itertools
import os
import signal
from functools import partial

import anyio
import pytest
from structlog.testing import capture_logs

from kev_async.runtime.actors import Mailbox
from kev_async.runtime.lifecycle import run_service

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


class Pipeline:
    """A service: intake feeds a bounded mailbox, a worker takes 20 ms per item; final commits."""

    def __init__(self):
        self.taken, self.done, self.committed = [], [], None

    async def serve(self, shutdown, *, task_status):
        work = Mailbox("work", 4)
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._worker, work.receive)
            task_status.started()
            async with work.send:
                with shutdown.intake():
                    for n in itertools.count():
                        await work.send.send(n)
                        self.taken.append(n)

    async def _worker(self, inbox):
        async with inbox:
            async for item in inbox:
                await anyio.sleep(0.02)
                self.done.append(item)

    async def final(self):
        await anyio.sleep(0.01)  # a real flush awaits the broker; the shield must let it
        self.committed = list(self.done)


async def serve_forever(shutdown, *, task_status):
    """A service that ignores shutdown requests: only the drain deadline can end it."""
    task_status.started()
    await anyio.sleep_forever()


async def start(tg, results, serve, **options):
    async def main(*, task_status):
        results.append(await run_service(serve, task_status=task_status, **options))
    await tg.start(main)


async def test_a_signal_stops_intake_drains_in_flight_work_and_commits_it():
    pipeline, results = Pipeline(), []
    with capture_logs() as logs:
        async with anyio.create_task_group() as tg:
            await start(tg, results, pipeline.serve, drain_deadline=5, final=pipeline.final)
            await anyio.sleep(0.05)
            os.kill(os.getpid(), signal.SIGTERM)
            signalled = anyio.current_time()
        drained_in = anyio.current_time() - signalled
    assert results == [0]
    assert len(pipeline.taken) >= 5  # the mailbox (4) was full of in-flight work when the signal came
    assert pipeline.done == pipeline.taken  # nothing taken was lost
    assert pipeline.committed == pipeline.done  # and the final step saw all of it
    assert drained_in < 2
    events = [e["event"] for e in logs]
    assert events == ["shutdown.requested", "shutdown.drained", "shutdown.final_step_done"]
    assert logs[0]["reason"] == "SIGTERM"


async def test_past_the_drain_deadline_the_service_is_cancelled_and_the_final_step_still_runs():
    pipeline, results = Pipeline(), []
    with capture_logs() as logs:
        async with anyio.create_task_group() as tg:
            await start(tg, results, serve_forever, drain_deadline=0.05, final=pipeline.final)
            os.kill(os.getpid(), signal.SIGTERM)
            signalled = anyio.current_time()
        took = anyio.current_time() - signalled
    assert results == [0] and pipeline.committed == []
    assert 0.05 <= took < 2
    assert [e["event"] for e in logs][1:] == ["shutdown.drain_deadline_passed", "shutdown.final_step_done"]


async def test_the_final_step_runs_in_full_even_when_the_service_is_cancelled_from_outside():
    pipeline, results = Pipeline(), []
    async with anyio.create_task_group() as tg:
        await start(tg, results, pipeline.serve, final=pipeline.final)
        await anyio.sleep(0.05)
        tg.cancel_scope.cancel()
    assert results == []  # cancelled: no exit code
    assert pipeline.committed == pipeline.done and pipeline.done  # yet the flush ran to its end


async def test_the_final_step_is_cut_at_its_own_timeout():
    async def stuck_flush():
        await anyio.sleep_forever()

    results = []
    with capture_logs() as logs:
        async with anyio.create_task_group() as tg:
            await start(tg, results, serve_forever, drain_deadline=0, final=stuck_flush, final_timeout=0.05)
            os.kill(os.getpid(), signal.SIGTERM)
    assert results == [0]
    assert logs[-1]["event"] == "shutdown.final_step_timed_out"


async def test_a_second_signal_forces_an_exit_with_128_plus_the_signal_number():
    forced, results = [], []

    def force_exit(code, scope):
        forced.append(code)
        scope.cancel()  # stands in for os._exit in this test: end everything now

    with capture_logs() as logs:
        async with anyio.create_task_group() as tg:
            await start(tg, results, serve_forever, drain_deadline=30,
                        force_exit=partial(force_exit, scope=tg.cancel_scope))
            os.kill(os.getpid(), signal.SIGINT)
            await anyio.sleep(0.05)
            os.kill(os.getpid(), signal.SIGINT)
    assert forced == [130]
    assert [e["event"] for e in logs][:2] == ["shutdown.requested", "shutdown.forced"]
