"""The one model loader every benchmark uses: torch threads from --threads, then the model from --model."""

from __future__ import annotations

import argparse


def bench_model(args: argparse.Namespace):
    from engine import load_model
    from kev_async.settings import set_threads

    set_threads(args.threads)
    return load_model(args.model)
