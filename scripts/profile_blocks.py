"""Where a verification block's compute goes, against the target's decode step: a named full-size config with
seeded random weights on the GPU, routing following --trace (default the olmoe-like source), synthetic blocks at
tau --tau for each --k, verified by the engine as `Engine` makes it with default settings (host blocks path) with
copies skipped (compute only), pool P = --pool.

For the target step (every expert resident, the engine's default) and for each k it prints:
- ms per step (per verification block) and the block in target steps;
- "graphs only": the runner's launches of the block (attention and MoE of every layer, then the head) back to
  back with no host step between them, the GPU time of the block's kernels as they are;
- the distinct experts a block's layer reads (mean over blocks and layers) and their bytes at the measured
  copy bandwidth: the MoE's floor;
- a torch.profiler table of the kernels of the measured blocks (count per block and GPU time), and the GPU's busy
  time per block.

    PYTHONPATH=. python3 scripts/profile_blocks.py [--out runs/profile_blocks.txt]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import measure_bandwidth  # noqa: E402
from profile_engine import Transcript  # noqa: E402

from specmoe.engines import Engine, EngineConfig, build_engine  # noqa: E402
from specmoe.engines.helpers import free_routed_experts, random_model_on_device  # noqa: E402
from specmoe.models import adapter_for, decoder_for  # noqa: E402
from specmoe.offload import ExpertResidency, ExpertStore  # noqa: E402
from specmoe.records import AcceptanceProfile, synthetic_blocks  # noqa: E402
from specmoe.records.synthetic import read_calibration, read_trace  # noqa: E402
from specmoe.routing import Calibration, preset  # noqa: E402
from specmoe.speculation import SpeculativeConfig  # noqa: E402
from specmoe.verifiers import selector_preset  # noqa: E402


def kernel_table(prof, steps: int, rows: int = 20) -> tuple[str, float, float]:
    """(the profiler's kernel table, kernels per step, GPU busy ms per step)."""
    table = prof.key_averages()
    kernels = [e for e in table if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_us = sum(e.self_device_time_total for e in kernels)
    text = table.table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=70)
    return text, sum(e.count for e in kernels) / steps, busy_us / 1e3 / steps


def graphs_only_ms(run, num_layers: int, reps: int = 20) -> float:
    """The block's launches (attention and MoE of every layer, the head) back to back, ms per block."""
    def once():
        for layer in range(num_layers):
            run.attention(layer)
            run.moe(layer)
        run.head()

    once()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(run.stream)
    for _ in range(reps):
        once()
    end.record(run.stream)
    end.synchronize()
    return start.elapsed_time(end) / reps


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
    ap.add_argument("--paths", nargs="+", choices=("host", "device"), default=["host"],
                    help="block paths to profile (EngineConfig.block_device off / auto; the default: host)")
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
    model, adapter = random_model_on_device(args.model, 0, torch.bfloat16, "cuda")
    store = ExpertStore.from_model(model, adapter)
    free_routed_experts(model)
    L, E, K, V = adapter.num_moe_layers, adapter.num_experts, adapter.top_k, adapter.vocab_size
    unit = ExpertResidency(store, E, "cuda")
    bandwidth = measure_bandwidth("cuda", 2 * 1024**3)
    calibration = read_calibration(args.calibration)
    trace = read_trace(args.trace, num_experts=E, top_k=K)
    calibration.check(trace.num_layers, E)
    trace, calibration = trace.tiled(L), calibration.tiled(L)
    cfg = EngineConfig(max_seq_len=args.max_seq_len)
    target = build_engine(model, preset("exact_lru", E, K), Calibration.uniform(L, E, V), cfg, residency=unit)
    say(f"{args.model}: set up in {time.time() - t0:.0f} s; HBM copy bandwidth {bandwidth / 1e9:.0f} GB/s; "
        f"kernels {target.kernels}")

    tokens = np.random.default_rng(1).integers(0, V, 48)
    for _ in range(2):
        r = target.teacher_forced(tokens, first_position=args.position)
    step_ms = float(r.ms[r.timed].mean())
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        target.teacher_forced(tokens[:16], first_position=args.position)
        torch.cuda.synchronize()
    text, per_step, busy = kernel_table(prof, 16, 12)
    say(f"\n## target step (every expert resident, routing {r.info['routing']}): {step_ms:.3f} ms; "
        f"{per_step:.0f} kernels, GPU busy {busy:.3f} ms per step")
    say(text)

    fingerprint = adapter_for(model.config).fingerprint(model)
    for k, path in itertools.product(args.k, args.paths):
        blocks = synthetic_blocks(trace, k, AcceptanceProfile.for_tau(args.tau, k), seed=0, max_blocks=args.blocks,
                                  blocks_per_request=max(1, args.blocks // 4))
        if blocks.tokens.max() >= V:  # a trace of a model with a larger vocabulary: only the embeddings read them
            blocks = dataclasses.replace(blocks, tokens=blocks.tokens % V)
        config = SpeculativeConfig(selector_preset(args.selector), k=k, pool_size=args.pool)
        engine = Engine(decoder_for(model.config).from_model(model, args.max_seq_len), unit, None, calibration,
                        dataclasses.replace(cfg, block_device="auto" if path == "device" else "off"),
                        fingerprint=fingerprint, speculative=config)
        engine.configure(skip_copies=True)
        for _ in range(2):  # the first pass warms up
            results = engine.follow(blocks, first_position=args.position, record=True)
        block_ms = float(np.concatenate([x.ms[x.timed] for x in results]).mean())
        n_blocks = sum(int(x.timed.sum()) for x in results)
        selected = [s for x in results for s in x.block_selected]  # [D, L, K] per block
        distinct = np.mean([[len(np.unique(s[:, layer])) for layer in range(L)] for s in selected])
        floor_ms = distinct * L * store.expert_bytes / bandwidth * 1e3
        timeline = {p: float(np.mean([x.timeline()[p] for x in results]))
                    for p in ("selection", "copy_issue", "copy_checks")}
        run = engine._runners[k + 1]
        graphs_ms = graphs_only_ms(run, L)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            again = engine.follow(blocks, first_position=args.position)
            torch.cuda.synchronize()
        profiled = sum(int(x.timed.sum()) for x in again)
        text, per_block, busy = kernel_table(prof, profiled)
        say(f"\n## k = {k} ({args.selector}, P = {args.pool}, tau {blocks.tau:.2f}, {n_blocks} blocks, copies skipped, "
            f"path {results[0].info['verify']})")
        say(f"block {block_ms:.3f} ms = {block_ms / step_ms:.2f} target steps; graphs only {graphs_ms:.3f} ms "
            f"({graphs_ms / step_ms:.2f}); GPU busy {busy:.3f} ms, {per_block:.0f} kernels per block; host parts "
            + ", ".join(f"{p} {v:.3f}" for p, v in timeline.items()) + " ms")
        say(f"distinct experts per layer {distinct:.1f} of {E}: {distinct * store.expert_bytes * L / 1e9:.2f} GB "
            f"per block, floor {floor_ms:.3f} ms at {bandwidth / 1e9:.0f} GB/s")
        say(text)
    say.save(args.out)


if __name__ == "__main__":
    main()
