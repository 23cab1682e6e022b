"""`kev model prepare`: resolve a model and convert a GGUF once into the cache."""

from __future__ import annotations

import argparse
import sys

from schemas import DEFAULT_MODEL


def register(subparsers: argparse._SubParsersAction) -> None:
    model = subparsers.add_parser("model", help="prepare models", description="Prepare models for serving.")
    actions = model.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    prepare = actions.add_parser(
        "prepare", help="convert a GGUF (or the built-in model) once into the cache",
        description="Resolve MODEL and convert it to safetensors under KEV_CACHE_DIR if it is a GGUF (a GGUF "
                    "whose blocks core.weights: auto keeps: its config and tokenizer only); later loads take "
                    "about a second.")
    prepare.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    prepare.set_defaults(func=_prepare)


def _prepare(args: argparse.Namespace) -> int:
    # torch is heavy: not for --help
    from engine.model.gguf_weights import runs_as_stored
    from engine.model.loader import ModelNotFound, UnsupportedModel, gguf_file, resolve_model_dir

    try:
        gguf = gguf_file(args.model)
        print(resolve_model_dir(args.model, weights=gguf is None or not runs_as_stored(gguf)))
    except (ModelNotFound, UnsupportedModel) as exc:
        print(f"kev model prepare: {exc}", file=sys.stderr)
        return 2
    return 0
