"""Waiting in tests for something to become true: one helper for the whole suite.

`eventually` (async) and `eventually_sync` call a probe until its value is truthy and return that value.
On timeout they fail with what was still false and the last value the probe returned, so a red test
says what it was waiting for. A probe that raises fails at once: `assert process.running()` inside a
probe ends the wait as soon as the process is gone, not at the timeout.

A probe may be a plain function or an async one (for `eventually`); each call is one fresh look.
`what` (a string, or a function for a description only worth building on failure, such as a child
process's log tail) names the condition; without it, a lambda's source line does.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio

T = TypeVar("T")


async def eventually(probe: Callable[[], T | Awaitable[T]], *, timeout: float = 20.0, every: float = 0.05,
                     what: str | Callable[[], str] | None = None) -> T:
    """The probe's first truthy value, looked for every `every` seconds for up to `timeout` seconds."""
    give_up = time.monotonic() + timeout
    while True:
        seen = probe()
        if inspect.isawaitable(seen):
            seen = await seen
        if seen:
            return seen
        if time.monotonic() >= give_up:
            raise AssertionError(_still_false(probe, what, timeout, seen))
        await anyio.sleep(every)


def eventually_sync(probe: Callable[[], T], *, timeout: float = 20.0, every: float = 0.05,
                    what: str | Callable[[], str] | None = None) -> T:
    """`eventually` for tests without an event loop: blocks the thread between looks."""
    give_up = time.monotonic() + timeout
    while not (seen := probe()):
        if time.monotonic() >= give_up:
            raise AssertionError(_still_false(probe, what, timeout, seen))
        time.sleep(every)
    return seen


def _still_false(probe: Callable, what: str | Callable[[], str] | None, timeout: float, seen: object) -> str:
    last = repr(seen)
    if len(last) > 2000:
        last = last[:2000] + "..."
    if callable(what):
        what = what()
    return f"still false after {timeout}s: {what or _describe(probe)} (last value: {last})"


def _describe(probe: Callable) -> str:
    """A lambda's own source line says best what it waited for; a named function its name."""
    if isinstance(probe, functools.partial):
        return f"{_describe(probe.func)}{probe.args}"
    name = getattr(probe, "__qualname__", repr(probe))
    if "<lambda>" not in name:
        return name
    try:
        return " ".join(inspect.getsource(probe).split())[:300]
    except (OSError, TypeError):
        return name
