"""CompileBudget: who may compile a response_format grammar now.

Compiles run on a few threads (engine/compile_threads.py), first come first served, and each principal
(schemas/principal.py: the key that signed a question, and its tenant) holds at most `per_principal`
places in that line at a time, compiling or waiting for a thread. A principal that sends twenty new
grammars at once therefore queues mostly behind itself: another principal's compile waits for at most
`per_principal` compiles of each principal ahead of it, never for the whole flood. Questions without a
response_format never come here.

    budget = CompileBudget(CompileThreads(compile_threads(), post), per_principal=2)
    grammar = await budget.run(principal, compile, question)
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable
from typing import Any

import anyio

from engine.compile_threads import CompileThreads


def compile_threads() -> int:
    """A quarter of the cores, 1 to 4: compiles share the CPU with the step's threads, which need it more."""
    return min(4, max(1, (os.cpu_count() or 1) // 4))


class CompileBudget:
    """Made inside a running event loop (anyio's CapacityLimiter needs one)."""

    def __init__(self, threads: CompileThreads, per_principal: int) -> None:
        if per_principal < 1:
            raise ValueError(f"compiles_per_principal must be at least 1, not {per_principal}")
        self.threads = threads
        self.per_principal = per_principal
        self._principals: dict[Hashable, tuple[anyio.CapacityLimiter, int]] = {}  # -> (its places, its users)

    async def run(self, principal: Hashable, fn: Callable, *args) -> Any:
        """`fn(*args)` on a compile thread, once one of `principal`'s places is free (first come, first served)."""
        limiter, users = self._principals.get(principal) or (anyio.CapacityLimiter(self.per_principal), 0)
        self._principals[principal] = (limiter, users + 1)
        try:
            async with limiter:
                return await self.threads.run(fn, *args)
        finally:
            limiter, users = self._principals[principal]
            if users == 1:  # its last compile: forget it, so principals seen once do not pile up
                del self._principals[principal]
            else:
                self._principals[principal] = (limiter, users - 1)

    def holding(self, principal: Hashable) -> int:
        """Places `principal` holds now (compiling, or waiting for a thread)."""
        entry = self._principals.get(principal)
        return 0 if entry is None else entry[0].borrowed_tokens

    def close(self) -> None:
        self.threads.close()
