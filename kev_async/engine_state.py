"""What control commands changed in an engine, kept outside the scheduler actor so a restart keeps it.

The supervisor restarts the scheduler actor after a crash, and the restarted actor builds a fresh
Engine: without this, every adapter loaded and every default updated since start-up would be gone
(the control topic is replayed only when the control actor starts, not when the scheduler does).
The actor records each command it applied here; a new Engine gets all of it back before it takes
its first question: the adapters under the same versions, the defaults under the same version.

    state = ControlState()   # one per device, made where the actor's Child is made
    Child("scheduler", partial(engine_actor, engine_factory=make_engine, state=state), ...)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from engine import Engine
from engine.sampling_defaults import Defaults

log = structlog.get_logger("kev.engine_actor")


@dataclass
class ControlState:
    adapters: dict[str, tuple[Path, int]] = field(default_factory=dict)  # name -> (path, version) served now
    defaults: Defaults | None = None  # None: never updated, the configured ones stand
    # control command_id -> (succeeded, reply or error): a replayed command is not applied twice,
    # by this engine or by the one that replaces it.
    applied: dict[int, tuple[bool, Any]] = field(default_factory=dict)

    def adapter_loaded(self, name: str, path: Path, version: int) -> None:
        self.adapters.pop(name, None)  # re-inserted last: re-applied in the order they were loaded
        self.adapters[name] = (Path(path), version)

    def adapter_unloaded(self, name: str) -> None:
        self.adapters.pop(name, None)

    def defaults_updated(self, defaults: Defaults) -> None:
        self.defaults = defaults

    async def reapply(self, engine: Engine) -> None:
        """Give a fresh engine what its predecessor served. An adapter whose files can no longer be read
        is dropped (logged): questions naming it get `unknown_adapter`, and the engine still starts."""
        if self.defaults is not None:
            engine.restore_defaults(self.defaults)
        for name, (path, version) in list(self.adapters.items()):
            try:
                await engine.load_adapter(name, path, version)
            except Exception as error:  # noqa: BLE001 - one adapter's files must not stop the engine
                log.error("engine_actor.adapter_not_restored", adapter=name, path=str(path), version=version,
                          error=str(error), error_type=type(error).__name__)
                del self.adapters[name]
        if self.defaults is not None or self.adapters:
            log.info("engine_actor.state_restored", adapters={n: v for n, (_, v) in self.adapters.items()},
                     defaults_version=engine.defaults.version)
