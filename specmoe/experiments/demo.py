"""`specmoe demo` (the main job before `specmoe run`): the paper's policies on a small OLMoE-architecture model.

It calibrates on held-out text, runs exact routing with LRU, Cache-Prior, PSR and speculative execution at
two residencies in the harness, and prints one table per policy and capacity: logical copies per token
(demand, prefetch, unused prefetches), router slots replaced per token, and the excess NLL over exact routing
on selfgen windows (text sampled from the exact model at temperature 1, where the mean excess NLL estimates
the KL divergence from exact routing). Everything is seeded: the same command prints the same table.

The held-out texts are the model's own samples under exact routing, drawn with separate seeds for
calibration and evaluation, so the job needs no corpus and runs on any model.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pandas as pd

from specmoe.arguments import check_positions, int_at_least, int_list
from specmoe.files import check_output_dir, write_run_dir

DEMO_POLICIES = ("exact_lru", "cache_prior", "psr", "spec_exec")
RESULT_FILES = ("results.csv", "results.json")  # one run's files, written together (files.write_run_dir)


def run_demo(model_source: str, capacities: tuple[int, ...], *, windows: int = 16, length: int = 128,
             calibration_windows: int = 32, seed: int = 0, policies=DEMO_POLICIES,
             threads: int | None = None) -> tuple[pd.DataFrame, dict]:
    """Run the demo; returns the table and a dict describing the run."""
    import pandas as pd
    import torch

    from specmoe.harness import collect_calibration, excess_nll, patch_model, sample_selfgen, token_nll, unpatch
    from specmoe.models import load_model
    from specmoe.routing import preset, psr_bonus

    if windows < 1 or calibration_windows < 1 or length < 2 or (threads is not None and threads < 1):
        raise ValueError(f"need windows >= 1, calibration_windows >= 1, length >= 2 and threads >= 1 (or None), "
                         f"got {windows}, {calibration_windows}, {length} and {threads}")
    if threads:
        torch.set_num_threads(threads)
    started = time.time()
    model, adapter = load_model(model_source, seed=seed)
    check_positions(model, length, "--length")
    for capacity in capacities:
        if not adapter.top_k <= capacity <= adapter.num_experts:
            raise ValueError(f"capacity {capacity} outside [K={adapter.top_k}, E={adapter.num_experts}]")
    held_out = sample_selfgen(model, calibration_windows, length, seed=seed + 1)
    calibration = collect_calibration(
        model, adapter, held_out.windows,
        {"text": f"{calibration_windows} windows of {length} tokens sampled from the exact model, seed {seed + 1}"})
    selfgen = sample_selfgen(model, windows, length, seed=seed + 2)
    exact = token_nll(model, None, selfgen)
    rows = []
    for capacity in capacities:
        for name in policies:
            overrides = {"bonus": psr_bonus(capacity, adapter.num_experts)} if name == "psr" else {}
            policy = preset(name, capacity, adapter.top_k, **overrides)
            context = patch_model(model, adapter, policy, calibration)
            result = excess_nll(model, context, selfgen, exact_nll=exact)
            unpatch(model)
            rows.append({
                "C": capacity, "residency_pct": 100.0 * capacity / adapter.num_experts, "policy": policy.name,
                "copies": result["copies"], "demand": result["demand"], "prefetch": result["prefetch"],
                "unused": result["unused"], "replaced": result["replaced"],
                "excess_nll": result["excess_nll"], "excess_ppl_pct": result["excess_ppl_pct"],
            })
    info = {"model": model.specmoe_source, "layers": adapter.num_moe_layers, "experts": adapter.num_experts,
            "top_k": adapter.top_k, "selfgen_windows": windows, "length": length, "seed": seed,
            "scored_tokens": int(sum(len(e) for e in exact)), "seconds": round(time.time() - started, 1)}
    return pd.DataFrame(rows), info


def add_parser(sub) -> None:
    parser = sub.add_parser("demo", help="copies and excess NLL of the paper's policies on a small model",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint directory, named config or family target "
                        "(family, family/deepseek_v3, family/qwen3_5_moe; default: family, else olmoe-tiny)")
    parser.add_argument("--capacities", type=int_list(1), default=(32, 16),
                        help="comma-separated C values (default 32,16)")
    parser.add_argument("--windows", type=int_at_least(1), default=16, help="selfgen windows to score (default 16)")
    parser.add_argument("--length", type=int_at_least(2), default=128,
                        help="tokens per window (default 128; at most the model's positions)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int_at_least(1), default=1,
                        help="torch CPU threads (default 1: small models run fastest on one thread)")
    parser.add_argument("--out", default="runs/demo",
                        help="directory for results.csv / results.json (replaced as a whole by each run)")
    parser.set_defaults(func=main)


def main(args) -> int:
    import pandas as pd

    from specmoe.models import default_model

    out = Path(args.out)
    check_output_dir(out, RESULT_FILES, "--out")
    table, info = run_demo(args.model or default_model(), args.capacities, windows=args.windows, length=args.length,
                           seed=args.seed, threads=args.threads)
    csv_name, json_name = RESULT_FILES
    write_run_dir(out, {csv_name: table.to_csv(index=False),
                        json_name: json.dumps({"info": info, "rows": table.to_dict("records")}, indent=2)})
    print(f"model: {info['model']}  (L={info['layers']}, E={info['experts']}, K={info['top_k']})")
    print(f"selfgen: {info['selfgen_windows']} windows x {info['length']} tokens, {info['scored_tokens']} scored; "
          "copies are logical copies per token (sum over layers)")
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(table.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    print(f"results: {out / 'results.csv'}  ({info['seconds']} s)")
    return 0
