"""structlog set up once for the whole process: JSON lines to stderr, or a console view on a tty."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import Any

import structlog

from schemas import DEFAULT_CONFIG

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}

_configured = False


class _Stderr:
    """Writes to whatever sys.stderr is *now*, so redirections (pytest capsys) see the logs."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


_STDERR = _Stderr()


class _NamedPrintLogger(structlog.PrintLogger):
    """A PrintLogger with a `.name`, so each line can say which component wrote it."""

    def __init__(self, name: str = "") -> None:
        super().__init__(file=_STDERR)  # one shared file object, so one shared write lock
        self.name = name


def _logger_factory(*args: Any) -> _NamedPrintLogger:
    return _NamedPrintLogger(args[0] if args else "")


def configure_logging(level: str = DEFAULT_CONFIG.logging.level,
                      json: bool | None = DEFAULT_CONFIG.logging.json) -> None:
    """Configure structlog on the first call; later calls only change the level."""
    global _configured
    if _configured:
        structlog.configure(wrapper_class=_filtering(level))
        return
    structlog.configure(
        processors=_processors(json if json is not None else not sys.stderr.isatty()),
        wrapper_class=_filtering(level),
        logger_factory=_logger_factory,
        # Not cached, so a later level change reaches loggers created at import time.
        cache_logger_on_first_use=False,
    )
    _configured = True


@contextlib.contextmanager
def quieted(level: str = "warning") -> Iterator[None]:
    """Log at `level` inside the block, then as before: a benchmark run in process (tests call the
    CLI in process) must not leave the level it needed for a readable table."""
    before = structlog.get_config()["wrapper_class"]
    configure_logging(level)
    try:
        yield
    finally:
        structlog.configure(wrapper_class=before)


def get_logger(name: str, **initial: Any) -> Any:
    """A lazy logger whose lines carry `logger=name`; safe to create at import time."""
    return structlog.get_logger(name, **initial)


def _filtering(level: str) -> type:
    try:
        return structlog.make_filtering_bound_logger(LEVELS[level.lower()])
    except KeyError:
        raise ValueError(f"unknown log level {level!r} (allowed: {', '.join(LEVELS)})") from None


def _processors(as_json: bool) -> list[Any]:
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        _add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if as_json:
        return [*shared, structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
    return [*shared, structlog.dev.ConsoleRenderer()]


def _add_logger_name(logger: Any, _method: str, event_dict: dict) -> dict:
    if getattr(logger, "name", ""):
        event_dict.setdefault("logger", logger.name)
    return event_dict
