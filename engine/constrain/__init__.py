"""Structured answers: per-question token masks from a JSON schema, regex or grammar (llguidance).

What a format means as grammar text, and whether it is valid, is schemas/constraint.py's: the gateway
checks formats there too, without loading the engine."""

from engine.constrain.constraints import Constraints
from engine.constrain.masks import RowMasks

__all__ = ["Constraints", "RowMasks"]
