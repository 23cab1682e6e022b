"""LoRA adapters on disk: PEFT's file format read, checked against the base model, and fused.

An adapter's rank, alpha, rsLoRA flag and target modules come from its adapter_config.json, never from
the caller, and are checked against its weights and the base model before it may serve.
Kev fuses q/k/v into one `qkv` matmul and gate/up into `gate_up`; an adapter is fused the same way, so a
fused projection gets one low-rank update: shrink (every target's A stacked) then expand (the B's laid
block-diagonally, with the scaling folded in). Parts of a fused matrix the adapter does not target get
exact zeros. engine/adapters/pool.py keeps loaded adapters; engine/adapters/lora.py applies them in a forward.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch
from safetensors.torch import load

log = structlog.get_logger("kev.lora")

# Kev's fused projections and the PEFT target modules inside each, in the order of their output columns.
FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
         "down": ("down_proj",)}
TARGETS = tuple(t for targets in FUSED.values() for t in targets)
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20  # a PEFT adapter_config.json is a few KB
# PEFT features that change the math beyond plain LoRA: refused by name rather than served wrong.
UNSUPPORTED = {"use_dora": False, "fan_in_fan_out": False, "lora_bias": False, "bias": "none",
               "rank_pattern": {}, "alpha_pattern": {}, "modules_to_save": None, "layer_replication": None,
               "exclude_modules": None, "trainable_token_indices": None}
_WEIGHT_KEY = re.compile(r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)"
                         r"\.lora_([AB])(?:\.\w+)?\.weight")


class AdapterError(ValueError):
    """An adapter that does not fit: the message names the adapter and the offending field."""


@dataclass(frozen=True)
class AdapterConfig:
    rank: int
    alpha: float
    use_rslora: bool
    targets: frozenset[str]
    layers: tuple[int, ...]  # the layers adapted (PEFT's layers_to_transform; all by default)
    base_model: str | None

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


@dataclass(frozen=True)
class FusedLora:
    """The low-rank update of one fused projection: delta = x @ shrink @ expand.

    A step's adapters are stacked in front: shrink [groups, in, rank], expand [groups, rank, out].
    """

    shrink: torch.Tensor  # [in, sum of ranks]: every target's A (transposed), side by side
    expand: torch.Tensor  # [sum of ranks, fused out]: the B's (transposed) block-diagonal, times the scaling


@dataclass(eq=False)
class LoraAdapter:
    """One loaded version of a named adapter. Compared by identity: a reload is a new object."""

    name: str
    version: int
    path: Path
    config: AdapterConfig
    layers: list[dict[str, FusedLora]]  # per layer: fused projection name -> its update

    @property
    def key(self) -> tuple[str, int]:
        """What any cache of computed state must be keyed on, so nothing crosses adapters or versions."""
        return (self.name, self.version)


def load_adapter(name: str, path: str | Path, model, version: int = 1) -> LoraAdapter:
    """Read a PEFT LoRA directory and fuse it for `model`; AdapterError says what does not fit."""
    path = Path(path)
    config = read_config(name, path, model)
    weights = _read_weights(name, path, model.spec)
    pairs = _pair_weights(name, weights, model.spec.num_layers)
    _check_targets(name, config, pairs)
    shapes = target_shapes(model.spec)
    layers = [_fuse_layer(name, config, pairs, layer, shapes, model) if layer in config.layers else {}
              for layer in range(model.spec.num_layers)]
    return LoraAdapter(name, version, path, config, layers)


def read_config(name: str, path: Path, model) -> AdapterConfig:
    raw = json.loads(read_adapter_file(name, path / CONFIG_FILE, MAX_CONFIG_BYTES))
    if not isinstance(raw, dict):
        raise AdapterError(f"adapter {name!r}: {CONFIG_FILE} holds a {type(raw).__name__}, not an object")
    if raw.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"adapter {name!r}: peft_type is {raw['peft_type']!r}; Kev serves LORA adapters")
    for field_name, plain in UNSUPPORTED.items():
        if raw.get(field_name) not in (plain, None, {}, [], False):
            raise AdapterError(f"adapter {name!r}: {field_name}={raw[field_name]!r} is not supported")
    rank, alpha = raw.get("r"), raw.get("lora_alpha")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"adapter {name!r}: r must be a positive integer, not {rank!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        raise AdapterError(f"adapter {name!r}: lora_alpha must be a positive number, not {alpha!r}")
    _check_base_model(name, raw.get("base_model_name_or_path"), model)
    num_layers = model.spec.num_layers
    return AdapterConfig(rank=rank, alpha=float(alpha), use_rslora=bool(raw.get("use_rslora")),
                         targets=_targets(name, raw.get("target_modules"), num_layers),
                         layers=_layers(name, raw.get("layers_to_transform"), num_layers),
                         base_model=raw.get("base_model_name_or_path"))


def target_shapes(spec) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of every target module of the base model."""
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    hidden, inter = spec.hidden_size, spec.intermediate_size
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def _targets(name: str, value, num_layers: int) -> frozenset[str]:
    if value == "all-linear":  # PEFT's shorthand: every linear layer but the output head
        return frozenset(TARGETS)
    if isinstance(value, str):  # a regex over full module names, as PEFT matches it
        modules = {f"model.layers.{i}.{'self_attn' if t in FUSED['qkv'] + ('o_proj',) else 'mlp'}.{t}": t
                   for i in range(num_layers) for t in TARGETS}
        found = frozenset(t for full, t in modules.items() if re.fullmatch(value, full))
    elif isinstance(value, (list, tuple)):
        found = frozenset(value)
    else:
        raise AdapterError(f"adapter {name!r}: target_modules {value!r} is neither a list nor a pattern")
    unknown = sorted(found - set(TARGETS))
    if unknown or not found:
        raise AdapterError(f"adapter {name!r}: target_modules {sorted(found) or value!r} — Kev adapts only "
                           f"{', '.join(TARGETS)}" + (f"; not {', '.join(unknown)}" if unknown else ""))
    return found


