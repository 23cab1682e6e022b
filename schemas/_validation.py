"""Shared constrained types and the translation of msgspec errors into `key.path: reason` form.

Events and config both validate with msgspec `Meta`; this module turns msgspec's terse messages
into ones that name the field, the offending value and what is allowed.
"""

from __future__ import annotations

import difflib
import re
from typing import Annotated, Any

import msgspec
import msgspec.inspect as mi
from msgspec import Meta

# Sampling limits, shared by per-question Params and the config's engine-wide defaults.
MaxNewTokens = Annotated[int, Meta(ge=1, le=32768)]
Temperature = Annotated[float, Meta(ge=0, le=10)]
TopP = Annotated[float, Meta(gt=0, le=1)]
TopK = Annotated[int, Meta(ge=0, le=1_000_000)]
RepetitionPenalty = Annotated[float, Meta(gt=0, le=10)]
Seed = Annotated[int, Meta(ge=0, le=2**63 - 1)]
StopString = Annotated[str, Meta(min_length=1, max_length=256)]
StopStrings = Annotated[tuple[StopString, ...], Meta(max_length=16)]

# Hard ceilings of the wire: the schema types enforce these whatever the config says; `kafka.limits`
# (schemas/config.py) may only set tighter bounds. Ids are echoed on every answer, so their ceiling
# also bounds an answer's size.
ID_CHARS_CEILING = 256  # question_id, request_id, tenant, cache_salt, adapter name
TOPIC_CHARS_CEILING = 249  # Kafka's own limit on a topic name
TEXT_CHARS_CEILING = 1_000_000  # any one prompt, system prompt or message
MESSAGES_CEILING = 4096
EVENT_BYTES_CEILING = 8_000_000
CONSTRAINT_CHARS_CEILING = 1_000_000  # a response_format's schema (as JSON), regex or grammar

_MISSING = object()
_AT = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_PATH_PART = re.compile(r"\.([^.\[\]]+)|\[(\d+|\.\.\.)\]")  # msgspec writes a dict value as [...]
_BOUND = re.compile(r"^Expected `\w+` (?P<op>>=|>|<=|<) (?P<bound>\S+)$")
_LENGTH = re.compile(r"^Expected `(?P<kind>\w+)` of length (?P<op>>=|<=) (?P<bound>\d+)$")
_TYPE = re.compile(r"^Expected `(?P<want>[^`]+)`, got `(?P<got>[^`]+)`$")
_FIELD = re.compile(r"^Object (?P<what>missing required|contains unknown) field `(?P<name>[^`]+)`$")


def explain(error: msgspec.ValidationError, data: Any, root: type) -> tuple[str, str]:
    """Return (dotted key path, reason) for a ValidationError raised converting `data` to `root`."""
    match = _AT.match(str(error))
    message, keys = match["msg"], _named_entries(_parse_path(match["path"] or ""), data, root)
    field = _FIELD.match(message)
    if field:
        return _field_problem(field, keys, root)
    value = _lookup(data, keys)
    tags = _tags(_resolve(mi.type_info(root), keys[:-1])) if message.startswith("Invalid value") else ()
    if tags:  # a tagged union's tag, e.g. response_format.type
        return format_path(keys), f"{show(value)} is not one of: {', '.join(tags)}"
    return format_path(keys), _reason(message, value, _resolve(mi.type_info(root), keys))


def format_path(keys: list[str | int]) -> str:
    out = ""
    for key in keys:
        if isinstance(key, int) or key == "[value]":
            out += f"[{key}]" if isinstance(key, int) else key
        else:
            out += f".{key}" if out else key
    return out


def struct_fields(info: Any) -> dict[str, Any]:
    """Field name → type info of a struct type, looking through `X | None`."""
    info = _unwrap_optional(info)
    if not isinstance(info, mi.StructType):
        return {}
    return {f.encode_name: f.type for f in info.fields}


def show(value: Any) -> str:
    """A value as it would appear in the input, short enough for a log line."""
    if value is _MISSING:
        return "(missing)"
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    if isinstance(value, str):
        return repr(value if len(value) <= 40 else value[:37] + "...")
    if isinstance(value, (list, dict)):
        return f"a {'list' if isinstance(value, list) else 'mapping'} of {len(value)}"
    return str(value)


