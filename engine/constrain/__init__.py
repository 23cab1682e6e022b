"""Structured answers: per-question token masks from a JSON schema, regex or grammar (llguidance)."""

from engine.constrain.constraints import Constraints
from engine.constrain.masks import RowMasks
from engine.constrain.spec import ConstraintSpec, InvalidConstraint, check, spec_of

__all__ = ["ConstraintSpec", "Constraints", "InvalidConstraint", "RowMasks", "check", "spec_of"]