def _layers(name: str, value, num_layers: int) -> tuple[int, ...]:
    if value is None:
        return tuple(range(num_layers))
    layers = (value,) if isinstance(value, int) else tuple(value)
    if any(not 0 <= i < num_layers for i in layers):
        raise AdapterError(f"adapter {name!r}: layers_to_transform {list(layers)} outside the base model's "
                           f"{num_layers} layers")
    return tuple(sorted(set(layers)))


def _check_base_model(name: str, declared: str | None, model) -> None:
    """Names only loosely: 'HuggingFaceTB/SmolLM2-135M-Instruct' is the local 'smollm2-135m-instruct'."""
    if not declared:
        log.warning("lora.base_model_unknown", adapter=name, model=model.name)
        return
    ours = {_plain(model.name), _plain(getattr(model.hf_config, "_name_or_path", "") or "")} - {""}
    theirs = _plain(declared)
    if ours and not any(theirs in n or n in theirs for n in ours):
        raise AdapterError(f"adapter {name!r}: base_model_name_or_path {declared!r} is not the loaded "
                           f"model {model.name!r}")


def _plain(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", Path(str(name)).name.lower())


def read_adapter_file(name: str, file: Path, max_bytes: int) -> bytes:
    """The bytes of a regular file, at most `max_bytes`, through one descriptor.

    adapters.root vets the directory only: a file inside it could be a symlink to anywhere, a FIFO or
    a device (/dev/zero would never end a read on the device thread). So the file itself is opened
    without following a symlink and without blocking (a FIFO's open waits for a writer otherwise),
    and only then checked, on the descriptor: what is checked is what is read."""
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise AdapterError(f"adapter {name!r}: {file} is missing") from None
    except OSError as error:
        why = "it is a symbolic link" if os.path.islink(file) else error.strerror or str(error)
        raise AdapterError(f"adapter {name!r}: {file} could not be read: {why}; Kev reads adapter files "
                           f"only as regular files, never through a symbolic link") from None
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise AdapterError(f"adapter {name!r}: {file} could not be read: it is not a regular file")
        if info.st_size > max_bytes:
            raise AdapterError(f"adapter {name!r}: {file} could not be read: {info.st_size} bytes, "
                               f"at most {max_bytes} expected")
        data = handle.read(max_bytes + 1)  # a file growing while read is cut off here
    if len(data) > max_bytes:
        raise AdapterError(f"adapter {name!r}: {file} could not be read: it grew beyond {max_bytes} bytes")
    return data


def max_weights_bytes(spec) -> int:
    """A bound no LoRA of this base model reaches: rank min(in, out) on every target of every layer
    (a full-rank update) in fp32, plus room for the safetensors header."""
    full = sum(2 * fin * fout for fin, fout in target_shapes(spec).values())
    return full * spec.num_layers * 4 + MAX_CONFIG_BYTES


def _read_weights(name: str, path: Path, spec) -> dict[str, torch.Tensor]:
    return load(read_adapter_file(name, path / WEIGHTS_FILE, max_weights_bytes(spec)))


def _pair_weights(name: str, weights: dict[str, torch.Tensor], num_layers: int) -> dict:
    """(layer, target) -> {"A": tensor, "B": tensor}; any other key is an error."""
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in weights.items():
        match = _WEIGHT_KEY.fullmatch(key)
        if not match or match[2] not in TARGETS or int(match[1]) >= num_layers:
            raise AdapterError(f"adapter {name!r}: weight {key!r} is not a LoRA weight of a target Kev adapts "
                               f"({', '.join(TARGETS)}, layers 0-{num_layers - 1})")
        pairs.setdefault((int(match[1]), match[2]), {})[match[3]] = tensor
    for (layer, target), pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"adapter {name!r}: layer {layer} {target} has lora_{'A' if 'B' in pair else 'B'} "
                               f"missing")
    return pairs


