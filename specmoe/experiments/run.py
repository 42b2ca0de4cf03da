"""`specmoe run CONFIG`: every configuration of a config file, interleaved over rounds in one process.

Round r measures configuration 0, 1, ..., N-1 in turn (A B C A B C ...), so slow drifts of the machine hit
every configuration alike. Each finished (configuration, round) cell is written at once, atomically, as one
small file (RUN_DIR/cells/cNNNN_rRRR.json); a run that was killed, or stopped by `--max-cells`, resumes where it
stopped when the same command runs again: finished cells are not redone. Each cell file carries a sha256 of its row and the run's digest;
a cell file that does not validate (not JSON, another cell's or run's, edited) is named and measured again. RUN_DIR (default runs/NAME, or
runs/NAME-DIGEST with `--set KEY=VALUE` overrides) holds:

- results.parquet: one row per finished cell (the cells combined, rewritten after each invocation);
- manifest.json: the resolved config (overrides applied, and listed) and its digest (over the config and the
  contents of its input files, listed under "inputs"), the grid, the model's
  geometry, and per invocation the command line, git commit, package versions, hardware, set-up time and the cells it ran;
- config.toml: the config file as read; calibration.safetensors: the calibration every cell uses (sampled once,
  reused on resume unless the config names a file).

A run directory resumes only a run of the same config (same digest); `--dry-run` prints the grid and what is
done, without loading the model. `specmoe report RUN_DIR` renders tables and plots from results.parquet.
"""

from __future__ import annotations

import argparse
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

from specmoe.arguments import int_at_least
from specmoe.files import write_file_atomic, write_text_atomic
from specmoe.geometry import Geometry

from .config import ConfigError, ExperimentConfig, load_config
from .grid import Configuration, check_sizes, expand, grid_model

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


def quickstart_config() -> Path:
    """experiments/quickstart.toml of the source checkout this package runs from."""
    path = Path(__file__).resolve().parents[2] / "experiments" / "quickstart.toml"
    if not path.is_file():
        raise FileNotFoundError(f"no {path}: the main job runs the quickstart config of a source checkout "
                                "(specmoe run CONFIG runs any other)")
    return path


