"""`kev config check`: validate a kev.yaml plus KEV_* overrides and print it resolved, with the seed keys
it mapped onto Kev's names (schemas/seed_keys.py) as comments ahead of the YAML."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import yaml

from kev_async.settings import load_config_with_mappings, model_path_problem, resolved_dict
from schemas import ConfigError


def register(subparsers: argparse._SubParsersAction) -> None:
    config = subparsers.add_parser("config", help="check and show configuration files",
                                   description="Work with kev.yaml configuration files.")
    actions = config.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    check = actions.add_parser(
        "check", help="validate a config file and print it resolved",
        description="Validate FILE plus KEV_* environment overrides. The seed articles' spelling (a kev: root, "
                    "isolation.shared_prefix, deploy.mode multi_gpu, ...) is mapped onto Kev's keys, each mapping "
                    "printed as a '# seed ...' comment. On success print the full resolved config as YAML "
                    "(secrets masked) and exit 0; otherwise print each problem as 'FILE: key.path: reason' to "
                    "stderr and exit 2. core.model_path must name a model on this host.",
    )
    check.add_argument("file", metavar="FILE", type=Path, help="the YAML config, e.g. ops/kev.yaml")
    check.add_argument("--no-env", action="store_true", help="ignore KEV_* environment overrides")
    check.set_defaults(func=_config_check)


def _config_check(args: argparse.Namespace) -> int:
    try:
        cfg, mappings = load_config_with_mappings(args.file, env={} if args.no_env else os.environ)
        if problem := model_path_problem(cfg.core.model_path):
            raise ConfigError([("core.model_path", problem)])
    except ConfigError as error:
        error.source = error.source or str(args.file)
        for line in error.lines():
            print(line, file=sys.stderr)
        return 2
    for mapping in mappings:  # comments: the output stays the YAML of the resolved config
        print(f"# {mapping}")
    print(yaml.safe_dump(resolved_dict(cfg), sort_keys=False), end="")
    return 0
