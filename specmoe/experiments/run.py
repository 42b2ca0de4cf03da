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
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pandas as pd

from specmoe.arguments import int_at_least
from specmoe.files import check_output_file, write_text_atomic
from specmoe.geometry import Geometry
from specmoe.rundir import RESULTS, RunDir, run_cells

from .config import ConfigError, ExperimentConfig, load_config
from .grid import Configuration, check_sizes, expand, grid_model


def shipped_config(name: str) -> Path:
    """experiments/NAME.toml of the source checkout this package runs from (the configs `specmoe`, `specmoe sd`
    and `specmoe demo` run)."""
    path = Path(__file__).resolve().parents[2] / "experiments" / f"{name}.toml"
    if not path.is_file():
        raise FileNotFoundError(f"no {path}: this command runs a shipped config of a source checkout "
                                "(specmoe run CONFIG runs any other)")
    return path


def quickstart_config() -> Path:
    """experiments/quickstart.toml: the main job."""
    return shipped_config("quickstart")


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
    run_dir = RunDir(out if out is not None else default_run_dir(config), config.digest())
    run_dir.check(config.digest(), config.inputs(), config.resolved(),
                  f"change `name` in {config.path} (the run directory is runs/NAME) or pass --out DIR")
    if config.sd.records:
        check_output_file(run_dir.path / "blocks" / "blocks.safetensors", "block records file")
    target = grid_model(config)
    geo = target.geometry
    grid = expand(config, geo)
    check_sizes(config, target, grid)
    if dry_run:
        print(describe_grid(config, geo, grid, run_dir.check_cells(log, move=False), run_dir.path))
        return None, {}
    from .measure import check_device

    check_device(config)  # before anything is written
    with run_dir.lock():
        return _run(config, target, grid, run_dir, max_cells=max_cells, on_cell=on_cell, progress=progress,
                    command=command, log=log)


def _run(config: ExperimentConfig, target, grid: list[Configuration], run_dir: RunDir, *, max_cells, on_cell,
         progress, command, log) -> tuple[pd.DataFrame, dict]:
    """`run_experiment`'s work, with the run directory's lock held."""
    from .measure import Session

    manifest = {"kind": "run", "name": config.name, "description": config.description,
                "config_file": str(config.path), "overrides": list(config.overrides), "digest": config.digest(),
                "inputs": config.inputs(), "config": config.resolved(), "geometry": target.describe(),
                "grid": [c.describe() for c in grid], "rounds": config.rounds}
    write_text_atomic(run_dir.path / "config.toml", config.text)

    def start():
        session = Session(config, target, grid, run_dir.path, log, progress=progress)
        return session.measure, {"setup_seconds": session.setup_seconds}

    cells = [(c, c.index, r) for r in range(config.rounds) for c in grid]
    return run_cells(run_dir, manifest, cells, start, name=config.name, max_cells=max_cells, on_cell=on_cell,
                     progress=progress, command=command, log=log)


# -- command line -----------------------------------------------------------------------------------------------
def add_parser(sub) -> None:
    parser = sub.add_parser("run", help="run an experiment config (TOML): a grid of configurations over rounds",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="config file (e.g. experiments/quickstart.toml)")
    add_options(parser)
    parser.set_defaults(func=main)


def add_options(parser) -> None:
    parser.add_argument("--set", action="extend", nargs="+", default=[], metavar="KEY=VALUE", dest="overrides",
                        help="override keys of the config, each a dotted TOML key and a TOML value, e.g. --set "
                        "rounds=2 sd.drafters='[\"synthetic\"]' (one or more per --set, --set repeatable; recorded in "
                        "the manifest)")
    parser.add_argument("--out", default=None, help="run directory (default runs/NAME, NAME from the config; "
                        "runs/NAME-DIGEST with --set)")
    parser.add_argument("--dry-run", action="store_true", help="print the grid and what is done; run nothing")
    parser.add_argument("--max-cells", type=int_at_least(1), default=None,
                        help="run at most this many new cells, then stop (run again to resume)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def as_override(key: str, value) -> str:
    """A `--set KEY=VALUE` item of a command's flag: strings and lists of strings quoted as TOML (JSON) strings."""
    return f"{key}={json.dumps(value) if isinstance(value, (str, list, tuple)) else str(value).lower() if isinstance(value, bool) else value}"


def run_shipped(name: str, args, overrides: list[str]) -> int:
    """`specmoe sd`, `specmoe demo`: `specmoe run` of the shipped config NAME (`shipped_config`), the command's
    flags given as `--set` overrides (`overrides`, applied before the command line's own --set)."""
    args.config = str(shipped_config(name))
    args.overrides = [*overrides, *args.overrides]
    return main(args)


def print_ratios(table: pd.DataFrame, mode: str) -> None:
    """The report's latency comparison (`report.latency_ratios`): ms per token of each configuration over the
    first timed one, with its 95% interval over the workload's units; nothing for an untimed run."""
    from .report import latency_ratios

    comparison = latency_ratios(table, mode)
    if comparison is None:
        return
    base, unit, ratios = comparison
    label = table[table.config == base].label.iloc[0]
    print(f"ms per token against #{base} {label}, 95% interval over the {unit}s (paired bootstrap, each {unit}'s time "
          "a mean over the rounds: docs/measurement.md)")
    print(ratios.drop(columns="unit").to_string(index=False, float_format=lambda v: f"{v:.3f}"))


def main(args) -> int:
    import pandas as pd

    from .report import summary_table

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
            print_ratios(table, config.mode)
    print(f"results: {Path(out) / RESULTS}; tables and plots: specmoe report {out}")
    return 0


__all__ = ["ConfigError", "quickstart_config", "run_shipped", "shipped_config", "run_experiment"]
