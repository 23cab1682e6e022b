"""What the service commands (`kev serve`, `kev demo`) share: their --config/--model flags and loading
the config they run with. Not a command: COMMANDS does not list it."""

from __future__ import annotations

import argparse

import msgspec

from kev_async.settings import load_config, set_threads


def add_config_and_model(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="a kev.yaml (default: built-in defaults + KEV_* env)")
    parser.add_argument("--model", default=None, help="HF directory, .gguf or built-in name (core.model_path)")


def load_service_config(args: argparse.Namespace, **kafka):
    from kev_async.logs import configure_logging  # structlog is slow to import: not loaded for `kev --help`

    cfg = load_config(args.config)
    if args.model:
        cfg = msgspec.structs.replace(cfg, core=msgspec.structs.replace(cfg.core, model_path=args.model))
    kafka = {k: v for k, v in kafka.items() if v}
    if kafka:
        cfg = msgspec.structs.replace(cfg, kafka=msgspec.structs.replace(cfg.kafka, **kafka))
    configure_logging(cfg.logging.level, cfg.logging.json)
    set_threads(cfg.core.threads)
    return cfg
