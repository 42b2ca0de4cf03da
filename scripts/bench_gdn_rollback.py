"""Benchmark of the Gated DeltaNet rollback modes (specmoe.models.qwen3_5_moe_decode.GDN_ROLLBACKS) on one CUDA GPU.

The recurrent states of a named config's Gated DeltaNet layers (default qwen3.6-35b-a3b: 30 of its 40 layers,
16 key and 32 value heads of d_k = d_v = 128, a 2 MiB float32 state each), a verification block of D = 16
positions, for each recurrence kernel (`specmoe.kernels.gdn`: our Triton kernel, fla's where installed, torch
with --torch):
- "history": the step runs the recurrence of every layer storing the state after each position (D x 2 MiB per
  layer), and rollback copies the committed one back (one copy of all layers' states);
- "recompute": the step copies each layer's state at its start and runs the recurrence without history, and
  rollback copies the start states back and reruns the recurrence of the committed positions, layer by layer
  (eager, as the engine calls it); nothing when every position is committed.
The step part of all layers is captured in one CUDA graph (as the decoder's step launches are) and its replay
timed; the rollback runs eagerly and is timed from launch to completion. Reported per mode and kernel: the step
(ms), the rollback at every committed length 1 .. D - 1 (ms; at D it is nothing in both modes; printed at
1, 2, 4, 8, 12, 15), and the expected block cost step + rollback under a geometric acceptance with a mean of
tau = 7.7 and 13.0 committed tokens (the paper's DFlash rates). `--check` first compares each kernel with torch
on the same inputs. `--device cpu` is a dry run of the script (torch kernel only, no graphs; use --layers 2).

    PYTHONPATH=. python3 scripts/bench_gdn_rollback.py --check [--model qwen3.6-35b-a3b] [--positions 16] \
        [--out runs/gdn_rollback.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from specmoe.kernels.gdn import fla_missing, gdn_recurrence, load_fla, random_gdn_inputs
from specmoe.models import named_config

PRINTED = (1, 2, 4, 8, 12, 15)


def committed_distribution(tau: float, d: int) -> list[float]:
    """P(committed = c), c = 1 .. d, of a block whose drafts are accepted one after another with probability p
    each (committed = 1 + accepted drafts, at most d), p chosen so that the mean is tau."""
    def dist(p):
        probs = [(1 - p) * p ** (c - 1) for c in range(1, d)] + [p ** (d - 1)]
        return probs, sum(c * q for c, q in zip(range(1, d + 1), probs))
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if dist(mid)[1] < tau else (lo, mid)
    return dist(lo)[0]


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, repeats: int, device: str, before=None) -> float:
    """Median ms of fn() from launch to completion (after `before()` has completed, untimed)."""
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def graphed(fn, device: str):
    """fn captured into a CUDA graph after a warm-up; returns the graph's replay (fn itself on the CPU)."""
    if device != "cuda":
        return fn
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def bench(kernel: str, heads, layers: int, d: int, repeats: int, fla, device: str) -> dict:
    nk, nv, dk, dv = heads
    inputs = [random_gdn_inputs(d, nk, nv, dk, dv, device, seed=i) for i in range(layers)]
    state = torch.stack([x[5] for x in inputs])  # [layers, NV, dk, dv]
    history = torch.zeros(layers, d, nv, dk, dv, device=device)
    start = torch.zeros_like(state)
    out = torch.zeros(d, nv, dv, device=device)

    def run(i, n, hist):
        q, k, v, decay, beta, _ = inputs[i]
        gdn_recurrence(q[:n], k[:n], v[:n], decay[:n], beta[:n], state[i], hist, out[:n], kernel, fla)

    def step_history():
        for i in range(layers):
            run(i, d, history[i])

    def step_recompute():
        start.copy_(state)
        for i in range(layers):
            run(i, d, None)

    def rollback_history(c):
        state.copy_(history[:, c - 1])

    def rollback_recompute(c):
        state.copy_(start)
        for i in range(layers):
            run(i, c, None)

    result = {}
    for mode, step, rollback in (("history", step_history, rollback_history),
                                 ("recompute", step_recompute, rollback_recompute)):
        replay = graphed(step, device)
        step_ms = timed(replay, repeats, device)
        roll = {}
        for c in range(1, d):
            replay()
            rollback(c)  # warm (compiles the rerun's length where it is specialised)
            roll[c] = timed(lambda: rollback(c), repeats, device, before=replay)
        result[mode] = {"step_ms": step_ms, "rollback_ms": roll}
        for tau in (7.7, 13.0):
            probs = committed_distribution(tau, d)  # committed = d needs no rollback
            result[mode][f"block_ms_tau{tau}"] = step_ms + sum(p * roll[c] for c, p in zip(range(1, d), probs))
    return result


def check(kernel: str, heads, d: int, fla, device: str) -> float:
    nk, nv, dk, dv = heads
    q, k, v, decay, beta, state = random_gdn_inputs(d, nk, nv, dk, dv, device, seed=7)
    outs = []
    for name in ("torch", kernel):
        s, h = state.clone(), torch.zeros(d, nv, dk, dv, device=device)
        outs.append(torch.cat([gdn_recurrence(q, k, v, decay, beta, s, h, kernel=name, fla=fla).flatten(),
                               s.flatten(), h.flatten()]))
    return float((outs[1] - outs[0]).norm() / outs[0].norm())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3.6-35b-a3b")
    parser.add_argument("--positions", type=int, default=16)
    parser.add_argument("--layers", type=int, default=None, help="Gated DeltaNet layers (default: the config's)")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--torch", action="store_true", help="also the torch recurrence (slow)")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--out", default=None)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = parser.parse_args()
    device = args.device
    config = named_config(args.model).get_text_config()
    heads = (config.linear_num_key_heads, config.linear_num_value_heads, config.linear_key_head_dim,
             config.linear_value_head_dim)
    layers = args.layers or sum(t == "linear_attention" for t in config.layer_types[:config.num_hidden_layers])
    fla = load_fla() if device == "cuda" else None
    kernels = (["triton"] + (["fla"] if fla is not None else []) + (["torch"] if args.torch else [])
               if device == "cuda" else ["torch"])
    name = torch.cuda.get_device_name() if device == "cuda" else "the CPU"
    print(f"{args.model}: {layers} Gated DeltaNet layers, heads (NK, NV, dk, dv) = {heads}, D = {args.positions}; "
          f"{name}; " + ("fla installed" if fla is not None else fla_missing()))
    report = {"model": args.model, "layers": layers, "heads": heads, "positions": args.positions,
              "device": name, "host": platform.node(), "kernels": {}}
    for kernel in kernels:
        if args.check and kernel != "torch":
            err = check(kernel, heads, args.positions, fla, device)
            print(f"check {kernel} vs torch (outputs, state, history): relative error {err:.2e}")
        report["kernels"][kernel] = res = bench(kernel, heads, layers, args.positions, args.repeats, fla, device)
        for mode, r in res.items():
            roll = " ".join(f"{c}:{r['rollback_ms'][c]:.3f}" for c in PRINTED if c in r["rollback_ms"])
            print(f"{kernel:6s} {mode:9s} step {r['step_ms']:.3f} ms | rollback at committed {roll} ms | "
                  f"block at tau 7.7 {r['block_ms_tau7.7']:.3f} ms, tau 13.0 {r['block_ms_tau13.0']:.3f} ms")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
