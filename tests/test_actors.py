"""Mailboxes are bounded and measurable; a full one makes the sender wait; ask() is request/reply."""

import math

import anyio
import pytest
from polling import eventually

from kev_async.runtime.actors import Mailbox, Request, ask

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


@pytest.mark.parametrize("capacity", [math.inf, -1, 2.5, None, True])
def test_a_mailbox_is_always_bounded(capacity):
    with pytest.raises(ValueError, match="capacity"):
        Mailbox("unbounded", capacity)


async def test_a_full_mailbox_makes_the_sender_wait_and_drops_nothing():
    box = Mailbox("work", 3)
    sent = []

    async def producer():
        async with box.send:
            for n in range(10):
                await box.send.send(n)
                sent.append(n)

    async with anyio.create_task_group() as tg:
        tg.start_soon(producer)
        await eventually(lambda: box.stats().senders_waiting == 1, timeout=2, every=0.001)
        stats = box.stats()
        assert (stats.depth, stats.capacity, stats.senders_waiting) == (3, 3, 1)
        assert sent == [0, 1, 2]  # the fourth send waits for room instead of being dropped
        received = [await box.receive.receive() for _ in range(4)]
        await eventually(lambda: box.stats().senders_waiting == 1 and box.stats().depth == 3, timeout=2, every=0.001)
        assert sent == [0, 1, 2, 3, 4, 5, 6]
        async with box.receive:
            received += [n async for n in box.receive]
    assert received == list(range(10))
    stats = box.stats()
    assert (stats.depth, stats.senders_waiting, stats.open_senders, stats.open_receivers) == (0, 0, 0, 0)


async def test_depth_counts_what_was_sent_and_not_yet_received():
    box = Mailbox("gauge", 5)
    for n in range(4):
        box.send.send_nowait(n)
    assert box.stats().depth == 4
    await box.receive.receive()
    assert box.stats().depth == 3
    clone = box.send.clone()
    box.send.close()
    assert box.stats().open_senders == 1 and box.stats().depth == 3  # still readable after close
    clone.close()
    box.receive.close()


async def doubler(inbox, *, task_status=anyio.TASK_STATUS_IGNORED):
    task_status.started()
    async for request in inbox:
        if request.body < 0:
            request.reply_to.fail(ValueError("no negatives"))
        else:
            request.reply_to.set(request.body * 2)


async def test_ask_gets_the_reply_meant_for_it_from_many_tasks():
    box = Mailbox("doubler", 0)
    results = {}

    async def asker(n):
        results[n] = await ask(box.send, n, timeout=5)

    async with anyio.create_task_group() as tg:
        await tg.start(doubler, box.receive)
        async with anyio.create_task_group() as askers:
            for n in range(50):
                askers.start_soon(asker, n)
        with pytest.raises(ValueError, match="no negatives"):
            await ask(box.send, -1, timeout=5)
        box.send.close()
    box.receive.close()
    assert results == {n: 2 * n for n in range(50)}


async def test_ask_times_out_when_the_actor_does_not_answer():
    box = Mailbox("silent", 1)
    with pytest.raises(TimeoutError):
        await ask(box.send, "hello?", timeout=0.05)
    request = box.receive.receive_nowait()
    assert isinstance(request, Request) and request.body == "hello?"
    request.reply_to.set("too late")  # harmless: nobody waits any more
    box.send.close()
    box.receive.close()
