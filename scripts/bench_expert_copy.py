"""Expert copies from the pinned host store into device slots on one CUDA GPU: the copy engine against the copy
kernel, alone and beside a GEMM.

The host path copies an expert with the copy engine (`Tensor.copy_` of a pinned row on a side stream); the device
policy with the copy kernel (`kernels.expert_copy.launch_copy`: `--programs` programs read the pinned rows through
unified addressing, each `--words` int64 words per chunk, so programs x words x 8 bytes are in flight per step).
For each method and launch shape this times a list of n experts (`--experts`, a layer's demand copies) alone,
and the largest list, `--beside-repeats` times, beside a bf16 GEMM on another stream: the GEMM's slowdown is the
SM cost of SM-driven copies, the copy's rate under load what a copy beside the token's kernels gets. Rounds
interleave every configuration; medians over rounds are reported, and the json keeps every round.

Experts of OLMoE-1B-7B's size by default (3 x 2048 x 1024 bf16 = 12.6 MB; `--expert-mb` for another).

    PYTHONPATH=. python3 scripts/bench_expert_copy.py --out runs/expert_copy.json
"""

from __future__ import annotations

import argparse
import json
import platform

import numpy as np
import torch

from specmoe.files import write_text_atomic
from specmoe.kernels.expert_copy import COPY_BLOCK, COPY_BLOCKS, launch_copy


def configs(programs, words) -> list[tuple[str, int, int]]:
    """(method, programs, words): the copy engine, then the copy kernel at every launch shape; the kernel's
    default shape (COPY_BLOCKS, COPY_BLOCK) is always among them."""
    shapes = sorted({(p, w) for p in programs for w in words} | {(COPY_BLOCKS, COPY_BLOCK)})
    return [("engine", 0, 0)] + [("kernel", p, w) for p, w in shapes]


def label(method: str, programs: int, words: int) -> str:
    return "copy engine" if method == "engine" else f"kernel {programs} x {words}"


def check_args(parser, args) -> None:
    """One-line errors (exit 2) for sizes the copies cannot take."""
    if not args.expert_mb > 0:
        parser.error(f"--expert-mb must be positive, got {args.expert_mb}")
    for name in ("experts", "programs", "words"):
        if min(getattr(args, name)) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if any(w & (w - 1) for w in args.words):
        parser.error(f"--words must be powers of two (a chunk is one Triton block), got {args.words}")
    for name in ("gemm", "beside_repeats", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")


def gb_per_s(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="json results file")
    parser.add_argument("--expert-mb", type=float, default=3 * 2048 * 1024 * 2 / 1e6)
    parser.add_argument("--experts", type=int, nargs="+", default=[1, 4], help="list lengths timed alone")
    parser.add_argument("--programs", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    parser.add_argument("--words", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--gemm", type=int, default=8192, help="size of the square bf16 GEMM beside the copies")
    parser.add_argument("--beside-repeats", type=int, default=6,
                        help="the largest list copied this many times beside the GEMM (about the GEMM's time)")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    check_args(parser, args)
    if not torch.cuda.is_available():
        raise SystemExit("bench_expert_copy times copies into a CUDA device: it needs one")
    device = torch.device("cuda")
    words_per_row = int(args.expert_mb * 1e6) // 8
    n_max = max(args.experts)
    store = torch.randint(-2**62, 2**62, (2 * n_max, words_per_row), dtype=torch.int64).pin_memory()
    slots = torch.zeros(n_max, words_per_row, dtype=torch.int64, device=device)
    ids = list(range(1, 2 * n_max, 2))  # every other row: no two copies read neighbouring rows
    lists = {n: torch.tensor([n] + ids[:n] + list(range(n)), dtype=torch.int64, device=device)
             for n in args.experts}
    copy_stream, gemm_stream = torch.cuda.Stream(), torch.cuda.Stream()
    a = torch.randn(args.gemm, args.gemm, dtype=torch.bfloat16, device=device)
    b = torch.randn_like(a)

    def copy(method, programs, words, n):
        if method == "engine":
            for j in range(n):
                slots[j].copy_(store[ids[j]], non_blocking=True)
        else:
            launch_copy(store, slots, lists[n], programs, words)

    def timed(stream, work) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record()
            work()
            end.record()
        return start, end

    def gemms():
        for _ in range(4):
            torch.mm(a, b)

    grid = configs(args.programs, args.words)
    for method, programs, words in grid:  # compile (one kernel per list length) and warm up
        with torch.cuda.stream(copy_stream):
            for n in args.experts:
                copy(method, programs, words, n)
    with torch.cuda.stream(gemm_stream):
        gemms()
    torch.cuda.synchronize()
    times: dict[str, list] = {}
    for _ in range(args.rounds):
        torch.cuda.synchronize()
        gemm = timed(gemm_stream, gemms)
        torch.cuda.synchronize()
        times.setdefault("gemm alone", []).append(gemm[0].elapsed_time(gemm[1]))
        for method, programs, words in grid:
            name = label(method, programs, words)
            for n in args.experts:
                torch.cuda.synchronize()
                ev = timed(copy_stream, lambda: copy(method, programs, words, n))
                torch.cuda.synchronize()
                times.setdefault(f"{name}: {n} alone", []).append(ev[0].elapsed_time(ev[1]))
            torch.cuda.synchronize()  # beside the GEMM: the GEMM starts first, the copies run under it
            gemm = timed(gemm_stream, gemms)
            ev = timed(copy_stream, lambda: [copy(method, programs, words, n_max) for _ in range(args.beside_repeats)])
            torch.cuda.synchronize()
            times.setdefault(f"{name}: {n_max} beside gemm", []).append(ev[0].elapsed_time(ev[1]))
            times.setdefault(f"{name}: gemm beside it", []).append(gemm[0].elapsed_time(gemm[1]))
    median = {k: float(np.median(v)) for k, v in times.items()}
    expert_bytes = words_per_row * 8
    rows = []
    for method, programs, words in grid:
        name = label(method, programs, words)
        row = {"method": method, "programs": programs, "words": words}
        for n in args.experts:
            row[f"GBps_{n}_alone"] = gb_per_s(n * expert_bytes, median[f"{name}: {n} alone"])
        row[f"GBps_{n_max}_beside_gemm"] = gb_per_s(args.beside_repeats * n_max * expert_bytes,
                                                    median[f"{name}: {n_max} beside gemm"])
        row["gemm_slowdown"] = median[f"{name}: gemm beside it"] / median["gemm alone"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    write_text_atomic(args.out, json.dumps(dict(
        machine=platform.node(), gpu=torch.cuda.get_device_name(), torch=torch.__version__, args=vars(args),
        expert_bytes=expert_bytes, rows=rows, rounds_ms=times), indent=1))
    head = ["copy", *[f"{n} alone GB/s" for n in args.experts], f"{n_max} beside GEMM GB/s", "GEMM slowdown"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for row in rows:
        cells = [label(row["method"], row["programs"], row["words"])]
        cells += [f"{row[f'GBps_{n}_alone']:.1f}" for n in args.experts]
        cells += [f"{row[f'GBps_{n_max}_beside_gemm']:.1f}", f"{row['gemm_slowdown']:.3f}"]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
