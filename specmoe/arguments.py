"""Argument checks shared by the `specmoe` commands. A bad value is reported in one line that names the
argument (exit status 2, see `specmoe.cli`), as early as it can be known: by argparse for plain values,
right after the model is loaded for values that depend on it, always before the computation starts."""

from __future__ import annotations

import argparse


def int_at_least(minimum: int, maximum: int | None = None):
    """An argparse type: an integer >= minimum (and <= maximum, one of the stated maxima of
    `specmoe.limits`, where given)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum}, got {value}")
        return value

    return parse


def int_list(minimum: int):
    """An argparse type: comma-separated integers, each >= minimum (e.g. capacities "32,16")."""
    parse_one = int_at_least(minimum)

    def parse(text: str) -> tuple[int, ...]:
        return tuple(parse_one(item.strip()) for item in text.split(","))

    return parse


def check_positions(model, length: int, argument: str) -> None:
    """Raise ValueError if windows of `length` tokens exceed the positions the model was built for."""
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit and length > limit:
        raise ValueError(f"{argument} {length} exceeds the {limit} positions of the model")
