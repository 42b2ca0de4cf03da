"""Reading and writing the project's files: array files (calibrations, traces) as safetensors with JSON-able
string metadata, text results, and the result directory of a run. Everything is written under a temporary
name unique to the process and renamed into place, so an interrupted run never leaves a truncated file, two
processes writing the same path do not collide, and the files of one run are replaced together. Commands
check their output paths with `check_output_file` / `check_output_dir` before they compute anything."""

from __future__ import annotations

import errno
import hashlib
import os
import secrets
import shutil
from pathlib import Path

import numpy as np


def _temporary(path: Path, kind: str = "tmp") -> Path:
    """A sibling of `path` no other process uses: <name>.<kind>-<pid>-<random>."""
    return path.with_name(f"{path.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}")


def _write_atomic(path: str | os.PathLike, write) -> Path:
    """Call write(temporary path), then rename the temporary file to `path` (removed again on failure)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary(path)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write a text file (results tables, JSON) through a temporary file and a rename."""
    return _write_atomic(path, lambda tmp: tmp.write_text(text))


def write_file_atomic(path: str | os.PathLike, write) -> Path:
    """Call write(temporary path) to make the file (a parquet table, say), then rename it to `path`."""
    return _write_atomic(path, write)


def write_safetensors(path: str | os.PathLike, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> Path:
    """Write `tensors` with `metadata` to `path` through a temporary file and a rename."""
    from safetensors.numpy import save_file

    arrays = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    return _write_atomic(path, lambda tmp: save_file(arrays, str(tmp), metadata=metadata))


def write_run_dir(path: str | os.PathLike, texts: dict[str, str]) -> Path:
    """Write the result files of one run (name -> text) as one unit (`write_dir_atomic`)."""
    return write_dir_atomic(path, lambda tmp: [(tmp / name).write_text(text) for name, text in texts.items()], texts)


def write_dir_atomic(path: str | os.PathLike, write, names, what: str = "result directory") -> Path:
    """Write a directory of result files as one unit: write(temporary directory) makes the files (of the
    names `names` only), then the directory is renamed to `path`. An existing `path` (holding only files of
    these names, as an earlier run left it) is moved aside under a unique name first and removed after, so
    `path` always holds the files of one run. Raises FileExistsError, touching nothing, if `path` holds
    other files."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary(path)
    tmp.mkdir()
    moved = []  # earlier runs' directories, moved aside
    try:
        write(tmp)
        for _ in range(8):  # another process may put its run at `path` between our two renames: move it too
            try:
                os.rename(tmp, path)
                break
            except OSError as exc:
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
            check_output_dir(path, names, what)
            moved.append(_temporary(path, "old"))
            try:
                os.rename(path, moved[-1])
            except FileNotFoundError:
                moved.pop()
        else:
            raise FileExistsError(f"could not replace {path}: other processes keep writing it")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if moved and not path.exists():
            os.rename(moved.pop(), path)  # put the earlier run back
        raise
    finally:
        for old in moved:
            shutil.rmtree(old, ignore_errors=True)
    return path


def _check_can_create_in(path: Path, what: str) -> None:
    """Raise OSError unless a file can be created next to `path` (in its nearest existing ancestor, if its
    parent directories do not exist yet: they will be made). Probes with a temporary file, removed."""
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise NotADirectoryError(f"{what} {path}: {parent} is not a directory")
    probe = _temporary(parent / ".specmoe-probe")
    try:
        probe.touch(exist_ok=False)
    except OSError as exc:
        raise PermissionError(f"{what} {path}: cannot create files in {parent} ({exc.strerror})") from None
    probe.unlink()


def check_output_file(path: str | os.PathLike, what: str = "output file") -> None:
    """Raise OSError unless a file can be written at `path`: not an existing directory, and a writable
    directory (or one that can be made) to hold it. For commands, before they compute anything."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{what} {path} is an existing directory")
    _check_can_create_in(path, what)


def check_output_dir(path: str | os.PathLike, names, what: str = "output directory") -> None:
    """Raise OSError unless `write_run_dir` can write a run's files `names` at `path`: `path` is new, or a
    directory holding only files of those names, and its parent is writable (or can be made)."""
    path = Path(path)
    try:  # one call, not exists() then is_dir(): another writer may move `path` away in between
        entries = os.listdir(path)
    except FileNotFoundError:
        entries = []
    except NotADirectoryError:
        raise NotADirectoryError(f"{what} {path} is an existing file") from None
    if entries:
        others = sorted(set(entries) - set(names))
        if others:
            raise FileExistsError(f"{what} {path} holds files that are not a run's results ({', '.join(others[:3])}"
                                  f"{', ...' if len(others) > 3 else ''}): give a new directory")
    _check_can_create_in(path, what)


def file_sha256(path: str | os.PathLike) -> str:
    """The sha256 of a file's contents (read in chunks), as a run's identity records its input files;
    "missing" if there is no such file."""
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return "missing"
    return digest.hexdigest()


def read_utf8(path: str | os.PathLike, what: str = "text file") -> str:
    """The text of a UTF-8 file; FileNotFoundError or ValueError naming the file and the first bad byte."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no {what} {path}")
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{what} {path} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})") \
            from None


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
