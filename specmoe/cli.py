"""The `specmoe` command. With no subcommand (or only options) it runs the main job: `specmoe run` of
experiments/quickstart.toml (`specmoe demo` is the earlier main job).

Every fault a user can cause (a bad argument or value, a missing, unreadable or unwritable file, a file of
another model) ends in one line on stderr naming the file or argument, and exit status 2. Ctrl-C ends in one
line ("interrupted", with what is kept where a run directory holds finished cells) and exit status 130.

Building the parser imports no torch, transformers, scipy, pandas or numba (`--help` is fast): the commands
import what they use inside their functions."""

from __future__ import annotations

import argparse
import os
import sys

from .arguments import int_at_least


class UsageError(Exception):
    """A command line argparse rejects (reported like every other error: one line, exit status 2)."""


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors raise UsageError instead of printing the usage and exiting."""

    def error(self, message: str):
        raise UsageError(f"{self.prog}: error: {message} (see {self.prog} -h)")


def _add_policy_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policy", default="psr", help="a preset of specmoe.routing.PRESETS, e.g. psr, cache_prior, "
                        "exact_lru (default psr; an unknown name lists them all)")
    parser.add_argument("--capacity", "-C", type=int_at_least(1), required=True, help="expert slots per layer")
    parser.add_argument("--set", action="extend", nargs="+", default=[], metavar="FIELD=VALUE",
                        help="override policy fields, e.g. --set bonus=0.25 window=4 (one or more per --set)")


def build_parser() -> argparse.ArgumentParser:
    from .evaluation import compare
    from .evaluation import run as evaluation
    from .experiments import calibrate, demo, report, run, sd, stats, trace
    from .replay import command as replay_sd

    parser = _Parser(prog="specmoe", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    demo.add_parser(sub)
    calibrate.add_parser(sub)
    sd.add_parser(sub)
    replay_sd.add_parser(sub)
    evaluation.add_parser(sub)
    compare.add_parser(sub)
    run.add_parser(sub)
    report.add_parser(sub)

    replay_parser = sub.add_parser("replay", help="run a policy over a recorded routing trace (no model)")
    replay_parser.add_argument("--trace", required=True, help="trace file written by `specmoe trace`, or a "
                               "synthetic routing source NAME[:key=value,...] (docs/routing-source.md)")
    replay_parser.add_argument("--calibration", required=True, help="calibration file of the traced model (for a "
                               "synthetic source: its name)")
    _add_policy_args(replay_parser)
    replay_parser.add_argument("--out", default=None, help="run directory (default runs/replay-DIGEST, DIGEST of "
                               "the policy and the input files); `specmoe report` reads it")
    replay_parser.set_defaults(func=_run_replay)

    trace.add_parser(sub)
    stats.add_parser(sub)
    return parser


def _run_replay(args) -> int:
    """`specmoe replay`: one cell (the policy over the trace) in a run directory of kind "replay"."""
    import dataclasses
    import math

    from .rundir import RunDir, digest_of, run_cells
    from .routing import parse_policy, replay
    from .records.synthetic import input_sha256, read_calibration, read_trace

    calibration = read_calibration(args.calibration)
    trace = read_trace(args.trace)
    calibration.check(trace.num_layers, trace.num_experts, trace.vocab_size, fingerprint=trace.fingerprint or None)
    policy = parse_policy(args.policy, args.capacity, trace.top_k, args.set)
    inputs = {key: {"path": str(path), "sha256": input_sha256(path)}
              for key, path in (("trace", args.trace), ("calibration", args.calibration))}
    identity = {"command": "replay", "policy": dataclasses.asdict(policy)}
    digest = digest_of(identity, inputs)
    run_dir = RunDir(args.out or f"runs/replay-{digest}", digest)
    run_dir.check(digest, inputs, identity, "pass another --out DIR")

    def measure(_, round_):
        from .experiments.measure import COLUMNS

        result = replay(policy, trace.router_logits, trace.pregate_logits, trace.token_ids, calibration,
                        sequence_starts=trace.sequence_starts, scoring=trace.scoring)
        s = result.summary()
        row = dict.fromkeys(COLUMNS, math.nan)
        row.update(config=0, round=round_, label=f"replay {policy.name}", kind="ar_replay", policy=policy.name,
                   C=policy.capacity, requests=len(trace.sequence_starts), tokens=int(trace.router_logits.shape[0]),
                   tau=1.0, copies_per_token=s["copies"], demand_per_token=s["demand"],
                   prefetch_per_token=s["prefetch"], unused_per_token=s["unused"],
                   replaced_per_token=s["replaced"], displaced_per_token_layer=s["displaced_mass"] / trace.num_layers,
                   token_ms=[], request_ms=[], request_tokens=[])
        return row

    grid = [{"config": 0, "label": f"replay {policy.name}", "kind": "ar_replay"}]
    manifest = {"kind": "replay", "name": "replay", "description": f"{policy.name} over the trace {args.trace}",
                "digest": digest, "inputs": inputs, "config": identity, "grid": grid, "rounds": 1}
    with run_dir.lock():
        table, _ = run_cells(run_dir, manifest, [(None, 0, 0)], lambda: (measure, {}), name="replay",
                             progress=False)
    row = table.iloc[0]
    print(f"{policy.name} on {int(row.tokens)} tokens")
    for key, column in (("copies", "copies_per_token"), ("demand", "demand_per_token"),
                        ("prefetch", "prefetch_per_token"), ("unused", "unused_per_token"),
                        ("replaced", "replaced_per_token")):
        print(f"  {key:>15} per token: {row[column]:.3f}")
    print(f"  {'displaced_mass':>15} per token: {row.displaced_per_token_layer * trace.num_layers:.3f}")
    print(f"results: {run_dir.path / 'results.parquet'}; specmoe report {run_dir.path}")
    return 0


def _no_checkpoint_bars() -> None:
    """One line per result, not a bar per checkpoint load (transformers reads the variable when imported)."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        from .experiments.run import quickstart_config

        try:
            argv = ["run", str(quickstart_config()), *argv]  # `specmoe [options]`: the quickstart config
        except FileNotFoundError as exc:
            print(f"specmoe: error: {exc}", file=sys.stderr)
            return 2
    try:
        args = build_parser().parse_args(argv)
    except UsageError as exc:
        print(exc, file=sys.stderr)
        return 2
    _no_checkpoint_bars()
    try:
        return args.func(args) or 0
    except KeyboardInterrupt as exc:  # finished cells are written atomically: nothing to clean up
        print(f"specmoe {args.command}: interrupted" + (f"; {exc}" if str(exc) else ""), file=sys.stderr)
        return 130
    except (ValueError, OSError) as exc:  # PolicyError, CalibrationError, TraceError, ...; files and permissions
        message = " ".join(str(exc).split())
        print(f"specmoe {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
