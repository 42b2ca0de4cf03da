"""Host time of one block-level expert selection (one layer, one verification block), as the engine calls it.

Times `select_block_into` (caller buffers, float32 logits and weights: the engine's per-layer call) and
`select_block` (allocating) for each selector at E experts, top-K, D = 9 and 17 positions, on random
float32 logits with 37.5% of the experts resident. Rounds are interleaved; the median over rounds of the mean
per call (and the best round) is reported, as CPU time of the calling thread (`time.thread_time`: on a shared machine, wall time
would also count other processes' slices). Run pinned to one core, e.g.
`PYTHONPATH=. taskset -c 0 python3 scripts/bench_verifiers.py` (or with this checkout installed).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

os.environ.setdefault("NUMBA_NUM_THREADS", "1")

import numba  # noqa: E402
import numpy as np  # noqa: E402

from specmoe.verifiers import (SELECTORS, SelectionBuffers, confidence_weights, select_block,  # noqa: E402
                               select_block_into, selector_preset)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--positions", type=int, nargs="+", default=[9, 17])
    parser.add_argument("--blocks", type=int, default=2000, help="distinct random blocks per round")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    e, k = args.experts, args.top_k
    resident = np.zeros(e, dtype=bool)
    resident[rng.choice(e, int(0.375 * e), replace=False)] = True
    rows = []
    for d in args.positions:
        blocks = [rng.normal(scale=2.0, size=(d, e)).astype(np.float32) for _ in range(args.blocks)]
        alpha = confidence_weights(np.full(d - 1, 0.85))
        buffers = SelectionBuffers(d, e, k, np.float32)
        cases = {}
        for name in SELECTORS:
            config = selector_preset(name)
            cases[f"{name} into"] = lambda z, c=config: select_block_into(c, z, resident, alpha, k, True, buffers)
            cases[f"{name} alloc"] = lambda z, c=config: select_block(c, z, resident, alpha, k, True)
        times = {label: [] for label in cases}
        for label, call in cases.items():  # compile and warm up
            call(blocks[0])
        for _ in range(args.rounds):
            for label, call in cases.items():
                start = time.thread_time()
                for z in blocks:
                    call(z)
                times[label].append((time.thread_time() - start) / len(blocks) * 1e6)
        for label, samples in times.items():
            sizes = [select_block(selector_preset(label.split()[0]), z, resident, alpha, k, True) for z in blocks[:50]]
            rows.append({"D": d, "E": e, "K": k, "call": label, "us_per_call": float(np.median(samples)),
                         "us_best_round": float(np.min(samples)),
                         "eligible": float(np.mean([s.eligible.size for s in sizes])),
                         "missing": float(np.mean([s.missing.size for s in sizes]))})
    info = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "numpy": np.__version__, "numba": numba.__version__,
            "date": time.strftime("%Y-%m-%d")}
    print(json.dumps(info))
    print(f"{'D':>3} {'call':<22} {'us/call':>8} {'best':>8} {'eligible':>9} {'missing':>8}")
    for row in rows:
        print(f"{row['D']:>3} {row['call']:<22} {row['us_per_call']:>8.2f} {row['us_best_round']:>8.2f} "
              f"{row['eligible']:>9.1f} "
              f"{row['missing']:>8.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
