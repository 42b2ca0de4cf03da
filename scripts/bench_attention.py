"""Benchmark of the split-KV decode attention kernel (specmoe.kernels.split_kv) on one CUDA GPU.

A named config's attention shapes (--model; default OLMoE-1B-7B: NH = NKV = 16, HD = 128; qwen3.6-35b-a3b's gated
attention: NH 16, NKV 2, HD 256), bf16, a static cache of S = 4096 positions, seq_len 100 .. 4000, D = 1 (a decode
step) and D = 17 (a verification block). Each path is captured once per
D in a CUDA graph of one call per layer over L layers' caches (L = 128 by default, so that K and V come from
device memory, not from the 50 MB L2, as in the decoder where each layer's experts stream in between), and
the graph is replayed at every seq_len after changing the device tensor (split-KV) or the mask (SDPA): the
median replay time / L is the time per call. Paths:
- split-KV with its default launch parameters, and a few variants (`--no-variants` to skip);
- SDPA over the whole masked cache (`specmoe.kernels.decode_attention`, with a [D, S]
  causal mask: the reference, and the engine's default before split-KV);
- flash-attn's `flash_attn_with_kvcache` (D = 1) where the package is installed.
The bytes-read floor of one call is K and V of the written positions plus q and the output, over the device
bandwidth measured here (a 1 GiB device-to-device copy, read + write bytes over time) and over the nominal
4.8 TB/s of an H200. Also reported: split-KV with the cache warm in L2 (every call on one layer).
`--check` first compares the kernel with the torch reference at seq_len 1 (D), 7, 128, 1000 and S.

    PYTHONPATH=. python3 scripts/bench_attention.py --out runs/attn.json [--check]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
import traceback

import torch

NOMINAL_BPS = 4.8e12  # H200 HBM3e
DEVICE = "cuda"
VARIANTS = {  # launch parameters tried besides the defaults (see specmoe.kernels.split_kv.block_params)
    1: {"bn32": dict(block_n=32), "bn32_st2": dict(block_n=32, num_stages=2),
        "bn32_st3": dict(block_n=32, num_stages=3), "bn128_w8": dict(block_n=128, num_warps=8),
        "splits16": dict(num_splits=16), "splits66": dict(num_splits=66), "elementwise": dict(block_m=1),
        "st3": dict(num_stages=3)},
    9: {"splits4": dict(num_splits=4), "splits8": dict(num_splits=8), "splits12": dict(num_splits=12),
        "splits17": dict(num_splits=17), "splits33": dict(num_splits=33)},
    17: {"bn32_st3": dict(block_n=32, num_stages=3), "splits4": dict(num_splits=4), "splits8": dict(num_splits=8),
         "splits12": dict(num_splits=12), "splits17": dict(num_splits=17), "splits33": dict(num_splits=33),
         "splits66": dict(num_splits=66), "st2": dict(num_stages=2), "w8": dict(num_warps=8)},
}


def measure_bandwidth(nbytes: int = 1 << 30, reps: int = 10) -> float:
    """Device memory bandwidth, bytes read + written per second, of a large device-to-device copy (median)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE).random_(0, 255)
    b = torch.empty_like(a)
    b.copy_(a)
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del a, b
    return 2 * nbytes / statistics.median(times)


class GraphTimer:
    """One CUDA graph of `calls` (closures), captured once; `ms_per_call()` replays it and returns the median
    replay time divided by the number of calls."""

    def __init__(self, calls, replays: int):
        self.replays = replays
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # compile and warm up outside the capture
            for call in calls[:2]:
                call()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            for call in calls:
                call()
        self.n = len(calls)

    def ms_per_call(self) -> float:
        for _ in range(3):
            self.graph.replay()
        times = []
        for _ in range(self.replays):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            self.graph.replay()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e))
        return statistics.median(times) / self.n


def causal_mask(mask: torch.Tensor, n: int) -> None:
    """Fill an additive mask [D, S] in place: query i attends positions 0 .. n - D + i."""
    num_q, max_seq = mask.shape
    pos = torch.arange(max_seq, device=mask.device)
    last = n - num_q + torch.arange(num_q, device=mask.device)
    mask.copy_(torch.where(pos[None, :] <= last[:, None], 0.0, torch.finfo(mask.dtype).min).to(mask.dtype))


