"""The adapters an engine serves: registered by name, versioned on every load, a few resident (LRU)."""

from __future__ import annotations

from collections import Counter, OrderedDict
from pathlib import Path

import structlog

from engine.adapters.files import AdapterError, LoraAdapter, load_adapter

log = structlog.get_logger("kev.lora")


class UnknownAdapter(KeyError):
    """No adapter is registered under this name."""


class AdapterPoolFull(RuntimeError):
    """Every resident adapter is held by a question in flight; none can make room. The engine's questions
    wait for a slot instead (the scheduler offers them one as they come up for admission)."""


class LoraPool:
    """Adapters by name. At most `max_loras` (adapters.max_resident) are resident (weights in memory), least
    recently used evicted first, and never one a question in flight holds. An evicted adapter stays registered and
    is read back from its path when next asked for (under the same version: files must not change
    while registered; load the name again to serve new files).

    Each `load` of a name is a new version; questions keep the version they were admitted with, so a
    hot reload or unload never changes an answer under way (the old version lives on in the questions
    holding it and is freed when the last one ends). Not thread-safe: the device thread owns it.
    """

    def __init__(self, model, max_loras: int):
        self.model = model
        self.max_loras = max_loras
        self._registered: dict[str, tuple[Path, int]] = {}  # name -> (path, current version)
        self._resident: OrderedDict[str, LoraAdapter] = OrderedDict()  # least recently used first
        self._holds: Counter[LoraAdapter] = Counter()
        self._versions: Counter[str] = Counter()  # never reused, even after an unload
        self.num_loads = 0

    def load(self, name: str, path: str | Path, version: int | None = None) -> LoraAdapter:
        """Register (or replace) `name`; the adapter is checked before anything changes.

        `version`: the version to serve it under (re-applying a predecessor engine's load after a
        restart, so answers and prefix-cache keys keep their numbering); default the next one."""
        adapter = self._read(name, path, version or self._versions[name] + 1)
        self._versions[name] = max(self._versions[name], adapter.version)
        self._registered[name] = (adapter.path, adapter.version)
        self._resident.pop(name, None)
        if self._make_room():
            self._resident[name] = adapter
        log.info("lora.loaded", adapter=name, version=adapter.version, path=str(adapter.path),
                 rank=adapter.config.rank, alpha=adapter.config.alpha, targets=sorted(adapter.config.targets))
        return adapter

    def unload(self, name: str) -> None:
        """New questions may no longer ask for `name`; those in flight finish with their version."""
        if self._registered.pop(name, None) is None:
            raise UnknownAdapter(name)
        self._resident.pop(name, None)
        log.info("lora.unloaded", adapter=name)

    def acquire(self, name: str) -> LoraAdapter:
        """The current version of `name`, held until `release`; made resident if it is not."""
        adapter = self._resident.get(name)
        if adapter is None:
            if name not in self._registered:
                raise UnknownAdapter(name)
            if not self._make_room():
                raise AdapterPoolFull(f"all {self.max_loras} resident adapters (adapters.max_resident) are in use")
            path, version = self._registered[name]
            adapter = self._resident[name] = self._read(name, path, version)
        self._resident.move_to_end(name)
        self._holds[adapter] += 1
        return adapter

    def release(self, adapter: LoraAdapter | None) -> None:
        if adapter is not None:
            self._holds[adapter] -= 1
            if self._holds[adapter] <= 0:
                del self._holds[adapter]

    @property
    def resident(self) -> list[str]:
        """Names in memory, least recently used first."""
        return list(self._resident)

    @property
    def registered(self) -> list[str]:
        return list(self._registered)

    def _make_room(self) -> bool:
        """Evict idle adapters, oldest use first, until one more fits; False if all are held."""
        while len(self._resident) >= self.max_loras:
            idle = next((n for n, a in self._resident.items() if not self._holds[a]), None)
            if idle is None:
                return False
            del self._resident[idle]
            log.info("lora.evicted", adapter=idle)
        return True

    def current(self, name: str) -> tuple[Path, int]:
        """(path, version) of what `name` serves now; UnknownAdapter if it is not registered."""
        if name not in self._registered:
            raise UnknownAdapter(name)
        return self._registered[name]

    def _read(self, name: str, path, version: int) -> LoraAdapter:
        """Read and check an adapter; whatever goes wrong (a file cut short, bad JSON, a corrupt
        safetensors header) is an AdapterError, so it ends only the questions that asked for it."""
        self.num_loads += 1
        try:
            return load_adapter(name, path, self.model, version)
        except AdapterError:
            raise
        except Exception as exc:  # noqa: BLE001 - any unreadable file is this adapter's problem alone
            raise AdapterError(f"adapter {name!r}: could not be read from {path}: "
                               f"{type(exc).__name__}: {exc}") from exc
