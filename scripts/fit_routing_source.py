"""Fit a synthetic routing source to OLMoE-1B-7B's copy counts on the CPU replay (docs/routing-source.md).

Finds the parameters of `specmoe.records.synthetic.SourceParams` (persistence, margin, pre-gate noise, skew; the
rest fixed at the source's values) for which exact LRU, Cache-Prior lambda 0.2, PSR n = 1 (`psr_bonus`) and
speculative execution, replayed over a draw of the source with a calibration from a held-out draw, reproduce
`OLMOE_COPIES` (C = 32 from the paper's Section 6.5, C = 16 derived from its latencies). The loss is the sum of
squared log ratios measured / target; Nelder-Mead over the four parameters from `--start` (default: the shipped
"olmoe-like" values), with common random numbers (fixed seeds), so the objective is deterministic.

    python3 scripts/fit_routing_source.py [--tokens 4096] [--calibration-tokens 16384] [--maxfev 60]

Prints every evaluation and the best parameters with their copy counts next to the targets; the fitted values are
then written into `SOURCES["olmoe-like"]` by hand.
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np
from scipy.optimize import minimize

from specmoe.records.synthetic import OLMOE_COPIES, SOURCES, paper_copies, synthetic_calibration, synthetic_trace

FITTED = ("persistence", "margin", "pregate_noise", "skew")
BOUNDS = ((0.3, 0.99), (0.0, 3.0), (0.05, 3.0), (0.0, 2.0))


def loss(copies: dict) -> float:
    """Sum of squared log ratios of the replayed copy counts to OLMOE_COPIES."""
    return sum(math.log(max(copies[c][name], 1e-3) / target) ** 2
               for c, row in OLMOE_COPIES.items() for name, target in row.items())


def evaluate(params, tokens: int, calibration_tokens: int, seed: int = 1) -> dict:
    """Copies per token of the paper's policies on a draw of `params` (held-out calibration)."""
    trace = synthetic_trace(params, tokens, seed=seed)
    return paper_copies(trace, synthetic_calibration(params, calibration_tokens), tuple(OLMOE_COPIES))


def table(copies: dict) -> str:
    rows = [f"{'C':>3} {'policy':>11} {'replay':>8} {'OLMoE':>7} {'ratio':>6}"]
    for c, row in copies.items():
        for name, value in row.items():
            target = OLMOE_COPIES.get(c, {}).get(name)
            ratio = f"{value / target:6.3f}" if target else "     -"
            rows.append(f"{c:>3} {name:>11} {value:8.2f} {target if target else '-':>7} {ratio}")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", default="olmoe-like", help="the named source whose other parameters are kept")
    parser.add_argument("--start", type=float, nargs=len(FITTED), metavar=tuple(f.upper() for f in FITTED),
                        help="starting point (default: the source's values)")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens of the evaluation draw")
    parser.add_argument("--calibration-tokens", type=int, default=16384, help="tokens of the held-out draw")
    parser.add_argument("--maxfev", type=int, default=60, help="objective evaluations of Nelder-Mead")
    args = parser.parse_args()
    base = SOURCES[args.source]
    start = np.array(args.start if args.start else [getattr(base, f) for f in FITTED])
    seen = {}

    def objective(x):
        x = np.clip(x, [b[0] for b in BOUNDS], [b[1] for b in BOUNDS])
        key = tuple(np.round(x, 4))
        if key not in seen:
            t0 = time.time()
            copies = evaluate(base.replace(**dict(zip(FITTED, map(float, key)))), args.tokens, args.calibration_tokens)
            seen[key] = (loss(copies), copies)
            print(f"{len(seen):3d} " + " ".join(f"{f}={v:.4f}" for f, v in zip(FITTED, key))
                  + f"  loss {seen[key][0]:.4f}  ({time.time() - t0:.1f} s)", flush=True)
        return seen[key][0]

    minimize(objective, start, method="Nelder-Mead", bounds=BOUNDS,
             options={"maxfev": args.maxfev, "xatol": 1e-3, "fatol": 1e-4})
    best = min(seen, key=lambda k: seen[k][0])
    print("\nbest: " + ", ".join(f"{f}={v:g}" for f, v in zip(FITTED, best)) + f"  (loss {seen[best][0]:.4f})")
    print(table(seen[best][1]))


if __name__ == "__main__":
    main()