# -- provenance -------------------------------------------------------------------------------------------------
def git_state() -> dict:
    """The commit of the checkout the package runs from, and whether its tracked files differ from it."""
    root = Path(__file__).resolve().parents[2]
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

    def check(self, config: ExperimentConfig) -> None:
        """ValueError unless this directory is new, empty, or a run of the same config (to resume)."""
        if self.path.exists() and not self.path.is_dir():
            raise NotADirectoryError(f"run directory {self.path} is an existing file")
        manifest = self.manifest()
        if manifest is None:
            if self.path.is_dir() and any(p.name != LOCK for p in self.path.iterdir()):
                raise FileExistsError(f"run directory {self.path} holds files but no {MANIFEST}: give a new --out")
            return
        before, now = manifest.get("inputs"), config.inputs()
        changed = [key for key in now if isinstance(before, dict) and isinstance(before.get(key), dict)
                   and before[key].get("path") == now[key]["path"] and before[key].get("sha256") != now[key]["sha256"]]
        if changed and manifest.get("config") == config.resolved():
            key = changed[0]
            raise ValueError(f"run directory {self.path} was run with other contents of {key} = {now[key]['path']} "
                             f"(sha256 {before[key]['sha256'][:12]} then, {now[key]['sha256'][:12]} now): restore "
                             f"the file or pass --out DIR")
        if manifest.get("digest") != config.digest():
            raise ValueError(f"run directory {self.path} holds a run of another config (digest "
                             f"{manifest.get('digest')}, this config {config.digest()}): change `name` in "
                             f"{config.path} (the run directory is runs/NAME) or pass --out DIR, or remove "
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
        raise FileNotFoundError(f"no {RESULTS} in {run_dir}: not a run directory of `specmoe run`, or no cell "
                                "finished yet")
    table = pd.read_parquet(path)
    missing = [c for c in ("config", "round", "label", "kind") if c not in table.columns]
    if not len(table) or missing:
        raise ValueError(f"{path} holds no finished cell (" + (f"no column {', '.join(missing)}" if missing else
                         "no rows") + "): run the config again to measure its cells")
    return table


def means_table(table: pd.DataFrame) -> pd.DataFrame:
    """One row per configuration: the identifying columns and the means over rounds of the figures."""
    import pandas as pd

    numeric = [c for c in table.columns if c not in ("token_ms", "request_ms", "round") and
               pd.api.types.is_numeric_dtype(table[c]) and c != "config"]
    ident = ["config", "label", "kind"]
    means = table.groupby("config", sort=True)[numeric].mean()
    first = table.groupby("config", sort=True)[["label", "kind"]].first()
    out = first.join(means).reset_index()
    out["rounds"] = table.groupby("config", sort=True).size().to_numpy()
    out["verify_compute_ms_per_token"] = out["verify_ms_per_token"] - out["wait_ms_per_token"].fillna(0.0)
    return out[ident + [c for c in out.columns if c not in ident]]


def summary_table(table: pd.DataFrame) -> pd.DataFrame:
    """The main table: per configuration tau, copies per committed token, KL, excess NLL, ms per token and its
    split (columns without any value left out)."""
    m = means_table(table)
    columns = {"label": "configuration", "tau": "tau", "copies_per_token": "copies/token", "kl": "kl",
               "excess_nll": "excess_nll", "displaced_per_token_layer": "displaced", "ms_per_token": "ms/token",
               "draft_ms_per_token": "draft_ms", "verify_compute_ms_per_token": "verify_ms",
               "wait_ms_per_token": "wait_ms"}
    out = m[list(columns)].rename(columns=columns)
    return out[[c for c in out.columns if c == "configuration" or out[c].notna().any()]]


def _check_pyarrow() -> None:
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        raise ValueError("the results table is parquet, which needs pyarrow (pip install pyarrow; a dependency of "
                         "specmoe)") from None


# -- running ----------------------------------------------------------------------------------------------------
def describe_grid(config: ExperimentConfig, geo: Geometry, grid: list[Configuration], done: set, out: Path) -> str:
    w = config.workload
    lines = [f"{config.name}: mode {config.mode}, engine {config.engine}, device {config.device}, "
             f"{config.rounds} round{'s' * (config.rounds > 1)}, seed {config.seed}; model {config.model.source} "
             f"(L={geo.num_layers}, E={geo.num_experts}, K={geo.top_k})",
             f"workload: {w.source}, {w.count} x {w.length} tokens"
             + (f", {w.new_tokens} new tokens each" if config.mode == "generation" else "")]
    width = max(len(c.label) for c in grid)
    lines.append(f"{'#':>4}  {'configuration':<{width}}  done")
    for c in grid:
        finished = sum((c.index, r) in done for r in range(config.rounds))
        lines.append(f"{c.index:>4}  {c.label:<{width}}  {finished}/{config.rounds}")
    total = len(grid) * config.rounds
    lines.append(f"{len(grid)} configurations x {config.rounds} rounds = {total} cells "
                 f"({len(done & {(c.index, r) for c in grid for r in range(config.rounds)})} done in {out})")
    return "\n".join(lines)


def default_run_dir(config: ExperimentConfig) -> Path:
    """runs/NAME, or runs/NAME-DIGEST for a config with --set overrides (each set of values its own run)."""
    return Path("runs") / (f"{config.name}-{config.digest()}" if config.overrides else config.name)


def run_experiment(config: ExperimentConfig, out: str | Path | None = None, *, max_cells: int | None = None,
                   dry_run: bool = False, on_cell=None, progress: bool = True, command: list[str] | None = None,
                   log=None) -> tuple[pd.DataFrame | None, dict]:
    """Run (or resume) `config` into `out` (default `default_run_dir`); returns the results table and the manifest.

    max_cells: run at most this many new cells, then stop (rerun to resume). on_cell(row): called after each
    cell is written (tests use it to interrupt a run). dry_run: print the grid, run nothing. A second writer of
    the same run directory (its lock file held by a live process) is refused."""
    log = log or (lambda text: print(text, file=sys.stderr, flush=True))
    target = grid_model(config)
    geo = target.geometry
    grid = expand(config, geo)
    check_sizes(config, target, grid)
    run_dir = RunDir(out if out is not None else default_run_dir(config), config.digest())
    run_dir.check(config)
    if dry_run:
        print(describe_grid(config, geo, grid, run_dir.check_cells(log, move=False), run_dir.path))
        return None, {}
    from .measure import check_device

    _check_pyarrow()
    check_device(config)  # before anything is written
    with run_dir.lock():
        return _run(config, target, grid, run_dir, max_cells=max_cells, on_cell=on_cell, progress=progress,
                    command=command, log=log)


def _run(config: ExperimentConfig, target, grid: list[Configuration], run_dir: RunDir, *, max_cells, on_cell,
         progress, command, log) -> tuple[pd.DataFrame, dict]:
    """`run_experiment`'s work, with the run directory's lock held."""
    from tqdm import tqdm

    from .measure import Session

    done = run_dir.check_cells(log)
    cells = [(c, r) for r in range(config.rounds) for c in grid]
    todo = [(c, r) for c, r in cells if (c.index, r) not in done]
    started = time.time()
    argv = list(command if command is not None else sys.argv)
    if argv and argv[0].endswith("__main__.py"):
        argv[0:1] = ["python3", "-m", "specmoe"]
    invocation = {"command": argv,
                  "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "git": git_state(), "versions": versions(), "hardware": hardware(), "cells_run": 0}
    manifest = run_dir.manifest() or {"name": config.name, "description": config.description,
                                      "config_file": str(config.path), "overrides": list(config.overrides),
                                      "digest": config.digest(), "inputs": config.inputs(),
                                      "config": config.resolved(), "geometry": target.describe(),
                                      "grid": [c.describe() for c in grid], "rounds": config.rounds,
                                      "cells_total": len(cells), "invocations": []}
    manifest["invocations"].append(invocation)
    manifest.update({k: invocation[k] for k in ("command", "git", "versions", "hardware")})

    def save_manifest(status: str) -> None:
        manifest.update(status=status, cells_done=len(run_dir.done()))
        invocation["seconds"] = round(time.time() - started, 1)
        write_text_atomic(run_dir.path / MANIFEST, json.dumps(manifest, indent=1))

    save_manifest("running")
    write_text_atomic(run_dir.path / "config.toml", config.text)
    if not todo:
        log(f"all {len(cells)} cells of {config.name} are done in {run_dir.path} (give another --out to run again)")
        table = run_dir.write_table()
        save_manifest("complete")
        return table, manifest
    try:
        session = Session(config, target, grid, run_dir.path, log)
    except BaseException as exc:
        save_manifest(f"set-up failed: {type(exc).__name__}: {' '.join(str(exc).split())}")
        raise
    invocation["setup_seconds"] = session.setup_seconds
    invocation["hardware"]["torch_threads"] = config.threads
    bar = tqdm(total=len(cells), initial=len(cells) - len(todo), desc=config.name, unit="cell", disable=not progress,
               file=sys.stderr, dynamic_ncols=True)
    stopped = False
    try:
        for c, r in todo:
            if max_cells is not None and invocation["cells_run"] >= max_cells:
                stopped = True
                break
            bar.set_postfix_str(f"round {r}: {c.label}"[:60])
            row = session.measure(c, r)
            run_dir.write_cell(row)
            invocation["cells_run"] += 1
            bar.update(1)
            if on_cell is not None:
                on_cell(row)
    except KeyboardInterrupt:
        raise KeyboardInterrupt(f"{len(run_dir.done())} of {len(cells)} cells done, kept in {run_dir.path}; run "
                                "the same command to resume") from None
    finally:
        bar.close()
        table = run_dir.write_table()
        complete = run_dir.done() >= {(c.index, r) for c, r in cells}
        save_manifest("complete" if complete else "partial")
    if stopped:
        log(f"stopped after {max_cells} cells ({len(run_dir.done())} of {len(cells)} done): run the same command "
            "again to resume")
    return table, manifest


# -- command line -----------------------------------------------------------------------------------------------
def add_parser(sub) -> None:
    parser = sub.add_parser("run", help="run an experiment config (TOML): a grid of configurations over rounds",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="config file (e.g. experiments/quickstart.toml)")
    add_options(parser)
    parser.set_defaults(func=main)


def add_options(parser) -> None:
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                        help="override a key of the config, a dotted TOML key and a TOML value, e.g. --set rounds=2 "
                        "--set sd.drafters='[\"synthetic\"]' (repeatable; recorded in the manifest)")
    parser.add_argument("--out", default=None, help="run directory (default runs/NAME, NAME from the config; "
                        "runs/NAME-DIGEST with --set)")
    parser.add_argument("--dry-run", action="store_true", help="print the grid and what is done; run nothing")
    parser.add_argument("--max-cells", type=int_at_least(1), default=None,
                        help="run at most this many new cells, then stop (run again to resume)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def main(args) -> int:
    import pandas as pd

    config = load_config(args.config, args.overrides)
    table, manifest = run_experiment(config, args.out, max_cells=args.max_cells, dry_run=args.dry_run,
                                     progress=not args.no_progress)
    if table is None:
        return 0
    out = args.out or default_run_dir(config)
    print(f"{config.name}: {manifest['cells_done']} of {manifest['cells_total']} cells done; model "
          f"{config.model.source}, workload {config.workload.source} ({config.workload.count} x "
          f"{config.workload.length} tokens), {config.rounds} round(s); means over rounds")
    if len(table):
        with pd.option_context("display.width", 250, "display.max_columns", 30, "display.max_colwidth", 60):
            print(summary_table(table).to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    print(f"results: {Path(out) / RESULTS}; tables and plots: specmoe report {out}")
    return 0


__all__ = ["ConfigError", "RunDir", "quickstart_config", "read_table", "run_experiment"]
