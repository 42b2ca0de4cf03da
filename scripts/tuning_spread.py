"""How much a fresh tuning moves the engine's speed: the target's decode step (every expert resident, the engine
as `build_engine` makes it, a named full-size config with seeded random weights on the GPU) after --rounds fresh
tunings with each timer of --timers, alternating, in one process on one model:

- `graph`: the tuners' own (`specmoe.kernels.tuning.fastest`: each candidate timed in a CUDA graph over a batch
  of launches that reads past twice the L2);
- `eager`: the timer before tuning-cache version 2, put back for the comparison: triton's do_bench (eager
  launches, the L2 flushed before each) on one operand (`rotation` 1).

Each tuning writes a fresh cache file, so the per-token MoE kernel and every one-row linear layer's GEMV are tuned
again; then the step is timed teacher-forced over --tokens positions from --position (the median of --passes
passes, after one to warm up). Printed per tuning: the step's ms and the launch parameters chosen; per timer: the
steps' min, median and max and the spread (max / min), and how many tunings chose each set of parameters (two
tunings with the same choice differ only by the step's own noise).

    PYTHONPATH=. python3 scripts/tuning_spread.py [--rounds 3] [--out runs/tuning_spread.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from unittest import mock

import numpy as np
import torch

TIMERS = ("graph", "eager")


def eager_timer(fn) -> float:
    """The tuners' timer before tuning-cache version 2: triton's do_bench, median ms (eager, L2 flushed)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=5, rep=20, return_mode="median"))


def use_timer(timer: str) -> None:
    """Make every tuner time with `timer` ("graph": the package's own; "eager": `eager_timer` on one operand)."""
    from specmoe.kernels import gemv, moe, tuning

    if not hasattr(use_timer, "own"):
        use_timer.own = (tuning.graph_ms, moe.rotation, gemv.rotation)
    graph_ms, moe_rotation, gemv_rotation = use_timer.own
    eager = timer == "eager"
    tuning.graph_ms = eager_timer if eager else graph_ms
    moe.rotation = (lambda *a, **k: 1) if eager else moe_rotation
    gemv.rotation = (lambda *a, **k: 1) if eager else gemv_rotation


def choice_of(launch: dict) -> str:
    """The tuned launch parameters of a decoder's launch table, as one comparable string."""
    return json.dumps({name: entry["params"] for name, entry in sorted(launch.items())}, sort_keys=True)


def spread_table(rows: list[dict]) -> str:
    """Per timer: tunings, the steps' min / median / max ms, the spread (max / min), and the distinct choices
    with how many tunings made each and their mean step ms (markdown)."""
    lines = ["| timer | tunings | step ms min | median | max | max / min | distinct choices (tunings: mean ms) |",
             "|---|---|---|---|---|---|---|"]
    for timer in dict.fromkeys(r["timer"] for r in rows):
        mine = [r for r in rows if r["timer"] == timer]
        ms = [r["step_ms"] for r in mine]
        by_choice = collections.defaultdict(list)
        for r in mine:
            by_choice[r["choice"]].append(r["step_ms"])
        choices = ", ".join(f"{len(v)}: {statistics.mean(v):.3f}" for v in
                            sorted(by_choice.values(), key=lambda v: (-len(v), statistics.mean(v))))
        lines.append(f"| {timer} | {len(mine)} | {min(ms):.3f} | {statistics.median(ms):.3f} | {max(ms):.3f} | "
                     f"{max(ms) / min(ms):.3f} | {len(by_choice)} ({choices}) |")
    return "\n".join(lines)


def fresh_step(model, adapter, unit, tokens, args) -> dict:
    """The target engine built over the all-resident `unit` (tuned into the cache file the environment names) and
    its step timed: {"step_ms": the median of --passes after one to warm up, "passes_ms", "build_s", "choice",
    "sources"}."""
    from specmoe.engines import EngineConfig, build_engine
    from specmoe.routing import Calibration, preset

    L, E, K, V = adapter.num_moe_layers, adapter.num_experts, adapter.top_k, adapter.vocab_size
    t0 = time.time()
    engine = build_engine(model, preset("exact_lru", E, K), Calibration.uniform(L, E, V),
                          EngineConfig(max_seq_len=args.max_seq_len), residency=unit)
    built = time.time() - t0
    passes = []
    for _ in range(args.passes + 1):  # the first warms up
        r = engine.teacher_forced(tokens, first_position=args.position)
        passes.append(float(r.ms[r.timed].mean()))
    launch = engine.kernels["launch"]
    del engine, r
    torch.cuda.empty_cache()
    return {"step_ms": statistics.median(passes[1:]), "passes_ms": passes[1:], "build_s": built,
            "choice": choice_of(launch), "sources": sorted({entry["source"] for entry in launch.values()})}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="olmoe-1b-7b", help="a named config of specmoe.models")
    ap.add_argument("--rounds", type=int, default=3, help="fresh tunings per timer")
    ap.add_argument("--timers", nargs="+", choices=TIMERS, default=list(TIMERS))
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--position", type=int, default=2048, help="first position of the timed steps")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--max-seq-len", type=int, default=4096)
    ap.add_argument("--out", default=None, help="also write the rows and the table as JSON here")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.passes < 1 or args.tokens < 2:
        ap.error("--rounds and --passes must be at least 1, --tokens at least 2")
    if not torch.cuda.is_available():
        raise SystemExit("tuning_spread.py times tuned CUDA kernels: it needs a CUDA device")

    from specmoe.engines.helpers import resident_model_on_device
    from specmoe.files import write_text_atomic
    from specmoe.kernels import tuning

    t0 = time.time()
    model, adapter, _, unit = resident_model_on_device(args.model, 0, torch.bfloat16, "cuda")
    tokens = np.random.default_rng(1).integers(0, adapter.vocab_size, args.tokens)
    print(f"{args.model}: set up in {time.time() - t0:.0f} s", flush=True)
    rows = []
    try:
        with tempfile.TemporaryDirectory() as scratch, mock.patch.dict(os.environ):  # the environment restored
            for n, timer in enumerate(t for _ in range(args.rounds) for t in args.timers):
                use_timer(timer)
                os.environ[tuning.CACHE_ENV] = str(Path(scratch) / f"tuning{n}.json")  # a fresh cache
                row = {"round": n // len(args.timers), "timer": timer, **fresh_step(model, adapter, unit, tokens, args)}
                rows.append(row)
                print(f"round {row['round']} {timer}: step {row['step_ms']:.3f} ms (passes "
                      f"{', '.join(f'{x:.3f}' for x in row['passes_ms'])}), built and tuned in "
                      f"{row['build_s']:.0f} s, sources {row['sources']}; {row['choice']}", flush=True)
    finally:
        use_timer("graph")  # the package's own timer back, whatever ran last
    table = spread_table(rows)
    print(table, flush=True)
    if args.out:
        write_text_atomic(Path(args.out), json.dumps({"args": vars(args), "rows": rows, "table": table}, indent=1))
    return rows


if __name__ == "__main__":
    main()
