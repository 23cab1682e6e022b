"""kev.models.load_kev_model: seed 000's model loader, over Kev's (engine/model/loader.py).

It loads as `kev ask` does: precision, weights and matmul kernel from the config (defaults plus KEV_*
environment), logs to stderr at its level, torch's threads as configured.
"""

from __future__ import annotations

import os

from engine import Model, load_model
from kev_async.logs import configure_logging
from kev_async.settings import load_config, set_threads
from schemas import KevConfig

DEVICE_MAPS = ("auto", "cpu", "cuda")  # Kev runs a model whole on one device


def load_kev_model(name_or_path: str | os.PathLike, device_map: str = "auto") -> Model:
    """A built-in name (smollm2-135m-instruct), an HF directory or a .gguf file, on `device_map`: "auto"
    (CUDA where present, else the CPU), "cpu" or "cuda". A name Kev cannot find raises ModelNotFound,
    which lists what it can load."""
    if device_map not in DEVICE_MAPS:
        raise ValueError(f"device_map={device_map!r}: Kev puts a model whole on one device; use one of "
                         f"{', '.join(map(repr, DEVICE_MAPS))} (auto: CUDA where present, else the CPU)")
    return model_from_config(load_config(), name_or_path, device_map)


def model_from_config(cfg: KevConfig, source: str | os.PathLike | None = None, device: str | None = None) -> Model:
    """The model `cfg` names (or `source`), loaded as `kev ask` loads it, with the process set up as it sets it."""
    configure_logging(cfg.logging.level, cfg.logging.json)
    set_threads(cfg.core.threads)
    return load_model(source or cfg.core.model_path, device=device or cfg.core.device, dtype=cfg.core.precision,
                      weights=cfg.core.weights, pack_fp32=cfg.core.pack_fp32, matmul=cfg.core.matmul)
