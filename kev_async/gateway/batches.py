"""Running a batch: each line of its input file asked as a question of the batch's tenant, at a priority
below interactive traffic, a bounded number at a time; each line's result recorded once on the batch
topic (batch_store.py); the output and error files written when every line is settled.

    validating -> in_progress -> finalizing -> completed
                  (cancel) cancelling -> cancelled        (completion_window passed) -> expired

A gateway process with `runs_batches` runs every unfinished batch it reads on the topic, at start (a
restart resumes them) and as they are created. A line whose result is on the topic is never asked
again; a line asked before a restart and not recorded is asked again, under a new question id. At
most `gateway.batch_in_flight` lines of all batches together are in flight, so a batch never floods
the questions topic: the queue behind it stays short, and a signed question is published minutes,
not hours, before a worker takes it (kafka.trust.max_age_ms). Each question's deadline is the batch's
(created_at + completion_window). A cancel or the deadline stops asking; the lines in flight are
cancelled, and every line left unsettled goes to the error file as `batch_cancelled` or
`batch_expired`, so each custom_id is in exactly one of the two files, once.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import time
from typing import TYPE_CHECKING

import anyio
import msgspec
import structlog

from kev_async.gateway.batch_input import BatchLine, parse_lines
from kev_async.gateway.batch_lines import ask_line, not_run_line
from kev_async.gateway.batch_store import TERMINAL, BatchRecord, BatchStore
from kev_async.gateway.errors import ApiError, bad_request
from kev_async.gateway.files import FileStore, derived_file_id

if TYPE_CHECKING:
    from kev_async.gateway.state import Gateway

log = structlog.get_logger("kev.gateway.batches")

RETRY_S = 5.0  # a batch interrupted by the broker or the file store is taken up again after this
MAX_WINDOW_S = 86_400  # 24 h: OpenAI's only window, and the longest deadline a question may carry
_WINDOW = re.compile(r"([1-9][0-9]{0,5})([smh])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600}
_FINAL = {None: ("completed", "completed_at"), "cancelled": ("cancelled", "cancelled_at"),
          "expired": ("expired", "expired_at")}


def window_seconds(window: str) -> int:
    """`24h` (OpenAI's) or shorter, as `<n>h`, `<n>m` or `<n>s`; a 400 otherwise."""
    match = _WINDOW.fullmatch(window)
    seconds = int(match[1]) * _UNIT_S[match[2]] if match else 0
    if not 0 < seconds <= MAX_WINDOW_S:
        raise bad_request(f"completion_window={window[:20]!r} is not supported: give '24h' or a shorter window "
                          f"such as '2h', '30m' (a question's deadline is at most 24 h).",
                          param="completion_window", code="invalid_value")
    return seconds


def new_batch_id() -> str:
    return f"batch_{secrets.token_hex(16)}"


class Batches:
    """What the batch and file routes share: the state on the topic, the files, and (in one process) the runner."""

    def __init__(self, gateway: Gateway, store: BatchStore, files: FileStore, *, runs_batches: bool) -> None:
        self.gateway, self.store, self.files = gateway, store, files
        self.runs_batches = runs_batches
        cfg = gateway.cfg.gateway
        self.max_lines = cfg.max_batch_lines
        self._window = asyncio.Semaphore(cfg.batch_in_flight)
        self._running: dict[str, anyio.Event] = {}  # batch id -> set when it is to stop asking (cancel)
        self._tg: anyio.abc.TaskGroup | None = None
        store.watchers.append(self._noticed)

    async def run(self, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        """Run the unfinished batches on the topic, then each one as it appears, until cancelled."""
        async with anyio.create_task_group() as tg:
            self._tg = tg
            for batch in list(self.store.batches.values()):
                self._noticed(batch)
            task_status.started()
            await anyio.sleep_forever()

    def _noticed(self, batch: BatchRecord) -> None:
        if self._tg is None or not self.runs_batches or batch.status in TERMINAL:
            return
        stop = self._running.get(batch.id)
        if stop is None:
            stop = self._running[batch.id] = anyio.Event()
            self._tg.start_soon(self._run_batch, batch.id, stop)
        if batch.id in self.store.cancels:
            stop.set()

    async def _run_batch(self, batch_id: str, stop: anyio.Event) -> None:
        try:
            while not await self._attempt(batch_id, stop):
                await anyio.sleep(RETRY_S)
        finally:
            self._running.pop(batch_id, None)

    async def _attempt(self, batch_id: str, stop: anyio.Event) -> bool:
        """Run the batch to its end: True; False when the broker or the file store failed on the way (the batch
        is as recorded, and the next attempt, or the next start, takes it up from there)."""
        try:
            if batch_id in self.store.cancels:
                stop.set()
            lines = await self._lines(self.store.batches[batch_id])
            if lines is None:
                return True
            batch = self.store.batches[batch_id]
            if batch.status == "validating":
                batch = await self.store.update(batch, status="in_progress", in_progress_at=_now(), total=len(lines))
            reason = await self._ask_all(batch, lines, stop)
            await self._finish(batch_id, lines, reason)
            return True
        except Exception:
            log.exception("gateway.batch_interrupted", batch_id=batch_id, retry_s=RETRY_S)
            return False

    async def _lines(self, batch: BatchRecord) -> list[BatchLine] | None:
        """The input file's lines; None (and the batch failed, saying why) when they cannot be read."""
        try:
            content = await self.files.read(batch.input_file_id, batch.tenant)
            return await anyio.to_thread.run_sync(lambda: parse_lines(content, max_lines=self.max_lines))
        except ApiError as error:
            if error.status >= 500:  # the file store is away, not the file
                raise
            await self.store.update(batch, status="failed", failed_at=_now(),
                                    errors=[{"code": "invalid_input_file", "message": error.message, "param": None,
                                             "line": None}])
            return None

    async def _ask_all(self, batch: BatchRecord, lines: list[BatchLine], stop: anyio.Event) -> str | None:
        """Ask every unsettled line until all are settled; why it stopped early (cancelled, expired), or None. A
        line left unsettled by a pass (its question cancelled by someone else) is asked again in the next."""
        passes = 0
        while unsettled := [line for line in lines if line.index not in self.store.lines.get(batch.id, {})]:
            if stop.is_set() or time.time() >= batch.expires_at:
                break
            if passes:
                await anyio.sleep(RETRY_S)
            await self._ask_pass(batch, unsettled, stop)
            passes += 1
        if stop.is_set():
            return "cancelled"
        return "expired" if len(self.store.lines.get(batch.id, {})) < len(lines) else None

    async def _ask_pass(self, batch: BatchRecord, lines: list[BatchLine], stop: anyio.Event) -> None:
        """Ask these lines, `batch_in_flight` at a time (for all batches together), until a stop or the deadline."""
        async with anyio.create_task_group() as tg:
            for line in lines:
                await self._window.acquire()
                if stop.is_set() or time.time() >= batch.expires_at:
                    self._window.release()
                    break
                tg.start_soon(self._ask, batch, line, stop)

    async def _ask(self, batch: BatchRecord, line: BatchLine, stop: anyio.Event) -> None:
        try:
            record = await ask_line(self.gateway, batch, line, stop)
            if record is not None:
                await self.store.put(record)
        finally:
            self._window.release()

    async def _finish(self, batch_id: str, lines: list[BatchLine], reason: str | None) -> None:
        """The output and error files, one line per custom_id between them, then the final status."""
        batch = self.store.batches[batch_id]
        if reason == "cancelled" and batch.status != "cancelling":
            batch = await self.store.update(batch, status="cancelling", cancelling_at=self.store.cancels[batch_id])
        elif reason is None and batch.status != "finalizing":
            batch = await self.store.update(batch, status="finalizing", finalizing_at=_now())
        settled = self.store.lines.get(batch_id, {})
        records = [settled.get(line.index) or not_run_line(batch, line, reason or "expired") for line in lines]
        ids = {}
        for outcome, role in (("completed", "output"), ("failed", "error")):
            chosen = [record.line for record in records if record.outcome == outcome]
            ids[role] = await self._save(batch, role, chosen) if chosen else None
        status, stamp = _FINAL[reason]
        await self.store.update(batch, status=status, **{stamp: _now()}, output_file_id=ids["output"],
                                error_file_id=ids["error"])
        log.info("gateway.batch_done", batch_id=batch_id, status=status, **self.store.counts(batch_id))

    async def _save(self, batch: BatchRecord, role: str, lines: list[dict]) -> str:
        content = b"".join(msgspec.json.encode(line) + b"\n" for line in lines)
        stored = await self.files.save(content, filename=f"{batch.id}_{role}.jsonl", purpose="batch_output",
                                       tenant=batch.tenant, file_id=derived_file_id(batch.id, role))
        return stored.id


def _now() -> int:
    return int(time.time())
