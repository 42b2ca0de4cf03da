"""`specmoe eval`: lm-evaluation-harness benchmarks of one model configuration (a routing policy, or speculative
decoding with a block-level selector) into a run directory that `specmoe report` and `specmoe compare` read.

One cell is one task as named in --tasks (a group such as mmlu is one cell holding its subtasks), run by
`lm_eval.simple_evaluate` on the `specmoe` lm-eval model (`specmoe.evaluation.lm_eval_model`, the `eval` extra)
with logged samples. The run directory has the schema of every run directory (`specmoe.rundir`, and
docs/run-directories.md): manifest.json (kind "eval"; the model arguments and lm-eval options as the run's
identity, the sha256 of the calibration file and of the task files under --include-path as its inputs; per
invocation the command line, commit, versions and hardware), cells/ and results.parquet (one row per task:
lm-eval's results of the task and its subtasks, the number of samples, the task versions, the seconds spent in
the model and the routing summary: copies per routed token, or tau and copies per committed token), and
lm-eval's own output of each task under RUN_DIR/lm_eval/cNNNN/ (results_<date>.json and
samples_<task>_<date>.jsonl, written whole before the cell: a task interrupted part-way leaves nothing behind
and is run again). The model is loaded once per invocation; a run stopped part-way resumes at the next task.

`specmoe compare RUN_A RUN_B` pairs two such run directories question by question (the sample files of their
finished cells). lm-eval options not offered here (generation kwargs, system instructions, ...) are those of
lm-eval's own command line, `python3 -m specmoe.evaluation run --model specmoe ...`, whose output directory
`specmoe compare` reads as well.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from specmoe.arguments import int_at_least

KIND = "eval"
OUTPUT = "lm_eval"  # lm-eval's own output of each cell: RUN_DIR/lm_eval/cNNNN/
FILE_ARGS = ("calibration",)  # model arguments naming an input file whose contents are part of the run's identity


def parse_model_args(items: list[str]) -> dict:
    """KEY=VALUE items (each may hold several, comma-separated, as lm-eval's --model_args) as a dict; values
    typed as lm-eval types them (true/false, integers, floats, else the string)."""
    out = {}
    for item in (part for text in items for part in text.split(",") if part.strip()):
        key, sep, value = item.strip().partition("=")
        if not sep or not key:
            raise ValueError(f"--model-args: expected KEY=VALUE, got {item!r}")
        out[key] = _typed(value)
    return out


def _typed(value: str):
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return value


def describe(model_args: dict) -> str:
    """The configuration in one line: the policy (or selector) and its settings."""
    if "selector" in model_args:
        keys = ("selector", "drafter", "k", "pool")
    else:
        keys = ("policy", "capacity")
        model_args = {"policy": "exact_lru", **model_args}
    head = [f"{k}={model_args[k]}" for k in keys if k in model_args]
    rest = [f"{k}={v}" for k, v in model_args.items() if k not in keys and k not in ("calibration", "threads")]
    return " ".join(head + rest)


def inputs_of(model_args: dict, include_path: str | None) -> dict:
    """The run's input files: the calibration file, and every task file under --include-path (their sha256)."""
    from specmoe.files import file_sha256

    paths = {key: str(model_args[key]) for key in FILE_ARGS if model_args.get(key)}
    if include_path:
        root = Path(include_path)
        if not root.is_dir():
            raise FileNotFoundError(f"--include-path {include_path}: no such directory")
        for path in sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
            paths[f"include_path/{path.relative_to(root)}"] = str(path)
    return {key: {"path": path, "sha256": file_sha256(path)} for key, path in paths.items()}


# -- lm-eval --------------------------------------------------------------------------------------------------
def start_lm_eval(model_args: dict, options: dict):
    """Load the model once; returns (evaluate, summary): evaluate(task, out_dir) runs one task with logged
    samples, writes lm-eval's results and sample files into out_dir and returns lm-eval's results dict;
    summary() is the routing summary since its last call (`SpecmoeLM.routing_summary`). Tests replace this
    function (it is the one place that needs lm-eval)."""
    try:
        import lm_eval
        from lm_eval.loggers import EvaluationTracker
        from lm_eval.tasks import TaskManager

        from .lm_eval_model import SpecmoeLM
    except ImportError as exc:
        raise ValueError(f"specmoe eval needs lm-evaluation-harness: pip install -e '.[eval]' ({exc})") from None

    lm = SpecmoeLM(**model_args)
    manager = TaskManager(include_path=options["include_path"], include_defaults=True)

    def evaluate(task: str, out_dir: Path) -> dict:
        results = lm_eval.simple_evaluate(
            model=lm, tasks=[task], task_manager=manager, num_fewshot=options["num_fewshot"],
            limit=options["limit"], log_samples=True, bootstrap_iters=options["bootstrap_iters"],
            apply_chat_template=options["apply_chat_template"])
        if results is None:
            raise ValueError(f"lm-eval returned no results for task {task}")
        tracker = EvaluationTracker(output_path=str(out_dir))
        samples = results.pop("samples")
        tracker.save_results_aggregated(results=results, samples=samples)
        for name in results["configs"]:
            tracker.save_results_samples(task_name=name, samples=samples[name])
        return results

    def summary() -> dict:
        out = lm.routing_summary()
        lm.clear_summary()
        return out

    return evaluate, summary


def _json(value) -> str:
    return json.dumps(value, sort_keys=True, default=lambda v: float(v) if hasattr(v, "__float__") else str(v))


def cell_row(index: int, round_: int, task: str, results: dict, samples: list[str], seconds: float,
             routing: dict) -> dict:
    """One task's row: lm-eval's per-task results (JSON columns), its sample files and the routing summary."""
    return {"config": index, "round": round_, "label": task, "kind": "lm_eval", "task": task,
            "results": _json(results.get("results", {})), "n_samples": _json(results.get("n-samples", {})),
            "versions": _json(results.get("versions", {})),
            "higher_is_better": _json(results.get("higher_is_better", {})), "samples": _json(samples),
            "wall_seconds": seconds, "model_seconds": float(routing.get("seconds", float("nan"))),
            "routing": _json({k: v for k, v in routing.items() if k != "seconds"})}


def run_evaluation(model_args: dict, tasks: list[str], options: dict, out: str | Path | None = None, *,
                   max_cells: int | None = None, progress: bool = True, command: list[str] | None = None):
    """Run (or resume) the tasks into a run directory (default runs/eval-DIGEST); returns (table, manifest, path)."""
    from specmoe.rundir import RunDir, digest_of, run_cells

    if not tasks:
        raise ValueError("--tasks: name at least one task")
    if len(set(tasks)) != len(tasks):
        raise ValueError(f"--tasks names a task twice: {','.join(tasks)}")
    inputs = inputs_of(model_args, options.get("include_path"))
    identity = {"command": KIND, "model_args": model_args, "tasks": list(tasks), **options}
    digest = digest_of(identity, inputs)
    run_dir = RunDir(out if out is not None else Path("runs") / f"eval-{digest}", digest)
    run_dir.check(digest, inputs, identity, "pass another --out DIR")
    description = f"lm-eval: {describe(model_args)}"
    manifest = {"kind": KIND, "name": "eval", "description": description, "digest": digest, "inputs": inputs,
                "config": identity, "grid": [{"config": i, "label": t, "kind": "lm_eval"} for i, t in enumerate(tasks)],
                "rounds": 1}

    def start():
        started = time.time()
        evaluate, summary = start_lm_eval(model_args, options)

        def measure(task, round_):
            index = tasks.index(task)
            final = run_dir.path / OUTPUT / f"c{index:04d}"
            partial = final.with_name(final.name + ".partial")
            for stale in (final, partial):  # an earlier attempt at this cell that did not finish
                shutil.rmtree(stale, ignore_errors=True)
            summary()  # counters from here on are this task's
            began = time.time()
            results = evaluate(task, partial)
            seconds = time.time() - began
            partial.rename(final)
            samples = sorted(str(p.relative_to(run_dir.path)) for p in final.rglob("samples_*.jsonl"))
            if not samples:
                raise ValueError(f"lm-eval wrote no sample file for task {task} into {final}")
            return cell_row(index, round_, task, results, samples, seconds, summary())

        return measure, {"setup_seconds": round(time.time() - started, 1)}

    cells = [(task, i, 0) for i, task in enumerate(tasks)]
    with run_dir.lock():
        table, manifest = run_cells(run_dir, manifest, cells, start, name="eval", max_cells=max_cells,
                                    progress=progress, command=command)
    return table, manifest, run_dir.path


# -- reading --------------------------------------------------------------------------------------------------
def is_eval_dir(path: str | Path) -> bool:
    """Whether `path` is a run directory of `specmoe eval`."""
    from specmoe.rundir import RunDir

    path = Path(path)
    return path.is_dir() and (path / "manifest.json").is_file() and (RunDir(path).manifest() or {}).get("kind") == KIND


def sample_files_of(path: str | Path) -> list[Path]:
    """The sample files of the finished cells of an eval run directory (cells whose files validate)."""
    from specmoe.rundir import RunDir

    path = Path(path)
    manifest = RunDir(path).manifest() or {}
    run_dir = RunDir(path, manifest.get("digest", ""))
    good = run_dir.check_cells(lambda text: print(text, file=sys.stderr), move=False)
    files = []
    for index, round_ in sorted(good):
        row = json.loads(run_dir.cell_path(index, round_).read_text(encoding="utf-8"))
        files += [path / name for name in json.loads(row["samples"])]
    if not files:
        raise FileNotFoundError(f"{path}: a `specmoe eval` run directory with no finished task yet")
    return files


def task_table(table):
    """One row per (task or subtask, filter, metric) of an eval run's results table: the value, its standard
    error, the samples and whether higher is better."""
    import pandas as pd

    rows = []
    for cell in table.sort_values("config").itertuples():
        results, n = json.loads(cell.results), json.loads(cell.n_samples)
        better = json.loads(cell.higher_is_better)
        for task, figures in results.items():
            count = n.get(task, {}).get("effective", n.get(task, {}).get("original"))
            for key, value in figures.items():
                metric, _, filter_ = key.partition(",")
                if key == "alias" or metric.endswith("_stderr") or not isinstance(value, (int, float)):
                    continue
                stderr = figures.get(f"{metric}_stderr,{filter_}")
                rows.append({"task": figures.get("alias", task).strip(), "metric": metric, "filter": filter_ or "–",
                             "value": float(value), "stderr": float(stderr) if isinstance(stderr, (int, float))
                             else float("nan"), "n": count if count is not None else "–",
                             "higher is better": {True: "yes", False: "no"}.get(better.get(task, {}).get(metric), "–")})
    return pd.DataFrame(rows, columns=["task", "metric", "filter", "value", "stderr", "n", "higher is better"])


def cost_table(table):
    """One row per cell: the task, its wall and model seconds and the routing summary (copies per routed token,
    or tau and copies per committed token under speculative decoding)."""
    import pandas as pd

    rows = []
    for cell in table.sort_values("config").itertuples():
        rows.append({"task": cell.task, "wall s": cell.wall_seconds, "model s": cell.model_seconds,
                     **{k: v for k, v in json.loads(cell.routing).items() if isinstance(v, (int, float))}})
    return pd.DataFrame(rows)


# -- command line ---------------------------------------------------------------------------------------------
def add_parser(sub) -> None:
    parser = sub.add_parser("eval", help="lm-eval benchmarks of a routing policy or speculative decoding, into a "
                            "run directory", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", required=True, help="lm-eval task names, comma-separated (one cell each)")
    parser.add_argument("--model-args", nargs="+", default=[], metavar="KEY=VALUE",
                        help="the specmoe model's arguments (docs/evaluation.md), e.g. policy=psr capacity=32 "
                        "bonus=0.3 calibration=cal.safetensors (or comma-separated, as lm-eval's --model_args)")
    parser.add_argument("--include-path", default=None, help="a directory of extra task files (lm-eval's "
                        "--include_path; their contents are inputs of the run)")
    parser.add_argument("--num-fewshot", type=int_at_least(0), default=None, help="few-shot examples (default: "
                        "the task's)")
    parser.add_argument("--limit", type=float, default=None, help="at most this many questions per task (or a "
                        "fraction below 1), for a quick look; not a benchmark figure")
    parser.add_argument("--apply-chat-template", action="store_true", help="wrap prompts in the tokenizer's chat "
                        "template")
    parser.add_argument("--bootstrap-iters", type=int_at_least(0), default=100000,
                        help="lm-eval's bootstrap resamples for the standard error of non-mean metrics (default "
                        "100000, as lm-eval; 0: none)")
    parser.add_argument("--out", default=None, help="run directory (default runs/eval-DIGEST, DIGEST of the model "
                        "arguments, the options and the input files)")
    parser.add_argument("--max-cells", type=int_at_least(1), default=None,
                        help="run at most this many new tasks, then stop (run again to resume)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=main)


def main(args) -> int:
    import pandas as pd

    model_args = parse_model_args(args.model_args)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    limit = int(args.limit) if args.limit is not None and args.limit >= 1 and args.limit == int(args.limit) \
        else args.limit
    options = {"include_path": args.include_path, "num_fewshot": args.num_fewshot, "limit": limit,
               "apply_chat_template": args.apply_chat_template, "bootstrap_iters": args.bootstrap_iters}
    table, manifest, path = run_evaluation(model_args, tasks, options, args.out, max_cells=args.max_cells,
                                           progress=not args.no_progress)
    print(f"{manifest['description']}: {manifest['cells_done']} of {manifest['cells_total']} tasks done")
    if len(table):
        with pd.option_context("display.width", 200, "display.max_columns", 20):
            print(task_table(table).to_string(index=False, float_format=lambda v: f"{v:.4f}"))
    print(f"results: {path / 'results.parquet'}; specmoe report {path}; specmoe compare {path} OTHER_RUN")
    return 0
