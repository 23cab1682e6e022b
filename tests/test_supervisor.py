"""One-for-one supervision: restart with backoff, give up past the limit, escalate, start/stop in order."""

import anyio
import pytest
from polling import eventually
from structlog.testing import capture_logs

from kev_async.runtime.actors import Mailbox
from kev_async.runtime.supervisor import Child, Escalated, RestartPolicy, Supervisor

pytestmark = pytest.mark.anyio

FAST = RestartPolicy(max_restarts=3, within_s=10, backoff_s=0.01, backoff_factor=2)


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


class Flaky:
    """An echo actor that crashes on its first `crashes` runs, recording when each run began."""

    def __init__(self, crashes: int):
        self.crashes = crashes
        self.starts: list[float] = []

    async def __call__(self, inbox, outbox, *, task_status):
        self.starts.append(anyio.current_time())
        task_status.started()
        if len(self.starts) <= self.crashes:
            raise RuntimeError(f"crash number {len(self.starts)}")
        async for message in inbox:
            await outbox.send(message)
        await outbox.aclose()


async def test_a_crashing_child_is_restarted_and_its_crash_logged_with_name_and_context():
    flaky, inbox, outbox = Flaky(crashes=2), Mailbox("in", 1), Mailbox("out", 1)
    supervisor = Supervisor("app", [Child("echo", flaky, (inbox.receive, outbox.send), FAST,
                                          context={"partition": 3})])
    with capture_logs() as logs:
        async with anyio.create_task_group() as tg:
            await tg.start(supervisor.run)
            async with inbox.send:
                await inbox.send.send("ping")
            assert await outbox.receive.receive() == "ping"  # the third run serves
    inbox.receive.close()
    outbox.receive.close()
    assert supervisor.restarts == {"echo": 2}
    crashes = [e for e in logs if e["event"] == "actor.crashed"]
    assert [(e["actor"], e["partition"], e["log_level"]) for e in crashes] == [("echo", 3, "error")] * 2
    assert crashes[0]["error"] == "RuntimeError('crash number 1')"
    assert isinstance(crashes[0]["exc_info"], RuntimeError)
    gaps = [b - a for a, b in zip(flaky.starts, flaky.starts[1:])]
    assert gaps[0] >= 0.01 and gaps[1] >= 0.02  # exponential backoff


async def test_past_the_limit_the_supervisor_gives_up_and_escalates():
    flaky = Flaky(crashes=1000)
    supervisor = Supervisor("app", [Child("doomed", flaky, (None, None), FAST)])
    with capture_logs() as logs, pytest.raises(Escalated) as raised:
        await supervisor.run()
    assert len(flaky.starts) == 1 + FAST.max_restarts
    assert raised.value.child == "doomed" and raised.value.restarts == 3
    assert str(raised.value.__cause__) == "crash number 4"  # the last crash travels with it
    assert [e["event"] for e in logs if e["event"].startswith("actor.")] == (
        ["actor.crashed", "actor.restarting"] * 3 + ["actor.crashed", "actor.gave_up"])


async def test_a_child_supervisor_that_gives_up_is_restarted_by_its_parent_then_escalates():
    flaky = Flaky(crashes=1000)
    inner = Supervisor("inner", [Child("doomed", flaky, (None, None), RestartPolicy(max_restarts=1, backoff_s=0))])
    outer = Supervisor("outer", [Child("inner", inner.run, (), RestartPolicy(max_restarts=1, backoff_s=0))])
    with capture_logs() as logs, pytest.raises(Escalated) as raised:
        await outer.run()
    assert (raised.value.supervisor, raised.value.child) == ("outer", "inner")
    assert isinstance(raised.value.__cause__, Escalated) and raised.value.__cause__.child == "doomed"
    assert len(flaky.starts) == 4  # inner ran twice, each time: one run + one restart
    inner_crashes = [e for e in logs if e["event"] == "actor.crashed" and e["actor"] == "inner"]
    assert len(inner_crashes) == 2 and inner_crashes[0]["supervisor"] == "outer"


async def test_retries_spread_out_in_time_do_not_count_against_the_limit():
    flaky, idle = Flaky(crashes=4), Mailbox("in", 0)
    policy = RestartPolicy(max_restarts=1, within_s=0.02, backoff_s=0.03)
    supervisor = Supervisor("app", [Child("slow-crasher", flaky, (idle.receive, None), policy)])
    with capture_logs(), idle.send, idle.receive:
        async with anyio.create_task_group() as tg:
            await tg.start(supervisor.run)
            await eventually(lambda: len(flaky.starts) >= 5, timeout=2, every=0.005)
            tg.cancel_scope.cancel()
    assert supervisor.restarts == {"slow-crasher": 4}


async def test_children_start_in_order_each_ready_first_and_stop_in_reverse_order():
    events = []

    def named(name):
        async def child(*, task_status):
            events.append(f"start {name}")
            await anyio.sleep(0.01)  # readiness takes a while; the next child must wait for it
            task_status.started()
            try:
                await anyio.sleep_forever()
            finally:
                events.append(f"stop {name}")
        return Child(name, child)

    supervisor = Supervisor("app", [named("publisher"), named("engine"), named("consumer")])
    async with anyio.create_task_group() as tg:
        await tg.start(supervisor.run)
        events.append("ready")
        await supervisor.stop()
    assert events == ["start publisher", "start engine", "start consumer", "ready",
                      "stop consumer", "stop engine", "stop publisher"]


async def test_a_transient_child_that_returns_is_not_restarted_but_a_permanent_one_is():
    runs = {"transient": 0, "permanent": 0}

    def counting(name):
        async def child(*, task_status):
            runs[name] += 1
            task_status.started()
        return child

    supervisor = Supervisor("app", [
        Child("transient", counting("transient")),
        Child("permanent", counting("permanent"), policy=RestartPolicy("permanent", max_restarts=2, backoff_s=0)),
    ])
    with pytest.raises(Escalated, match="'permanent'"):
        await supervisor.run()
    assert runs == {"transient": 1, "permanent": 3}
