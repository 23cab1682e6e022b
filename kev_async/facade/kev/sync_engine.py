"""kev.Engine: seed 002's blocking face over Kev's async engine, for scripts and notebooks.

The async `engine.Engine` runs in an event loop of its own on a background thread (anyio's blocking
portal), so `submit` and `wait` block only their caller, whether or not the caller's thread runs a loop
of its own (a notebook's does). `submit(queries)` feeds a list of questions to the engine as one request
and returns its id; `wait(request_id)` returns one kev.Result per query, ordered as `aggregator.mode` says.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import os
import secrets
import threading
import typing
import uuid

import anyio
import anyio.from_thread
import msgspec

from engine import EngineOptions
from engine import Engine as AsyncEngine
from engine.prompt import as_question
from kev.models import model_from_config
from kev.request import AGGREGATOR_MODES, Request, WaitTimeout
from kev.result import Result
from kev_async.settings import load_config
from schemas import QuestionEvent
from schemas.config import IsolationLevel

ISOLATION_LEVELS = typing.get_args(IsolationLevel)  # isolation.level: what a question may read of another's KV
SEED_LEVELS = {"loose": "system_prefix"}  # seed 002's level: global knowledge shared, each conversation its own


class Engine:
    """`with kev.Engine.from_config("kev.yaml") as engine: results = engine.wait(engine.submit(queries))`."""

    def __init__(self, model, options: EngineOptions | None = None, *, aggregator_mode: str = "slot_map") -> None:
        if aggregator_mode not in AGGREGATOR_MODES:
            raise ValueError(f"aggregator_mode={aggregator_mode!r}: one of {', '.join(AGGREGATOR_MODES)}")
        self._engine = AsyncEngine(model, options)
        self.options = self._engine.options
        self.aggregator_mode = aggregator_mode
        self.isolation = _isolation_level(self.options)
        self._loop = _PortalLoop(self._engine)
        self._requests: dict[str, Request] = {}

    @classmethod
    def from_config(cls, path: str | os.PathLike | None = None) -> "Engine":
        """The engine a kev.yaml describes (None: defaults), KEV_* environment applied, as `kev ask` builds it:
        the model from core.model_path, the engine's knobs from the rest, results in aggregator.mode's order."""
        cfg = load_config(path)
        model = model_from_config(cfg)
        return cls(model, EngineOptions.from_config(cfg, worker="kev-python"), aggregator_mode=cfg.aggregator.mode)

    def submit(self, queries, *, isolation: str | None = None, max_parallel: int | None = None, **params) -> str:
        """Queue `queries` (strings, question dicts or QuestionEvents) as one request; returns its id.

        `isolation`: "strict" reads no other question's cached KV whatever the engine's isolation.level
        (each query gets a cache_salt of its own, as the gateway's /v1/query does); "system_prefix" (seed
        002's "loose") or "shared" must be this engine's isolation.level, which decides whether prefixes are
        cached at all. `max_parallel`: at most this many
        of the request's queries in the engine at once (fed N at a time, in order); None: all. `params`
        (max_new_tokens, temperature, ...) apply to every query; keys Kev does not know go as
        intake.unknown_fields says: logged and listed in each answer's audit.ignored_fields, or refused
        here (QuestionRejected) before anything is queued."""
        if isinstance(queries, (str, dict, QuestionEvent)):  # one query, not its characters or keys
            queries = [queries]
        self._check_isolation(isolation)
        limit = _parallel_limit(max_parallel, len(queries))
        request_id = f"kev-{uuid.uuid4().hex[:12]}"
        policy = self.options.unknown_fields
        questions = [_question(query, slot, request_id, policy, params) for slot, query in enumerate(queries)]
        if isolation == "strict" and self.isolation != "strict":  # a salt of its own: nobody's blocks, none shared
            questions = [msgspec.structs.replace(q, cache_salt=secrets.token_hex(16)) for q in questions]
        request = Request(request_id, tuple(questions))
        request.future = self._loop.start(self._feed, request, limit)
        self._requests[request_id] = request
        return request_id

    def wait(self, request_id: str, timeout: float | None = None) -> list[Result]:
        """The request's results, one per query, ordered as aggregator.mode says; WaitTimeout (naming the
        queries still unanswered) when they are not all in within `timeout` seconds."""
        request = self._requests.get(request_id)
        if request is None:
            raise KeyError(f"no request {request_id!r} is waiting here (each request is waited for once)")
        try:
            request.future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise WaitTimeout(request, timeout, self.aggregator_mode) from None
        except concurrent.futures.CancelledError:
            raise RuntimeError("the engine was closed before this request was answered") from None
        del self._requests[request_id]
        return request.results(self.aggregator_mode)

    def close(self) -> None:
        """Cancel what is still running and stop the engine and its thread; safe to call twice."""
        for request in self._requests.values():
            request.future.cancel()
        self._loop.stop()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_isolation(self, isolation: str | None) -> None:
        level = SEED_LEVELS.get(isolation, isolation)
        if level is None or level == "strict" or level == self.isolation:
            return
        if level not in ISOLATION_LEVELS:
            raise ValueError(f"isolation={isolation!r}: Kev's levels are {', '.join(map(repr, ISOLATION_LEVELS))} "
                             f"(isolation.level; docs/prefix-cache.md)")
        named = f" (Kev's {level})" if level != isolation else ""
        raise ValueError(f"isolation={isolation!r}{named}, but this engine runs isolation.level: {self.isolation}; "
                         f"Kev shares prefixes per engine, not per request: set isolation.level: {level} in its config")

    async def _feed(self, request: Request, limit: int) -> None:
        """Submit the request's questions in slot order, at most `limit` in the engine at once."""
        places = anyio.Semaphore(limit)
        async with anyio.create_task_group() as tg:
            for slot, question in enumerate(request.questions):
                await places.acquire()
                tg.start_soon(self._answer, request, slot, question, places)

    async def _answer(self, request: Request, slot: int, question: QuestionEvent, places: anyio.Semaphore) -> None:
        try:
            handle = await self._engine.submit(question)
            request.record(slot, await self._engine.wait(handle))
        finally:
            places.release()


