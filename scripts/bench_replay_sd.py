"""Blocks per minute of the CPU replay of verification blocks (`specmoe.replay`), per method, on one core.

Random router logits (a trace with some routing locality: each position's logits are the previous ones plus
noise), L=16 MoE layers, E=64 experts, K=8, k=16 drafts, synthetic drafter at tau 5; a calibration with a
random warm ranking and token prior. Times are CPU time of this process (numba runs on the calling thread),
after one warm-up run that compiles everything.

    PYTHONPATH=. python3 scripts/bench_replay_sd.py [--blocks 2000] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np

from specmoe.records import AcceptanceProfile, Trace, synthetic_blocks
from specmoe.replay import replay_ar, replay_block_selection, replay_rollback
from specmoe.routing import Calibration, preset
from specmoe.verifiers import selector_preset


def make_inputs(blocks: int, k: int, num_layers: int, num_experts: int, top_k: int, tau: float, seed: int = 0):
    rng = np.random.default_rng(seed)
    length = int(blocks * tau * 1.1) + k + 2
    z = np.empty((length, num_layers, num_experts), dtype=np.float32)
    z[0] = rng.normal(size=(num_layers, num_experts))
    noise = rng.normal(size=z.shape).astype(np.float32)
    for t in range(1, length):
        z[t] = 0.7 * z[t - 1] + 0.7 * noise[t]
    g = z + 0.3 * rng.normal(size=z.shape).astype(np.float32)
    g[:, 0] = 0
    vocab = 1000
    trace = Trace(z, g, rng.integers(0, vocab, length), [0], top_k=top_k, vocab_size=vocab)
    prior = rng.random((num_layers, vocab, num_experts)) * (rng.random((num_layers, vocab, num_experts)) < 0.05)
    cal = Calibration(np.array([rng.permutation(num_experts) for _ in range(num_layers)]), prior,
                      np.full(num_layers, 2.0), {"model": "random"})
    source = synthetic_blocks(trace, k, AcceptanceProfile.for_tau(tau, k), seed=seed, max_blocks=blocks)
    return source, cal


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=2000)
    parser.add_argument("-k", type=int, default=16)
    parser.add_argument("--capacity", type=int, default=32)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    num_layers, num_experts, top_k = 16, 64, 8
    blocks, cal = make_inputs(args.blocks, args.k, num_layers, num_experts, top_k, 5.0)
    warm, _ = make_inputs(20, args.k, num_layers, num_experts, top_k, 5.0, seed=1)
    policy = preset("psr", args.capacity, top_k, bonus=0.3)
    methods = {
        "rollback psr": lambda b: replay_rollback(policy, b, cal),
        "block exact": lambda b: replay_block_selection(selector_preset("exact"), b, cal, args.capacity),
        "block acceptmoe": lambda b: replay_block_selection(selector_preset("acceptmoe"), b, cal, args.capacity),
        "block confidence_top1": lambda b: replay_block_selection(selector_preset("confidence_top1"), b, cal,
                                                                   args.capacity),
        "block acceptmoe + counterfactual": lambda b: replay_block_selection(
            selector_preset("acceptmoe"), b, cal, args.capacity, counterfactual=True),
        "ar psr (committed sequence)": lambda b: replay_ar(policy, b, cal),
    }
    rows = {}
    for name, run in methods.items():
        run(warm)  # compile
        started = time.process_time()
        run(blocks)
        seconds = time.process_time() - started
        rows[name] = {"seconds": round(seconds, 3), "blocks_per_minute": round(60 * blocks.num_blocks / seconds)}
        print(f"{name:>34}: {blocks.num_blocks} blocks in {seconds:.2f} s CPU = "
              f"{rows[name]['blocks_per_minute']:,} blocks/min")
    info = {"blocks": blocks.num_blocks, "k": args.k, "L": num_layers, "E": num_experts, "K": top_k,
            "C": args.capacity, "tau": blocks.tau, "machine": platform.processor() or platform.machine(),
            "date": time.strftime("%Y-%m-%d"), "results": rows}
    if args.out:
        from specmoe.files import write_text_atomic
        write_text_atomic(args.out, json.dumps(info, indent=2))


if __name__ == "__main__":
    main()
