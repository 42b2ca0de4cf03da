"""Host time of one PSR (token, layer) step: part 2 of a layer plus part 1 of the next.

Three ways of calling the same kernels are timed in one process, rounds interleaved:
- engine: `LogicalCache.route` (part 2, slots, execution weights, records) + `LogicalCache.insert_predicted`,
  one Python->numba call each, as the AR engine calls them around its two CUDA graphs of a layer;
- unfused: the same outputs from `select` + `slot_of` + execution weights + numpy copies (the engine's
  calls before `route`), for comparison;
- span: `LogicalCache.run_span` over a whole window per layer (harness and replay), kernel cost alone.

Run pinned to one core, e.g. `taskset -c 0 python3 scripts/bench_routing.py`.
Logits are random (no locality), so every step does the full eviction work of a miss-heavy stream.
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

from specmoe.routing import Calibration, EngineScoring, LogicalCache, RouterScoring, preset  # noqa: E402
from specmoe.routing.kernels import execution_weights  # noqa: E402


def make_case(num_experts: int, top_k: int, capacity: int, tokens: int, layers: int, vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    z = rng.normal(size=(tokens, layers, num_experts)).astype(np.float32).astype(np.float64)
    g = z + 0.5 * rng.normal(size=z.shape)  # a pre-gate correlated with the router, as in real models
    token_ids = rng.integers(0, vocab, tokens)
    prior = np.zeros((layers, vocab, num_experts))
    for layer in range(layers):
        for x in range(vocab):
            prior[layer, x, rng.choice(num_experts, top_k, replace=False)] = rng.random(top_k)
    cal = Calibration(np.stack([rng.permutation(num_experts) for _ in range(layers)]), prior,
                      np.full(layers, 4.0), {})
    policy = preset("psr", capacity, top_k, bonus=0.3, insert_budget=1)
    return policy, cal, z, g, token_ids


def time_engine(policy, cal, z, g, tokens, fused: bool = True) -> float:
    """Seconds per (token, layer) step as the AR engine makes it: part 2 with everything the engine needs
    from it (slots, execution weights, the record of z and S, the demand slots) and part 1 of the next layer.
    fused: one `LogicalCache.route` call (the engine's way); else `select` + `slot_of` + execution weights +
    numpy copies (the engine's way before `route` existed), for the same-run comparison."""
    num_tokens, num_layers, num_experts = z.shape
    cache = LogicalCache(policy, cal, num_layers, num_experts)
    rows_z = [[np.ascontiguousarray(z[t, l], dtype=np.float32) for l in range(num_layers)] for t in range(num_tokens)]
    rows_g = [[np.ascontiguousarray(g[t, l]) for l in range(num_layers)] for t in range(num_tokens)]
    k = policy.top_k
    z_rec, sel_rec = np.empty((num_layers, num_experts), np.float32), np.empty((num_layers, k), np.int64)
    route = np.empty((num_layers, 2 * k), np.int32)  # slot ids, then the weights' float32 bit patterns
    slots, weights = [route[l, :k] for l in range(num_layers)], [route[l].view(np.float32)[k:] for l in range(num_layers)]
    w64 = np.empty(k)
    scoring = EngineScoring.of(RouterScoring(renormalise=True), num_layers, num_experts)
    start = time.perf_counter()
    for t in range(num_tokens):
        x = int(tokens[t])
        for layer in range(num_layers):
            zl = rows_z[t][layer]
            if fused:
                cache.route(layer, zl, x, scoring, z_rec[layer], sel_rec[layer], slots[layer], weights[layer])
            else:
                z_rec[layer] = zl
                selected, demand = cache.select(layer, zl.astype(np.float64), x)
                slots[layer][:] = cache.slot_of(layer, selected)
                execution_weights(zl, selected, 0, True, 1.0, w64)
                weights[layer][:] = w64
                sel_rec[layer] = selected
                if demand.size:
                    cache.slot_of(layer, demand)
            if layer + 1 < num_layers:
                cache.insert_predicted(layer + 1, rows_g[t][layer + 1], x)
    return (time.perf_counter() - start) / (num_tokens * num_layers)


def time_span(policy, cal, z, g, tokens) -> float:
    """Seconds per (token, layer) step through run_span over the whole window."""
    num_tokens, num_layers, num_experts = z.shape
    cache = LogicalCache(policy, cal, num_layers, num_experts)
    zs = [np.ascontiguousarray(z[:, l]) for l in range(num_layers)]
    gs = [np.ascontiguousarray(g[:, l]) for l in range(num_layers)]
    start = time.perf_counter()
    for layer in range(num_layers):
        cache.run_span(layer, zs[layer], gs[layer] if layer else None, tokens)
    return (time.perf_counter() - start) / (num_tokens * num_layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    cases = {"E=64,K=8,C=32": (64, 8, 32, 16), "E=256,K=8,C=64": (256, 8, 64, 40)}
    results = {}
    for name, (num_experts, top_k, capacity, layers) in cases.items():
        policy, cal, z, g, tokens = make_case(num_experts, top_k, capacity, args.tokens, layers, vocab=1000)
        time_engine(policy, cal, z[:20], g[:20], tokens[:20])  # compile and warm up
        time_engine(policy, cal, z[:20], g[:20], tokens[:20], fused=False)
        time_span(policy, cal, z[:20], g[:20], tokens[:20])
        engine, unfused, span = [], [], []
        for _ in range(args.rounds):  # interleaved rounds
            engine.append(time_engine(policy, cal, z, g, tokens))
            unfused.append(time_engine(policy, cal, z, g, tokens, fused=False))
            span.append(time_span(policy, cal, z, g, tokens))
        results[name] = {
            "engine_us_mean": 1e6 * float(np.mean(engine)), "engine_us_min": 1e6 * float(np.min(engine)),
            "unfused_us_mean": 1e6 * float(np.mean(unfused)), "unfused_us_min": 1e6 * float(np.min(unfused)),
            "unfused_over_engine": float(np.mean(np.array(unfused) / np.array(engine))),
            "span_us_mean": 1e6 * float(np.mean(span)), "span_us_min": 1e6 * float(np.min(span)),
            "engine_over_span": float(np.mean(np.array(engine) / np.array(span))),
            "steps_per_round": args.tokens * layers, "rounds": args.rounds,
        }
    info = {"machine": platform.processor() or platform.machine(), "python": platform.python_version(),
            "numba": numba.__version__, "numpy": np.__version__,
            "affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None}
    print(json.dumps({"info": info, "results": results}, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"info": info, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
