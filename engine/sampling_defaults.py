"""Sampling defaults that can change while serving; each question keeps the version it was admitted with."""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass, replace

import msgspec

from engine.sequence import SamplingParams
from schemas import DEFAULT_CONFIG, SamplingConfig

_SAMPLING = DEFAULT_CONFIG.sampling


@dataclass(frozen=True)
class Defaults:
    """kev.yaml's `sampling` section at one version; a field's default is the schema's."""

    version: int = 1
    temperature: float = _SAMPLING.temperature
    top_p: float = _SAMPLING.top_p
    top_k: int = _SAMPLING.top_k
    repetition_penalty: float = _SAMPLING.repetition_penalty
    max_new_tokens: int = _SAMPLING.max_new_tokens
    seed: int | None = _SAMPLING.seed

    @classmethod
    def from_config(cls, sampling: SamplingConfig) -> "Defaults":
        """The first version of a config's sampling defaults."""
        return cls(**msgspec.structs.asdict(sampling))


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
            logprobs=params.top_logprobs if params.logprobs else None,
            logprobs_mode=params.logprobs_mode,
        )
