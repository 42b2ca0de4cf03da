"""Two source trees, one benchmark: processes alternate between an older tree and this one, and each row's
old / new ratio gets a paired interval over the alternations (a change measured against the code before it when
the two cannot run in one process, e.g. a decoder's kernels).

The benchmark is a script of the trees (default `scripts/bench_engine.py`) that takes `--out DIR` and writes a
JSON report there whose "table" (or another key, --table-key) maps row names to numbers (bench_engine's
`bench_engine.json`: ms_mean, copies_skipped_ms, ...; bench_drafters' `bench_drafters.json` under "rows": ms_per_step,
...) or is a list of rows, each named by its --row-key field (bench_spec_engine's `bench_spec_engine.json`: "key";
compute_ms_per_token, compute_ms_per_block, ...). Pair i runs the script once in each tree (cwd and PYTHONPATH the
tree), old first in even pairs and new first in odd ones (drift in the machine's clocks or temperature falls on
both sides); pair i's old / new per row and field is one paired unit, and `specmoe.stats.log_ratio_ttest` gives
the ratio (the geometric mean) with its interval over the pairs (two pairs at least). Give each process one round
of the benchmark's own (`--rounds 1`): the pairs are the rounds.

The two sides may also be one tree run with two environments (`--old-env` / `--new-env` NAME=VALUE, e.g. a
kernel switch such as SPECMOE_PDL=0 against the default): --old and --new may then be the same tree.

Every process writes into --out/<old|new>_<i>; a rerun with the same --out reuses the processes whose report is
there (a run cut short resumes; one with other trees, script or arguments is refused). The summary is written
atomically at the start and after each pair: ab_trees.json (the comparison, every process's values and the
ratios) and ab_trees.md (the table).

    PYTHONPATH=. python3 scripts/ab_trees.py --old ../old_tree --pairs 3 --out runs/ab -- \\
        --model moonlight-16b-a3b --rounds 1 --windows 2 --tokens 64 --prompt 32 --no-hf --capacities 24
    PYTHONPATH=. python3 scripts/ab_trees.py --old . --old-env SPECMOE_PDL=0 --pairs 3 --out runs/pdl -- ...
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specmoe.files import write_text_atomic  # noqa: E402
from specmoe.stats import log_ratio_ttest  # noqa: E402


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", required=True, help="the older tree (holds the script and the package)")
    ap.add_argument("--new", default=".", help="the newer tree (default: this checkout)")
    ap.add_argument("--pairs", type=int, default=3, help="alternations: one process per tree each (at least 2)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--script", default="scripts/bench_engine.py", help="the benchmark, relative to each tree")
    ap.add_argument("--report", default="bench_engine.json", help="the JSON report the script writes in its --out")
    ap.add_argument("--table-key", default="table",
                    help="the report's key of its rows (bench_engine: table; bench_drafters: rows)")
    ap.add_argument("--row-key", default="key",
                    help="where the rows are a list (bench_spec_engine's table): the field that names each row")
    ap.add_argument("--fields", nargs="+", default=["ms_mean", "copies_skipped_ms"],
                    help="numbers of each table row to compare (rows without one are left out)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per process")
    for side in ("old", "new"):
        ap.add_argument(f"--{side}-env", nargs="+", default=[], metavar="NAME=VALUE",
                        help=f"environment variables of the {side} side's processes")
    ap.add_argument("bench_args", nargs=argparse.REMAINDER, help="after --: the script's arguments but --out")
    args = ap.parse_args(argv)
    args.bench_args = [a for a in args.bench_args if a != "--"]
    if args.pairs < 2:
        ap.error(f"--pairs must be at least 2 (a paired interval needs two units), got {args.pairs}")
    if "--out" in args.bench_args:
        ap.error("the script's --out is set per process (under --out); leave it out of its arguments")
    for side in ("old", "new"):
        pairs = getattr(args, f"{side}_env")
        if any("=" not in p or not p.split("=", 1)[0] for p in pairs):
            ap.error(f"--{side}-env takes NAME=VALUE pairs, got {pairs}")
        setattr(args, f"{side}_env", dict(p.split("=", 1) for p in pairs))
        tree = Path(getattr(args, side)).resolve()
        if not (tree / args.script).is_file():
            ap.error(f"--{side} {getattr(args, side)}: {args.script} not found in {tree}")
        setattr(args, side, tree)
    if args.old == args.new and args.old_env == args.new_env:
        ap.error("--old and --new are one tree with one environment: nothing to compare")
    return args


def run_process(side: str, out: Path, args) -> dict:
    """One process of the script in the side's tree and environment, its table (reused where a finished report is already in `out`);
    RuntimeError naming the process and the end of its output if it fails or writes no table."""
    report = out / args.report
    table = _table(report, args.table_key, args.row_key)
    if table:
        return table
    out.mkdir(parents=True, exist_ok=True)
    tree = getattr(args, side)
    env = {**os.environ, **getattr(args, f"{side}_env"), "PYTHONPATH": str(tree)}
    started = time.time()
    done = subprocess.run([sys.executable, args.script, "--out", str(out.resolve()), *args.bench_args], cwd=tree,
                          env=env, capture_output=True, text=True, timeout=args.timeout)
    (out / "log.txt").write_text(done.stdout + done.stderr)
    table = _table(report, args.table_key, args.row_key)
    if not table:
        raise RuntimeError(f"{args.script} in {tree} (exit {done.returncode}, {time.time() - started:.0f} s) wrote no "
                           f"table to {report}; its output ends:\n{(done.stdout + done.stderr)[-2000:]}")
    return table


def _table(report: Path, key: str = "table", row_key: str = "key") -> dict | None:
    """The rows (under `key`) of a finished report by name, None if there are none: a dict of rows as it is, a list
    of rows keyed by each row's `row_key` field."""
    rows = json.loads(report.read_text()).get(key) if report.is_file() else None
    if isinstance(rows, list):
        rows = {str(r[row_key]): r for r in rows if isinstance(r, dict) and row_key in r}
    return rows or None


