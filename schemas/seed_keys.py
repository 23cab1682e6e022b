"""The seed articles' kev.yaml spelling, mapped once onto Kev's keys before the schema sees the file.

Seed 002 (§3.2) prints a kev.yaml under a `kev:` root, with keys and values Kev spells otherwise or
does not need; seed 000 names two switches. Each is mapped here onto Kev's one name for the knob (or
onto nothing, where Kev always behaves as the seed asks), and each mapping is returned as a note that
`kev config check` prints and `kev serve` logs at start. Nothing past the config loader sees a seed
name. Values that cannot mean what the seed says, or seed keys that contradict each other, are
problems naming their key. Unknown keys elsewhere stay the schema's errors.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from schemas._validation import show

SEED_ROOT = "kev"
_ABSENT = object()
_KV_CACHE = {  # isolation.kv_cache: what each value is in Kev
    "split": "nothing to set: each question's KV blocks are its own, taken as its tokens arrive, never a "
             "max_context slot up front (Kev's paged pool)",
    "shared_readonly": None,  # read-only shared prefix blocks: an isolation.level, settled with shared_prefix
    "unified": "nothing to set: Kev keeps one preallocated block pool for every question (kv_cache.num_blocks)",
}
_SHARING_LEVELS = ("system_prefix", "shared")  # the isolation levels that read other questions' blocks
_SAME_VALUES = {  # (section, key) -> {seed value: Kev value, why}
    ("deploy", "mode"): {"multi_gpu": ("multi", "deploy.workers worker processes on this host, one per GPU")},
    ("isolation", "level"): {"loose": ("system_prefix", "the system prompt's KV blocks are shared within the "
                                       "prefix scope, each question's own turns are not (seed 002 §2.2)")},
}
_ALWAYS_ON = {  # (section, key) -> (what Kev always does, why false cannot be)
    ("isolation", "ignore_pad_in_attention"): (
        "Kev never pads: each question's rows attend only to its own keys, so no pad token is ever visible",
        "Kev packs questions without padding, so there is no pad to attend to; drop the key or set true"),
    ("kv_cache", "contiguous_first"): (
        "Kev's allocator always takes a contiguous run of free blocks first, right behind a question's "
        "last block where it can (engine/kv/block_pool.py)",
        "Kev's allocator always prefers contiguous block runs; it has no other order to switch to"),
}


@dataclass
class SeedMapping:
    """A parsed kev.yaml in Kev's names, the mappings applied (one line each), and what could not be mapped."""

    data: Any
    notes: list[str] = field(default_factory=list)
    problems: list[tuple[str, str]] = field(default_factory=list)


def map_seed_keys(data: Any) -> SeedMapping:
    """`data` (a parsed kev.yaml, left unchanged) with every seed key and value in Kev's names."""
    out = SeedMapping(data)
    if not isinstance(data, dict):
        return out  # the schema says what a non-mapping file is
    out.data = copy.deepcopy(_unwrap_root(data, out))
    if not isinstance(out.data, dict):
        return out
    for (section, key), values in _SAME_VALUES.items():
        _rename_value(out, section, key, values)
    _int8_precision(out)
    _isolation(out)
    for (section, key), (always, never) in _ALWAYS_ON.items():
        _always_on(out, section, key, always, never)
    return out


def _unwrap_root(data: dict, out: SeedMapping) -> Any:
    if SEED_ROOT not in data:
        return data
    beside = sorted(str(k) for k in data if k != SEED_ROOT)
    if beside:
        out.problems.append((SEED_ROOT, f"a `kev:` root holds the whole config; found beside it: {', '.join(beside)}"))
        return {k: v for k, v in data.items() if k != SEED_ROOT}
    out.notes.append("seed root kev: → its sections are read as the file's top level")
    return {} if data[SEED_ROOT] is None else data[SEED_ROOT]


def _section(out: SeedMapping, name: str) -> dict | None:
    section = out.data.get(name)
    return section if isinstance(section, dict) else None  # absent, or the schema's error


