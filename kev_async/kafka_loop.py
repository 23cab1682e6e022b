"""The Kafka loop's fate decides the process's: when it ends on its own, the process ends non-zero.

A worker whose Kafka loop has died consumes nothing while its other actors look fine, and nothing
inside the process can bring the loop back safely (its producer gave up, or the broker refused
the answers topic), so the watch logs one line, requests shutdown, cancels the rest of the service
(nothing it holds can be answered or committed now: Kafka redelivers it) and `kev serve` exits 1
for compose, systemd or Kubernetes to restart it.

    watch = KafkaLoopWatch(shutdown)
    Child("kafka", partial(watch.run, worker), policy=RestartPolicy(restart="temporary"))
    async with anyio.create_task_group() as tg:
        watch.scope = tg.cancel_scope
        ...
    watch.raise_if_failed()     # KafkaLoopFailed
"""

from __future__ import annotations

import anyio
import structlog
from anyio.abc import TaskStatus

from consumers.publish.delivery import PublishFailed
from kev_async.runtime.lifecycle import Shutdown
from kev_async.runtime.supervisor import ReadyOnce

log = structlog.get_logger("kev.app")

EXIT_KAFKA_FAILED = 1


class KafkaLoopFailed(RuntimeError):
    """The Kafka loop ended while the service was meant to run; `kev serve` exits EXIT_KAFKA_FAILED."""


class KafkaLoopWatch:
    def __init__(self, shutdown: Shutdown) -> None:
        self.shutdown = shutdown
        self.scope: anyio.CancelScope | None = None  # the service's scope: cancelled when the loop fails
        self.error: BaseException | None = None

    async def run(self, worker, *, task_status: TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        """Run `worker` (a KafkaWorker); a failure, or an end nobody asked for, fails the service."""
        ready = ReadyOnce(task_status)
        try:
            await worker.run(task_status=ready)
        except Exception as error:  # noqa: BLE001 - any end of the loop ends the process, see the module
            self._failed(error)
        else:
            if not self.shutdown.requested.is_set():
                self._failed(RuntimeError("the Kafka loop stopped on its own (its engine actor is gone)"))
        ready.started()  # a loop that failed while starting: let the service go on to its shutdown

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise KafkaLoopFailed(f"the Kafka loop failed: {self.error}") from self.error

    def _failed(self, error: BaseException) -> None:
        self.error = error
        expected = isinstance(error, PublishFailed)  # says all in its message; anything else needs its trace
        log.error("kev.kafka_failed", error=str(error) or repr(error), error_type=type(error).__name__,
                  action=f"stopping: exit code {EXIT_KAFKA_FAILED}, uncommitted questions are redelivered",
                  exc_info=None if expected else error)
        self.shutdown.request("kafka_failed")
        if self.scope is not None:
            self.scope.cancel()