def check(report, sk, args, shape) -> bool:
    """The kernel against the torch reference at the test lengths, for each D; True if all agree."""
    num_heads, num_kv, head_dim, max_seq = shape
    ok = True
    for num_q in args.queries:
        q = torch.randn(num_q, num_heads, head_dim, device=DEVICE, dtype=torch.bfloat16)
        k = torch.randn(num_kv, max_seq, head_dim, device=DEVICE, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        ws = sk.make_split_kv_workspace(num_q, num_heads, head_dim, max_seq, DEVICE, num_kv_heads=num_kv)
        out = torch.empty(num_q, num_heads * head_dim, device=DEVICE, dtype=torch.bfloat16)
        for n in sorted({min(max(num_q, m), max_seq) for m in (1, 7, 128, 1000, max_seq)}):
            seq_len = torch.tensor([n], device=DEVICE, dtype=torch.int32)
            sk.split_kv_attention(q, k, v, seq_len, head_dim ** -0.5, out, ws)
            ref = sk.split_kv_attention_reference(q, k, v, seq_len, head_dim ** -0.5)
            err = (out.float() - ref.float()).abs().max().item()
            good = math.isfinite(err) and err <= 2e-2 * (1 + ref.float().abs().max().item())
            ok &= good
            report["check"].append({"D": num_q, "seq_len": n, "max_abs_err": err, "ok": good})
            print(f"check D={num_q:2d} seq_len={n:5d} max|err| {err:.2e} {'ok' if good else 'FAIL'}", flush=True)
    return ok


def run(args, report) -> None:
    from specmoe.kernels import decode_attention
    from specmoe.kernels import split_kv as sk

    if sk.triton is None:
        raise RuntimeError("Triton is not installed (pip install triton)")
    start = time.monotonic()
    props = torch.cuda.get_device_properties(0)
    report["env"] = {"gpu": props.name, "sms": props.multi_processor_count,
                     "l2_bytes": getattr(props, "L2_cache_size", None), "torch": torch.__version__,
                     "triton": sk.triton.__version__, "python": platform.python_version()}
    num_heads, num_kv, head_dim = attention_shape(args.model)
    max_seq = args.max_seq
    dtype, item = torch.bfloat16, 2
    shape = (num_heads, num_kv, head_dim, max_seq)
    report["shape"] = {"model": args.model, "num_heads": num_heads, "num_kv_heads": num_kv, "head_dim": head_dim,
                       "max_seq_len": max_seq, "dtype": "bfloat16", "layers": args.layers}
    if args.check and not check(report, sk, args, shape):
        report["notes"].append("--check found a mismatch: the times below are of a kernel that disagrees with the "
                               "reference")
    bw = measure_bandwidth()
    report["bandwidth_Bps"], report["nominal_Bps"] = bw, NOMINAL_BPS
    print(f"device {props.name}: measured copy bandwidth {bw / 1e9:.0f} GB/s (nominal {NOMINAL_BPS / 1e9:.0f})",
          flush=True)
    scale = head_dim ** -0.5
    layers = args.layers
    ks = [torch.randn(num_kv, max_seq, head_dim, device=DEVICE, dtype=dtype) for _ in range(layers)]
    vs = [torch.randn(num_kv, max_seq, head_dim, device=DEVICE, dtype=dtype) for _ in range(layers)]
    seq_len = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    try:
        from specmoe.kernels import decode_attention_flash, load_flash_attn
        flash = load_flash_attn()
    except ImportError:
        flash = None
        report["notes"].append("flash-attn is not installed: no flash_attn_with_kvcache times")

    def over_budget(what):
        if time.monotonic() - start > args.budget_s:
            report["notes"].append(f"time budget of {args.budget_s} s spent: skipped {what}")
            return True
        return False

    for num_q in args.queries:
        qs = [torch.randn(num_q, num_heads, head_dim, device=DEVICE, dtype=dtype) for _ in range(layers)]
        outs = [torch.empty(num_q, num_heads * head_dim, device=DEVICE, dtype=dtype) for _ in range(layers)]
        floor = {n: sk.split_kv_bytes(num_q, num_heads, num_kv, head_dim, n, item) for n in args.lengths}
        # SDPA over the whole masked cache (the reference; the engine's default before split-KV)
        mask = torch.zeros(num_q, max_seq, device=DEVICE, dtype=dtype)
        sdpa_ms = {}
        try:
            calls = [lambda i=i: outs[i].copy_(decode_attention(qs[i], ks[i], vs[i], mask, scale))
                     for i in range(layers)]
            causal_mask(mask, max(num_q, args.lengths[0]))
            timer = GraphTimer(calls, args.replays)
            for n in args.lengths:
                causal_mask(mask, n)
                sdpa_ms[n] = timer.ms_per_call()
                report["sdpa"].append({"D": num_q, "seq_len": n, "ms": sdpa_ms[n],
                                       "ratio_to_floor": sdpa_ms[n] / (floor[n] / bw * 1e3)})
            del timer
        except Exception as exc:
            report["errors"].append(f"SDPA D={num_q}: {exc!r}\n{traceback.format_exc()[-1500:]}")
            print(f"SDPA D={num_q} failed: {exc!r}", flush=True)
        if flash is not None and num_q == 1:
            try:
                seqlens = torch.zeros(1, dtype=torch.int32, device=DEVICE)
                calls = [lambda i=i: outs[i].copy_(decode_attention_flash(qs[i], ks[i], vs[i], seqlens, scale, flash))
                         for i in range(layers)]
                seqlens.fill_(args.lengths[0])
                timer = GraphTimer(calls, args.replays)
                for n in args.lengths:
                    seqlens.fill_(n)
                    ms = timer.ms_per_call()
                    report["flash_attn"].append({"D": 1, "seq_len": n, "ms": ms,
                                                 "ratio_to_floor": ms / (floor[n] / bw * 1e3)})
                del timer
            except Exception as exc:
                report["errors"].append(f"flash-attn: {exc!r}\n{traceback.format_exc()[-1500:]}")
        # split-KV: defaults, then the variants
        variants = {"default": {}}
        if not args.no_variants:
            variants.update(VARIANTS.get(num_q, {}))
        for name, opts in variants.items():
            if name != "default" and over_budget(f"variant {name} D={num_q}"):
                break
            try:
                ws = sk.make_split_kv_workspace(num_q, num_heads, head_dim, max_seq, DEVICE, num_kv_heads=num_kv,
                                                **opts)
                params = ws.launch_params(dtype)
                # correctness of this variant at the longest length before timing it
                seq_len.fill_(args.lengths[-1])
                sk.split_kv_attention(qs[0], ks[0], vs[0], seq_len, scale, outs[0], ws)
                ref = sk.split_kv_attention_reference(qs[0], ks[0], vs[0], seq_len, scale)
                err = (outs[0].float() - ref.float()).abs().max().item()
                if not err <= 2e-2 * (1 + ref.float().abs().max().item()):
                    raise RuntimeError(f"disagrees with the reference at seq_len {args.lengths[-1]}: max|err| {err}")
                calls = [lambda i=i: sk.split_kv_attention(qs[i], ks[i], vs[i], seq_len, scale, outs[i], ws)
                         for i in range(layers)]
                timer = GraphTimer(calls, args.replays)
                warm = GraphTimer([calls[0]] * layers, args.replays) if name == "default" else None
                for n in args.lengths:
                    seq_len.fill_(n)
                    ms = timer.ms_per_call()
                    fl, fl_nom = floor[n] / bw * 1e3, floor[n] / NOMINAL_BPS * 1e3
                    row = {"D": num_q, "seq_len": n, "variant": name, "params": params, "ms": ms,
                           "bytes_floor": floor[n], "floor_ms": fl, "floor_ms_nominal": fl_nom,
                           "ratio_to_floor": ms / fl, "ratio_to_nominal_floor": ms / fl_nom,
                           "achieved_Bps": floor[n] / (ms / 1e3), "sdpa_ms": sdpa_ms.get(n),
                           "speedup_vs_sdpa": sdpa_ms[n] / ms if n in sdpa_ms else None}
                    if warm is not None:
                        row["l2_warm_ms"] = warm.ms_per_call()
                    report["split_kv"].append(row)
                    print(f"split-kv {name:10s} D={num_q:2d} seq_len={n:5d} {ms * 1e3:8.2f} us  floor "
                          f"{fl * 1e3:6.2f} us  x{ms / fl:5.2f} (nominal x{ms / fl_nom:5.2f})  SDPA "
                          + (f"{sdpa_ms[n] * 1e3:8.2f} us  speedup x{sdpa_ms[n] / ms:5.2f}" if n in sdpa_ms else "-")
                          + (f"  L2-warm {row['l2_warm_ms'] * 1e3:6.2f} us" if warm is not None else ""), flush=True)
                del timer, warm
            except Exception as exc:
                report["errors"].append(f"split-kv {name} D={num_q}: {exc!r}\n{traceback.format_exc()[-1500:]}")
                print(f"split-kv {name} D={num_q} failed: {exc!r}", flush=True)
        qs = outs = None  # free the device buffers before the next D (the timed lambdas read these names)
    summarize(report)


def summarize(report) -> None:
    """Best variant per (D, seq_len), and the target: default split-KV within 2x of the floor at ~4k positions."""
    rows = report["split_kv"]
    best = {}
    for r in rows:
        key = (r["D"], r["seq_len"])
        if key not in best or r["ms"] < best[key]["ms"]:
            best[key] = r
    report["best"] = [{"D": d, "seq_len": n, "variant": r["variant"], "ms": r["ms"],
                       "ratio_to_floor": r["ratio_to_floor"]} for (d, n), r in sorted(best.items())]
    longest = max((r["seq_len"] for r in rows), default=None)
    target = [r for r in rows if r["variant"] == "default" and r["seq_len"] == longest]
    report["target"] = [{"D": r["D"], "seq_len": r["seq_len"], "ratio_to_floor": r["ratio_to_floor"],
                         "within_2x": r["ratio_to_floor"] <= 2.0} for r in target]
    for t in report["target"]:
        print(f"target D={t['D']} seq_len={t['seq_len']}: default split-KV at x{t['ratio_to_floor']:.2f} of the "
              f"measured-bandwidth floor ({'within' if t['within_2x'] else 'NOT within'} 2x)", flush=True)


def attention_shape(name: str) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim) of a named config's attention, from its config alone. ValueError for
    multi-head latent attention (DeepSeek-V3 / Moonlight: `split_kv_latent_attention` over a latent cache, which
    this benchmark does not time)."""
    from specmoe.geometry import attention_shape as config_attention_shape
    from specmoe.models.registry import named_config

    config = named_config(name)
    if getattr(config, "kv_lora_rank", None):
        raise ValueError(f"{name} has multi-head latent attention (kv_lora_rank {config.kv_lora_rank}): this "
                         "benchmark times split_kv_attention over K and V caches")
    return config_attention_shape(config)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the report as JSON here")
    ap.add_argument("--check", action="store_true", help="compare the kernel with the torch reference first")
    ap.add_argument("--model", default="olmoe-1b-7b", help="the named config whose attention shapes are timed")
    ap.add_argument("--max-seq", type=int, default=4096, help="static cache length S")
    ap.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[100, 500, 1000, 2000, 4000])
    ap.add_argument("--queries", type=lambda s: [int(x) for x in s.split(",")], default=[1, 17])
    ap.add_argument("--layers", type=int, default=128, help="layer caches rotated through in one graph")
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--no-variants", action="store_true", help="time the default launch parameters only")
    ap.add_argument("--budget-s", type=float, default=420.0, help="skip further variants after this many seconds")
    args = ap.parse_args(argv)
    report = {"argv": sys.argv[1:], "check": [], "sdpa": [], "flash_attn": [], "split_kv": [], "notes": [],
              "errors": []}
    bad = None
    if any(not 1 <= n <= args.max_seq for n in args.lengths) or args.layers < 1:
        bad = f"--lengths must lie in 1 .. --max-seq ({args.max_seq}) and --layers be positive"
    else:
        try:
            attention_shape(args.model)
        except (KeyError, ValueError) as exc:
            bad = f"--model: {exc.args[0] if exc.args else exc}"
    return run_reported("bench_attention", run, args, report, bad)


def run_reported(name: str, run, args, report: dict, bad_arguments: str | None) -> int:
    """A GPU benchmark's main: refuse a machine without CUDA or bad arguments (exit 2), run `run(args, report)`
    with its failure as one line (exit 1) and the traceback's tail in the report, and write the report as JSON
    to --out (atomically) whatever happened."""
    code = 0
    if not torch.cuda.is_available():
        print(f"{name} needs a CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        report["errors"].append("no CUDA device")
        code = 2
    elif bad_arguments:
        print(bad_arguments, file=sys.stderr)
        code = 2
    else:
        try:
            run(args, report)
        except Exception as exc:  # a clear line, the traceback's tail in the report
            print(f"{name} failed: {exc!r} (traceback in the report's errors)", file=sys.stderr)
            report["errors"].append(f"{exc!r}\n{traceback.format_exc()[-3000:]}")
            code = 1
    if report["errors"] and code == 0:
        print(f"{len(report['errors'])} part(s) failed; see the report's errors", file=sys.stderr)
    if args.out:
        from specmoe.files import write_text_atomic
        write_text_atomic(args.out, json.dumps(report, indent=1, default=str))
        print(f"wrote {args.out}")
    return code


if __name__ == "__main__":
    sys.exit(main())
