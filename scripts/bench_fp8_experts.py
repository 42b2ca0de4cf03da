"""Benchmark of FP8 experts against bf16 at Qwen3.6-35B-A3B's expert size, on one CUDA GPU, in one run: the
host-to-device copies of experts and the slot MoE kernels' time, FP8 rows (`specmoe.kernels.fp8`: float8 e4m3
weights plus 128 x 128 block scales, 3 MiB + 768 bytes an expert) against bf16 rows (6 MiB), with ratios.

Shapes: H = 2048, I = 512, E = 256 experts in a pinned host store (one layer), K = 8, C = 64 slots. The bf16
rows are the FP8 rows dequantised, so both formats hold the same weights (`--check` compares the kernels'
outputs, which must be bitwise equal, and each with the torch reference).

Copies: (a) `measure_copy_ms` of bench_engine.py (torch copy_ from the pinned store, n back-to-back copies and
one alone); (b) the engine's copy path, `CopyStream` (cuda-python's cudaMemcpyBatchAsync where installed), one
demand batch of 8 and of 64 experts into the slots, CUDA events on the copy stream, median per expert.
Kernels: the per-token kernel (D = 1) and the grouped kernel (D = 16, a verification block of k = 15; Zipf
a = 1.2 routes), each captured in a CUDA graph of one call per layer over L layer slot buffers (so experts come
from device memory, not L2); median replay time / L. Launch parameters: the defaults, or with --tune each
format's own tuned ones (`moe_launch_params`, `grouped_launch_params`, tune=True).

    PYTHONPATH=. python3 scripts/bench_fp8_experts.py --out runs/fp8_experts.json [--check] [--tune]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import GraphTimer, measure_bandwidth, run_reported  # noqa: E402

DEVICE = "cuda"
HIDDEN, INTER, EXPERTS, TOP_K, SLOTS, BLOCK_D = 2048, 512, 256, 8, 64, 16


def host_rows(seed: int = 0):
    """(FP8 rows, bf16 rows = the FP8 rows dequantised) of EXPERTS random experts, [E, W] each on the host."""
    from specmoe.kernels.fp8 import fp8_rows_of, unpack_fp8_rows

    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) * HIDDEN ** -0.5
    down = torch.randn(EXPERTS, HIDDEN, INTER, generator=g) * INTER ** -0.5
    fp8 = fp8_rows_of(gate_up, down)
    gu, dn = unpack_fp8_rows(fp8, HIDDEN, INTER, torch.bfloat16)
    return fp8, torch.cat([gu.flatten(1), dn.flatten(1)], dim=1)


def copy_times(rows: torch.Tensor, reps: int) -> dict:
    """Copies of one format: torch copy_ (bench_common.measure_copy_ms) and the engine's CopyStream batches."""
    from bench_common import measure_copy_ms

    from specmoe.geometry import Geometry
    from specmoe.offload import ExpertResidency, ExpertStore

    store = ExpertStore([rows.pin_memory()], Geometry(1, EXPERTS, TOP_K, 0, HIDDEN, INTER, layer_ids=(0,)))
    out = {"expert_bytes": store.expert_bytes, "torch_copy": measure_copy_ms(store, DEVICE)}
    residency = ExpertResidency(store, SLOTS, DEVICE)
    copies = residency.copies
    out["issue_path"] = copies.issue_path
    rng = np.random.default_rng(0)
    for n in (TOP_K, SLOTS):
        per = []
        for rep in range(reps + 2):
            experts = rng.choice(EXPERTS, n, replace=False)
            copies.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record(copies.stream)
            copies.assign(0, np.arange(n), experts, prefetch=False)
            e.record(copies.stream)
            e.synchronize()
            if rep >= 2:
                per.append(s.elapsed_time(e) / n)
        ms = statistics.median(per)
        out[f"batch_{n}"] = {"ms_per_expert": ms, "GBps": store.expert_bytes / ms / 1e6}
    del residency
    return out


