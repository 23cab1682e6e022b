"""A parsed kev.yaml checked against the schema (schemas/config.py): a KevConfig, or a ConfigError that
names every bad key, so one run of `kev config check` lists them all."""

from __future__ import annotations

from typing import Any

import msgspec
import msgspec.inspect as mi

from schemas._validation import explain, show, struct_fields
from schemas.config import KevConfig

_MAX_PROBLEMS = 50


class ConfigError(Exception):
    """Every problem found, each as (dotted key path, reason); `source` names the file, if any."""

    def __init__(self, problems: list[tuple[str, str]], source: str | None = None) -> None:
        self.problems = list(problems)
        self.source = source
        super().__init__(self.problems)

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def lines(self) -> list[str]:
        """One `[source: ]key.path: reason` line per problem."""
        prefix = f"{self.source}: " if self.source else ""
        return [prefix + (f"{path}: {reason}" if path else reason) for path, reason in self.problems]


def config_from_dict(data: Any) -> KevConfig:
    """Validate a parsed kev.yaml (or {}) into a KevConfig; raise ConfigError naming every bad key."""
    if not isinstance(data, dict):
        raise ConfigError([("", f"expected a mapping of sections at the top level, got {show(data)}")])
    data = _drop_empty_sections(data, mi.type_info(KevConfig))
    problems: list[tuple[str, str]] = []
    while len(problems) < _MAX_PROBLEMS:
        try:
            config = msgspec.convert(data, KevConfig)
            break
        except msgspec.ValidationError as error:
            problems.append(_with_yaml_hint(*explain(error, data, KevConfig)))
            # msgspec stops at the first error; drop that key and look again so one run lists all.
            if not _remove_key(data, problems[-1][0]):
                break
    if problems:
        raise ConfigError(problems)
    return config


def _with_yaml_hint(path: str, reason: str) -> tuple[str, str]:
    # YAML 1.1 reads an unquoted off/on/no/yes as a boolean: `method: off` arrives as false.
    if reason.startswith("expected str") and reason.endswith(("got bool true", "got bool false")):
        reason += " (YAML reads unquoted off, on, no and yes as booleans: quote the word, e.g. 'off')"
    return path, reason


def _remove_key(data: dict, dotted: str) -> bool:
    *parents, leaf = dotted.split(".")
    for key in parents:
        data = data.get(key) if isinstance(data, dict) else None
    if not isinstance(data, dict) or leaf not in data:
        return False
    del data[leaf]
    return True


def _drop_empty_sections(data: dict, info: Any) -> dict:
    # `scheduler:` with every key commented out parses as None; read it as "all defaults".
    fields = struct_fields(info)
    out = {}
    for key, value in data.items():
        is_section = isinstance(fields.get(key), mi.StructType)
        if is_section and value is None:
            continue
        out[key] = _drop_empty_sections(value, fields[key]) if is_section and isinstance(value, dict) else value
    return out
