"""What the service commands (`kev serve`, `kev demo`) share: their --config/--model flags and loading
the config they run with. Not a command: COMMANDS does not list it."""

from __future__ import annotations

import argparse

import msgspec

from kev_async.settings import load_config_with_mappings, model_path_problem, set_threads
from schemas import ConfigError


def add_config_and_model(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="a kev.yaml (default: built-in defaults + KEV_* env)")
    parser.add_argument("--model", default=None, help="HF directory, .gguf or built-in name (core.model_path)")


def load_service_config(args: argparse.Namespace, *, check_model: bool = False, **kafka):
    """The config a command runs with (--config, KEV_*, --model, `kafka` overrides), logging set up by it.

    `check_model`: a core.model_path naming nothing on this host is a ConfigError (one line) before anything
    is logged or started."""
    import structlog

    from kev_async.logs import configure_logging  # structlog is slow to import: not loaded for `kev --help`

    cfg, mappings = load_config_with_mappings(args.config)
    if args.model:
        cfg = msgspec.structs.replace(cfg, core=msgspec.structs.replace(cfg.core, model_path=args.model))
    kafka = {k: v for k, v in kafka.items() if v}
    if kafka:
        cfg = msgspec.structs.replace(cfg, kafka=msgspec.structs.replace(cfg.kafka, **kafka))
    if check_model and (missing := model_path_problem(cfg.core.model_path)) is not None:
        raise ConfigError([("core.model_path", missing)])
    configure_logging(cfg.logging.level, cfg.logging.json)
    if mappings:  # the seed's names the file used, and what each became: one line at start
        structlog.get_logger("kev.config").info("config.seed_keys", mappings=mappings)
    set_threads(cfg.core.threads)
    return cfg


def sampling_params(args: argparse.Namespace) -> dict:
    """--max-new-tokens, --temperature and --seed as question params, those given only."""
    return {k: v for k, v in (("max_new_tokens", args.max_new_tokens), ("temperature", args.temperature),
                              ("seed", args.seed)) if v is not None}


def bad_sampling(params: dict) -> str | None:
    """Why `params` are not valid question params, named by their flag; None when they are. Checked before
    the model loads: a typo should not cost its seconds."""
    from schemas import Params
    from schemas._validation import explain

    try:
        msgspec.convert(params, Params)
    except msgspec.ValidationError as error:
        path, reason = explain(error, params, Params)
        return f"--{path.replace('_', '-')}: {reason}"
    return None
