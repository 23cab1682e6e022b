"""The base of every kev.yaml section, and the number type most of their keys share."""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta, Struct

Positive = Annotated[int, Meta(ge=1)]


class Section(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A kev.yaml section: frozen, keys by name only, and an unknown key is an error (a typo must not
    silently fall back to a default)."""
