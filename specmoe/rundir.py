"""Run directories: what every measuring command writes and `specmoe report` reads.

A run directory holds one row per finished cell, each written at once, atomically, as RUN_DIR/cells/cNNNN_rRRR.json
(configuration NNNN, round RRR) with a sha256 of its row and the run's digest; results.parquet (the cells
combined, rewritten after each invocation); manifest.json (the run's kind, identity and digest, its grid of
configurations, and per invocation the command line, git commit, package versions, hardware and the cells it
ran); and a lock file while a process writes it. `run_cells` is the one loop that fills one: it skips the
finished cells (a killed run resumes where it stopped), shows a progress bar and turns Ctrl-C into a message
saying how to resume. docs/run-directories.md describes the schema and which command writes what.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import platform
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pandas as pd

from specmoe.files import check_output_file, write_file_atomic, write_text_atomic

RESULTS = "results.parquet"
MANIFEST = "manifest.json"
LOCK = "lock"
CELL = re.compile(r"^c(\d{4})_r(\d{3})\.json$")
PACKAGES = ("specmoe", "torch", "transformers", "numpy", "numba", "pandas", "pyarrow", "scipy", "matplotlib",
            "safetensors", "tokenizers", "tqdm")


def _alive(pid: int) -> bool:
    """Whether a process `pid` exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# -- provenance -------------------------------------------------------------------------------------------------
def git_state() -> dict:
    """The commit of the checkout the package runs from, and whether its tracked files differ from it."""
    root = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip()
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {"commit": None}
    return {"commit": commit or None, "dirty": bool(status)}


