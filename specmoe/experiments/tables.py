"""TOML tables read with type checks for the experiment configs (`specmoe.experiments.config`): `Table` takes a
table's keys one by one, each checked for its type and range, and refuses the keys nobody took; every failure is a
`ConfigError` naming the file, the key, what was expected and what was found."""

from __future__ import annotations

import math


class ConfigError(ValueError):
    """A config file that cannot be run: bad syntax, an unknown key, a value of the wrong type or range, an
    unknown policy, drafter or selector, or a grid that does not fit the model (C > E)."""


def _describe(value) -> str:
    return f"{value!r}" if not isinstance(value, dict) else "a table"


class Table:
    """One TOML table being read: takes keys with type checks; `done()` refuses the keys nobody took."""

    def __init__(self, file: str, data, prefix: str = ""):
        self.file, self.prefix = file, prefix
        if not isinstance(data, dict):
            self.fail("", "expected a table", data)
        self.data = dict(data)

    def key(self, name: str) -> str:
        return f"{self.prefix}{name}"

    def fail(self, name: str, expected: str, value=None):
        got = "" if value is None else f", got {_describe(value)}"
        where = self.key(name) if name else self.prefix.rstrip(".") or "(top level)"
        raise ConfigError(f"{self.file}: {where}: {expected}{got}")

    def has(self, name: str) -> bool:
        return name in self.data

    def table(self, name: str) -> "Table":
        return Table(self.file, self.data.pop(name, {}), f"{self.key(name)}.")

    def string(self, name: str, default=None, choices=None, optional: bool = False):
        if name not in self.data:
            return default
        value = self.data.pop(name)
        if optional and value == "":
            return None
        if not isinstance(value, str) or (choices and value not in choices):
            self.fail(name, f"expected one of {', '.join(map(repr, choices))}" if choices else "expected a string",
                      value)
        return value

    def integer(self, name: str, default=None, minimum: int | None = None, maximum: int | None = None):
        if name not in self.data:
            return default
        value = self.data.pop(name)
        if not is_int(value, minimum, maximum):
            self.fail(name, f"expected an integer{_bounds(minimum, maximum)}", value)
        return value

    def number(self, name: str, default=None, minimum: float = 0.0):
        if name not in self.data:
            return default
        value = self.data.pop(name)
        if not is_number(value, minimum):
            self.fail(name, f"expected a number >= {minimum:g}", value)
        return float(value)

    def boolean(self, name: str, default=None):
        if name not in self.data:
            return default
        value = self.data.pop(name)
        if not isinstance(value, bool):
            self.fail(name, "expected true or false", value)
        return value

    def ints(self, name: str, default=(), minimum: int = 1, maximum: int | None = None) -> tuple[int, ...]:
        """An integer or a list of integers (a grid axis)."""
        if name not in self.data:
            return tuple(default)
        value = self.data.pop(name)
        items = value if isinstance(value, list) else [value]
        if not items or not all(is_int(v, minimum, maximum) for v in items):
            self.fail(name, f"expected an integer{_bounds(minimum, maximum)} or a non-empty list of them", value)
        return tuple(items)

    def numbers(self, name: str, default=(), minimum: float = 0.0) -> tuple[float, ...]:
        if name not in self.data:
            return tuple(default)
        value = self.data.pop(name)
        items = value if isinstance(value, list) else [value]
        if not items or not all(is_number(v, minimum) for v in items):
            self.fail(name, f"expected a number >= {minimum:g} or a non-empty list of them", value)
        return tuple(float(v) for v in items)

    def strings(self, name: str, default=(), choices=None) -> tuple[str, ...]:
        if name not in self.data:
            return tuple(default)
        value = self.data.pop(name)
        items = value if isinstance(value, list) else [value]
        if not items or not all(isinstance(v, str) for v in items):
            self.fail(name, "expected a string or a non-empty list of strings", value)
        for v in items:
            if choices and v not in choices:
                self.fail(name, f"expected some of {', '.join(map(repr, choices))}", v)
        return tuple(items)

    def done(self) -> None:
        if self.data:
            name = sorted(self.data)[0]
            self.fail(name, "unknown key (see docs/configs.md for the keys)")


def is_int(value, minimum, maximum=None) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool) and (minimum is None or value >= minimum)
            and (maximum is None or value <= maximum))


def _bounds(minimum, maximum) -> str:
    return ("" if minimum is None and maximum is None else f" <= {maximum}" if minimum is None
            else f" >= {minimum}" if maximum is None else f" in [{minimum}, {maximum}]")


def is_number(value, minimum) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and value >= minimum)
