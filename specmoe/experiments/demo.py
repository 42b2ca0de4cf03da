"""`specmoe demo` (the main job before `specmoe run`): the paper's policies on a small OLMoE-architecture model.

A short form of `specmoe run experiments/demo.toml`: each flag below is a `--set` override of that config, and
the run directory (default runs/demo, or runs/demo-DIGEST with overrides) is a `specmoe run` directory that
resumes where it stopped and that `specmoe report` reads.

It calibrates on held-out text, runs exact routing with LRU, Cache-Prior, PSR and speculative execution at
two residencies in the harness, and prints one row per policy and capacity: logical copies per token (demand,
prefetch, unused prefetches), displaced router mass and the excess NLL over exact routing on selfgen windows
(text sampled from the exact model at temperature 1, where the mean excess NLL estimates the KL divergence
from exact routing). Everything is seeded: the same command prints the same table.

The held-out texts are the model's own samples under exact routing, drawn with separate seeds for
calibration (seed + 1) and evaluation (seed + 2), so the job needs no corpus and runs on any model.
"""

from __future__ import annotations

import argparse

from specmoe.arguments import int_at_least, int_list
from specmoe.limits import MAX_THREADS


def add_parser(sub) -> None:
    from .run import add_options

    parser = sub.add_parser("demo", help="copies and excess NLL of the paper's policies on a small model "
                            "(specmoe run experiments/demo.toml)", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a family name (family, family/deepseek_v3, "
                        "family/qwen3_5_moe), named config, checkpoint directory or hub id (default: family)")
    parser.add_argument("--capacities", type=int_list(1), default=None, help="comma-separated C values (default 32,16)")
    parser.add_argument("--windows", type=int_at_least(1), default=None, help="selfgen windows to score (default 16)")
    parser.add_argument("--length", type=int_at_least(2), default=None,
                        help="tokens per window and per calibration window (default 128; at most the model's positions)")
    parser.add_argument("--seed", type=int_at_least(0), default=None, help="seed (default 0)")
    parser.add_argument("--threads", type=int_at_least(1, MAX_THREADS), default=None,
                        help="torch CPU threads (default 1: small models run fastest on one thread)")
    add_options(parser)
    parser.set_defaults(func=main)


def overrides(args) -> list[str]:
    """The config keys the flags set, as --set items (flags not given leave the config's values)."""
    from .run import as_override

    out = []
    for value, keys in ((args.model, ["model.source"]), (args.capacities, ["ar.capacity"]),
                        (args.windows, ["workload.count"]), (args.length, ["workload.length", "calibration.length"]),
                        (args.seed, ["seed"]), (args.threads, ["threads"])):
        if value is not None:
            out += [as_override(key, list(value) if isinstance(value, tuple) else value) for key in keys]
    return out


def main(args) -> int:
    from .run import run_shipped

    return run_shipped("demo", args, overrides(args))
