"""Sweep of the grouped MoE's two weight kernels' tiles (`specmoe.kernels.grouped_moe`), each kernel timed alone,
on one CUDA GPU: where `GATE_UP_CANDIDATES` and `DOWN_CANDIDATES` come from.

OLMoE-1B-7B's expert shapes (H = 2048, I = 1024, K = 8, bf16), C = 64 slots per layer, L = 16 layer slot buffers
(0.8 GB each: the experts come from device memory, not L2), one Zipf-like route per layer (`zipf_routes`, exponent
--zipf; the mean distinct experts per layer is printed). For each D of --positions, the gate/up kernel and the
down kernel are each captured in a CUDA graph of one launch per layer (`bench_attention.GraphTimer`, median of 20
replays / L) for every tile (block rows 16 / 32 / 64, block_k 64-512 with block x block_k <= 16384, warps 2 / 4 /
8 (not 2 with 64 rows), stages 3 / 4; and swapped, the weight rows as the product's M, `grouped_moe._tile_dot`:
64 / 128 rows, block_k 64-256, warps 4 / 8), until --budget-s seconds have passed; `--tiles candidates` times the
tuner's candidates only (`GATE_UP_CANDIDATES`, `DOWN_CANDIDATES`). Printed per kernel: the 8 fastest tiles with µs
per layer, GB/s over the distinct experts' bytes and that as a share of the device's bandwidth (a
device-to-device copy's read + write bytes per second), the fastest tile of each product form (swap 0 / 1), and
the tile the tuner chose before the gate/up and down kernels were tuned apart, (16, 128, 2, 4, 0); --out writes
every timing as JSON.

    PYTHONPATH=. python3 scripts/sweep_grouped_moe.py --out runs/sweep_grouped.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import GraphTimer, measure_bandwidth  # noqa: E402

H, I, C, K, L = 2048, 1024, 64, 8, 16
BEFORE = (16, 128, 2, 4, 0)  # the tuner's choice at D = 17 on the H200 before the two kernels were tuned apart


def tiles(which: str = "sweep") -> dict[str, list[tuple[int, int, int, int, int]]]:
    """(block rows, block_k, warps, stages, swap) per kernel: the sweep's, or the tuner's candidates."""
    if which == "candidates":
        from specmoe.kernels import grouped_moe as gm

        return {"gate_up": [tuple(c.values()) for c in gm.GATE_UP_CANDIDATES],
                "down": [tuple(c.values()) for c in gm.DOWN_CANDIDATES]}
    plain = [(bn, bk, w, s, 0) for bn in (16, 32, 64) for bk in (64, 128, 256, 512) for w in (2, 4, 8) for s in (3, 4)
             if bn * bk <= 16384 and not (bn == 64 and w == 2)]
    swapped = [(bn, bk, w, s, 1) for bn in (64, 128) for bk in (64, 128, 256) for w in (4, 8) for s in (3, 4)
               if bn * bk <= 16384]
    return {"gate_up": plain + swapped, "down": plain + swapped}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--positions", type=int, nargs="+", default=[17])
    ap.add_argument("--zipf", type=float, default=1.2, help="popularity exponent of the routes (3: the tuner's)")
    ap.add_argument("--budget-s", type=float, default=300.0, help="stop timing tiles after this many seconds")
    ap.add_argument("--tiles", choices=("sweep", "candidates"), default="sweep",
                    help="the sweep's tiles, or the tuner's candidates only")
    ap.add_argument("--out", default=None, help="write every timing here as JSON")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("sweep_grouped_moe.py times CUDA graphs: it needs a CUDA device")
    import triton

    from specmoe.kernels import grouped_moe as gm
    from specmoe.kernels.moe import fp8_kernel_args

    dev = "cuda"
    bw = measure_bandwidth()
    print(f"device bandwidth (a copy's read + write) {bw / 1e9:.0f} GB/s", flush=True)
    bufs = [torch.randn(C, 3 * H * I, dtype=torch.bfloat16, device=dev) * 0.02 for _ in range(L)]
    results, t_start, a = {}, time.time(), args.zipf
    for d in args.positions:
        g = torch.Generator().manual_seed(0)
        routes = gm.zipf_routes(L, d, K, C, a, g, dev)
        distinct = sum(len(torch.unique(r[:, :K].cpu())) for r in routes) / L
        ws = [gm.make_grouped_workspace(d, K, H, I, torch.bfloat16, dev) for _ in range(L)]
        xs = [torch.randn(d, H, device=dev, dtype=torch.bfloat16) for _ in range(L)]
        G = min(d * K, C)
        for layer in range(L):
            gm._group_slots_kernel[(1,)](routes[layer], ws[layer].groups, P=d * K, K=K, C=C, C_PAD=64, G=G,
                                        G_PAD=triton.next_power_of_2(G), BLOCK_P=128, num_warps=4)
        torch.cuda.synchronize()
        gu_bytes, dn_bytes = distinct * 2 * H * I * 2, distinct * H * I * 2
        bm = gm.default_block_m(d)
        fp8 = fp8_kernel_args(bufs[0], H, I, 16, 16)

        def gate_up(layer, bn, bk, w, s, swap):
            gm._grouped_gate_up_kernel[(G, triton.cdiv(I, bn), 1)](
                xs[layer], bufs[layer], routes[layer], ws[layer].groups, ws[layer].act, 0, C, D=d, K=K, H=H, I=I,
                W=bufs[layer].stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, PRECISION="tf32", SWAP=bool(swap),
                num_warps=w, num_stages=s, **fp8)

        def down(layer, bh, bk, w, s, swap):
            gm._grouped_down_kernel[(G, triton.cdiv(H, bh), 1)](
                ws[layer].act, bufs[layer], routes[layer], ws[layer].groups, ws[layer].y, 0, C, D=d, K=K, H=H, I=I,
                W=bufs[layer].stride(0), BLOCK_M=bm, BLOCK_H=bh, BLOCK_K=bk, PRECISION="tf32", SWAP=bool(swap),
                num_warps=w, num_stages=s, **fp8)

        for name, fn, nbytes in (("gate_up", gate_up, gu_bytes), ("down", down, dn_bytes)):
            rows = []
            for c in tiles(args.tiles)[name]:
                if time.time() - t_start > args.budget_s:
                    break
                try:
                    ms = GraphTimer([lambda layer=layer: fn(layer, *c) for layer in range(L)], 20).ms_per_call()  # noqa: B023
                except Exception:  # a tile the compiler rejects is skipped
                    continue
                rows.append((ms * 1e3, c))
            rows.sort()
            results[f"{name} D={d}"] = rows
            print(f"\n{name} D={d} a={a}: distinct {distinct:.1f}, bytes {nbytes / 1e6:.1f} MB, floor "
                  f"{nbytes / bw * 1e6:.1f} us; {len(rows)} candidates", flush=True)
            for us, c in rows[:8]:
                print(f"  {us:6.1f} us  {nbytes / us / 1e3:6.0f} GB/s  {100 * nbytes / bw / (us * 1e-6):4.0f}%  "
                      f"(block, block_k, warps, stages, swap)={c}", flush=True)
            for swap in (0, 1):
                best = [r for r in rows if r[1][4] == swap][:1]
                if best:
                    print(f"  fastest with swap {swap}: {best[0][0]:.1f} us {best[0][1]}", flush=True)
            before = [r for r in rows if r[1] == BEFORE]
            if before:
                print(f"  the tuner's choice before, {BEFORE}: {before[0][0]:.1f} us", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({k: [(u, list(c)) for u, c in v] for k, v in results.items()}))


if __name__ == "__main__":
    main()
