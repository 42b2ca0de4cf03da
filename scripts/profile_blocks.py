"""Where a verification block's compute goes, against the target's decode step: a named full-size config with
seeded random weights on the GPU, routing following --trace (default the olmoe-like source), synthetic blocks at
tau --tau for each --k, verified by the engine with default settings on each block path of --paths (the device
path, the default on CUDA, and the host path) with copies skipped (compute only), pool P = --pool.

For the target step (every expert resident, the engine's default) and for each k and path it prints:
- ms per step (per verification block) and the block in target steps, also apart for each request's first block
  and its later ones (`first_and_later`); the host path's host parts per block;
- the distinct experts a block's layer reads (mean over blocks and layers) and their bytes at the measured
  copy bandwidth: the MoE's floor; the bytes a block and a target step read in all (`Decoder.bytes_per_token`
  plus the routed experts) and their ratio: the block's cost in target steps at equal efficiency, a floor for a
  target ratio such as issue 21's 1.8 on this routing source, and each one's efficiency (floor / measured);
- on the device path, the block's wall time split: the graph's `replay()` call, the GPU's span (an event before the
  launch to one after), the host's other work (acceptance, the next block's input); and the host functions with the
  most time of their own over a pass under cProfile (`host_profile`);
- a torch.profiler table of the GPU operations of a pass over the blocks (`kernel_timeline.kernel_table`: count
  per block, GPU time as recorded and as each kernel could run, the GPU's idle time just before each), and the
  kernels' GPU time per block (memory copies left out: with copies skipped those are the requests' warm-pool
  loads, outside the blocks); on the device path the block's timeline from the same pass
  (`specmoe.engines.kernel_timeline`: selection, compute, in-line copies (the refill's moves are skipped too),
  idle and host, in ms and target steps).

Every wall time is taken before the first profiled pass: torch's profiler leaves CUPTI attached to the process,
and graph launches after it cost more on the host.

    PYTHONPATH=. python3 scripts/profile_blocks.py [--out runs/profile_blocks.txt]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import itertools
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import measure_bandwidth, read_tiled  # noqa: E402
from bench_spec_engine import in_vocabulary  # noqa: E402
from profile_engine import Transcript  # noqa: E402

from specmoe.engines import Engine, EngineConfig, build_engine, kernel_timeline  # noqa: E402
from specmoe.engines.kernel_timeline import kernel_table  # noqa: E402
from specmoe.engines.helpers import resident_model_on_device  # noqa: E402
from specmoe.models import adapter_for, decoder_for  # noqa: E402
from specmoe.records import AcceptanceProfile, synthetic_blocks  # noqa: E402
from specmoe.routing import Calibration, preset  # noqa: E402
from specmoe.speculation import SpeculativeConfig  # noqa: E402
from specmoe.verifiers import selector_preset  # noqa: E402


def bytes_floor(selected, decoder, position: int, top_k: int, expert_bytes: int) -> dict:
    """What a verification block and a target step must read, each weight and KV row once: the decoder's bytes
    but the routed experts' (`Decoder.bytes_per_token` at `position`), plus the routed experts, the block's
    distinct ones per layer (mean over `selected`, each block's selections [D, L, K]) and the step's K per layer.
    Returns {"distinct": mean distinct experts per layer, "block": bytes, "step": bytes, "ratio": block / step}:
    the block's cost in target steps if both ran at the same share of the bandwidth."""
    num_layers = selected[0].shape[1]
    distinct = float(np.mean([[len(np.unique(s[:, layer])) for layer in range(num_layers)] for s in selected]))
    dense = decoder.bytes_per_token(position)
    block = dense + distinct * num_layers * expert_bytes
    step = dense + top_k * num_layers * expert_bytes
    return {"distinct": distinct, "block": block, "step": step, "ratio": block / step}


def tau_blocks(trace, k: int, tau: float, count: int, vocab_size: int):
    """`count` synthetic blocks of k drafts at tau over `trace` (4 requests of count / 4 blocks), tokens wrapped
    into the target's vocabulary."""
    return in_vocabulary(synthetic_blocks(trace, k, AcceptanceProfile.for_tau(tau, k), seed=0, max_blocks=count,
                                          blocks_per_request=max(1, count // 4)), vocab_size)


def first_and_later(results) -> tuple[float, float]:
    """Mean ms of each request's first timed block (which follows the request's start: its pool's warm-up copies
    and the recorder's reset) and of its later ones (nan where no request has two)."""
    timed = [x.ms[x.timed] for x in results if x.timed.any()]
    later = np.concatenate([ms[1:] for ms in timed])
    return float(np.mean([ms[0] for ms in timed])), float(later.mean()) if len(later) else float("nan")


def block_engine(model, unit, calibration, config: EngineConfig, speculative: SpeculativeConfig, path: str) -> Engine:
    """An engine verifying blocks of `speculative` on block path `path` ("device": `block_device` auto, the
    default; "host": off) over the shared expert unit, copies skipped (compute only)."""
    engine = Engine(decoder_for(model.config).from_model(model, config.max_seq_len), unit, None, calibration,
                    dataclasses.replace(config, block_device="auto" if path == "device" else "off"),
                    fingerprint=adapter_for(model.config).fingerprint(model), speculative=speculative)
    engine.configure(skip_copies=True)
    return engine


def host_profile(engine, blocks, position: int, rows: int = 12) -> str:
    """The host's side of a pass over `blocks` under cProfile (which slows Python code down: the times are for
    ranking, not adding up to the launch split's): a markdown table of the functions with the most time of
    their own, per block: calls, µs of their own, µs with what they call."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    results = engine.follow(blocks, first_position=position)
    profiler.disable()
    n = sum(len(x.ms) for x in results)
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (primitive calls, calls, own s, cumulative s, ...)}
    top = sorted(stats.items(), key=lambda kv: -kv[1][2])[:rows]
    lines = ["| function | calls per block | own µs per block | cumulative µs per block |", "|---|---|---|---|"]
    for (file, line, name), (_, calls, own, cumulative, _) in top:
        where = f"{Path(file).name}:{line} {name}" if line else name
        lines.append(f"| {where[:70]} | {calls / n:.1f} | {own / n * 1e6:.1f} | {cumulative / n * 1e6:.1f} |")
    return "\n".join(lines)


def launch_split(engine, blocks, position: int) -> dict:
    """A pass over `blocks` on the device path with its one launch per block timed (ms per block): the wall time
    per block (the engine's), the graph's span on the GPU (CUDA events around the replay), and the host's part:
    the `replay()` call, the wait after it, and the rest (the engine's acceptance and the next block's input),
    itself split by the host's clock at `DeviceBlocks.verify`'s entry and exit: "staging" (verify's entry to the
    launch: the block's input, weights and recorded logits staged), "reading" (the launch's end to verify's exit:
    the outputs read, the union-slot check, the displaced mass) and "between" (verify's exit to the next block's
    verify: acceptance, rollback, the pool's and copy stream's counters, the recorder, the next block's weights;
    part of it outside the engine's wall time per block). None where the blocks do not run as one captured graph
    holding its copy-out (`device_policy.launch`'s other forms, run as they are)."""
    from specmoe.engines import device_blocks

    plain, verify, times = device_blocks.launch, device_blocks.DeviceBlocks.verify, collections.defaultdict(list)
    stamps = []  # (verify's entry, the launch's entry, the launch's exit, verify's exit) per block

    def timed(path):
        if not (path.use_graphs and path.copy_in_graph):
            return plain(path)
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        stamps[-1].append(time.perf_counter())
        before.record(path.stream)
        t0 = time.perf_counter()
        device_blocks.captured(path).replay()
        t1 = time.perf_counter()
        after.record(path.stream)
        after.synchronize()
        stamps[-1].append(time.perf_counter())
        times["replay"].append(t1 - t0)
        times["wait"].append(stamps[-1][-1] - t1)
        times["events"].append((before, after))

    def stamped(self, *args, **kwargs):
        stamps.append([time.perf_counter()])
        out = verify(self, *args, **kwargs)
        stamps[-1].append(time.perf_counter())
        return out

    device_blocks.launch, device_blocks.DeviceBlocks.verify = timed, stamped
    try:
        results = engine.follow(blocks, first_position=position)
    finally:
        device_blocks.launch, device_blocks.DeviceBlocks.verify = plain, verify
    if not times["events"]:
        return None
    wall = float(np.concatenate([x.ms for x in results]).mean())
    gpu = float(np.mean([a.elapsed_time(b) for a, b in times["events"]]))
    replay, wait = 1e3 * float(np.mean(times["replay"])), 1e3 * float(np.mean(times["wait"]))
    return {"wall": wall, "gpu": gpu, "replay": replay, "wait": wait, "rest": wall - replay - wait,
            **host_clock_split(stamps)}


def host_clock_split(stamps) -> dict:
    """ms per block by the host's clock from `launch_split`'s stamps (seconds: verify's entry, the launch's entry,
    the launch's exit, verify's exit; a block without all four, not launched as one graph, is left out): "staging"
    and "reading" (means), "between" (the median of verify's exit to the next block's entry, within and across
    requests; nan with fewer than two blocks)."""
    s = np.array([x for x in stamps if len(x) == 4], dtype=float).reshape(-1, 4)
    if not len(s):
        return {"staging": float("nan"), "reading": float("nan"), "between": float("nan")}
    between = s[1:, 0] - s[:-1, 3]
    return {"staging": 1e3 * float(np.mean(s[:, 1] - s[:, 0])), "reading": 1e3 * float(np.mean(s[:, 3] - s[:, 2])),
            "between": 1e3 * float(np.median(between)) if len(between) else float("nan")}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="olmoe-1b-7b")
    ap.add_argument("--trace", default="olmoe-like:tokens=8192")
    ap.add_argument("--calibration", default="olmoe-like")
    ap.add_argument("--k", type=int, nargs="+", default=[16, 8])
    ap.add_argument("--tau", type=float, default=5.0)
    ap.add_argument("--selector", default="acceptmoe")
    ap.add_argument("--pool", type=int, default=24)
    ap.add_argument("--position", type=int, default=2048, help="first position of the blocks and target steps")
    ap.add_argument("--blocks", type=int, default=24, help="blocks per k (4 requests of blocks / 4)")
    ap.add_argument("--max-seq-len", type=int, default=4096)
    ap.add_argument("--paths", nargs="+", choices=("host", "device"), default=["device", "host"],
                    help="block paths to profile (EngineConfig.block_device auto, the default, / off)")
    ap.add_argument("--out", default=None, help="also write the output to this file")
    args = ap.parse_args(argv)
    if args.blocks < 4 or min(args.k) < 1 or any(not 1 <= args.tau < k + 1 for k in args.k):
        ap.error(f"--blocks must be at least 4 and --tau in [1, k + 1) for every --k; got --blocks {args.blocks}, "
                 f"--tau {args.tau:g}, --k {' '.join(map(str, args.k))}")
    if not torch.cuda.is_available():
        raise SystemExit("profile_blocks.py profiles CUDA graphs: it needs a CUDA device")
    from torch.profiler import ProfilerActivity, profile

    say = Transcript()
    t0 = time.time()
    model, adapter, store, unit = resident_model_on_device(args.model, 0, torch.bfloat16, "cuda")
    L, E, K, V = adapter.num_moe_layers, adapter.num_experts, adapter.top_k, adapter.vocab_size
    bandwidth = measure_bandwidth("cuda", 2 * 1024**3)
    trace, calibration = read_tiled(args.trace, args.calibration, L, E, K)
    cfg = EngineConfig(max_seq_len=args.max_seq_len)
    target = build_engine(model, preset("exact_lru", E, K), Calibration.uniform(L, E, V), cfg, residency=unit)
    say(f"{args.model}: set up in {time.time() - t0:.0f} s; HBM copy bandwidth {bandwidth / 1e9:.0f} GB/s; "
        f"kernels {target.kernels}")

    # Every wall time first, every profiler pass after: once torch's profiler has recorded CUDA activity, CUPTI
    # stays attached to the process and each later graph launch costs more on the host (a full-size OLMoE block's
    # replay() on the H200: 0.19 ms after, 0.04 ms before; BENCHMARKS.md), so a time measured after a profiled
    # pass is not the engine's.
    tokens = np.random.default_rng(1).integers(0, V, 48)
    for _ in range(2):
        r = target.teacher_forced(tokens, first_position=args.position)
    step_ms = float(r.ms[r.timed].mean())
    runs = []
    for k, path in itertools.product(args.k, args.paths):
        blocks = tau_blocks(trace, k, args.tau, args.blocks, V)
        engine = block_engine(model, unit, calibration, cfg,
                              SpeculativeConfig(selector_preset(args.selector), k=k, pool_size=args.pool), path)
        for _ in range(2):  # the first pass warms up
            results = engine.follow(blocks, first_position=args.position, record=True)
        device = results[0].info["verify"] == "device"
        split = launch_split(engine, blocks, args.position) if device else None  # None: no single graph
        host_table = host_profile(engine, blocks, args.position) if device else None
        runs.append((k, blocks, engine, results, split, host_table))

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        target.teacher_forced(tokens[:16], first_position=args.position)
        torch.cuda.synchronize()
    text, per_step, busy = kernel_table(prof, 16, 12)
    say(f"\n## target step (every expert resident, routing {r.info['routing']}): {step_ms:.3f} ms; "
        f"{per_step:.0f} kernels, GPU busy {busy:.3f} ms per step")
    say(text)

    for k, blocks, engine, results, split, host_table in runs:
        block_ms = float(np.concatenate([x.ms[x.timed] for x in results]).mean())
        n_blocks = sum(int(x.timed.sum()) for x in results)
        selected = [s for x in results for s in x.block_selected]  # [D, L, K] per block
        floors = bytes_floor(selected, engine.decoder, args.position + k, K, store.expert_bytes)
        distinct = floors["distinct"]
        floor_ms = distinct * L * store.expert_bytes / bandwidth * 1e3
        timeline = {p: float(np.mean([x.timeline()[p] for x in results]))
                    for p in ("selection", "copy_issue", "copy_checks")}
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            again = engine.follow(blocks, first_position=args.position)
            torch.cuda.synchronize()
        profiled = sum(int(x.timed.sum()) for x in again)
        text, per_block, busy = kernel_table(prof, profiled)
        say(f"\n## k = {k} ({args.selector}, P = {args.pool}, tau {blocks.tau:.2f}, {n_blocks} blocks, copies skipped, "
            f"path {results[0].info['verify']})")
        say(f"block {block_ms:.3f} ms = {block_ms / step_ms:.2f} target steps; GPU busy {busy:.3f} ms, kernels "
            f"{per_block:.0f} per block; host parts " + ", ".join(f"{p} {v:.3f}" for p, v in timeline.items()) + " ms")
        first, later = first_and_later(results)
        say(f"a request's first block {first:.3f} ms (its pool's warm-up ahead of it), the later ones {later:.3f} ms = "
            f"{later / step_ms:.2f} target steps")
        grouped = getattr(engine.decoder, "launch", {}).get(f"grouped_slot_moe D={k + 1}")
        if grouped is not None:
            say(f"grouped MoE launch parameters at D = {k + 1} ({grouped['source']}): {grouped['params']}")
        if split is not None:
            say("host functions over a pass (cProfile):\n" + host_table)
            say(f"launch split, ms per block: wall {split['wall']:.3f} = GPU {split['gpu']:.3f} (from an event "
                f"before the graph's launch to one after it: the launch's latency, the graph's kernels and copies) + "
                f"host {split['wall'] - split['gpu']:.3f}; of the host: replay() {split['replay']:.3f}, waiting "
                f"after it {split['wait']:.3f} (GPU still running), the rest {split['rest']:.3f} (acceptance, the "
                f"next block's input); by the host's clock: staging {split['staging']:.3f}, reading the outputs "
                f"{split['reading']:.3f}, between blocks (median) {split['between']:.3f}")
        say(f"distinct experts per layer {distinct:.1f} of {E}: {distinct * store.expert_bytes * L / 1e9:.2f} GB "
            f"per block, floor {floor_ms:.3f} ms at {bandwidth / 1e9:.0f} GB/s")
        block_floor, step_floor = floors["block"], floors["step"]
        say(f"bytes floor: block {block_floor / 1e9:.2f} GB, target step {step_floor / 1e9:.2f} GB: "
            f"{block_floor / step_floor:.2f} target steps at equal efficiency ({block_ms / step_ms:.2f} measured); "
            f"efficiency block {block_floor / bandwidth * 1e3 / block_ms:.0%}, target step "
            f"{step_floor / bandwidth * 1e3 / step_ms:.0%}")
        if results[0].info["verify"] == "device":  # the block's timeline from its kernels (kernel_timeline)
            line = kernel_timeline.timeline(kernel_timeline.profiled_spans(prof), profiled, block_ms)
            say("device timeline, ms per block (target steps): " + ", ".join(
                f"{part} {line[part]:.3f} ({line[part] / step_ms:.2f})"
                for part in ("selection", "compute", "copy_wait", "idle_other")))
        say(text)
    say.save(args.out)


if __name__ == "__main__":
    main()
