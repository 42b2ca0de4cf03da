"""Time of the device block selection (`DevicePool.select`, three or four launches per layer) and the pool refill
(`DevicePool.end_block`) on the GPU, against the host's `select_block_into` + `ExpertPool.use`.

For each geometry, selector and block size D, one CUDA graph holds one block's selections of every layer (as the
device blocks path launches them); the graph is replayed `--rounds` times (the pool's state carries on) and timed
with CUDA events. Reported in µs: the median over rounds per layer's selection, the refill per block, and the
host's selection + pool use per layer (numba, one thread, wall time; without the round trip the host path also
pays per layer). Inputs are `policy_checks.device_select_case`'s (logits on a bfloat16 grid with ties).

`--module LABEL=FILE[,CACHE]` also times other versions of the kernel module (e.g. device_select.py before a
change) in the same rounds, each under its label; CACHE is the device_cache.py that version imports its helpers
from (default: the current one). `--warps 2 8` also times the current module's selection on those numbers of warps
(labels "w2", "w8"; the default, `select_warps(E)`, is "current", recorded as current_warps).

    PYTHONPATH=. python3 scripts/bench_device_select.py --out runs/dselect.json [--module old=old_device_select.py]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_device_cache import graph_of, load_file, scoring_of, time_graph  # noqa: E402

from specmoe.files import write_text_atomic  # noqa: E402
from specmoe.kernels.policy_checks import device_select_case  # noqa: E402
from specmoe.verifiers import ExpertPool, SelectionBuffers, select_block_into, selector_preset  # noqa: E402

# name: (layers, experts, top-K, pool P, union U, scoring): the paper's three architectures at full size
GEOMETRIES = {
    "olmoe-1b-7b": (16, 64, 8, 24, 40, "softmax"),
    "moonlight-16b-a3b": (26, 64, 6, 24, 40, "sigmoid"),
    "qwen3.6-35b-a3b": (40, 256, 8, 64, 64, "softmax_renorm"),
}
SELECTORS = ("exact", "acceptmoe", "confidence_top1")


def load_module(path: str | None, cache_path: str | None = None):
    """The selection module: specmoe's, or the file at `path` (`load_file`), its `.device_cache` being the file at
    `cache_path` where given."""
    from specmoe.kernels import device_select
    if path is None:
        return device_select
    current = sys.modules["specmoe.kernels.device_cache"]
    try:
        if cache_path is not None:
            sys.modules["specmoe.kernels.device_cache"] = load_file("specmoe.kernels._device_cache_other", cache_path)
        return load_file("specmoe.kernels._device_select_other", path)
    finally:
        sys.modules["specmoe.kernels.device_cache"] = current


def host_select_us(selector, scoring, pool: ExpertPool, z: np.ndarray, alpha: np.ndarray) -> float:
    """µs per layer of the host's selection and pool use over the blocks of z [B, L, D, E] (after one warm-up
    block: numba compiles)."""
    num_blocks, num_layers, positions, num_experts = z.shape
    buffers = SelectionBuffers(positions, num_experts, pool.top_k)
    times = []
    for block in range(num_blocks):
        started = time.perf_counter()
        for layer in range(num_layers):
            select_block_into(selector, z[block, layer], pool.resident(layer), alpha[block], pool.top_k, scoring,
                              buffers, layer=layer)
            pool.use(layer, buffers.selected[:positions])
        pool.end_block()
        if block:
            times.append((time.perf_counter() - started) / num_layers)
    return float(np.median(times)) * 1e6


def device_us(module, selector, scoring, pool: ExpertPool, z: np.ndarray, alpha: np.ndarray, rounds: int,
              warps: int | None = None) -> dict:
    """µs per layer's selection and per block's refill (medians over `rounds` replays): graphs of one block's
    selections (every layer) and of the refill; the selection on `warps` warps (None: the module's default)."""
    _, num_layers, positions, _ = z.shape
    dev = module.DevicePool(pool, selector, scoring, positions, "cuda", **({} if warps is None else {"warps": warps}))
    z_dev = torch.tensor(z[0], device="cuda")
    a_dev = torch.tensor(alpha[0], device="cuda")
    select = graph_of(lambda: [dev.select(layer, z_dev[layer], a_dev) for layer in range(num_layers)])
    refill = graph_of(dev.end_block)
    return {"select_us": float(np.median([time_graph(select) for _ in range(rounds)])) / num_layers,
            "refill_us": float(np.median([time_graph(refill) for _ in range(rounds)]))}


def union_slots(selector: str, union: int, positions: int, top_k: int, num_experts: int, pool_size: int) -> int:
    """The geometry's union slots U; for exact selection at least as many as a block can miss (min(D K, E - P)):
    every position runs its own top-K, and the pool refuses a block that misses more than U experts (Qwen3.6's
    U = 64 at D = 17 did)."""
    if selector == "exact":
        return max(union, min(positions * top_k, num_experts - pool_size))
    return union


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--geometries", nargs="+", choices=list(GEOMETRIES), default=list(GEOMETRIES))
    ap.add_argument("--selectors", nargs="+", choices=SELECTORS, default=["acceptmoe", "confidence_top1"])
    ap.add_argument("--positions", type=int, nargs="+", default=[9, 17], help="block sizes D (k + 1)")
    ap.add_argument("--blocks", type=int, default=8, help="blocks of logits the host times (the device: the first)")
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--module", nargs="+", default=[], metavar="LABEL=FILE[,CACHE]",
                    help="other versions of device_select.py timed alongside (CACHE: the device_cache.py it imports)")
    ap.add_argument("--warps", type=int, nargs="*", default=[], choices=(1, 2, 4, 8),
                    help="also time the current selection on these numbers of warps (labels w1, w2, ...)")
    args = ap.parse_args(argv)
    if min(args.positions) < 1 or args.blocks < 2 or args.rounds < 1:
        ap.error("--positions must be at least 1, --blocks at least 2 and --rounds at least 1")
    others = {}
    for spec in args.module:
        label, _, files = spec.partition("=")
        if not label or not files or label == "current" or label in others:
            ap.error(f"--module takes LABEL=FILE[,CACHE] with distinct labels other than 'current', got {spec!r}")
        others[label] = files.split(",", 1) + [None] * (1 - files.count(","))
    if not torch.cuda.is_available():
        raise SystemExit("bench_device_select.py times CUDA graphs: it needs a CUDA device")
    current = load_module(None)
    variants = {"current": (current, None)}
    variants.update({label: (load_module(path, cache), None) for label, (path, cache) in others.items()})
    report = {"command": " ".join(["bench_device_select.py"] + (argv if argv is not None else sys.argv[1:])),
              "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "python": platform.python_version(),
              "rows": []}
    for name in args.geometries:
        num_layers, num_experts, top_k, pool_size, union, kind = GEOMETRIES[name]
        scoring = scoring_of(kind, num_layers, num_experts)
        warm = np.stack([np.random.default_rng(layer).permutation(num_experts) for layer in range(num_layers)])
        default = current.select_warps(num_experts)
        timed = dict(variants, **{f"w{w}": (current, w) for w in args.warps if w != default})
        for selector_name, positions in ((s, d) for s in args.selectors for d in args.positions):
            selector = selector_preset(selector_name)
            z, alpha = device_select_case(args.blocks, num_layers, positions, num_experts, seed=positions)
            slots = union_slots(selector_name, union, positions, top_k, num_experts, pool_size)
            row = {"geometry": name, "selector": selector_name, "D": positions, "U": slots, "current_warps": default,
                   "host_us": host_select_us(selector, scoring, ExpertPool(num_layers, num_experts, top_k, pool_size,
                                                                           warm, slots), z, alpha)}
            for label, (module, warps) in timed.items():
                got = device_us(module, selector, scoring, ExpertPool(num_layers, num_experts, top_k, pool_size, warm,
                                                                      slots), z, alpha, args.rounds, warps)
                row.update({f"{label}_{key}": value for key, value in got.items()})
            print(json.dumps(row), flush=True)
            report["rows"].append(row)
            write_text_atomic(args.out, json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
