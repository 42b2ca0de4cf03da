"""Checks at the boundaries of the routing core: nothing a numba kernel indexes with goes in unchecked.

The kernels of `kernels.py` index their state with layers, expert ids, token ids and CSR offsets without
bounds checks, so a value out of range there is a crash or a silently wrong result, never a Python error.
Whatever enters the routing core (calibrations and traces as they are made or loaded, policies, the
arguments of `LogicalCache` and `replay`) is checked with these functions first, once per file, array or
call of a span: dtypes, shapes, index ranges against L, E and V, finiteness, rankings that must be
permutations. Each check raises the error type its caller passes (CalibrationError, PolicyError, TraceError,
ValueError) with a message that names the field and the bad value.
"""

from __future__ import annotations

import numbers

import numpy as np


def integer(value, name: str, error: type[Exception] = ValueError, minimum: int | None = None,
            maximum: int | None = None) -> int:
    """`value` as a Python int: an integer (numpy integers too, not a bool) in [minimum, maximum]."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise error(f"{name} must be an integer, got {value!r}")
    value = int(value)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        bounds = f">= {minimum}" if maximum is None else f"<= {maximum}" if minimum is None else \
            f"in [{minimum}, {maximum}]"
        raise error(f"{name} must be {bounds}, got {value}")
    return value


def real(value, name: str, error: type[Exception] = ValueError, minimum: float | None = None) -> float:
    """`value` as a finite Python float (numpy floats and integers too, not a bool), at least `minimum`."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise error(f"{name} must be a real number, got {value!r}")
    value = float(value)
    if not np.isfinite(value) or (minimum is not None and value < minimum):
        raise error(f"{name} must be finite" + (f" and >= {minimum:g}" if minimum is not None else "")
                    + f", got {value}")
    return value


def integer_array(value, name: str, error: type[Exception], ndim: int) -> np.ndarray:
    """`value` as an int64 array of `ndim` dimensions; floats, bools and other dtypes are refused (an
    empty array may be float, as np.asarray([]) is)."""
    array = np.asarray(value)
    if array.ndim != ndim:
        raise error(f"{name} must have {ndim} dimension(s), got shape {array.shape}")
    if array.dtype.kind not in "iu" and not (array.size == 0 and array.dtype.kind == "f"):
        raise error(f"{name} must hold integers, got dtype {array.dtype}")
    return array.astype(np.int64, copy=False)


def real_array(value, name: str, error: type[Exception], ndim: int, dtype=None) -> np.ndarray:
    """`value` as an array of real numbers (no bool, complex or object dtype) with `ndim` dimensions; with
    `dtype`, a C-contiguous copy of that dtype where it is not one already."""
    array = np.asarray(value)
    if array.ndim != ndim:
        raise error(f"{name} must have {ndim} dimension(s), got shape {array.shape}")
    if array.dtype.kind not in "fiu":
        raise error(f"{name} must hold real numbers, got dtype {array.dtype}")
    return array if dtype is None else np.ascontiguousarray(array, dtype=dtype)


def _at(array: np.ndarray, bad: np.ndarray) -> str:
    """'entry [i, j] is v': the first True entry of `bad` (same shape as `array`) and its value."""
    index = np.unravel_index(int(np.flatnonzero(bad)[0]), array.shape)
    return f"entry [{', '.join(str(int(i)) for i in index)}] is {array[index]}"


def check_real(array: np.ndarray, name: str, error: type[Exception], minimum: float | None = None,
               maximum: float | None = None) -> None:
    """Raise unless every entry of `array` is finite (no NaN, no infinity) and within [minimum, maximum]."""
    bad = ~np.isfinite(array)
    if minimum is not None:
        bad |= array < minimum
    if maximum is not None:
        bad |= array > maximum
    if bad.any():
        bounds = (f" in [{minimum:g}, {maximum:g}]" if minimum is not None and maximum is not None
                  else f" and >= {minimum:g}" if minimum is not None
                  else f" and <= {maximum:g}" if maximum is not None else "")
        raise error(f"{name} must be finite (no NaN or infinity){bounds}; {_at(array, bad)}")


def check_range(array: np.ndarray, low: int, high: int, name: str, error: type[Exception], what: str = "") -> None:
    """Raise unless every entry of the integer `array` is in [low, high); `what` says what the range is."""
    if array.size and (array.min() < low or array.max() >= high):
        bad = (array < low) | (array >= high)
        raise error(f"{name}: {_at(array, bad)}, outside [{low}, {high})" + (f" ({what})" if what else ""))


def check_permutations(ranking: np.ndarray, name: str, error: type[Exception]) -> None:
    """Raise unless each row of the int64 array `ranking` [L, E] lists every expert 0..E-1 exactly once."""
    check_range(ranking, 0, ranking.shape[1], name, error, "expert ids of a layer")
    wrong = np.flatnonzero((np.sort(ranking, axis=1) != np.arange(ranking.shape[1])).any(axis=1))
    if wrong.size:
        layer = int(wrong[0])
        experts, counts = np.unique(ranking[layer], return_counts=True)
        raise error(f"{name} of layer {layer} lists expert {int(experts[counts > 1][0])} more than once; "
                    "each layer must rank every expert exactly once")


def token_ids(tokens, num_tokens: int | None, vocab_size: int, name: str, error: type[Exception],
              unknown_ok: bool = False) -> np.ndarray:
    """Token ids as an int64 array [num_tokens] (any length if None), each in [0, vocab_size); with
    `unknown_ok`, -1 (a position whose input token is not known) too."""
    array = integer_array(tokens, name, error, 1)
    if num_tokens is not None and array.shape[0] != num_tokens:
        raise error(f"{name} must hold {num_tokens} positions, got {array.shape[0]}")
    check_range(array, -1 if unknown_ok else 0, vocab_size, name, error, f"vocabulary of {vocab_size}"
                + (", or -1 for an unknown token" if unknown_ok else ""))
    return np.ascontiguousarray(array)


def bad_call(method: str, layer, num_layers: int, lengths: dict) -> ValueError:
    """The error of a `LogicalCache` call whose layer is outside [0, L) or one of whose arrays has the
    wrong length; lengths maps an argument name to (array, expected length). Built only once a check has
    failed (for the engine's per-layer calls, a check inside the kernel), so correct calls never pay for it."""
    if not (isinstance(layer, numbers.Integral) and 0 <= layer < num_layers):
        return ValueError(f"{method}: layer {layer!r} is outside [0, {num_layers}) (MoE layers of the cache)")
    for name, (array, expected) in lengths.items():
        if np.ndim(array) != 1 or len(array) != expected:
            return ValueError(f"{method}: {name} must be 1-D of length {expected}, got shape {np.shape(array)}")
    return ValueError(f"{method}: bad arguments")
