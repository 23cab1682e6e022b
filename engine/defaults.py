"""Sampling defaults that can change while serving; each question keeps the version it was admitted with."""

from __future__ import annotations

import os
import secrets
import threading
from dataclasses import dataclass, replace

from engine.schedule.sequence import SamplingParams


@dataclass(frozen=True)
class Defaults:
    version: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    max_new_tokens: int = 256
    seed: int | None = None

    @classmethod
    def from_env(cls, env=os.environ, **overrides) -> "Defaults":
        """`KEV_TEMPERATURE` sets the default temperature when the caller gives none."""
        if "temperature" not in overrides and env.get("KEV_TEMPERATURE"):
            overrides["temperature"] = float(env["KEV_TEMPERATURE"])
        return cls(**overrides)


class DefaultsRegistry:
    """Holds the current Defaults; every update makes a new version. Safe to call from any thread."""

    def __init__(self, initial: Defaults) -> None:
        self._current = initial
        self._lock = threading.Lock()

    @property
    def current(self) -> Defaults:
        return self._current

    def update(self, **changes) -> Defaults:
        unknown = set(changes) - (set(Defaults.__dataclass_fields__) - {"version"})
        if unknown:
            raise ValueError(f"unknown default(s): {', '.join(sorted(unknown))}")
        with self._lock:
            self._current = replace(self._current, version=self._current.version + 1, **changes)
            return self._current

    def restore(self, defaults: Defaults) -> None:
        """Serve `defaults`, version included (a restarted engine taking up where its predecessor was)."""
        with self._lock:
            self._current = defaults

    def resolve(self, params, stop_token_ids: tuple[int, ...]) -> SamplingParams:
        """A question's own params over the current defaults; no seed given means a fresh random one."""
        d = self._current

        def pick(name):
            value = getattr(params, name)
            return getattr(d, name) if value is None else value

        seed = pick("seed")
        return SamplingParams(
            max_new_tokens=pick("max_new_tokens"),
            temperature=pick("temperature"),
            top_p=pick("top_p"),
            top_k=pick("top_k"),
            repetition_penalty=pick("repetition_penalty"),
            seed=secrets.randbits(63) if seed is None else seed,
            stop=tuple(params.stop),
            stop_token_ids=stop_token_ids,
            defaults_version=d.version,
        )