def _isolation_level(options: EngineOptions) -> str:
    """The isolation.level the engine's options came from."""
    if not options.prefix_caching:
        return "strict"
    return "system_prefix" if options.prefix_system_only else "shared"


def _question(query, slot: int, request_id: str, policy: str, params: dict) -> QuestionEvent:
    """A query as Kev's question, its id of its request's own: two requests' first queries never clash."""
    if isinstance(query, str):
        query = {"prompt": query}
    if isinstance(query, dict):
        query = {"question_id": f"{request_id}-{slot}", "request_id": request_id, **query}
    return as_question(query, slot, on_unknown=policy, **params)


def _parallel_limit(max_parallel: int | None, queries: int) -> int:
    if max_parallel is None:
        return max(queries, 1)
    if isinstance(max_parallel, bool) or not isinstance(max_parallel, int) or max_parallel < 1:
        raise ValueError(f"max_parallel={max_parallel!r}: a whole number of queries, at least 1")
    return max_parallel


class _PortalLoop:
    """The async engine, entered in an event loop that anyio's blocking portal runs on a thread of its own."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._portal_cm = anyio.from_thread.start_blocking_portal(name="kev-engine-loop")
        self._portal = self._portal_cm.__enter__()
        try:
            self._engine_cm = self._portal.wrap_async_context_manager(engine)
            self._engine_cm.__enter__()
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            raise
        self._lock = threading.Lock()
        _stop_before_exit(self.stop)

    def start(self, fn, *args) -> concurrent.futures.Future:
        if self._portal is None:
            raise RuntimeError("the engine is closed")
        return self._portal.start_task_soon(fn, *args)

    def stop(self) -> None:
        with self._lock:
            if self._portal is None:
                return
            engine_cm, portal_cm = self._engine_cm, self._portal_cm
            self._portal = self._engine_cm = self._portal_cm = None  # the model goes with them once stopped
        try:
            engine_cm.__exit__(None, None, None)
        finally:
            portal_cm.__exit__(None, None, None)


def _stop_before_exit(stop) -> None:
    """Stop the loop when the interpreter exits, for a script that never called close().

    threading's own exit hooks run before the interpreter joins its threads, atexit's only after: a
    thread the loop still runs (anyio's portal before 4.x's daemon one, or its worker threads) would
    keep the script from ever ending."""
    register = getattr(threading, "_register_atexit", None) or atexit.register
    register(stop)
