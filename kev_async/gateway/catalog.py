"""What `GET /v1/models` lists and what a request's `model` may name: the served model, plus the LoRA
adapters commanded on the control topic.

The served model's id comes from config (`gateway.served_model_name`, else the last part of
`core.model_path`): the gateway loads no weights and trusts the workers behind it to run that
config. Adapters come from replaying kev.control, as every worker does: a `load_adapter` adds its
name, an `unload_adapter` removes it. That is what was commanded, not what each worker managed to
load; a worker that could not load it answers `unknown_adapter`, which the client sees as a 404.
"""

from __future__ import annotations

import time
from pathlib import PurePath

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream

from consumers import run_control_reader
from kev_async.gateway.errors import ApiError
from schemas import ControlEvent, KafkaConfig, KevConfig


def served_model_name(cfg: KevConfig) -> str:
    if cfg.gateway.served_model_name:
        return cfg.gateway.served_model_name
    return PurePath(cfg.core.model_path.rstrip("/\\")).name or cfg.core.model_path


class ModelCatalog:
    def __init__(self, model: str) -> None:
        self.model = model
        self.adapters: dict[str, int] = {}  # name -> when it was (last) loaded
        self.created = int(time.time())
        self._applied = 0

    def resolve(self, requested: str) -> str | None:
        """The adapter a request's `model` names (None for the base model); 404 for anything else."""
        if requested == self.model:
            return None
        if requested in self.adapters:
            return requested
        raise ApiError(404, f"The model `{requested[:200]}` does not exist or you do not have access to it.",
                       param="model", code="model_not_found")

    def listing(self) -> dict:
        base = {"id": self.model, "object": "model", "created": self.created, "owned_by": "kev"}
        adapters = [{"id": name, "object": "model", "created": created, "owned_by": "kev", "parent": self.model}
                    for name, created in sorted(self.adapters.items())]
        return {"object": "list", "data": [base, *adapters]}

    def apply(self, event: ControlEvent) -> None:
        if event.action == "load_adapter" and event.name:
            self.adapters[event.name] = int(time.time())
        elif event.action == "unload_adapter":
            self.adapters.pop(event.name or "", None)
        self._applied += 1

    async def follow(self, cfg: KafkaConfig, *, reader=run_control_reader,
                     task_status: TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        """Replay the control topic, then keep applying it until cancelled; ready once caught up."""
        send, receive = anyio.create_memory_object_stream[ControlEvent](64)
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._apply_all, receive)
            replayed = await tg.start(reader, cfg, send)
            while self._applied < replayed:
                await anyio.sleep(0.01)
            task_status.started()

    async def _apply_all(self, receive: MemoryObjectReceiveStream[ControlEvent]) -> None:
        async with receive:
            async for event in receive:
                self.apply(event)