def versions() -> dict:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def hardware() -> dict:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    out = {"platform": platform.platform(), "cpu": cpu, "cpu_count": os.cpu_count(),
           "torch_threads": torch.get_num_threads(), "cuda": torch.cuda.is_available()}
    try:
        out["memory_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        pass
    if out["cuda"]:
        out["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return out


# -- the run directory ------------------------------------------------------------------------------------------
class RunDir:
    """A run's directory: the cell files, the combined table and the manifest (module docstring)."""

    def __init__(self, path: str | Path, digest: str = ""):
        self.path = Path(path)
        self.cells = self.path / "cells"
        self.digest = digest  # the run's digest, signed into every cell it writes

    def _cell_digest(self, row: dict) -> str:
        body = json.dumps({k: v for k, v in row.items() if k != "digest"}, sort_keys=True)
        return hashlib.sha256(f"{self.digest}\n{body}".encode()).hexdigest()

    @contextlib.contextmanager
    def lock(self):
        """Hold RUN_DIR/lock (the holder's pid and host) while writing; ValueError naming the holder if another
        live process holds it. A lock of a process gone from this host is taken over."""
        self.path.mkdir(parents=True, exist_ok=True)
        path, mine = self.path / LOCK, {"pid": os.getpid(), "host": socket.gethostname()}
        while True:
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
                break
            except FileExistsError:
                try:
                    holder = json.loads(path.read_text())
                    pid, host = int(holder["pid"]), str(holder["host"])
                except (OSError, ValueError, TypeError, KeyError):
                    raise ValueError(f"{path} exists but names no holder: remove it if no run is writing "
                                     f"{self.path}") from None
                if host != mine["host"] or _alive(pid):
                    raise ValueError(f"run directory {self.path} is being written by pid {pid} on {host} ({path}): "
                                     "wait for it to finish, or remove the file if that process is gone") from None
                path.unlink(missing_ok=True)  # the holder died without releasing it
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(mine))
        try:
            yield
        finally:
            path.unlink(missing_ok=True)

    def manifest(self) -> dict | None:
        """The run's manifest (None if there is none); ValueError naming the file unless it is a JSON object."""
        try:
            manifest = json.loads((self.path / MANIFEST).read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise ValueError(f"{self.path / MANIFEST} is not a readable manifest ({exc})") from None
        if not isinstance(manifest, dict):
            raise ValueError(f"{self.path / MANIFEST} is not a manifest (a JSON object, got {type(manifest).__name__}):"
                             " give a new --out")
        return manifest

    def check(self, digest: str, inputs: dict | None = None, identity: dict | None = None,
              change: str = "pass --out DIR") -> None:
        """ValueError unless this directory is new, empty, or a run of the same `digest` (to resume), and the
        results table can be written (pyarrow). inputs: the run's input files ({key: {"path", "sha256"}});
        identity: the manifest's "config" entry, for naming an input file whose contents changed; change: what to
        do to start another run instead (in the message)."""
        _check_pyarrow()
        if self.path.exists() and not self.path.is_dir():
            raise NotADirectoryError(f"run directory {self.path} is an existing file")
        if not self.path.exists():
            check_output_file(self.path / MANIFEST, "run directory file")
        manifest = self.manifest()
        if manifest is None:
            if self.path.is_dir() and any(p.name != LOCK for p in self.path.iterdir()):
                raise FileExistsError(f"run directory {self.path} holds files but no {MANIFEST}: give a new --out")
            return
        before, now = manifest.get("inputs"), inputs or {}
        changed = [key for key in now if isinstance(before, dict) and isinstance(before.get(key), dict)
                   and before[key].get("path") == now[key]["path"] and before[key].get("sha256") != now[key]["sha256"]]
        if changed and manifest.get("config") == identity:
            key = changed[0]
            raise ValueError(f"run directory {self.path} was run with other contents of {key} = {now[key]['path']} "
                             f"(sha256 {before[key]['sha256'][:12]} then, {now[key]['sha256'][:12]} now): restore "
                             f"the file or pass --out DIR")
        if manifest.get("digest") != digest:
            raise ValueError(f"run directory {self.path} holds a run of another config (digest "
                             f"{manifest.get('digest')}, this config {digest}): {change}, or remove "
                             f"{self.path} to start again")

    def done(self) -> set[tuple[int, int]]:
        if not self.cells.is_dir():
            return set()
        return {(int(m[1]), int(m[2])) for m in map(CELL.match, os.listdir(self.cells)) if m}

    def cell_path(self, index: int, round_: int) -> Path:
        return self.cells / f"c{index:04d}_r{round_:03d}.json"

    def write_cell(self, row: dict) -> None:
        write_text_atomic(self.cell_path(row["config"], row["round"]),
                          json.dumps({**row, "digest": self._cell_digest(row)}))

    def cell_error(self, index: int, round_: int) -> str | None:
        """Why the file of cell (index, round_) is not a finished cell of this run (None if it is): not JSON,
        not an object, another cell's, or contents that do not match the digest written with them."""
        try:
            row = json.loads(self.cell_path(index, round_).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            return f"not a readable JSON cell ({type(exc).__name__})"
        if not isinstance(row, dict):
            return f"holds a JSON {type(row).__name__}, not a cell"
        if row.get("config") != index or row.get("round") != round_:
            return f"is not the cell of configuration {index}, round {round_}"
        if row.get("digest") != self._cell_digest(row):
            return "its contents do not match the digest written with them (edited, or another run's)"
        return None

    def check_cells(self, log, move: bool = True) -> set[tuple[int, int]]:
        """The finished cells whose files validate (`cell_error`); every other cell file is named in one line
        of `log` and, with `move`, renamed to NAME.invalid so that the cell is measured again."""
        good = set()
        for index, round_ in sorted(self.done()):
            error = self.cell_error(index, round_)
            if error is None:
                good.add((index, round_))
                continue
            path = self.cell_path(index, round_)
            log(f"{path}: {error}; " + ("moved to *.invalid, measured again" if move else "not counted as done"))
            if move:
                os.replace(path, path.with_name(path.name + ".invalid"))
        return good

    def rows(self) -> list[dict]:
        rows = []
        for index, round_ in sorted(self.done(), key=lambda cell: (cell[1], cell[0])):
            row = json.loads(self.cell_path(index, round_).read_text(encoding="utf-8"))
            rows.append({k: v for k, v in row.items() if k != "digest"})
        return rows

    def write_table(self) -> pd.DataFrame:
        import pandas as pd

        table = pd.DataFrame(self.rows())
        write_file_atomic(self.path / RESULTS, lambda tmp: table.to_parquet(tmp, index=False, engine="pyarrow"))
        return table


def read_table(run_dir: str | Path) -> pd.DataFrame:
    """The results table of a run directory (FileNotFoundError naming it if there is none)."""
    import pandas as pd

    path = Path(run_dir) / RESULTS
    if not path.is_file():
        raise FileNotFoundError(f"no {RESULTS} in {run_dir}: not a run directory (of `specmoe run`, `sd`, `demo`, "
                                "`replay`, `replay-sd`), or no cell finished yet")
    table = pd.read_parquet(path)
    missing = [c for c in ("config", "round", "label", "kind") if c not in table.columns]
    if not len(table) or missing:
        raise ValueError(f"{path} holds no finished cell (" + (f"no column {', '.join(missing)}" if missing else
                         "no rows") + "): run the config again to measure its cells")
    return table


def _check_pyarrow() -> None:
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        raise ValueError("the results table is parquet, which needs pyarrow (pip install pyarrow; a dependency of "
                         "specmoe)") from None




def provenance(command: list[str] | None = None) -> dict:
    """One invocation's entry of manifest.json: the command line, start time, git state, versions, hardware."""
    argv = list(command if command is not None else sys.argv)
    if argv and argv[0].endswith("__main__.py"):
        argv[0:1] = ["python3", "-m", "specmoe"]
    return {"command": argv, "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git": git_state(), "versions": versions(), "hardware": hardware(), "cells_run": 0}


def digest_of(identity: dict, inputs: dict) -> str:
    """A run's digest: a hash of what it measures (`identity`, plain data) and the contents of its input files."""
    body = json.dumps({"config": identity, "inputs": inputs}, sort_keys=True, default=str)
    return hashlib.sha256(body.encode()).hexdigest()[:16]


def run_cells(run_dir: RunDir, manifest: dict, cells: list[tuple], start, *, name: str, max_cells: int | None = None,
              on_cell=None, progress: bool = True, command: list[str] | None = None, log=None):
    """Measure the cells of `cells` not yet finished in `run_dir` (its lock held), writing each at once; returns
    (results table, manifest).

    manifest: the run's manifest entries for a new run directory (name, kind, digest, config, grid, ...; one
    already in the directory is kept and extended). cells: (item, index, round) in run order. start(): called once,
    only if a cell is left to run (the set-up: loading a model); returns measure(item, round) -> the cell's row
    (with "config" = index and "round") and a dict of entries for this invocation (e.g. setup_seconds). max_cells:
    run at most this many new cells. on_cell(row): called after each cell is written."""
    from tqdm import tqdm

    log = log or (lambda text: print(text, file=sys.stderr, flush=True))
    done = run_dir.check_cells(log)
    todo = [(item, i, r) for item, i, r in cells if (i, r) not in done]
    started = time.time()
    invocation = provenance(command)
    manifest = run_dir.manifest() or {**manifest, "cells_total": len(cells), "invocations": []}
    manifest["invocations"].append(invocation)
    manifest.update({k: invocation[k] for k in ("command", "git", "versions", "hardware")})
    wanted = {(i, r) for _, i, r in cells}

    def save_manifest(status: str) -> None:
        manifest.update(status=status, cells_done=len(run_dir.done() & wanted))
        invocation["seconds"] = round(time.time() - started, 1)
        write_text_atomic(run_dir.path / MANIFEST, json.dumps(manifest, indent=1, default=str))

    save_manifest("running")
    if not todo:
        log(f"all {len(cells)} cells of {name} are done in {run_dir.path} (give another --out to run again)")
        table = run_dir.write_table()
        save_manifest("complete")
        return table, manifest
    try:
        measure, extra = start()
    except BaseException as exc:
        save_manifest(f"set-up failed: {type(exc).__name__}: {' '.join(str(exc).split())}")
        raise
    invocation.update(extra)
    bar = tqdm(total=len(cells), initial=len(cells) - len(todo), desc=name, unit="cell",
               disable=not progress or not sys.stderr.isatty(), file=sys.stderr, dynamic_ncols=True)
    stopped = False
    try:
        for item, i, r in todo:
            if max_cells is not None and invocation["cells_run"] >= max_cells:
                stopped = True
                break
            bar.set_postfix_str(f"round {r}: {getattr(item, 'label', i)}"[:60])
            row = measure(item, r)
            run_dir.write_cell(row)
            invocation["cells_run"] += 1
            bar.update(1)
            if on_cell is not None:
                on_cell(row)
    except KeyboardInterrupt:
        raise KeyboardInterrupt(f"{len(run_dir.done() & wanted)} of {len(cells)} cells done, kept in {run_dir.path}; "
                                "run the same command to resume") from None
    finally:
        bar.close()
        table = run_dir.write_table()
        save_manifest("complete" if run_dir.done() >= wanted else "partial")
    if stopped:
        log(f"stopped after {max_cells} cells ({len(run_dir.done() & wanted)} of {len(cells)} done): run the same "
            "command again to resume")
    return table, manifest