def kernel_times(bufs, args, params, grouped_params) -> dict:
    """Per-token (D = 1) and grouped (D = BLOCK_D) kernel µs per call over the layer slot buffers `bufs`."""
    from specmoe.kernels import grouped_moe as gm
    from specmoe.kernels.moe import slot_moe_triton

    dtype, layers = torch.bfloat16, len(bufs)
    g = torch.Generator().manual_seed(2)
    out = {}
    for d in (1, BLOCK_D):
        routes = gm.zipf_routes(layers, d, TOP_K, SLOTS, 0.0 if d == 1 else 1.2, g, DEVICE)
        xs = [torch.randn(d, HIDDEN, generator=g).to(DEVICE, dtype) for _ in range(layers)]
        res = [torch.randn(d, HIDDEN, generator=g).to(DEVICE, dtype) for _ in range(layers)]
        outs = [torch.empty(d, HIDDEN, device=DEVICE, dtype=dtype) for _ in range(layers)]
        if d == 1:
            act = torch.empty(TOP_K, INTER, device=DEVICE, dtype=dtype)
            calls = [lambda i=i: slot_moe_triton(xs[i][0], res[i][0], bufs[i], routes[i][0], act, outs[i][0], HIDDEN,
                                                 INTER, params) for i in range(layers)]
        else:
            ws = [gm.make_grouped_workspace(d, TOP_K, HIDDEN, INTER, dtype, DEVICE) for _ in range(layers)]
            calls = [lambda i=i: gm.slot_moe_grouped_triton(xs[i], res[i], bufs[i], routes[i], outs[i], HIDDEN, INTER,
                                                            ws[i], grouped_params) for i in range(layers)]
        timer = GraphTimer(calls, args.replays)
        distinct = statistics.mean(torch.unique(r[:, :TOP_K]).numel() for r in routes)
        out[f"D{d}"] = {"us": timer.ms_per_call() * 1e3, "distinct_experts": distinct,
                        "bytes": distinct * bufs[0].stride(0) * bufs[0].element_size()}
        del timer
    return out


def check(report, fp8_dev, bf16_dev) -> None:
    """The FP8 kernels against the same kernels over the dequantised rows (bitwise) and the torch reference."""
    from specmoe.kernels import grouped_moe as gm
    from specmoe.kernels.moe import slot_moe_torch, slot_moe_triton

    g = torch.Generator().manual_seed(4)
    for d in (1, BLOCK_D):
        route = gm.zipf_routes(1, d, TOP_K, SLOTS, 1.2, g, DEVICE)[0]
        x = torch.randn(d, HIDDEN, generator=g).to(DEVICE, torch.bfloat16)
        res = torch.zeros_like(x)
        ws = gm.make_grouped_workspace(d, TOP_K, HIDDEN, INTER, torch.bfloat16, DEVICE)
        act = torch.empty(TOP_K, INTER, device=DEVICE, dtype=torch.bfloat16)
        ref = gm.slot_moe_grouped_torch(x, res, bf16_dev, route, torch.empty_like(x), HIDDEN, INTER)
        outs = {}
        for name, buf in (("fp8", fp8_dev), ("bf16", bf16_dev)):
            if d == 1:
                outs[name] = torch.empty_like(x)
                slot_moe_triton(x[0], res[0], buf, route[0], act, outs[name][0], HIDDEN, INTER)
            else:
                outs[name] = gm.slot_moe_grouped_triton(x, res, buf, route, torch.empty_like(x), HIDDEN, INTER,
                                                        ws).clone()
        torch.cuda.synchronize()
        torch_fp8 = torch.empty_like(x[0])
        slot_moe_torch(x[0], res[0], fp8_dev, route[0], act, torch_fp8, HIDDEN, INTER)
        row = {"D": d, "fp8_equals_bf16_kernel": bool(torch.equal(outs["fp8"], outs["bf16"])),
               "torch_fp8_equals_reference": bool(torch.equal(torch_fp8, ref[0])),
               "rel_err_fp8_vs_reference": float((outs["fp8"].float() - ref.float()).norm() / ref.float().norm())}
        report["check"].append(row)
        print(f"check D={d}: {row}", flush=True)


