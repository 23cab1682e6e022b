"""Multi-LoRA: PEFT adapters read from disk, a small LRU pool of them, and the per-step batch that adds
each adapter's delta only to the rows of its own questions.

An adapter's rank, alpha, rsLoRA flag and target modules come from its adapter_config.json, never from
the caller, and are checked against its weights and the base model before it may serve.
Kev fuses q/k/v into one `qkv` matmul and gate/up into `gate_up`; an adapter is fused the same way, so a
fused projection gets one low-rank update: shrink (every target's A stacked) then expand (the B's laid
block-diagonally, with the scaling folded in). Parts of a fused matrix the adapter does not target get
exact zeros. In a forward, rows are grouped by adapter and each group meets only its own adapter's
weights (LoraBatch); rows of questions without an adapter get no delta at all.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

log = structlog.get_logger("kev.lora")

# Kev's fused projections and the PEFT target modules inside each, in the order of their output columns.
FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
         "down": ("down_proj",)}
TARGETS = tuple(t for targets in FUSED.values() for t in targets)
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# PEFT features that change the math beyond plain LoRA: refused by name rather than served wrong.
UNSUPPORTED = {"use_dora": False, "fan_in_fan_out": False, "lora_bias": False, "bias": "none",
               "rank_pattern": {}, "alpha_pattern": {}, "modules_to_save": None, "layer_replication": None,
               "exclude_modules": None, "trainable_token_indices": None}
_WEIGHT_KEY = re.compile(r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)"
                         r"\.lora_([AB])(?:\.\w+)?\.weight")


class AdapterError(ValueError):
    """An adapter that does not fit: the message names the adapter and the offending field."""


class UnknownAdapter(KeyError):
    """No adapter is registered under this name."""


class AdapterPoolFull(RuntimeError):
    """Every resident adapter is held by a question in flight; none can make room."""


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


# -- loading and checking ----------------------------------------------------------------------------

def load_adapter(name: str, path: str | Path, model, version: int = 1) -> LoraAdapter:
    """Read a PEFT LoRA directory and fuse it for `model`; AdapterError says what does not fit."""
    path = Path(path)
    config = read_config(name, path, model)
    weights = _read_weights(name, path)
    pairs = _pair_weights(name, weights, model.spec.num_layers)
    _check_targets(name, config, pairs)
    shapes = target_shapes(model.spec)
    layers = [_fuse_layer(name, config, pairs, layer, shapes, model) if layer in config.layers else {}
              for layer in range(model.spec.num_layers)]
    return LoraAdapter(name, version, path, config, layers)


def read_config(name: str, path: Path, model) -> AdapterConfig:
    file = path / CONFIG_FILE
    if not file.is_file():
        raise AdapterError(f"adapter {name!r}: {file} is missing")
    raw = json.loads(file.read_text())
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


def _read_weights(name: str, path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    file = path / WEIGHTS_FILE
    if not file.is_file():
        raise AdapterError(f"adapter {name!r}: {file} is missing")
    return load_file(str(file))


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


# -- the pool ------------------------------------------------------------------------------------

class LoraPool:
    """Adapters by name. At most `max_loras` are resident (weights in memory), least recently used
    evicted first, and never one a question in flight holds. An evicted adapter stays registered and
    is read back from its path when next asked for (under the same version: files must not change
    while registered; load the name again to serve new files).

    Each `load` of a name is a new version; questions keep the version they were admitted with, so a
    hot reload or unload never changes an answer under way (the old version lives on in the questions
    holding it and is freed when the last one ends). Not thread-safe: the device thread owns it.
    """

    def __init__(self, model, max_loras: int = 8):
        self.model = model
        self.max_loras = max_loras
        self._registered: dict[str, tuple[Path, int]] = {}  # name -> (path, current version)
        self._resident: OrderedDict[str, LoraAdapter] = OrderedDict()  # least recently used first
        self._holds: Counter[LoraAdapter] = Counter()
        self._versions: Counter[str] = Counter()  # never reused, even after an unload
        self.num_loads = 0

    def load(self, name: str, path: str | Path) -> LoraAdapter:
        """Register (or replace) `name`; the adapter is checked before anything changes."""
        adapter = self._read(name, path, self._versions[name] + 1)
        self._versions[name] = adapter.version
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
                raise AdapterPoolFull(f"all {self.max_loras} resident adapters (max_loras) are in use")
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

    def _read(self, name: str, path, version: int) -> LoraAdapter:
        self.num_loads += 1
        return load_adapter(name, path, self.model, version)


# -- one step's adapters -------------------------------------------------------------------------

@dataclass
class LoraBatch:
    """The adapters of one packed forward and the rows each owns; rows of no adapter get no delta.

    Per projection: one gather of every adapter row, grouped by adapter and padded to the largest
    group; two batched matmuls in which group g's rows meet only adapter g's weights; one scatter-add.
    A loop over groups would do the same arithmetic, but on CPU its cost is per-call overhead: the
    batched form is ~3x faster at 4 adapters x 8 decode rows.
    """

    layers: list[dict[str, FusedLora]]  # the groups' weights, stacked (see LoraStacks)
    rows: torch.Tensor  # [groups, width]: the rows of each group; padding repeats the group's first row
    keep: torch.Tensor | None  # [groups, width, 1]: 0 on padding, so it adds exact zeros; None if unpadded

    @classmethod
    def build(cls, spans, device, stacks: "LoraStacks", row_tile: int = 1) -> "LoraBatch | None":
        """`spans`: (adapter or None, first row, rows) per chunk; None when no chunk has an adapter.

        `row_tile` > 1 pads each group to whole tiles (deterministic mode: fixed-size row tiles keep a
        row's bits independent of how many rows share its matmul).
        """
        groups: dict[LoraAdapter, list[int]] = {}
        for adapter, start, length in spans:
            if adapter is not None:
                groups.setdefault(adapter, []).extend(range(start, start + length))
        if not groups:
            return None
        adapters = tuple(sorted(groups, key=lambda a: a.key))  # one order per mix: the stacks are reused
        width = -(-max(map(len, groups.values())) // row_tile) * row_tile
        rows = [groups[a] + [groups[a][0]] * (width - len(groups[a])) for a in adapters]
        keep = None
        if any(len(r) < width for r in groups.values()):
            keep = torch.tensor([[[float(i < len(groups[a]))] for i in range(width)] for a in adapters],
                                device=device, dtype=stacks.dtype)
        return cls(stacks.get(adapters), torch.tensor(rows, dtype=torch.long, device=device), keep)

    def add(self, layer: int, projection: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """out[rows] += each group's delta on x[rows], for its own rows only."""
        lora = self.layers[layer].get(projection)
        if lora is None:
            return
        shrunk = torch.bmm(x[self.rows], lora.shrink)
        if self.keep is not None:
            shrunk = shrunk * self.keep
        out.index_add_(0, self.rows.flatten(), torch.bmm(shrunk, lora.expand).flatten(0, 1))


class LoraStacks:
    """Adapter weights stacked per mix of adapters, kept for the next steps: a mix changes rarely
    (when a question with a new adapter arrives or the last one of an adapter leaves). The few most
    recent mixes are kept; an older mix, and the adapters only it refers to, is dropped."""

    def __init__(self, dtype: torch.dtype, keep_mixes: int = 8):
        self.dtype = dtype
        self.keep_mixes = keep_mixes
        self._mixes: OrderedDict[tuple[LoraAdapter, ...], list[dict[str, FusedLora]]] = OrderedDict()

    def get(self, adapters: tuple[LoraAdapter, ...]) -> list[dict[str, FusedLora]]:
        if adapters not in self._mixes:
            self._mixes[adapters] = [_stack_layer([a.layers[i] for a in adapters])
                                     for i in range(len(adapters[0].layers))]
            while len(self._mixes) > self.keep_mixes:
                self._mixes.popitem(last=False)
        self._mixes.move_to_end(adapters)
        return self._mixes[adapters]


def _stack_layer(per_adapter: list[dict[str, FusedLora]]) -> dict[str, FusedLora]:
    stacked = {}
    for projection in FUSED:
        parts = [layer.get(projection) for layer in per_adapter]
        present = [p for p in parts if p is not None]
        if not present:
            continue
        rank = max(p.shrink.shape[1] for p in present)
        features_in, features_out = present[0].shrink.shape[0], present[0].expand.shape[1]
        like = present[0].shrink
        # Ranks differ between adapters, and some skip a projection: zero padding adds exact zeros.
        shrinks = [like.new_zeros(features_in, rank) if p is None else _pad(p.shrink, 1, rank) for p in parts]
        expands = [like.new_zeros(rank, features_out) if p is None else _pad(p.expand, 0, rank) for p in parts]
        stacked[projection] = FusedLora(torch.stack(shrinks), torch.stack(expands))
    return stacked


def _pad(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    missing = size - t.shape[dim]
    if not missing:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t, t.new_zeros(shape)], dim)