def _check_targets(name: str, config: AdapterConfig, pairs: dict) -> None:
    expected = {(layer, t) for layer in config.layers for t in config.targets}
    if set(pairs) != expected:
        held = sorted({t for _, t in pairs})
        extra, missing = sorted(set(pairs) - expected), sorted(expected - set(pairs))
        raise AdapterError(f"adapter {name!r}: target_modules {sorted(config.targets)} do not match the weights, "
                           f"which hold {held}" + (f"; unexpected {extra[:3]}" if extra else "")
                           + (f"; missing {missing[:3]}" if missing else ""))


def _fuse_layer(name: str, config: AdapterConfig, pairs: dict, layer: int, shapes: dict, model) -> dict:
    fused = {}
    for projection, targets in FUSED.items():
        if not config.targets.intersection(targets):
            continue
        shrinks, expands = [], []
        for target in targets:
            features_in, features_out = shapes[target]
            pair = pairs.get((layer, target))
            if pair is None:  # not targeted: zeros keep this part of the fused output as the base computes it
                pair = {"A": torch.zeros(0, features_in), "B": torch.zeros(features_out, 0)}
            else:
                _check_pair(name, config.rank, layer, target, pair, features_in, features_out)
            shrinks.append(pair["A"].float())
            expands.append(pair["B"].float() * config.scaling)
        fused[projection] = FusedLora(
            shrink=torch.cat(shrinks).t().to(model.device, model.dtype).contiguous(),
            expand=torch.block_diag(*expands).t().to(model.device, model.dtype).contiguous())
    return fused


def _check_pair(name: str, rank: int, layer: int, target: str, pair: dict, features_in: int,
                features_out: int) -> None:
    a, b = tuple(pair["A"].shape), tuple(pair["B"].shape)
    where = f"adapter {name!r}: layer {layer} {target}"
    if a[0] != rank or b[-1] != rank:
        raise AdapterError(f"{where}: r is {rank} in {CONFIG_FILE} but lora_A is {a} and lora_B is {b}")
    if a != (rank, features_in) or b != (features_out, rank):
        raise AdapterError(f"{where}: shapes lora_A {a}, lora_B {b} do not fit the base model's "
                           f"{features_in} -> {features_out} projection")
