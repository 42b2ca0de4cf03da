"""Benchmark of the speculative engine against AR-PSR on one CUDA GPU, both on one expert residency unit.

Full-size OLMoE-1B-7B config target (bf16, seeded random weights drawn on the device), a static KV cache of
--max-seq-len positions (default 4096), blocks rooted from --first-position (default 256: a prompt of a few
hundred tokens). Routing follows a trained model (random weights route without locality): every speculative
configuration is trace-following (`Engine.follow`) of
- synthetic blocks over a routing trace of the shipped family target (`--trace`, `make_bench_trace.py`): a
  synthetic drafter at tau about --taus (default 3 5 7) for each --k (default 8 16), acceptance profile
  `AcceptanceProfile.for_tau`;
- block records of the family's harness runs (`--records FILE ...`, `specmoe sd --records`: AR and DFlash
  drafters), cut to each k.
For each source and selector (--selectors) the engine runs with pool P = --pool (default 24, the paper's
37.5% of 64) and U = E - P union slots, rounds interleaved, with copies and with copies skipped (compute only,
same selections). AR-PSR (lambda --psr-lambda, n=1) on the same unit follows the committed sequence of the
same blocks (`LogitFeed`), at C = P and at C = P + U_max, the largest C within the speculative engine's peak
slot memory (U_max: the most union slots any block's layer used, over all runs).

Reported per configuration: tau, copies per committed token, ms per committed token (verification, of it
exposed copies = with copies - copies skipped, paired per round), p50 / p99 of the block time, and against
AR-PSR: the paired ratio (paired t on log latency over rounds) at zero drafting cost, and the break-even
drafting time per block, tau x AR ms/token - verification ms per block (Section 7 of the paper: speculative
decoding beats AR-PSR when drafting a block costs less than this).

    PYTHONPATH=. python3 scripts/bench_spec_engine.py --out DIR --trace FILE --trace-calibration FILE \\
        [--records blocks_ar_exact.safetensors blocks_dflash_exact.safetensors]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import measure_bandwidth, measure_copy_ms, ratio_ci  # noqa: E402

from specmoe.engines import Engine, EngineConfig, LogitFeed, build_engine  # noqa: E402
from specmoe.engines.helpers import random_olmoe_on_device  # noqa: E402
from specmoe.files import write_text_atomic  # noqa: E402
from specmoe.models import adapter_for, decoder_for  # noqa: E402
from specmoe.offload import ExpertResidency, ExpertStore  # noqa: E402
from specmoe.records import AcceptanceProfile, BlockRecords, Trace, blocks_from_records, synthetic_blocks  # noqa: E402
from specmoe.routing import Calibration, preset  # noqa: E402
from specmoe.speculation import SpeculativeConfig  # noqa: E402
from specmoe.verifiers import selector_preset  # noqa: E402


def block_sources(args, geometry) -> dict:
    """name -> (k, Blocks): synthetic blocks over the trace at each tau and k, and the records cut to each k."""
    num_layers, num_experts, top_k = geometry
    trace = Trace.load(args.trace, num_layers=num_layers, num_experts=num_experts, top_k=top_k)
    sources = {}
    for k in args.k:
        for tau in args.taus:
            profile = AcceptanceProfile.for_tau(tau, k)
            sources[f"synthetic_tau{tau:g}_k{k}"] = (k, synthetic_blocks(trace, k, profile, seed=args.seed,
                                                                         max_blocks=args.max_blocks))
        for path in args.records or []:
            records = BlockRecords.load(path, num_layers, num_experts, top_k)
            if k <= records.geometry["k"]:
                blocks = blocks_from_records(records, k=k, source=f"{records.drafter} records")
                if args.max_blocks:
                    blocks = _first_blocks(blocks, args.max_blocks)
                sources[f"{records.drafter}_records_k{k}"] = (k, blocks)
    return sources


def _first_blocks(blocks, n: int):
    from dataclasses import replace

    keep = slice(0, min(n, blocks.num_blocks))
    return replace(blocks, rows=blocks.rows[keep], accepted=blocks.accepted[keep], request=blocks.request[keep],
                   confidences=blocks.confidences[keep],
                   true_rows=None if blocks.true_rows is None else blocks.true_rows[keep])


def committed_feeds(blocks, fingerprint) -> list[LogitFeed]:
    """The committed sequence of each request of `blocks` as an AR logit feed (router, pre-gate, tokens)."""
    rows, starts = blocks.committed_rows()
    bounds = list(starts) + [len(rows)]
    return [LogitFeed(blocks.router_logits[rows[lo:hi]], blocks.pregate_logits[rows[lo:hi]],
                      blocks.tokens[rows[lo:hi]], fingerprint, blocks.scoring) for lo, hi in zip(bounds[:-1], bounds[1:])]


def spec_pass(engine: Engine, blocks, first_position: int) -> dict:
    results = engine.follow(blocks, first_position=first_position)
    committed = sum(len(r.tokens) for r in results)
    block_ms = np.concatenate([r.ms for r in results])
    return {"ms_per_token": float(block_ms.sum() / committed), "block_ms": block_ms,
            "copies_per_token": sum(r.counts()["copies"] for r in results) / committed,
            "moves_per_token": sum(r.moves for r in results) / committed,
            "tau": committed / sum(len(r.accepted) for r in results), "blocks": len(block_ms),
            "committed": committed, "union_used": max(r.info["union_used"] for r in results)}


def ar_pass(engine, feeds, first_position: int) -> dict:
    ms, copies, tokens = [], 0.0, 0
    for feed in feeds:
        r = engine.teacher_forced(feed.tokens, feed=feed, first_position=first_position)
        ms.append(r.ms[r.timed])
        tokens += int(r.timed.sum())
        copies += r.copy_totals()["issued"]
    ms = np.concatenate(ms)
    return {"ms_per_token": float(ms.mean()), "copies_per_token": copies / tokens, "p99": float(np.percentile(ms, 99))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--trace", required=True, help="routing trace of the family target (make_bench_trace.py)")
    ap.add_argument("--trace-calibration", required=True, help="calibration of the traced model")
    ap.add_argument("--records", nargs="*", help="block record files of the family (specmoe sd --records)")
    ap.add_argument("--pool", type=int, default=24)
    ap.add_argument("--k", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--taus", type=float, nargs="+", default=[3, 5, 7])
    ap.add_argument("--selectors", nargs="+", default=["exact", "acceptmoe", "confidence_top1"])
    ap.add_argument("--psr-lambda", type=float, default=0.25)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-blocks", type=int, default=None, help="blocks per source (default: all)")
    ap.add_argument("--max-seq-len", type=int, default=4096)
    ap.add_argument("--first-position", type=int, default=256)
    ap.add_argument("--model", default="olmoe-1b-7b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {"command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": {"gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
                          "python": platform.python_version(), "torch": torch.__version__},
              "args": vars(args), "errors": []}

    def save():
        write_text_atomic(out_dir / "bench_spec_engine.json", json.dumps(report, indent=1, default=float))

    t0 = time.time()
    model, adapter = random_olmoe_on_device(args.model, args.seed, getattr(torch, args.dtype), args.device)
    store = ExpertStore.from_model(model, adapter)
    report["bandwidth_Bps"] = measure_bandwidth(args.device, 2 * 1024**3 if args.device == "cuda" else 64 * 1024**2)
    report["copy"] = measure_copy_ms(store, args.device)
    L, E, K = adapter.num_moe_layers, adapter.num_experts, adapter.top_k
    calibration = Calibration.load(args.trace_calibration)
    calibration.check(L, E)
    trace_fingerprint = Trace.load(args.trace).fingerprint or None
    sources = block_sources(args, (L, E, K))
    for name, (k, blocks) in list(sources.items()):  # only the embeddings read the tokens; routing follows the record
        if blocks.tokens.max() >= adapter.vocab_size:
            from dataclasses import replace

            sources[name] = (k, replace(blocks, tokens=blocks.tokens % adapter.vocab_size))
            report["errors"].append(f"{name}: tokens beyond the target's vocabulary taken modulo {adapter.vocab_size}")
    unit = ExpertResidency(store, E, args.device)  # one unit for every engine, used alternately
    cfg = EngineConfig(max_seq_len=args.max_seq_len)
    fingerprint = adapter_for(model.config).fingerprint(model)
    engines = {}
    for k in args.k:
        for name in args.selectors:
            config = SpeculativeConfig(selector_preset(name), k=k, pool_size=args.pool)
            decoder = decoder_for(model.config).from_model(model, args.max_seq_len)
            engines[(k, name)] = Engine(decoder, unit, None, calibration, cfg, fingerprint=fingerprint,
                                        speculative=config)
    report["notes"] = engines[(args.k[0], args.selectors[0])].notes
    report["kernels"] = {f"k={k} {name}": e.kernels for (k, name), e in engines.items()}  # launch params, sources
    report["sources"] = {n: {"k": k, "blocks": b.num_blocks, "tau": b.tau, "source": b.source}
                         for n, (k, b) in sources.items()}
    print("sources", report["sources"], flush=True)
    report["setup_s"] = time.time() - t0
    save()

    rounds: dict[str, list] = {}
    details: dict[str, dict] = {}
    for r in range(args.rounds + 1):  # round 0 warms up
        for source, (k, blocks) in sources.items():
            for name in args.selectors:
                key = f"{source}/{name}"
                engine = engines[(k, name)]
                try:
                    for skip in (False, True):
                        engine.configure(skip_copies=skip)
                        res = spec_pass(engine, blocks, args.first_position)
                        if r:
                            rounds.setdefault(key + ("/skip" if skip else ""), []).append(res["ms_per_token"])
                            d = details.setdefault(key + ("/skip" if skip else ""), {"block_ms": []})
                            d["block_ms"].append(res["block_ms"])
                            d.update({x: res[x] for x in ("copies_per_token", "moves_per_token", "tau", "blocks",
                                                          "committed")})
                            d["union_used"] = max(d.get("union_used", 0), res["union_used"])
                finally:
                    engine.configure(skip_copies=False)
            print(f"round {r} {source}:", {n: round(v[-1], 3) for n, v in rounds.items() if n.startswith(source) and v},
                  flush=True)
        report["rounds_ms"] = rounds
        save()
    union_max = max(d["union_used"] for d in details.values())
    capacities = sorted({args.pool, min(E, args.pool + union_max)})
    report["union_max"] = union_max
    ar_engines = {c: build_engine(model, preset("psr", c, K, bonus=args.psr_lambda, insert_budget=1), calibration,
                                  cfg, residency=unit) for c in capacities}
    feeds = {source: committed_feeds(blocks, trace_fingerprint) for source, (_, blocks) in sources.items()}
    ar_rounds, ar_details = {}, {}
    for r in range(args.rounds + 1):
        for source in sources:
            for c in capacities:
                try:
                    res = ar_pass(ar_engines[c], feeds[source], args.first_position)
                    if r:
                        ar_rounds.setdefault(f"{source}/ar_psr_C{c}", []).append(res["ms_per_token"])
                        ar_details[f"{source}/ar_psr_C{c}"] = res
                except Exception as exc:
                    report["errors"].append(f"AR C={c} {source}: {exc!r}\n{traceback.format_exc()[-1500:]}")
    report["ar_rounds_ms"] = ar_rounds

    table = []
    for source, (k, blocks) in sources.items():
        for name in args.selectors:
            key = f"{source}/{name}"
            if key not in details:
                continue
            d, s = details[key], details.get(key + "/skip", {})
            ms, skip_ms = float(np.mean(rounds[key])), float(np.mean(rounds.get(key + "/skip", [math.nan])))
            block_ms = np.concatenate(d["block_ms"])
            row = {"source": source, "selector": name, "k": k, "tau": d["tau"], "blocks": d["blocks"],
                   "copies_per_token": d["copies_per_token"], "moves_per_token": d["moves_per_token"],
                   "ms_per_token": ms, "compute_ms_per_token": skip_ms, "exposed_copy_ms_per_token": ms - skip_ms,
                   "block_ms_p50": float(np.percentile(block_ms, 50)), "block_ms_p99": float(np.percentile(block_ms, 99)),
                   "union_used": d["union_used"], "skip_copies_per_token": s.get("copies_per_token")}
            for c in capacities:
                ar = ar_rounds.get(f"{source}/ar_psr_C{c}")
                if not ar:
                    continue
                ar_ms = float(np.mean(ar))
                row[f"ar_C{c}_ms_per_token"] = ar_ms
                row[f"ar_C{c}_copies_per_token"] = ar_details[f"{source}/ar_psr_C{c}"]["copies_per_token"]
                row[f"ratio_sd0_over_ar_C{c}"] = ratio_ci(rounds[key], ar)
                # break-even drafting ms per block: tau * AR ms/token - verification ms per block
                row[f"break_even_draft_ms_C{c}"] = d["tau"] * ar_ms - ms * d["tau"]
            table.append(row)
    report["capacities"] = capacities
    report["table"] = table
    report["total_s"] = time.time() - t0
    save()
    md = markdown(report)
    write_text_atomic(out_dir / "bench_spec_engine.md", md)
    print(md, flush=True)
    return 0 if not report["errors"] else 1


def markdown(report: dict) -> str:
    caps = report["capacities"]
    lines = [f"# Speculative engine vs AR-PSR ({report['date']})", "",
             f"{report['machine']['gpu']}; torch {report['machine']['torch']}. Command: `{report['command']}`. "
             f"Pool P = {report['args']['pool']}, U_max = {report['union_max']} union slots used at most; AR-PSR at C = "
             + ", ".join(map(str, caps)) + ". Expert copy "
             f"{report['copy']['stream_ms']:.3f} ms in a stream.", "",
             "| source | selector | k | tau | copies/token | ms/token (SD, zero drafting) | compute-only | exposed copies | "
             "block ms p50 / p99 | " + " | ".join(f"AR-PSR C={c} ms/token (copies) | SD/AR C={c} | break-even draft ms/block C={c}"
                                                   for c in caps) + " |",
             "|---|---|---|---|---|---|---|---|---|" + "---|---|---|" * len(caps)]
    for row in report["table"]:
        cells = [row["source"], row["selector"], str(row["k"]), f"{row['tau']:.2f}", f"{row['copies_per_token']:.2f}",
                 f"{row['ms_per_token']:.3f}", f"{row['compute_ms_per_token']:.3f}",
                 f"{row['exposed_copy_ms_per_token']:.3f}", f"{row['block_ms_p50']:.2f} / {row['block_ms_p99']:.2f}"]
        for c in caps:
            if f"ar_C{c}_ms_per_token" in row:
                ratio = row[f"ratio_sd0_over_ar_C{c}"]
                cells += [f"{row[f'ar_C{c}_ms_per_token']:.3f} ({row[f'ar_C{c}_copies_per_token']:.2f})",
                          f"{ratio['ratio']:.3f} ({ratio['lo']:.3f}-{ratio['hi']:.3f})",
                          f"{row[f'break_even_draft_ms_C{c}']:.2f}"]
            else:
                cells += ["-", "-", "-"]
        lines.append("| " + " | ".join(cells) + " |")
    if report["errors"]:
        lines += ["", "Errors:"] + [f"- {e.splitlines()[0]}" for e in report["errors"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
