"""`specmoe compare RUN_A RUN_B`: two benchmark runs compared question by question, one table of paired tests.

A run is a run directory of `specmoe eval` (the sample files of its finished tasks), or lm-evaluation-harness
output written with ``--log_samples``: a directory (searched recursively for ``samples_<task>_<date>.jsonl``;
one file per task) or one such file. Per task, filter and metric, the
questions both runs scored (matched by doc_id; a doc_id whose document hash differs between the runs is an
error) give one row: the mean score of A and of B, the paired difference A - B with its standard error, and a
p-value, two-sided:

- a 0/1 score per question (acc, exact_match, pass@1 under greedy decoding): exact McNemar test on the
  discordant questions (`specmoe.stats.mcnemar_exact`);
- a list of 0/1 scores per question (IFEval's instruction level): the question is the unit, so the standard
  error is cluster-robust and the test a sign flip of whole questions (`stats.sign_flip_test` with clusters);
  A and B are then the means over all items, as lm-eval reports them;
- any other number per question: sign-flip permutation test of the mean difference.

The table is one family of tests: p (Holm) is Holm's adjustment over all of its rows. A difference significant
after it is bold; one with p < 0.05 before correction only is marked †. Scores that lie in [0, 1] are shown in
points (x 100). The last line is the mean of the rows' differences with a 95% t interval that treats the rows
as independent: choose one metric per task (``--metrics``) to get the mean over tasks. Per-question values that
are not scores (corpus-level metrics such as BLEU, perplexity pairs) are left out and named. A and B are the
means of the per-question values, which equal lm-eval's figures for metrics aggregated by a mean.
``--pool NAME=GLOB`` pools the questions of every task matching GLOB into one row NAME (MMLU's or BBH's
subtasks, pooled at the question level).

The table is printed as markdown and written to ``--out`` (and the rows as JSON next to it), each atomically.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from specmoe.files import check_output_file, write_text_atomic

_SAMPLE_FILE = re.compile(r"^samples_(?P<task>.+)_(?P<date>\d{4}-\d{2}-\d{2}T\d{2}-\d{2}-\d{2}(?:\.\d+)?)\.jsonl$")
_NOT_METRICS = {"doc_id", "doc", "target", "arguments", "resps", "filtered_resps", "filter", "metrics", "doc_hash",
                "prompt_hash", "target_hash"}


# -- reading runs --------------------------------------------------------------------------------------------
def sample_files(run: str | Path) -> dict[str, Path]:
    """task -> the samples file of that task in `run` (a directory searched recursively, or one file)."""
    from .run import is_eval_dir, sample_files_of

    run = Path(run)
    if run.is_file():
        files = [run]
    elif is_eval_dir(run):  # a `specmoe eval` run directory: its finished tasks' sample files
        files = sample_files_of(run)
    elif run.is_dir():
        files = sorted(run.rglob("samples_*.jsonl"))
    else:
        raise FileNotFoundError(f"no run at {run} (expected a `specmoe eval` run directory, lm-eval's --output_path "
                                "directory or a samples file)")
    found: dict[str, Path] = {}
    for path in files:
        match = _SAMPLE_FILE.match(path.name)
        task = match["task"] if match else path.stem.removeprefix("samples_")
        if task in found:
            raise ValueError(f"{run} holds two sample files of task {task} ({found[task]} and {path}): "
                             "give the directory or file of one run")
        found[task] = path
    if not found:
        raise FileNotFoundError(f"no samples_<task>_<date>.jsonl files under {run}: run lm-eval with --log_samples")
    return found


def read_samples(path: Path) -> list[dict]:
    """The per-question records of one samples file (one JSON object a line)."""
    records = []
    try:
        lines = Path(path).read_text(encoding="utf-8").split("\n")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text (byte {exc.start} is {exc.object[exc.start]:#04x}); lm-eval "
                         "writes its samples as UTF-8") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}, line {number}: not JSON ({exc.msg})") from None
        if not isinstance(record, dict) or "doc_id" not in record:
            raise ValueError(f"{path}, line {number}: not an lm-eval sample (no doc_id)")
        doc_id = record["doc_id"]
        if isinstance(doc_id, bool) or not isinstance(doc_id, (int, str)):
            raise ValueError(f"{path}, line {number}: doc_id must be an integer or a string, got {doc_id!r:.60}")
        for key in _metrics(record):
            if isinstance(record[key], int) and not isinstance(record[key], bool) and abs(record[key]) > 2 ** 53:
                raise ValueError(f"{path}, line {number}: {key} = {str(record[key])[:20]}... is no score "
                                 "(an integer beyond 2**53)")
        records.append(record)
    return records


def _score(value):
    """A per-question value as a score: a float, a list of 0/1 item scores, or None (not a score)."""
    if isinstance(value, bool) or (isinstance(value, (int, float)) and math.isfinite(value)):
        return float(value)
    if isinstance(value, list) and value and all(isinstance(v, bool) or v in (0, 1) for v in value):
        return [float(v) for v in value]
    return None


def _metrics(record: dict) -> list[str]:
    names = record.get("metrics")
    if isinstance(names, list):
        return [n for n in names if isinstance(n, str) and n in record]
    return [k for k in record if k not in _NOT_METRICS]


def _by_question(run: str | Path, pools: dict[str, str]) -> dict[tuple[str, str, str], dict]:
    """(row task, filter, metric) -> {(task, doc_id): (doc hash, value)} of one run."""
    table: dict[tuple[str, str, str], dict] = {}
    for task, path in sample_files(run).items():
        row_task = next((name for name, pattern in pools.items() if fnmatch.fnmatchcase(task, pattern)), task)
        for record in read_samples(path):
            for metric in _metrics(record):
                questions = table.setdefault((row_task, str(record.get("filter", "none")), metric), {})
                key = (task, record["doc_id"])
                if key in questions:
                    raise ValueError(f"{path}: doc_id {record['doc_id']} appears twice for filter "
                                     f"{record.get('filter', 'none')}")
                questions[key] = (record.get("doc_hash"), record[metric])
    return table


# -- one row -------------------------------------------------------------------------------------------------
@dataclass
class Row:
    """One paired comparison: a task (or pool of tasks), a filter and a metric."""

    task: str
    metric: str
    filter: str
    n: int  # paired questions
    a: float
    b: float
    difference: float
    se: float
    test: str
    p: float
    p_holm: float = float("nan")
    scale: float = 100.0  # 100: points; 1: the metric's own unit
    items: int = 0  # scored items (list-valued scores), else equal to n


def paired_row(task: str, metric: str, filter_: str, pairs: list[tuple[object, object]], *, resamples: int,
               seed: int) -> Row | str:
    """The row of paired per-question values (value in A, value in B), or why there is none."""
    from specmoe import stats

    scored = [(_score(a), _score(b)) for a, b in pairs]
    if any(a is None or b is None for a, b in scored):
        return "per-question values are not scores"
    lists = [isinstance(a, list) or isinstance(b, list) for a, b in scored]
    if any(lists) and not all(lists):
        return "some questions have one score, others a list"
    if all(lists):
        if any(len(a) != len(b) for a, b in scored):
            return "a question has a different number of items in the two runs"
        clusters = np.repeat(np.arange(len(scored)), [len(a) for a, _ in scored])
        a = np.concatenate([a for a, _ in scored])
        b = np.concatenate([b for _, b in scored])
        if len(scored) < 2:
            return "fewer than 2 paired questions"
        test = stats.sign_flip_test(a - b, clusters, n_resamples=resamples, seed=seed)
        diff = stats.paired_difference(a, b, clusters)
        name, p = "sign flip by question", test.p_value
    else:
        a = np.array([v for v, _ in scored])
        b = np.array([v for _, v in scored])
        if a.size < 2:
            return "fewer than 2 paired questions"
        diff = stats.paired_difference(a, b)
        if np.isin(a, (0.0, 1.0)).all() and np.isin(b, (0.0, 1.0)).all():
            result = stats.mcnemar_exact(a, b)
            name, p = f"McNemar {result.only_a}/{result.only_b}", result.p_value
        else:
            name, p = "sign flip", stats.sign_flip_test(a - b, n_resamples=resamples, seed=seed).p_value
    scale = 100.0 if (0.0 <= min(a.min(), b.min()) and max(a.max(), b.max()) <= 1.0) else 1.0
    return Row(task, metric, filter_, len(scored), diff.mean_a, diff.mean_b, diff.difference, diff.se, name, p,
               scale=scale, items=int(a.size))


def _question_order(question) -> tuple:
    """Sort key of (task, doc_id): by task, then doc_id (numbers in numeric order)."""
    task, doc_id = question
    return (task, 0, doc_id, "") if isinstance(doc_id, int) else (task, 1, 0, str(doc_id))


def compare_runs(run_a: str | Path, run_b: str | Path, *, metrics=None, pools: dict[str, str] | None = None,
                 resamples: int = 20000, seed: int = 0) -> tuple[list[Row], list[str]]:
    """The table's rows (Holm-adjusted together) and notes on what was left out."""
    from specmoe import stats

    pools = pools or {}
    side_a, side_b = _by_question(run_a, pools), _by_question(run_b, pools)
    rows, notes = [], []
    for key in sorted(set(side_a) | set(side_b)):
        task, filter_, metric = key
        if metrics and metric not in metrics:
            continue
        if key not in side_a or key not in side_b:
            notes.append(f"{task} {metric} ({filter_}): only in run {'A' if key in side_a else 'B'}")
            continue
        qa, qb = side_a[key], side_b[key]
        common = sorted(set(qa) & set(qb), key=_question_order)
        for question in common:
            hash_a, hash_b = qa[question][0], qb[question][0]
            if hash_a is not None and hash_b is not None and hash_a != hash_b:
                raise ValueError(f"task {question[0]}, doc_id {question[1]}: the runs scored different documents "
                                 "(doc_hash differs); pair runs of the same task version and few-shot setting")
        dropped = len(qa) + len(qb) - 2 * len(common)
        if dropped:
            notes.append(f"{task} {metric} ({filter_}): {dropped} questions scored in one run only, left out")
        row = paired_row(task, metric, filter_, [(qa[q][1], qb[q][1]) for q in common], resamples=resamples,
                         seed=seed)
        if isinstance(row, str):
            notes.append(f"{task} {metric} ({filter_}): left out, {row}")
        else:
            rows.append(row)
    if metrics:
        missing = sorted(set(metrics) - {row.metric for row in rows})
        notes.extend(f"metric {m}: in no row" for m in missing)
    for row, adjusted in zip(rows, stats.holm([row.p for row in rows]).tolist()):
        row.p_holm = adjusted
    return rows, notes


