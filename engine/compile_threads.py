"""CompileThreads: the threads response_format grammars compile on, below the step's CPU priority.

A compile prepares one question; a step computes the next token of every running one. At the same
priority a compile takes its core's share from every step that runs meanwhile: on a 2-core host a
plain 1-token question's prefill ran at half speed while twenty new grammars compiled (0.10-0.13 s
against 0.05 s alone). At nice 10 (Linux, per thread; elsewhere the process's own priority) a compile
gets about a tenth of a core the step's threads want (CFS weights 110 against 1,024) and all of an
idle one: 0.06-0.07 s. Not nice 19: on a host whose steps keep every core busy a compile would get
1.5% of a core, 70 times its time.

Own threads, not anyio's pool: a thread's priority can be lowered but, unprivileged, not raised back,
so a pooled thread would carry it into whatever anyio runs on it next.

    threads = CompileThreads(2, post)   # post: the event loop's thread-safe "call this soon"
    grammar = await threads.run(compile, question)
    threads.close()                     # jobs queued before it still run
"""

from __future__ import annotations

import os
import queue
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import structlog

NICE = 10
log = structlog.get_logger("kev.structured")


class CompileThreadsClosed(RuntimeError):
    """A job offered after `close`: no thread would ever run it."""


@dataclass(eq=False)
class _Job:
    fn: Callable
    args: tuple
    done: anyio.Event = field(default_factory=anyio.Event)
    wanted: bool = True  # False once its caller stopped waiting: not started then, or its result dropped
    value: Any = None
    error: BaseException | None = None

    def run(self) -> None:
        try:
            self.value = self.fn(*self.args)
        except Exception as exc:  # handed to the caller, who awaits it; the thread goes on
            self.error = exc


class CompileThreads:
    """Made inside a running event loop (anyio's Event needs one); `post` is that loop's call_soon_threadsafe."""

    def __init__(self, count: int, post: Callable[..., Any]) -> None:
        self._post = post
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, name=f"kev-compile-{i}", daemon=True)
                         for i in range(count)]
        self.closed = False
        for thread in self._threads:
            thread.start()

    @property
    def count(self) -> int:
        return len(self._threads)

    async def run(self, fn: Callable, *args) -> Any:
        """`fn(*args)` on a compile thread, first come first served. Cancelled while it waits, it never
        runs; cancelled while it runs, it finishes unread (a compiled grammar is cached all the same)."""
        if self.closed:
            raise CompileThreadsClosed("the compile threads are closed")
        job = _Job(fn, args)
        self._jobs.put(job)
        try:
            await job.done.wait()
        finally:
            job.wanted = False
        if job.error is not None:
            raise job.error
        return job.value

    def close(self) -> None:
        """The threads end once the jobs already queued are done."""
        if not self.closed:
            self.closed = True
            for _ in self._threads:
                self._jobs.put(None)

    def _work(self) -> None:
        _lower_priority()
        while (job := self._jobs.get()) is not None:
            if not job.wanted:
                continue
            job.run()
            try:
                self._post(job.done.set)
            except RuntimeError:  # the event loop has ended: nobody waits for this one
                pass


def _lower_priority() -> None:
    if not sys.platform.startswith("linux"):  # elsewhere setpriority would lower the whole process
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
    except OSError as exc:  # a sandbox that forbids it: compiles run at the step's priority
        log.info("structured.compile_priority_unchanged", error=str(exc))
