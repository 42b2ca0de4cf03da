"""Time of the device cache's per-layer step (`DeviceCache.step`) on the GPU, against the host policy's step.

For each geometry and policy, one CUDA graph holds `--tokens` tokens of what the device policy launches per layer
(`DevicePolicy`): part 1 of layer l + 1 from its pre-gate logits, then the route of layer l; the graph is replayed
`--rounds` times (the cache's state carries on from replay to replay) and timed with CUDA events. Reported per
layer step (route + part 1) in µs: the median over rounds, and the same for graphs of the route alone and of part 1
alone, and for a graph of as many launches of an empty kernel (the launch floor inside a graph). The host column
is `LogicalCache.route` + `insert_predicted` per layer (numba, one thread, wall time): the host policy's own
compute, without the device-to-host round trip the host path also pays per layer.

Inputs are `policy_checks.device_cache_case`'s (logits on a bfloat16 grid that recur over positions, a sparse
token prior with `--prior-density` of its entries set). `--module FILE` also times another version of the kernel
module (e.g. the file before a change), in the same rounds, so that the two compare on one machine; `--warps 1 4` times the
current kernel launched on each number of warps (default: `default_warps` of the geometry's E), also in the same
rounds (labels "current" for the default, "w1", "w4", ... for the others).

    PYTHONPATH=. python3 scripts/bench_device_cache.py --out runs/dcache.json [--module old_device_cache.py]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import time

import numpy as np
import torch

from specmoe.files import write_text_atomic
from specmoe.kernels.policy_checks import device_cache_case
from specmoe.routing import PRESETS, EngineScoring, LogicalCache, RouterScoring, preset

# name: (layers, experts, top-K, capacity, scoring): the paper's three architectures at full size
GEOMETRIES = {
    "olmoe-1b-7b": (16, 64, 8, 32, "softmax"),
    "moonlight-16b-a3b": (26, 64, 6, 32, "sigmoid"),
    "qwen3.6-35b-a3b": (40, 256, 8, 64, "softmax_renorm"),
}
POLICIES = ("exact_lru", "cache_prior", "psr")


def scoring_of(kind: str, num_layers: int, num_experts: int) -> RouterScoring:
    if kind == "softmax":
        return RouterScoring("softmax")
    if kind == "softmax_renorm":
        return RouterScoring("softmax", renormalise=True)
    bias = np.random.default_rng(0).normal(0.0, 0.1, (num_layers, num_experts))
    return RouterScoring("sigmoid", renormalise=True, scale=2.446, bias=bias)


def load_file(name: str, path: str):
    """The module in the file at `path` (another version of one of specmoe's kernel modules) as `name`: a name
    inside specmoe.kernels, so that the file's relative imports resolve as they do for the original."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_module(path: str | None):
    """The kernel module: specmoe's, or the file at `path` (another version of device_cache.py)."""
    if path is None:
        from specmoe.kernels import device_cache
        return device_cache
    return load_file("specmoe.kernels._device_cache_other", path)


def case(geometry: str, policy_name: str, tokens: int, density: float):
    """The policy, scoring and inputs of a geometry (`device_cache_case`, a token prior of `density`)."""
    num_layers, num_experts, top_k, capacity, kind = GEOMETRIES[geometry]
    calibration, z, g, toks = device_cache_case(num_layers, num_experts, tokens, seed=1, vocab=64,
                                                prior_density=density)
    policy = preset(policy_name, capacity, top_k)
    return policy, scoring_of(kind, num_layers, num_experts), calibration, z, g, toks


def graph_of(launches) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `launches()` (run twice eagerly first: compile and warm up)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        launches()
        launches()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        launches()
    return graph


def time_graph(graph: torch.cuda.CUDAGraph) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3  # µs


def device_graphs(module, policy, scoring, calibration, z, g, toks, warps=None):
    """Graphs of `tokens` tokens: both launches per layer, the route alone, part 1 alone (the kernel on `warps`
    warps; None: the module's default)."""
    num_positions, num_layers, _ = z.shape
    host = LogicalCache(policy, calibration, num_layers, z.shape[2], groups=scoring.groups)
    host.reset()
    z_dev, g_dev = torch.tensor(z, device="cuda"), torch.tensor(g, device="cuda")
    tok_dev = torch.tensor(np.asarray(toks, np.int64), device="cuda")
    graphs = {}
    for part in ("both", "route", "part1"):
        dev = module.DeviceCache(host, scoring, "cuda", **({} if warps is None else {"warps": warps}))
        inserts = policy.insert_budget > 0

        def launches(dev=dev, part=part):
            for t in range(num_positions):
                for layer in range(num_layers):
                    if part != "route" and inserts and layer + 1 < num_layers:
                        dev.step(tok_dev[t:t + 1], layer + 1, pregate_logits=g_dev[t, layer + 1])
                    if part != "part1":
                        dev.step(tok_dev[t:t + 1], layer, z_dev[t, layer])

        graphs[part] = graph_of(launches)
    return graphs


def floor_graph(steps: int):
    """A graph of `steps` launches of an empty Triton kernel."""
    x = torch.zeros(1, dtype=torch.int64, device="cuda")
    return graph_of(lambda: [_empty[(1,)](x) for _ in range(steps)])


try:
    import triton
    import triton.language as tl

    @triton.jit
    def _empty(x_ptr):
        tl.store(x_ptr, tl.load(x_ptr) + 1)
except ImportError:  # pragma: no cover - depends on the environment
    triton = None


def host_step_us(policy, scoring, calibration, z, g, toks, repeats: int = 3) -> float:
    """µs per layer of `LogicalCache.route` + `insert_predicted` (the host policy's compute)."""
    num_positions, num_layers, num_experts = z.shape
    host = LogicalCache(policy, calibration, num_layers, num_experts, groups=scoring.groups)
    engine_scoring = EngineScoring.of(scoring, num_layers, num_experts)
    k = policy.top_k
    selected, slots = np.empty(k, np.int64), np.empty(k, np.int64)
    weights, logged = np.empty(k, np.float32), np.empty(num_experts, np.float32)
    g64 = [[scoring.selection_scores(g[t, l], l) if scoring.kind == "sigmoid" else g[t, l].astype(np.float64)
            for l in range(num_layers)] for t in range(num_positions)]
    best = np.inf
    for _ in range(repeats + 1):  # the first repeat compiles and warms up
        host.reset()
        start = time.perf_counter()
        for t in range(num_positions):
            token = int(toks[t])
            for layer in range(num_layers):
                host.route(layer, z[t, layer], token, engine_scoring, logged, selected, slots, weights)
                if policy.insert_budget > 0 and layer + 1 < num_layers:
                    host.insert_predicted(layer + 1, g64[t][layer + 1], token)
        best = min(best, (time.perf_counter() - start) / (num_positions * num_layers) * 1e6)
    return best


def warps_both_us(row: dict, label: str) -> float:
    """A row's route + part 1 time on the warps of `label` ("w4"): the current kernel's own where they are its
    default (timed once, as "current"), NaN where not timed."""
    if label == f"w{row['current_warps']}":
        return row["current_both_us"]
    return row.get(f"{label}_both_us", float("nan"))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="json results file")
    parser.add_argument("--geometries", nargs="+", default=list(GEOMETRIES), choices=list(GEOMETRIES))
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(PRESETS))
    parser.add_argument("--tokens", type=int, default=16, help="tokens per graph")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--prior-density", type=float, default=0.1)
    parser.add_argument("--module", help="also time this version of specmoe/kernels/device_cache.py")
    parser.add_argument("--warps", type=int, nargs="*", default=[], choices=(1, 2, 4, 8),
                        help="also time the current kernel on these numbers of warps")
    args = parser.parse_args(argv)
    if args.tokens < 1 or args.rounds < 1:
        parser.error(f"--tokens and --rounds must be at least 1, got {args.tokens} and {args.rounds}")
    if not 0 <= args.prior_density <= 1:
        parser.error(f"--prior-density must lie in [0, 1], got {args.prior_density}")
    if not torch.cuda.is_available() or triton is None:
        raise SystemExit("bench_device_cache times CUDA graphs of Triton kernels: it needs a CUDA device and Triton")
    current = load_module(None)
    modules = {"current": (current, None)}
    if args.module:
        modules["other"] = (load_module(args.module), None)
    rows = []
    for geometry in args.geometries:
        num_layers = GEOMETRIES[geometry][0]
        steps = args.tokens * num_layers
        floor = floor_graph(steps)
        for name in args.policies:
            policy, scoring, calibration, z, g, toks = case(geometry, name, args.tokens, args.prior_density)
            variants = dict(modules)
            default = current.default_warps(GEOMETRIES[geometry][1])
            variants.update({f"w{w}": (current, w) for w in args.warps if w != default})
            graphs = {label: device_graphs(m, policy, scoring, calibration, z, g, toks, warps)
                      for label, (m, warps) in variants.items()}
            times = {(label, part): [] for label in graphs for part in graphs[label]}
            times[("floor", "both")] = []
            for _ in range(args.rounds):  # interleaved: every graph once per round
                for (label, part), acc in times.items():
                    acc.append(time_graph(floor if label == "floor" else graphs[label][part]) / steps)
            row = dict(geometry=geometry, policy=name, layers=num_layers, experts=GEOMETRIES[geometry][1],
                       capacity=policy.capacity, tokens=args.tokens, rounds=args.rounds, current_warps=default,
                       host_us=host_step_us(policy, scoring, calibration, z, g, toks))
            for (label, part), acc in times.items():
                row[f"{label}_{part}_us"] = float(np.median(acc))
            if "other" in modules:
                row["current_over_other"] = row["current_both_us"] / row["other_both_us"]
            rows.append(row)
            print(json.dumps(row), flush=True)
            write_text_atomic(args.out, json.dumps(dict(machine=platform.node(), gpu=torch.cuda.get_device_name(),
                                                        torch=torch.__version__, rows=rows), indent=1))
    extra = [f"w{w}" for w in sorted(set(args.warps))]
    head = ["geometry", "policy", "current warps", "current both", "route", "part 1", "other both"] + \
        [f"{label} both" for label in extra] + ["floor", "host"]
    print("| " + " | ".join(head) + " |")
    for r in rows:
        cells = [r["geometry"], r["policy"], str(r["current_warps"]), f"{r['current_both_us']:.1f}",
                 f"{r['current_route_us']:.1f}", f"{r['current_part1_us']:.1f}",
                 f"{r.get('other_both_us', float('nan')):.1f}"] + \
            [f"{warps_both_us(r, label):.1f}" for label in extra] + [f"{r['floor_both_us']:.1f}", f"{r['host_us']:.1f}"]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