# -- the table -----------------------------------------------------------------------------------------------
def _run_name(run: str) -> str:
    """The run's path, and for a `specmoe eval` run directory what it ran (its manifest's description)."""
    from specmoe.rundir import RunDir

    from .run import is_eval_dir

    if not is_eval_dir(run):
        return f"`{run}`"
    return f"`{run}` ({(RunDir(run).manifest() or {}).get('description', 'specmoe eval')})"


def _num(value: float, scale: float, digits: int = 1) -> str:
    return f"{value * scale:.{digits}f}" if scale == 100.0 else f"{value:.4g}"


def _p(value: float) -> str:
    return f"{value:.2g}" if value < 0.001 else f"{value:.3f}"


def markdown(rows: list[Row], notes: list[str], run_a: str, run_b: str) -> str:
    """The comparison table as markdown (see the module docstring)."""
    from specmoe import stats

    lines = [f"A: {_run_name(run_a)}  ", f"B: {_run_name(run_b)}", "",
             "| task | metric | filter | n | A | B | A − B | se | test | p | p (Holm) |",
             "|---|---|---|---:|---:|---:|---:|---:|---|---:|---:|"]
    for row in rows:
        sign = "+" if row.difference >= 0 else "−"
        difference = f"{sign}{_num(abs(row.difference), row.scale)}"
        if row.p_holm < 0.05:
            difference = f"**{difference}**"
        elif row.p < 0.05:
            difference += " †"
        n = f"{row.n} ({row.items} items)" if row.items != row.n else str(row.n)
        lines.append(f"| {row.task} | {row.metric} | {row.filter} | {n} | {_num(row.a, row.scale)} | "
                     f"{_num(row.b, row.scale)} | {difference} | {_num(row.se, row.scale)} | {row.test} | "
                     f"{_p(row.p)} | {_p(row.p_holm)} |")
    lines.append("")
    lines.append(f"Holm's correction over the table's {len(rows)} tests; bold: significant after it (p < 0.05), "
                 "†: p < 0.05 before correction only. Scores in [0, 1] in points (x 100). A difference that is not "
                 "significant does not show equal quality: its interval is difference ± 1.96 se.")
    in_points = [row.difference * 100.0 for row in rows if row.scale == 100.0]
    if len(in_points) >= 2:
        mean = stats.mean_interval(in_points)
        lines.append(f"Mean difference over the {mean.n} rows in points: {mean.mean:+.2f} (95% interval "
                     f"{mean.low:+.2f} to {mean.high:+.2f}, rows treated as independent).")
    lines.extend(f"Note: {note}." for note in notes)
    return "\n".join(lines) + "\n"


