"""`EmbeddedUvicorn`: uvicorn's server run inside a process whose lifecycle owns the signals (the
gateway's HTTP API, a worker's metrics endpoint)."""

from __future__ import annotations

import contextlib

import uvicorn


class EmbeddedUvicorn(uvicorn.Server):
    """uvicorn inside Kev's process: Kev owns SIGINT/SIGTERM (its drain), so uvicorn installs no handlers;
    set `should_exit` to stop it."""

    def capture_signals(self):
        return contextlib.nullcontext()
