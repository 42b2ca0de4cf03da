"""Benchmark of the grouped slot MoE kernel (specmoe.kernels.grouped_moe) against the per-token kernel run once
per position (what OlmoeDecoder.moe did for D > 1 before it), on one CUDA GPU.

OLMoE-1B-7B's expert shapes (H = 2048, I = 1024, K = 8, bf16), a slot buffer of C = 64 slots per layer (every
expert resident), D = 1, 9 and 17 positions (a decode step; verification blocks of k = 8 and 16 drafts).
Routes are drawn as a trained model's blocks look: each position's K distinct experts from a Zipf-like
popularity over the 64 (`grouped_moe.zipf_routes`: the expert of rank r has weight 1 / (r + 1)^a, so positions
share many experts; a = 0 is uniform), a new ranking per call. Each path is captured once per (D, a) in a CUDA
graph of one call per layer over L layers' slot buffers (L = 16 by default, 0.8 GB each, so that the experts
come from device memory, not from the 50 MB L2, as in the decoder), each call with its own route; the median
replay time / L is the time per call.

Reported per (D, a): the mean number of distinct slots per call, the expert bytes the grouped kernel must
read (distinct slots x 3 * H * I * 2 bytes) and what the per-position loop reads (D * K experts), the time of
both paths in µs, the speed-up, and the achieved GB/s of each over the distinct bytes (and over the loop's
own bytes), next to the device bandwidth measured here (a 1 GiB device-to-device copy, read + write bytes over
time). `--check` first compares the grouped kernel with the torch reference and the per-token kernel;
`--tune` also times each of `GATE_UP_CANDIDATES` and `DOWN_CANDIDATES` (the other kernel at its defaults).

    PYTHONPATH=. python3 scripts/bench_grouped_moe.py --out runs/grouped_moe.json [--check] [--tune]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import GraphTimer, measure_bandwidth, run_reported  # noqa: E402

DEVICE = "cuda"
HIDDEN, INTER, SLOTS, TOP_K = 2048, 1024, 64, 8


def per_position(x, res, buf, route, act, out):
    """The per-token kernel once per position, as OlmoeDecoder.moe ran a block before the grouped kernel."""
    from specmoe.kernels.moe import slot_moe_triton

    for i in range(x.shape[0]):
        slot_moe_triton(x[i], res[i], buf, route[i], act, out[i], HIDDEN, INTER)


def rel(ref, out) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def check(report, gm, bufs, args) -> bool:
    """Grouped kernel against the torch reference (the MoE part of each position) and against the per-token
    kernel, one Zipf route per (D, a); True if all agree."""
    ok = True
    g = torch.Generator().manual_seed(1)
    for d in args.positions:
        ws = gm.make_grouped_workspace(d, TOP_K, HIDDEN, INTER, torch.bfloat16, DEVICE)
        act = torch.empty(TOP_K, INTER, dtype=torch.bfloat16, device=DEVICE)
        for a in args.zipf:
            route = gm.zipf_routes(1, d, TOP_K, SLOTS, a, g, DEVICE)[0]
            x = torch.randn(d, HIDDEN, generator=g).to(DEVICE, torch.bfloat16)
            res = torch.zeros_like(x)  # the MoE output alone
            out, loop = torch.empty_like(x), torch.empty_like(x)
            gm.slot_moe_grouped_triton(x, res, bufs[0], route, out, HIDDEN, INTER, ws)
            ref = gm.slot_moe_grouped_torch(x, res, bufs[0], route, torch.empty_like(x), HIDDEN, INTER)
            per_position(x, res, bufs[0], route, act, loop)
            err_ref = max(rel(ref[i], out[i]) for i in range(d))
            err_loop = rel(loop, out)
            good = err_ref < 2e-2 and err_loop < 2e-2
            ok &= good
            report["check"].append({"D": d, "zipf": a, "max_rel_err_vs_torch": err_ref,
                                    "rel_err_vs_per_token": err_loop,
                                    "bitwise_equal_to_per_token": bool(torch.equal(out, loop)), "ok": good})
            print(f"check D={d:2d} a={a:3.1f}: rel err vs torch (worst position) {err_ref:.2e}, vs per-token kernel "
                  f"{err_loop:.2e}{' (bitwise equal)' if torch.equal(out, loop) else ''} {'ok' if good else 'FAIL'}",
                  flush=True)
    return ok


def run(args, report) -> None:
    from specmoe.kernels import grouped_moe as gm

    if gm.triton is None:
        raise RuntimeError("Triton is not installed (pip install triton)")
    start = time.monotonic()
    props = torch.cuda.get_device_properties(0)
    report["env"] = {"gpu": props.name, "sms": props.multi_processor_count,
                     "l2_bytes": getattr(props, "L2_cache_size", None), "torch": torch.__version__,
                     "triton": gm.triton.__version__, "python": platform.python_version()}
    dtype, item = torch.bfloat16, 2
    expert_bytes = 3 * HIDDEN * INTER * item
    report["shape"] = {"hidden": HIDDEN, "inter": INTER, "slots": SLOTS, "top_k": TOP_K, "dtype": "bfloat16",
                       "layers": args.layers, "expert_bytes": expert_bytes, "defaults": gm.GROUPED_DEFAULTS}
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    bufs = [(torch.randn(SLOTS, 3 * HIDDEN * INTER, device=DEVICE, generator=gen) * 0.02).to(dtype)
            for _ in range(args.layers)]
    if args.check and not check(report, gm, bufs, args):
        report["notes"].append("--check found a mismatch: the times below are of a kernel that disagrees with the "
                               "reference")
    bw = measure_bandwidth()
    report["bandwidth_Bps"] = bw
    print(f"device {props.name}: measured copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    g = torch.Generator().manual_seed(2)
    layers = args.layers
    for d in args.positions:
        ws = [gm.make_grouped_workspace(d, TOP_K, HIDDEN, INTER, dtype, DEVICE) for _ in range(layers)]
        xs = [torch.randn(d, HIDDEN, generator=g).to(DEVICE, dtype) for _ in range(layers)]
        res = [torch.randn(d, HIDDEN, generator=g).to(DEVICE, dtype) for _ in range(layers)]
        outs = [torch.empty(d, HIDDEN, device=DEVICE, dtype=dtype) for _ in range(layers)]
        act = torch.empty(TOP_K, INTER, device=DEVICE, dtype=dtype)
        for a in args.zipf:
            routes = gm.zipf_routes(layers, d, TOP_K, SLOTS, a, g, DEVICE)
            distinct = [torch.unique(r[:, :TOP_K]).numel() for r in routes]
            nbytes = statistics.mean(distinct) * expert_bytes
            loop_bytes = d * TOP_K * expert_bytes
            row = {"D": d, "zipf": a, "distinct_slots_mean": statistics.mean(distinct),
                   "distinct_slots_min": min(distinct), "distinct_slots_max": max(distinct),
                   "bytes_distinct": nbytes, "bytes_per_position_loop": loop_bytes,
                   "floor_us_measured_bw": nbytes / bw * 1e6}
            try:
                loop = GraphTimer([lambda i=i: per_position(xs[i], res[i], bufs[i], routes[i], act, outs[i])
                                   for i in range(layers)], args.replays)
                row["loop_us"] = loop.ms_per_call() * 1e3
                del loop
                grouped = GraphTimer([lambda i=i: gm.slot_moe_grouped_triton(xs[i], res[i], bufs[i], routes[i], outs[i],
                                                                             HIDDEN, INTER, ws[i])
                                      for i in range(layers)], args.replays)
                row["grouped_us"] = grouped.ms_per_call() * 1e3
                del grouped
                row["speedup"] = row["loop_us"] / row["grouped_us"]
                row["grouped_GBps"] = nbytes / row["grouped_us"] / 1e3
                row["loop_GBps_distinct"] = nbytes / row["loop_us"] / 1e3
                row["loop_GBps_own"] = loop_bytes / row["loop_us"] / 1e3
                row["grouped_ratio_to_floor"] = row["grouped_us"] / row["floor_us_measured_bw"]
                print(f"D={d:2d} a={a:3.1f} distinct {row['distinct_slots_mean']:5.1f} ({nbytes / 1e6:6.0f} MB): "
                      f"grouped {row['grouped_us']:8.1f} us ({row['grouped_GBps']:5.0f} GB/s, x{row['grouped_ratio_to_floor']:.2f} "
                      f"of floor)  per-position loop {row['loop_us']:8.1f} us ({row['loop_GBps_own']:5.0f} GB/s of "
                      f"its {loop_bytes / 1e6:.0f} MB)  speed-up x{row['speedup']:.2f}", flush=True)
            except Exception as exc:
                report["errors"].append(f"D={d} a={a}: {exc!r}\n{traceback.format_exc()[-1500:]}")
                print(f"D={d} a={a} failed: {exc!r}", flush=True)
            report["rows"].append(row)
            if args.tune and time.monotonic() - start < args.budget_s:
                # each kernel's candidates with the other kernel's defaults (the tuner chooses the two apart)
                tried = [(f"gate_up {i}", c) for i, c in enumerate(gm.GATE_UP_CANDIDATES)] + \
                    [(f"down {i}", c) for i, c in enumerate(gm.DOWN_CANDIDATES)]
                for idx, cand in tried:
                    try:
                        timer = GraphTimer([lambda i=i: gm.slot_moe_grouped_triton(
                            xs[i], res[i], bufs[i], routes[i], outs[i], HIDDEN, INTER, ws[i], cand)
                            for i in range(layers)], args.replays)
                        us = timer.ms_per_call() * 1e3
                        del timer
                        report["candidates"].append({"D": d, "zipf": a, "index": idx, "params": cand, "us": us,
                                                     "GBps": nbytes / us / 1e3})
                        print(f"   candidate {idx} {cand}: {us:8.1f} us", flush=True)
                    except Exception as exc:
                        report["candidates"].append({"D": d, "zipf": a, "index": idx, "params": cand,
                                                     "error": repr(exc)[:300]})
                        print(f"   candidate {idx} failed: {exc!r}"[:300], flush=True)
            elif args.tune:
                report["notes"].append(f"time budget of {args.budget_s} s spent: candidates skipped at D={d} a={a}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the report as JSON here")
    ap.add_argument("--check", action="store_true", help="compare with the torch reference and the per-token kernel")
    ap.add_argument("--tune", action="store_true", help="also time each gate/up and down candidate")
    ap.add_argument("--positions", type=lambda s: [int(x) for x in s.split(",")], default=[1, 9, 17])
    ap.add_argument("--zipf", type=lambda s: [float(x) for x in s.split(",")], default=[0.0, 1.2, 3.0],
                    help="popularity exponents a of the routes (0: uniform; 3: the tuner's, a trained model's blocks)")
    ap.add_argument("--layers", type=int, default=16, help="layer slot buffers rotated through in one graph")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--budget-s", type=float, default=420.0, help="skip further candidates after this many seconds")
    args = ap.parse_args(argv)
    report = {"argv": sys.argv[1:], "check": [], "rows": [], "candidates": [], "notes": [], "errors": []}
    bad = "--layers and --positions must be positive" if args.layers < 1 or any(d < 1 for d in args.positions) else None
    return run_reported("bench_grouped_moe", run, args, report, bad)


if __name__ == "__main__":
    sys.exit(main())
