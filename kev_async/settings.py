"""Load kev.yaml, map the seed articles' spelling onto Kev's keys, apply KEV_* environment overrides, and
validate into a KevConfig.

`KEV_<SECTION>__<KEY>[__<KEY>]` sets any key (values parsed as YAML scalars); a few short names
(KEV_MODEL, KEV_TEMPERATURE, ...: schemas.ENV_SHORTCUTS) cover the common ones. An empty value means
unset, as if the variable were not there. Other KEV_ names are left alone. Seed names (schemas/seed_keys.py)
are read from the file only; the environment speaks Kev's names.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec
import msgspec.inspect as mi
import yaml

from schemas import ENV_SHORTCUTS, ConfigError, KevConfig, config_from_dict
from schemas.config import BUILTIN_MODEL_NAMES
from schemas.seed_keys import map_seed_keys

SECRET_KEYS = {("kafka", "security", "sasl_plain_password"), ("kafka", "trust", "keys"), ("gateway", "api_keys")}
_SCHEMA = mi.type_info(KevConfig)


def load_config(path: str | Path | None = None, env: Mapping[str, str] = os.environ) -> KevConfig:
    """The config from `path` (None: defaults only) with env overrides; raise ConfigError."""
    return load_config_with_mappings(path, env)[0]


def load_config_with_mappings(path: str | Path | None = None,
                              env: Mapping[str, str] = os.environ) -> tuple[KevConfig, list[str]]:
    """The config, and one line per seed key or value the file used and what it became in Kev's names."""
    source = str(path) if path is not None else None
    seed = map_seed_keys(read_yaml(Path(path)) if path is not None else {})
    overrides = env_overrides(env)
    try:
        cfg = config_from_dict(_merge(seed.data, overrides))
    except ConfigError as error:
        raise ConfigError(seed.problems + _blame_env(error.problems, overrides), source) from None
    if seed.problems:
        raise ConfigError(seed.problems, source)
    return cfg, seed.notes


def model_path_problem(model_path: str) -> str | None:
    """Why `core.model_path` names nothing Kev can load on this host (engine/model/loader.py's rules), or None.

    Checked by `kev config check` and `kev serve`, not by every command: a gateway's host need not hold the model.
    """
    if model_path in BUILTIN_MODEL_NAMES:
        return None
    path = Path(model_path).expanduser()
    if path.is_dir():
        return None if (path / "config.json").is_file() else f"{model_path} has no config.json (not an HF model folder)"
    if path.is_file():
        return None if path.suffix == ".gguf" else f"{model_path} is a file but not a .gguf"
    return (f"{model_path} does not exist (a model folder, a .gguf file, or a built-in name: "
            f"{', '.join(BUILTIN_MODEL_NAMES)})")


def read_yaml(path: Path) -> dict:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError([("", "file not found")], str(path)) from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError([("", f"cannot read: {error}")], str(path)) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ConfigError([("", _yaml_problem(error))], str(path)) from None
    return {} if data is None else data


def env_overrides(env: Mapping[str, str]) -> dict[tuple[str, ...], tuple[str, Any]]:
    """Key path → (env var name, parsed value); raise ConfigError for names of unknown keys.

    An empty (or blank) value is no override, the shell's usual meaning: `KEV_TEMPERATURE=` leaves the default."""
    overrides, unknown = {}, []
    for name in sorted(env):
        keys = _env_keys(name)
        if keys is None or not env[name].strip():
            continue
        target = _field_type(keys)
        if target is None:
            unknown.append((".".join(keys), f"unknown key (from {name})"))
            continue
        overrides[keys] = (name, _parse_env_value(env[name], target))
    if unknown:
        raise ConfigError(unknown, "environment")
    return overrides


def resolved_dict(cfg: KevConfig, redact: bool = True) -> dict:
    """The config as plain data for printing; secrets shown as '***' unless redact=False."""
    data = msgspec.to_builtins(cfg)
    for keys in SECRET_KEYS if redact else ():
        parent = data
        for key in keys[:-1]:
            parent = parent[key]
        if parent[keys[-1]] not in (None, {}):  # an empty key table has nothing to hide
            parent[keys[-1]] = "***"
    return data


def _env_keys(name: str) -> tuple[str, ...] | None:
    if name in ENV_SHORTCUTS:
        return ENV_SHORTCUTS[name]
    if not name.startswith("KEV_") or "__" not in name:
        return None  # other KEV_ variables (paths, test switches) are not config keys
    return tuple(part.lower() for part in name[len("KEV_"):].split("__"))


def _field_type(keys: tuple[str, ...]) -> Any:
    info = _SCHEMA
    for key in keys:
        fields = info.fields if isinstance(info, mi.StructType) else ()
        info = next((field.type for field in fields if field.encode_name == key), None)
        if info is None:
            return None
    return None if isinstance(info, mi.StructType) else info  # a whole section is not a value


def _parse_env_value(raw: str, target: Any) -> Any:
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw
    # A password of 123456 or a group id of "007" is still a string.
    if _accepts_str(target) and value is not None and not isinstance(value, str):
        return raw
    return value


def _accepts_str(info: Any) -> bool:
    options = info.types if isinstance(info, mi.UnionType) else (info,)
    return any(
        isinstance(t, mi.StrType) or (isinstance(t, mi.LiteralType) and isinstance(t.values[0], str))
        for t in options
    )


def _merge(data: Any, overrides: dict[tuple[str, ...], tuple[str, Any]]) -> Any:
    if not overrides or not isinstance(data, dict):
        return data  # a non-mapping file is reported by validation, overrides or not
    merged = copy.deepcopy(data)
    for keys, (_, value) in overrides.items():
        node = merged
        for key in keys[:-1]:
            if node.get(key) is None:
                node[key] = {}
            node = node[key]
            if not isinstance(node, dict):
                break  # the file's own type error for this section is the one to report
        else:
            node[keys[-1]] = value
    return merged


def _blame_env(problems: list[tuple[str, str]], overrides: dict) -> list[tuple[str, str]]:
    by_path = {".".join(keys): name for keys, (name, _) in overrides.items()}
    return [(path, f"{reason} (from {by_path[path]})" if path in by_path else reason)
            for path, reason in problems]


def _yaml_problem(error: yaml.YAMLError) -> str:
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    return f"not valid YAML{where}: {problem}"


def set_threads(threads: int | None) -> None:
    """Torch's CPU threads for every command: as configured, else one per core (at most 16)."""
    import torch  # heavy: not imported for `kev --help` or `kev config check`

    torch.set_num_threads(threads or min(os.cpu_count() or 1, 16))
