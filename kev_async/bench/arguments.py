"""argparse types the benchmarks share."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def positive_ints(what: str, example: str) -> Callable[[str], list[int]]:
    """A type for a comma list of whole numbers, each 1 or more (`what` and `example` word the errors)."""

    def parse(text: str) -> list[int]:
        try:
            values = [int(part) for part in text.split(",") if part.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: give {what} like {example}") from None
        if not values or min(values) < 1:
            raise argparse.ArgumentTypeError(f"{text!r}: {what} must be 1 or more")
        return values

    parse.__name__ = what  # argparse names the type in its own messages
    return parse


def positive_int(what: str) -> Callable[[str], int]:
    """A type for one whole number, 1 or more."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: {what} must be a whole number") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{text!r}: {what} must be 1 or more")
        return value

    parse.__name__ = what
    return parse