def _pool(text: str) -> tuple[str, str]:
    name, sep, pattern = text.partition("=")
    if not sep or not name or not pattern:
        raise argparse.ArgumentTypeError(f"expected NAME=GLOB (e.g. mmlu='mmlu_*'), got {text!r}")
    return name, pattern


def add_parser(sub) -> None:
    from specmoe.arguments import int_at_least

    parser = sub.add_parser("compare", help="paired per-question comparison of two lm-eval runs (McNemar, "
                            "sign flip, Holm)", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_a", metavar="RUN_A", help="lm-eval output (directory or samples file) of configuration A")
    parser.add_argument("run_b", metavar="RUN_B", help="lm-eval output of configuration B, the reference")
    parser.add_argument("--metrics", default=None, help="comma-separated metrics to compare (default: all)")
    parser.add_argument("--pool", type=_pool, action="append", default=[], metavar="NAME=GLOB",
                        help="pool the questions of the tasks matching GLOB into one row NAME (repeatable)")
    parser.add_argument("--resamples", type=int_at_least(1), default=20000,
                        help="random sign patterns of a sign-flip test with more than 16 units (default 20000)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sign-flip tests (default 0)")
    parser.add_argument("--out", default="runs/compare.md",
                        help="markdown file to write (the rows also go to the same name with .json)")
    parser.set_defaults(func=main)


def main(args) -> int:
    out = Path(args.out)
    rows_path = out.with_suffix(".json")
    check_output_file(out, "--out")
    check_output_file(rows_path, "--out (rows)")
    metrics = tuple(m.strip() for m in args.metrics.split(",") if m.strip()) if args.metrics else None
    rows, notes = compare_runs(args.run_a, args.run_b, metrics=metrics, pools=dict(args.pool),
                               resamples=args.resamples, seed=args.seed)
    if not rows:
        raise ValueError("the runs have no task, filter and metric in common with paired scores"
                         + (f" ({'; '.join(notes)})" if notes else ""))
    text = markdown(rows, notes, args.run_a, args.run_b)
    write_text_atomic(out, text)
    write_text_atomic(rows_path, json.dumps({"run_a": args.run_a, "run_b": args.run_b, "notes": notes,
                                             "rows": [asdict(row) for row in rows]}, indent=2))
    print(text, end="")
    print(f"written: {out}, {rows_path}")
    return 0