def _field_problem(field: re.Match, keys: list, root: type) -> tuple[str, str]:
    path = format_path([*keys, field["name"]])
    if field["what"] == "missing required":
        return path, "missing required field"
    known = sorted(struct_fields(_resolve(mi.type_info(root), keys)))
    close = difflib.get_close_matches(field["name"], known, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return path, f"unknown key ({hint}allowed: {', '.join(known)})"


def _reason(message: str, value: Any, info: Any) -> str:
    if m := _BOUND.match(message):
        return _bound_reason(m["op"], _number(m["bound"]), value, info)
    if m := _LENGTH.match(message):
        return _length_reason(m["kind"], m["op"], int(m["bound"]), value)
    if m := _TYPE.match(message):
        # "got str 'x'" names the value too; "got null" already is the value.
        scalar = not isinstance(value, (list, dict)) and value is not _MISSING and value is not None
        return f"expected {m['want']}, got {m['got']}" + (f" {show(value)}" if scalar else "")
    if message.startswith("Invalid enum value"):
        allowed = ", ".join(str(v) for v in getattr(info, "values", ()))
        return f"{show(value)} is not one of: {allowed}" if allowed else message
    if message == "Number out of range":
        return f"{show(value)} is out of range{_allowed(info)}"
    return message


def _bound_reason(op: str, bound: float, value: Any, info: Any) -> str:
    words = {">=": "is below", ">": "must be above", "<=": "is above", "<": "must be below"}
    return f"{show(value)} {words[op]} {show(bound)}{_allowed(info)}"


def _length_reason(kind: str, op: str, bound: int, value: Any) -> str:
    size = len(value) if hasattr(value, "__len__") else "?"
    if kind == "str" and op == ">=" and size == 0:
        return "empty"
    unit = "characters" if kind == "str" else "items"
    limit = "at least" if op == ">=" else "at most"
    return f"{size} {unit}, {limit} {bound} allowed"


def _allowed(info: Any) -> str:
    """' (allowed: 0 to 10)' from a numeric type's Meta bounds, or '' when there are none."""
    ge, gt, le, lt = (getattr(info, name, None) for name in ("ge", "gt", "le", "lt"))
    if ge is not None and le is not None:
        return f" (allowed: {show(ge)} to {show(le)})"
    parts = [f"{op} {show(bound)}" for op, bound in ((">=", ge), (">", gt), ("<=", le), ("<", lt))
             if bound is not None]
    return f" (allowed: {' and '.join(parts)})" if parts else ""


def _number(text: str) -> int | float:
    return int(text) if text.lstrip("-").isdigit() else float(text)  # keep big int bounds exact


def _parse_path(path: str) -> list[str | int]:
    return [name or (int(index) if index.isdigit() else "[value]") for name, index in _PATH_PART.findall(path)]


def _named_entries(keys: list[str | int], data: Any, root: type) -> list[str | int]:
    """msgspec names any value of a mapping `[...]`; where the values are structs, put back the key of the
    first entry that does not convert (`tenants.acme.weight`, not `tenants[value].weight`)."""
    named: list[str | int] = []
    for key in keys:
        if key == "[value]":
            mapping = _lookup(data, named)
            values = getattr(_resolve(mi.type_info(root), named), "value_type", None)
            cls = getattr(_unwrap_optional(values), "cls", None)
            if isinstance(mapping, dict) and cls is not None:
                key = next((k for k, v in mapping.items() if not _converts(v, cls)), key)
        named.append(key)
    return named


def _converts(value: Any, cls: type) -> bool:
    try:
        msgspec.convert(value, cls)
    except msgspec.ValidationError:
        return False
    return True


def _lookup(data: Any, keys: list[str | int]) -> Any:
    for key in keys:
        try:
            data = data[key]
        except (KeyError, IndexError, TypeError):
            return _MISSING
    return data


def _resolve(info: Any, keys: list[str | int]) -> Any:
    """The msgspec type info at `keys` below `info`, or None when the path leaves the schema."""
    for key in keys:
        info = _unwrap_optional(info)
        if isinstance(key, int):
            info = getattr(info, "item_type", None)
        elif isinstance(info, mi.DictType):
            info = info.value_type
        else:
            info = struct_fields(info).get(key)
        if info is None:
            return None
    return _unwrap_optional(info)


def _tags(info: Any) -> tuple[str, ...]:
    """The tags of a union of tagged structs (their `type` values), or () for anything else."""
    types = getattr(_unwrap_optional(info), "types", ())
    return tuple(t.tag for t in types if isinstance(t, mi.StructType) and t.tag is not None)


def _unwrap_optional(info: Any) -> Any:
    if isinstance(info, mi.UnionType):
        real = [t for t in info.types if not isinstance(t, mi.NoneType)]
        return real[0] if len(real) == 1 else info
    return info
