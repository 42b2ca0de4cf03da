"""The host's part of a verification block on the device path, without a GPU: the engine's `follow` over synthetic
blocks with each block's launch stubbed out (`device_blocks.launch` does nothing), so what is timed is the Python
and NumPy between launches: the position weights, the staging of the block's input and recorded logits, the
reading of its outputs, acceptance, the pool's and copy stream's counters and the recorder.

A named config's geometry (default olmoe-tiny: OLMoE's 16 layers, 64 experts, top-8, at tiny width; the host's
work per block depends on L, E, K and D, not on the width) with seeded random weights on the CPU, the device path
forced (`EngineConfig(block_device="on")`, its kernels compiled by Triton's interpreter for the warm-up only),
acceptmoe with P = --pool, k = --k, --blocks synthetic blocks at tau --tau over the olmoe-like source (4 requests).
Prints µs per block for each of --passes passes (the first warms up), then (--profile N) the N functions with the
most time of their own under cProfile. The device machine's CPU is another: compare runs on one machine.

    python3 scripts/host_block_time.py [--k 16] [--blocks 200]
"""

from __future__ import annotations

import argparse
import os

os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported: the device path's kernels run in its interpreter

import cProfile  # noqa: E402
import dataclasses  # noqa: E402
import io  # noqa: E402
import pstats  # noqa: E402

import numpy as np  # noqa: E402


def main(argv=None) -> list[float]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="olmoe-tiny")
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--tau", type=float, default=6.0)
    ap.add_argument("--pool", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=200)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--profile", type=int, default=0, help="also list this many functions under cProfile")
    args = ap.parse_args(argv)
    if args.k < 1 or args.blocks < 4 or args.passes < 1 or not 1 <= args.tau < args.k + 1:
        ap.error("--k >= 1, --blocks >= 4, --passes >= 1 and --tau in [1, k + 1)")

    from specmoe.engines import EngineConfig, build_engine, device_blocks
    from specmoe.models import load_model
    from specmoe.records import AcceptanceProfile, synthetic_blocks
    from specmoe.records.synthetic import SOURCES, synthetic_trace
    from specmoe.routing import Calibration
    from specmoe.speculation import SpeculativeConfig
    from specmoe.verifiers import selector_preset

    model, adapter = load_model(args.model, seed=0)
    source = SOURCES["olmoe-like"].replace(num_layers=adapter.num_moe_layers, num_experts=adapter.num_experts,
                                           top_k=adapter.top_k)  # the model's geometry
    trace = synthetic_trace(source, tokens=max(4096, 2 * (args.k + 1) * args.blocks), seed=1)
    blocks = synthetic_blocks(trace, args.k, AcceptanceProfile.for_tau(args.tau, args.k), seed=2,
                              max_blocks=args.blocks, blocks_per_request=max(1, args.blocks // 4))
    blocks = dataclasses.replace(blocks, tokens=blocks.tokens % adapter.vocab_size)
    calibration = Calibration.uniform(adapter.num_moe_layers, adapter.num_experts, adapter.vocab_size)
    span = 16 + int((blocks.accepted + 1).sum()) + args.k + 1
    engine = build_engine(model, None, calibration, EngineConfig(max_seq_len=span, block_device="on"),
                          speculative=SpeculativeConfig(selector_preset("acceptmoe"), k=args.k, pool_size=args.pool))
    engine.configure(skip_copies=True)
    plain = device_blocks.launch
    device_blocks.launch = lambda path: None
    times = []
    try:
        for i in range(args.passes):
            results = engine.follow(blocks, first_position=16)
            assert results[0].info["verify"] == "device", results[0].info
            times.append(float(np.concatenate([r.ms for r in results]).mean()) * 1e3)
            print(f"pass {i}: {times[-1]:.1f} µs per block (host only, {sum(len(r.ms) for r in results)} blocks)",
                  flush=True)
        if args.profile:
            profiler = cProfile.Profile()
            profiler.enable()
            engine.follow(blocks, first_position=16)
            profiler.disable()
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.profile)
            print(text.getvalue())
    finally:
        device_blocks.launch = plain
    return times


if __name__ == "__main__":
    main()
