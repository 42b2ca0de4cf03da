"""`specmoe replay-sd`: a rollback logical cache against block-level expert selection, replayed on the CPU.

Sources of verification blocks: block records of `specmoe sd --records` (`--records FILE...`; rejected
positions carry the drafter's tokens) and a synthetic drafter over an AR trace of `specmoe trace` (`--trace
FILE` with `--tau`, `--accept-rate`, `--accept-table` or `--accept-hist-from RECORDS`; rejected positions carry
the true continuation's logits), at each k of `-k`. For every source: the rollback cache's frontier over
lambda and n, block-level selection's over gamma and the prune budget, exact verification, AR-PSR on the same
committed sequence, the copy ratio at matched displaced mass, and (records) the fraction of committed
token-layers whose experts change with the rejected drafts. The calibration must be the traced model's.
Every method replays the source's accepted lengths: those of the run that made the records (its selector, the
records' `selector` field; `specmoe sd --records` writes one file per drafter and selector) or a given profile.
Each source's row says so per selector (`acceptance_from`, `<selector>_acceptance`: closed-loop where the
records are the selector's own run, open-loop otherwise, e.g. a lossy selector over exact's blocks, optimistic
for it); pass each selector's records for closed-loop rows.
Writes a run directory (--out): one cell per source, its summary row and every point of its sweeps (JSON column
`points`); a run stopped part-way resumes without recomputing the finished sources. `specmoe report RUN_DIR`
writes the summary table and frontier.png (one panel per source, two a row on shared axes, one legend below).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from specmoe.arguments import int_at_least
from specmoe.limits import MAX_COUNT

from . import sweeps


def _floats(text: str, what: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in str(text).split(",") if v.strip())
    except ValueError:
        raise ValueError(f"{what} must be comma-separated numbers, got {text!r}") from None
    if not values:
        raise ValueError(f"{what} needs at least one value")
    return values


def _ints(text: str, what: str, minimum: int = 0, maximum: int = MAX_COUNT) -> tuple[int, ...]:
    """Comma-separated integers (written as integers or as floats with integer values, 1e3), each in
    [minimum, maximum]."""
    from specmoe.routing.validate import integer

    values = _floats(text, what)
    if any(not math.isfinite(v) or v != int(v) for v in values):
        raise ValueError(f"{what} must be integers, got {text!r}")
    return tuple(integer(int(v), what, minimum=minimum, maximum=maximum) for v in values)


def add_parser(sub) -> None:
    p = sub.add_parser("replay-sd", help="CPU replay: rollback logical cache vs block-level expert selection",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calibration", required=True, help="calibration file of the model the blocks come from "
                   "(for a synthetic routing source: its name)")
    p.add_argument("--records", nargs="*", default=[], metavar="FILE", help="block record files (specmoe sd --records)")
    p.add_argument("--records-k", type=int, default=None, help="cut recorded blocks to this many drafts")
    p.add_argument("--true-continuation", action="store_true",
                   help="records: also replay them with the true continuation at rejected positions")
    p.add_argument("--trace", default=None, help="AR trace (specmoe trace) for the synthetic drafter, or a "
                   "synthetic routing source NAME[:key=value,...] (docs/routing-source.md)")
    p.add_argument("--tau", default=None, help="synthetic: geometric acceptance with these tau values, e.g. 3,5,7")
    p.add_argument("--accept-rate", default=None, help="synthetic: geometric acceptance rates, e.g. 0.7,0.8")
    p.add_argument("--accept-table", default=None, help="synthetic: one table q_1,q_2,... (non-increasing)")
    p.add_argument("--accept-hist-from", default=None, metavar="RECORDS",
                   help="synthetic: the accepted-length histogram of a block record file")
    p.add_argument("-k", default="8,16", help="synthetic: drafts per block, comma-separated (default 8,16)")
    p.add_argument("--capacity", "-C", type=int, default=32, help="C = P, experts per layer (default 32)")
    p.add_argument("--lambdas", default=",".join(map(str, sweeps.LAMBDAS)), help="rollback bonus sweep")
    p.add_argument("--budgets", default=",".join(map(str, sweeps.BUDGETS)), help="rollback insertion budgets n")
    p.add_argument("--gammas", default=",".join(map(str, sweeps.GAMMAS)), help="block selection gamma sweep")
    p.add_argument("--prune-budgets", default=",".join(map(str, sweeps.PRUNE_BUDGETS)), help="prune budget sweep")
    p.add_argument("--selectors", default=",".join(sweeps.SELECTORS), help="block selectors besides exact")
    p.add_argument("--prefetch", default="", help="block prefetch budgets to replay with exact and each selector's "
                   "preset, e.g. 0,2,4,8 (docs/block-prefetch.md; default none)")
    p.add_argument("--max-blocks", type=int, default=None, help="synthetic: at most this many blocks per source")
    p.add_argument("--seed", type=int_at_least(0), default=0, help="synthetic acceptance draws (an integer >= 0)")
    p.add_argument("--out", default="runs/replay_sd", help="run directory (default runs/replay_sd): one cell per "
                   "source, resumed where it stopped; `specmoe report` draws the frontier")
    p.add_argument("--max-cells", type=int_at_least(1), default=None,
                   help="replay at most this many new sources, then stop (run again to resume)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=main)


def _sources(args, calibration) -> list[tuple[str, object]]:
    """The sources of blocks, in run order, as (label, build): build() loads the files and returns the `Blocks`
    and the selector whose run gave their accepted lengths (the records' selector kind; None for a profile given
    by number), each source one cell of the run directory, so nothing is loaded for a finished one."""
    from specmoe.records import (AcceptanceProfile, BlockRecords, blocks_from_records, synthetic_blocks,
                                 with_true_continuation)
    from specmoe.records.synthetic import read_trace

    num_layers, num_experts = calibration.warm_ranking.shape

    def records(path):
        records = BlockRecords.load(path, num_layers=num_layers, num_experts=num_experts)
        calibration.check(num_layers, num_experts, records.vocab_size, fingerprint=records.fingerprint or None)
        name = f"{records.drafter} ({Path(path).stem})" if records.drafter else Path(path).stem  # files of one
        return (blocks_from_records(records, args.records_k, source=f"records {name}"),  # drafter stay apart
                records.selector.get("kind") or "unknown")

    out = []
    for path in args.records:
        out.append((f"records {Path(path).name}", lambda path=path: records(path)))
        if args.true_continuation:
            out.append((f"records {Path(path).name}, true continuation",
                        lambda path=path: (lambda b, kind: (with_true_continuation(b), kind))(*records(path))))
    if args.trace is None:
        if args.tau or args.accept_rate or args.accept_table or args.accept_hist_from:
            raise ValueError("a synthetic acceptance option needs --trace")
        return out
    loaded = {}

    def trace():
        if "trace" not in loaded:
            loaded["trace"] = read_trace(args.trace, num_layers=num_layers, num_experts=num_experts)
            calibration.check(num_layers, num_experts, loaded["trace"].vocab_size,
                              fingerprint=loaded["trace"].fingerprint or None)
        return loaded["trace"]

    for k in _ints(args.k, "-k"):
        profiles = []
        if args.tau:
            profiles += [(f"tau {t:g}", lambda t=t, k=k: (AcceptanceProfile.for_tau(t, k), None))
                         for t in _floats(args.tau, "--tau")]
        if args.accept_rate:
            profiles += [(f"rate {r:g}", lambda r=r: (AcceptanceProfile.geometric(r), None))
                         for r in _floats(args.accept_rate, "--accept-rate")]
        if args.accept_table:
            table = _floats(args.accept_table, "--accept-table")
            profiles.append(("table", lambda: (AcceptanceProfile.table(table), None)))
        if args.accept_hist_from:
            def histogram():
                records = BlockRecords.load(args.accept_hist_from)
                return AcceptanceProfile.of_records(records), records.selector.get("kind") or "unknown"

            profiles.append((f"histogram of {Path(args.accept_hist_from).stem}", histogram))
        if not profiles:
            raise ValueError("--trace needs an acceptance: --tau, --accept-rate, --accept-table or --accept-hist-from")
        for label, profile in profiles:
            def build(k=k, label=label, profile=profile):
                acceptance, kind = profile()
                return synthetic_blocks(trace(), k, acceptance, seed=args.seed, max_blocks=args.max_blocks,
                                        source=f"synthetic {label}"), kind

            out.append((f"synthetic {label}, k={k}", build))
    return out


def acceptance_columns(kind: str | None, selectors) -> dict:
    """Whose accepted lengths a source's block rows replay: `acceptance_from` (the selector of the run that made
    the records or the histogram; "profile" for one given by number, which stands in for exact's) and, per selector,
    closed-loop (its own run's) or open-loop (another's: optimistic for a lossy selector following exact's)."""
    from specmoe.records import CLOSED_LOOP, open_loop

    owner = kind or "exact"  # a profile given by number (a tau, a rate) stands in for exact verification's
    return {"acceptance_from": kind or "profile", **{f"{name}_acceptance": CLOSED_LOOP if name == owner else
                                                     open_loop(owner) for name in ("exact", *selectors)}}


IDENTITY = ("calibration", "records", "records_k", "true_continuation", "trace", "tau", "accept_rate", "accept_table",
            "accept_hist_from", "k", "capacity", "max_blocks", "seed")


def points_of(table) -> list:
    """The sweep's points of each source kept in a replay-sd run directory (one table per cell, from its JSON
    column `points`), for the frontier plot."""
    import pandas as pd

    return [pd.DataFrame(json.loads(text)) for text in table.points]


def main(args) -> int:
    import pandas as pd

    from specmoe.rundir import RunDir, digest_of, run_cells
    from specmoe.records import BlockSourceError
    from specmoe.records.synthetic import input_sha256, read_calibration
    from specmoe.limits import MAX_DRAFTS

    from . import report

    if not args.records and args.trace is None:
        raise ValueError("give --records FILE... and/or --trace FILE")
    if args.max_blocks is not None and args.max_blocks < 1:
        raise ValueError(f"--max-blocks must be >= 1, got {args.max_blocks}")
    _ints(args.k, "-k", 1, MAX_DRAFTS)
    calibration = read_calibration(args.calibration)
    if not 1 <= args.capacity <= calibration.warm_ranking.shape[1]:
        raise ValueError(f"-C {args.capacity} outside [1, E={calibration.warm_ranking.shape[1]}]")
    num_experts = calibration.warm_ranking.shape[1]  # an insertion budget beyond E inserts no more
    options = dict(lambdas=_floats(args.lambdas, "--lambdas"), budgets=_ints(args.budgets, "--budgets", 0, num_experts),
                   gammas=_floats(args.gammas, "--gammas"), prune_budgets=_floats(args.prune_budgets, "--prune-budgets"),
                   selectors=tuple(s.strip() for s in args.selectors.split(",") if s.strip()))
    if args.prefetch:  # only when given: earlier run directories keep their identity
        options["prefetch"] = _ints(args.prefetch, "--prefetch", 0, num_experts)
    unknown = [s for s in options["selectors"] if s not in ("acceptmoe", "confidence_top1")]
    if unknown:
        raise ValueError(f"unknown selector {', '.join(unknown)}; expected some of acceptmoe, confidence_top1")
    sources = _sources(args, calibration)
    identity = {"command": "replay-sd", **{k: getattr(args, k) for k in IDENTITY},
                "options": {k: list(v) for k, v in options.items()}}
    paths = {"calibration": args.calibration, **{f"records[{i}]": p for i, p in enumerate(args.records)},
             "trace": args.trace, "accept_hist_from": args.accept_hist_from}
    inputs = {key: {"path": str(p), "sha256": input_sha256(p)} for key, p in paths.items() if p}
    digest = digest_of(identity, inputs)
    run_dir = RunDir(args.out, digest)
    run_dir.check(digest, inputs, identity, "pass another --out DIR")
    grid = [{"config": i, "label": label, "kind": "replay_sd"} for i, (label, _) in enumerate(sources)]
    manifest = {"kind": "replay-sd", "name": "replay_sd", "description": "rollback logical cache vs block-level "
                "expert selection (CPU replay)", "digest": digest, "inputs": inputs, "config": identity,
                "grid": grid, "rounds": 1}

    def measure(item, round_):
        index, (label, build) = item
        blocks, kind = build()
        if blocks.top_k > args.capacity:
            raise BlockSourceError(f"-C {args.capacity} is below the blocks' K={blocks.top_k}")
        table = report.sweep(blocks, calibration, args.capacity, **options)
        summary = {**report.summarize(table), **acceptance_columns(kind, options["selectors"])}
        return {"config": index, "round": round_, "label": label, "kind": "replay_sd", **summary,
                "points": table.to_json(orient="records")}

    cells = [((i, source), i, 0) for i, source in enumerate(sources)]
    with run_dir.lock():
        table, manifest = run_cells(run_dir, manifest, cells, lambda: (measure, {}), name="replay-sd",
                                    max_cells=args.max_cells, progress=not args.no_progress)
    summary = table.drop(columns=["points"])
    columns = ["source", "k", "tau", "blocks", "acceptance_from", "ar_psr_copies", "rollback_psr_copies",
               "rollback_over_ar_psr", "exact_block_copies"]
    shown = summary[[c for c in columns if c in summary.columns] + [  # cells of older versions lack acceptance_from
        c for c in summary.columns if c.endswith(("_copies", "_ratio_min", "_ratio_max", "_ratio_at_preset", "_changed"))
        and c.split("_")[0] in ("acceptmoe", "confidence")]]
    with pd.option_context("display.width", 250, "display.max_columns", 40):
        print(shown.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
        ahead = [c for c in summary.columns if "_prefetch" in c]
        if ahead:  # block prefetch: demand copies and unused prefetches per committed token, peak union slots
            print(summary[["source", "k", *ahead]].to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    print(f"results: {run_dir.path / 'results.parquet'}; tables and the frontier plot: specmoe report {run_dir.path}")
    return 0
