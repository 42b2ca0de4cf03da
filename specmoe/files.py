"""Reading and writing the project's array files (calibrations, traces): safetensors with JSON-able string
metadata, written atomically so that an interrupted run never leaves a truncated file."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np


def _write_atomic(path: str | os.PathLike, write) -> Path:
    """Call write(temporary path), then rename the temporary file to `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)
    return path


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write a text file (results tables, JSON) through a temporary file and a rename."""
    return _write_atomic(path, lambda tmp: tmp.write_text(text))


def write_safetensors(path: str | os.PathLike, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> Path:
    """Write `tensors` with `metadata` to `path` through a temporary file and a rename."""
    from safetensors.numpy import save_file

    arrays = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    return _write_atomic(path, lambda tmp: save_file(arrays, str(tmp), metadata=metadata))


def read_safetensors(path: str | os.PathLike, error: type[Exception], what: str) -> tuple[dict, dict]:
    """(metadata, arrays) of the safetensors file at `path`; `error(...)` naming `what` is raised for a
    missing or unreadable file."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise error(f"no {what} file at {path}")
    try:
        with safe_open(str(path), framework="numpy") as f:
            return f.metadata() or {}, {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:  # safetensors raises several types for a corrupt header
        raise error(f"{path} is not a readable safetensors file: {exc}") from exc