def _rename_value(out: SeedMapping, section: str, key: str, values: dict) -> None:
    found = _section(out, section)
    value = found.get(key) if found is not None else None
    if isinstance(value, str) and value in values:
        kev_value, why = values[value]
        found[key] = kev_value
        out.notes.append(f"seed value {section}.{key}: {value} → {section}.{key}: {kev_value} ({why})")


def _int8_precision(out: SeedMapping) -> None:
    # Seed 002 lists int8 beside fp16 and bf16; in Kev int8 is a weight format (core.weights), computed in the
    # default precision, so `precision: int8` becomes both keys.
    core = _section(out, "core")
    if core is None or core.get("precision") != "int8":
        return
    if core.get("weights", "int8") != "int8":
        out.problems.append(("core.precision", f"int8 means int8 weights (core.weights: int8) at the default "
                                               f"compute precision, but core.weights is {show(core['weights'])}"))
        del core["precision"]  # reported here: the schema need not refuse it too
        return
    core["precision"], core["weights"] = "auto", "int8"
    out.notes.append("seed value core.precision: int8 → core.weights: int8, core.precision: auto "
                     "(int8 weights, computed in the default precision: fp32 on CPU, bf16 on CUDA)")


def _isolation(out: SeedMapping) -> None:
    section = _section(out, "isolation")
    if section is None:
        return
    shared_prefix = section.pop("shared_prefix", _ABSENT)
    kv_cache = section.pop("kv_cache", _ABSENT)
    if shared_prefix is not _ABSENT and not isinstance(shared_prefix, bool):
        out.problems.append(("isolation.shared_prefix", f"expected true or false, got {show(shared_prefix)}"))
        shared_prefix = _ABSENT
    if kv_cache is not _ABSENT and kv_cache not in _KV_CACHE:
        out.problems.append(("isolation.kv_cache", f"{show(kv_cache)} is not one of: {', '.join(_KV_CACHE)}"))
        kv_cache = _ABSENT
    if kv_cache == "shared_readonly" and shared_prefix is False:
        out.problems.append(("isolation.kv_cache", "shared_readonly shares read-only prefix blocks, but "
                                                   "isolation.shared_prefix is false"))
        return
    if kv_cache is not _ABSENT and _KV_CACHE[kv_cache] is not None:
        out.notes.append(f"seed key isolation.kv_cache: {kv_cache} → {_KV_CACHE[kv_cache]}")
    if shared_prefix is not _ABSENT:
        _share_prefix(out, section, "isolation.shared_prefix", shared_prefix)
        if kv_cache == "shared_readonly":
            out.notes.append("seed key isolation.kv_cache: shared_readonly → the read-only shared prefix blocks "
                             "isolation.shared_prefix: true maps")
    elif kv_cache == "shared_readonly":
        _share_prefix(out, section, "isolation.kv_cache", True, shown="shared_readonly")


def _share_prefix(out: SeedMapping, section: dict, seed_key: str, share: bool, shown: str | None = None) -> None:
    """Seed 002 §2.2: shared_prefix keeps the common prefix (the system prompt) once, read-only, and every other
    token strictly per question; with `level: shared` (which includes it) the level stands."""
    level = section.get("level")
    shown = shown or show(share)
    if not isinstance(level, (str, type(None))) or level not in (None, "strict", *_SHARING_LEVELS):
        return  # the schema names a bad level
    if not share and level in _SHARING_LEVELS:
        out.problems.append((seed_key, f"{shown} contradicts isolation.level: {level}, which shares prefix blocks"))
        return
    target = ("shared" if level == "shared" else "system_prefix") if share else "strict"
    section["level"] = target
    was = f" (from isolation.level: {level})" if level not in (None, target) else ""
    out.notes.append(f"seed key {seed_key}: {shown} → isolation.level: {target}{was}")


def _always_on(out: SeedMapping, section_name: str, key: str, always: str, never: str) -> None:
    section = _section(out, section_name)
    value = section.pop(key, _ABSENT) if section is not None else _ABSENT
    path = f"{section_name}.{key}"
    if value is _ABSENT:
        return
    if value is True:
        out.notes.append(f"seed key {path}: true → nothing to set: {always}")
    elif value is False:
        out.problems.append((path, f"false is not possible: {never}"))
    else:
        out.problems.append((path, f"expected true or false, got {show(value)}"))
