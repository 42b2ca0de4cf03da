"""`specmoe stats`: routing statistics of a trace or a model (`specmoe.routing.statistics`), printed as tables and
written as JSON, with the paper's OLMoE copy counts next to the model's at C = 32 (docs/routing-stats.md).

From a trace file (`--trace`, written by `specmoe trace`), or from a model (`--model`, default the shipped family):
a trace is recorded first, as `specmoe trace` records one, over `--text`, `--tokens` or, for the family without
either, its evaluation slice (metrics.json). `--calibration` (a `specmoe calibrate` file of the same model, from
held-out text) gives Delta_l, the warm sets and the token prior; without it they come from the trace itself, and
the output says so. `--floor ALL_RESIDENT_MS,COPY_MS` adds each replayed policy's schedule floor at a GPU's
measured all-resident token and expert copy (docs/measurement.md).
"""

from __future__ import annotations

import argparse
import json
import math

from specmoe.arguments import int_at_least
from specmoe.files import check_output_file


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _floor(text: str) -> tuple[float, float]:
    """--floor ALL_RESIDENT_MS,COPY_MS: two positive numbers."""
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        values = ()
    if len(values) != 2 or not all(v > 0 and math.isfinite(v) for v in values):
        raise argparse.ArgumentTypeError(f"expected ALL_RESIDENT_MS,COPY_MS, two positive numbers, got {text!r}")
    return values


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``stats`` to an argparse subparsers object (for specmoe.cli)."""
    p = subparsers.add_parser("stats", help="routing statistics of a trace or a model (entropy, margin, reuse, "
                              "pre-gate recall, distinct experts, load skew, LRU miss rate by C)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", help="a trace file written by `specmoe trace`, or a synthetic "
                   "routing source NAME[:key=value,...] such as olmoe-like (then no model is loaded)")
    p.add_argument("--model", default="family", help="the model to record a trace of, without --trace: a checkpoint "
                   "directory, 'family' (default) or 'family/<member>'")
    text = p.add_mutually_exclusive_group()
    text.add_argument("--text", help="a UTF-8 text file to record the trace over (the model's tokenizer)")
    text.add_argument("--tokens", help="a .npy file of token ids to record the trace over")
    p.add_argument("--window", type=int_at_least(1), default=512, help="tokens per recorded sequence")
    p.add_argument("--max-tokens", type=int_at_least(1), default=16384, help="record at most this many tokens")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--calibration", help="calibration file of the model, or a synthetic source's "
                   "name (its held-out calibration); default: built from the trace, in-sample")
    p.add_argument("--capacities", type=_int_list, default=(8, 16, 24, 32, 48),
                   help="C of the LRU miss-rate curve, comma-separated (default 8,16,24,32,48)")
    p.add_argument("--policy-capacities", type=_int_list, default=(32, 16),
                   help="C at which exact LRU, Cache-Prior, PSR and speculative execution are replayed (default 32,16)")
    p.add_argument("--windows", type=_int_list, default=(9, 17),
                   help="window lengths for distinct experts per window (default 9,17: blocks of k = 8, 16)")
    p.add_argument("--floor", type=_floor, metavar="ALL_RESIDENT_MS,COPY_MS",
                   help="also each replayed policy's schedule floor (floor_ms): the ms per token its copies leave at "
                   "best on a GPU whose all-resident token takes ALL_RESIDENT_MS and one expert copy COPY_MS "
                   "(docs/measurement.md), e.g. 1.043,0.234 for full-size OLMoE on an H200")
    p.add_argument("--out", default="routing_stats.json", help="JSON file to write (default routing_stats.json)")
    p.set_defaults(func=main)
    return p


def _trace(args):
    """The trace of the arguments: loaded, or recorded from the model (`specmoe trace`'s code path)."""
    import numpy as np

    from specmoe.records.synthetic import read_trace

    from .trace import record_tokens, text_ids

    if args.trace:
        if args.text or args.tokens:
            raise ValueError("--text and --tokens record a trace: give them without --trace")
        return read_trace(args.trace), args.trace
    if args.text:
        ids, what = text_ids(args.model, args.text), args.text
    elif args.tokens:
        ids, what = np.load(args.tokens, allow_pickle=False).reshape(-1), args.tokens
    elif args.model == "family":
        from specmoe.assets import family_path

        windows = json.loads((family_path().parent / "metrics.json").read_text())["slice"]["slice"]["token_ids"]
        ids, what = [i for w in windows for i in w], "the family's evaluation slice (metrics.json)"
        args.window = min(args.window, max(len(w) for w in windows))
    else:
        raise ValueError("--model other than the family needs --text or --tokens (or give --trace)")
    trace = record_tokens(args.model, ids[: args.max_tokens], args.window, args.dtype, args.device)
    trace.info["text"] = str(what)
    return trace, f"{args.model} over {what}"


def comparison(stats: dict):
    """pandas table: copies per token (demand) of each replayed policy at C = 32 next to the paper's OLMoE
    figures (None where the trace was not replayed at C = 32); the paper's figures are quoted in one place,
    `specmoe.records.synthetic.OLMOE_COPIES` (Section 6.5), not measured here."""
    import pandas as pd

    from specmoe.records.synthetic import OLMOE_COPIES, PAPER_POLICIES

    paper_c32, rows = OLMOE_COPIES[32], {}
    for name in PAPER_POLICIES:
        paper, paper_demand = paper_c32[name], paper_c32.get(f"{name}_demand")
        measured = stats["policies"].get(f"{name}@C=32")
        if measured is None:
            return None
        rows[measured["policy"]] = {"copies": measured["copies"], "demand": measured["demand"],
                                    "OLMoE copies (paper)": paper, "OLMoE demand (paper)": paper_demand}
    return pd.DataFrame(rows).T


def main(args) -> int:
    import pandas as pd

    from specmoe.files import write_text_atomic
    from specmoe.records.synthetic import read_calibration
    from specmoe.routing.statistics import routing_stats, stats_tables

    check_output_file(args.out, "--out")
    trace, what = _trace(args)
    calibration = None
    if args.calibration:
        calibration = read_calibration(args.calibration)
        calibration.check(trace.num_layers, trace.num_experts, trace.vocab_size, fingerprint=trace.fingerprint or None)
    stats = routing_stats(trace, calibration, capacities=args.capacities, windows=args.windows,
                          policy_capacities=args.policy_capacities, floor=args.floor)
    if args.floor is not None:
        stats["floor"] = {"all_resident_ms": args.floor[0], "copy_ms": args.floor[1]}
    stats["source"] = what
    layers, miss, policies = stats_tables(stats)
    with pd.option_context("display.width", 200, "display.max_columns", 50, "display.precision", 3):
        print(f"routing statistics of {what}: {stats['tokens']} tokens in {stats['sequences']} sequences, "
              f"L={trace.num_layers} E={trace.num_experts} K={trace.top_k}; calibration {stats['calibration']}")
        print(layers.T.to_string(float_format=lambda v: f"{v:.3f}"))
        print("\nLRU miss rate (demand copies / (T K)) by capacity C")
        print(miss.to_string(float_format=lambda v: f"{v:.3f}"))
        if len(policies):
            print("\ncopies per token of the replayed policies" + ("" if args.floor is None else
                  f"; floor_ms: the schedule floor at {args.floor[0]:g} ms all resident, {args.floor[1]:g} ms per copy"))
            print(policies.to_string(float_format=lambda v: f"{v:.3f}"))
        table = comparison(stats)
        if table is not None:
            print("\ncopies per token at C = 32, this model against OLMoE-1B-7B (paper, Section 6.5)")
            print(table.to_string(float_format=lambda v: f"{v:.2f}", na_rep="-"))
    write_text_atomic(args.out, json.dumps(stats, indent=1, sort_keys=True) + "\n")
    print(f"\nwrote {args.out}")
    return 0