def run(args, report) -> None:
    from specmoe.kernels import grouped_moe as gm
    from specmoe.kernels.moe import MOE_DEFAULTS, moe_launch_params

    if gm.triton is None:
        raise RuntimeError("Triton is not installed (pip install triton)")
    props = torch.cuda.get_device_properties(0)
    report["env"] = {"gpu": props.name, "torch": torch.__version__, "triton": gm.triton.__version__,
                     "python": platform.python_version()}
    report["shape"] = {"hidden": HIDDEN, "inter": INTER, "experts": EXPERTS, "top_k": TOP_K, "slots": SLOTS,
                       "layers": args.layers, "block_positions": BLOCK_D}
    report["bandwidth_Bps"] = measure_bandwidth()
    fp8, bf16 = host_rows()
    rows = {"fp8": fp8, "bf16": bf16}
    for name, r in rows.items():
        report["copies"][name] = copy_times(r, args.reps)
        c = report["copies"][name]
        print(f"{name}: {c['expert_bytes'] / 2**20:.3f} MiB/expert; torch copy_ {c['torch_copy']['stream_ms'] * 1e3:.0f} "
              f"us/expert in a stream ({c['torch_copy']['stream_GBps']:.1f} GB/s); CopyStream ({c['issue_path']}) "
              f"batch of 8: {c['batch_8']['ms_per_expert'] * 1e3:.0f} us/expert, of 64: "
              f"{c['batch_64']['ms_per_expert'] * 1e3:.0f} us/expert", flush=True)
    slot_bufs = {name: [r[:SLOTS].to(DEVICE) for _ in range(args.layers)] for name, r in rows.items()}
    if args.check:
        check(report, slot_bufs["fp8"][0], slot_bufs["bf16"][0])
    for name, bufs in slot_bufs.items():
        params, grouped = dict(MOE_DEFAULTS), None
        if args.tune:
            params = moe_launch_params(True, bufs[0], TOP_K, HIDDEN, INTER).params
            grouped = gm.grouped_launch_params(True, bufs[0], BLOCK_D, TOP_K, HIDDEN, INTER).params
        report["kernels"][name] = {"params": params, "grouped_params": grouped or gm.GROUPED_DEFAULTS,
                                   **kernel_times(bufs, args, params, grouped)}
        k = report["kernels"][name]
        print(f"{name}: per-token kernel (D=1) {k['D1']['us']:.1f} us, grouped (D={BLOCK_D}) "
              f"{k[f'D{BLOCK_D}']['us']:.1f} us", flush=True)
    c, k = report["copies"], report["kernels"]
    report["ratios_fp8_over_bf16"] = {
        "expert_bytes": c["fp8"]["expert_bytes"] / c["bf16"]["expert_bytes"],
        "torch_copy_ms": c["fp8"]["torch_copy"]["stream_ms"] / c["bf16"]["torch_copy"]["stream_ms"],
        "copystream_batch_8": c["fp8"]["batch_8"]["ms_per_expert"] / c["bf16"]["batch_8"]["ms_per_expert"],
        "copystream_batch_64": c["fp8"]["batch_64"]["ms_per_expert"] / c["bf16"]["batch_64"]["ms_per_expert"],
        "moe_D1_us": k["fp8"]["D1"]["us"] / k["bf16"]["D1"]["us"],
        f"moe_D{BLOCK_D}_us": k["fp8"][f"D{BLOCK_D}"]["us"] / k["bf16"][f"D{BLOCK_D}"]["us"]}
    print("FP8 / bf16: " + ", ".join(f"{key} {v:.3f}" for key, v in report["ratios_fp8_over_bf16"].items()), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the report as JSON here")
    ap.add_argument("--check", action="store_true", help="compare the FP8 kernels with bf16 and the reference first")
    ap.add_argument("--tune", action="store_true", help="each format's tuned launch parameters (else the defaults)")
    ap.add_argument("--layers", type=int, default=16, help="layer slot buffers rotated through in one graph")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--reps", type=int, default=20, help="copy batches timed per size")
    args = ap.parse_args(argv)
    report = {"argv": sys.argv[1:], "copies": {}, "kernels": {}, "check": [], "notes": [], "errors": []}
    bad = "--layers, --replays and --reps must be positive" if min(args.layers, args.replays, args.reps) < 1 else None
    return run_reported("bench_fp8_experts", run, args, report, bad)


if __name__ == "__main__":
    sys.exit(main())