def ratios(tables: dict, fields) -> dict:
    """{row: {field: {ratio, low, high, p, pairs}}} of old / new over the pairs where both sides have the value."""
    result = {}
    rows = sorted(set.intersection(*(set(t) for side in tables.values() for t in side)))
    for row in rows:
        for field in fields:
            old = [t[row].get(field) for t in tables["old"]]
            new = [t[row].get(field) for t in tables["new"]]
            if any(not isinstance(v, (int, float)) for v in old + new):
                continue
            r = log_ratio_ttest(old, new)
            result.setdefault(row, {})[field] = {"ratio": r.ratio, "low": r.low, "high": r.high, "p": r.p_value,
                                                 "pairs": r.rounds, "old_mean": sum(old) / len(old),
                                                 "new_mean": sum(new) / len(new)}
    return result


def _env(env: dict) -> str:
    return f" ({' '.join(f'{k}={v}' for k, v in env.items())})" if env else ""


def markdown(summary: dict) -> str:
    lines = [f"# {summary['script']}: old / new over {summary['pairs']} alternating pairs", "",
             f"old: {summary['old']}{_env(summary['old_env'])}; new: {summary['new']}{_env(summary['new_env'])}; "
             f"arguments: `{' '.join(summary['bench_args'])}`", "",
             "| row | field | old mean | new mean | old / new (95%, paired t over pairs) | p |",
             "|---|---|---|---|---|---|"]
    for row, fields in summary["ratios"].items():
        for field, r in fields.items():
            lines.append(f"| {row} | {field} | {r['old_mean']:.4g} | {r['new_mean']:.4g} | {r['ratio']:.3f} "
                         f"({r['low']:.3f}–{r['high']:.3f}) | {r['p']:.2g} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse(argv)
    out = Path(args.out)
    tables: dict[str, list] = {"old": [], "new": []}
    summary = {"script": args.script, "old": str(args.old), "new": str(args.new), "old_env": args.old_env,
               "new_env": args.new_env, "bench_args": args.bench_args, "fields": args.fields}
    identity = ("script", "old", "new", "old_env", "new_env", "bench_args")
    earlier = out / "ab_trees.json"
    if earlier.is_file():  # a resumed run must be the same comparison, or its finished processes do not belong
        before = json.loads(earlier.read_text())
        changed = [key for key in identity if before.get(key) != summary[key]]
        if changed:
            raise SystemExit(f"ab_trees.py: {out} holds a comparison with other {', '.join(changed)} "
                             f"({', '.join(repr(before.get(k)) for k in changed)}); use another --out")
    else:
        write_text_atomic(earlier, json.dumps({**summary, "pairs": 0}, indent=1))
    for i in range(args.pairs):
        for side in (("old", "new") if i % 2 == 0 else ("new", "old")):
            tables[side].append(run_process(side, out / f"{side}_{i}", args))
            print(f"pair {i}: {side} done", flush=True)
        if i >= 1:
            summary.update(pairs=i + 1, tables=tables, ratios=ratios(tables, args.fields))
            write_text_atomic(earlier, json.dumps(summary, indent=1))
            write_text_atomic(out / "ab_trees.md", markdown(summary))
    print(markdown(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
