"""Benchmark of the speculative engine against AR-PSR on one CUDA GPU, both on one expert residency unit.

Full-size OLMoE-1B-7B config target (bf16, seeded random weights drawn on the device), a static KV cache of
--max-seq-len positions (default 4096), blocks rooted from --first-position (default 256: a prompt of a few
hundred tokens). Routing follows a trained model (random weights route without locality): every speculative
configuration is trace-following (`Engine.follow`) of
- synthetic blocks over a routing trace of the shipped family target (`--trace`, `make_bench_trace.py`): a
  synthetic drafter at tau about --taus (default 3 5 7) for each --k (default 8 16), acceptance profile
  `AcceptanceProfile.for_tau`;
- block records of the family's harness runs (`--records FILE ...`, `specmoe sd --records`: one file per drafter
  and selector, RUN_DIR/blocks/blocks_cNNNN_DRAFTER_SELECTOR.safetensors), cut to each k, and synthetic blocks
  over the trace at each records file's accepted-length histogram (`AcceptanceProfile.of_records`).
Acceptance per row: a selector follows the records of its own run, matched by the file's selector field
(`records_per_selector`), and the synthetic blocks of its own histogram: closed loop, its own accepted lengths. A
selector without records follows exact's, and every selector follows the tau sources' one profile: open loop
(exact's acceptance; optimistic for a lossy selector), labelled so in the table and the json. --closed-loop makes
a selector without records of its own an error and keeps exact only on the tau sources.
For each source and selector (--selectors) the engine runs with pool P = --pool (default 24, the paper's
37.5% of 64) and U = --union union slots (default E - P), with copies and with copies skipped (compute only, same
selections). AR (--ar-policies, default PSR at the paper's lambda for C of E, n = 1) on the same unit follows the
committed sequence of the same blocks (`LogitFeed`), at C = P, at C = P + U_max (the largest C within the
speculative engine's peak slot memory; U_max: the most union slots any block's layer used in the warm-up round)
and at --ar-capacities, with and without copies; each AR row's schedule floor (`specmoe.engines.schedule`: what its
own copies leave at best when each is issued as its policy decides it, priced at the run's target step and copy
time; from its first timed round's routing) goes beside it. Every configuration runs once per round, rounds interleaved, so
that ratios pair measurements taken at the same time. Each speculative row runs its blocks on the device
(`EngineConfig.block_device="auto"`, row "source/selector") and on the host ("source/selector+host_blocks"), in the
same rounds, with the ratio host / device (--block-paths, for every --prefetch budget; a row's `verify` says
which path ran, `host_blocks_why` why the host). A trace of a shallower family member with the target's E
and K is tiled over the target's layers (`Trace.tiled`, `Calibration.tiled`).

Several traces (`--trace A B --trace-calibration a b`, e.g. the family's trace and olmoe-like): one model setup
and every trace's sources in the same interleaved rounds, so that SD-vs-AR rows on both routing sources are paired
in time. Each trace has its own calibration, and so its own set of SD and AR engines (all on the one unit), its own
U_max and AR capacities (`union_max`, `capacities`: dicts per trace label in the json, each value followed by its
label in the markdown); every source name is prefixed with the trace's label and "_" as bench_engine names its
rows (`trace_label`: a file's stem, or a source spec's name and parameters, e.g.
"olmoe_like_margin_0_synthetic_tau5_k8"). One trace: names unprefixed ("synthetic_tau5_k8"). --records belong to
the first trace (give the family's trace first).

Each round also times the target's decode step with every expert resident (the engine's default, `TARGET_TOKENS`
teacher-forced tokens at --first-position): each speculative configuration's compute-only block time is reported
in target steps ("block_compute_over_target_step", paired over rounds; the paper's 1.7-1.8 at k = 16).

With --timeline, after the rounds, each speculative configuration's per-block timeline on its own block path
(drafting, selection, copy issue and checks, exposed copy wait, other idle time, compute; ms per block and per
committed token), json "timeline" and a markdown table: on the host path one instrumented pass
(`DecodeResult.timeline`), on the device path the block's kernels under torch's profiler
(`specmoe.engines.kernel_timeline`).

Reported per configuration: tau, copies per committed token, ms per committed token (verification, of it
exposed copies = with copies - copies skipped, paired per round), p50 / p99 of the block time, and against
each AR configuration (the fastest in the main table; each --ar-policies at C = P + U_max, the speculative
engine's peak slot memory, in a table of its own): the ratio at zero drafting cost with a 95% interval, a paired
bootstrap over the requests (`request_ratio`; also a paired t on log latency over rounds in the json), and the break-even
drafting time per block, tau x AR ms/token - verification ms per block (Section 7 of the paper: speculative
decoding beats AR-PSR when drafting a block costs less than this). With --draft-ms MS (a drafter's measured
drafting time per block, scripts/bench_drafters.py), also ms per committed token with drafting (verification +
MS x the measured blocks / committed tokens) and the SD / AR ratio with drafting, its interval by the same
bootstrap (each request's SD time plus MS x its blocks). The json keeps, per configuration, the per-request times
of every round, tokens and (SD) blocks under `details`, enough to recompute any ratio.

    PYTHONPATH=. python3 scripts/bench_spec_engine.py --out DIR --trace FILE [olmoe-like] \\
        --trace-calibration FILE [olmoe-like] [--records RUN_DIR/blocks/*.safetensors [--closed-loop]]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import platform
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (layer_copies, mean_schedule_floor, measure_bandwidth, measure_copy_ms,  # noqa: E402
                          policies, read_tiled, trace_label, trace_prefixes)

from spec_report import TIMELINE_PARTS, markdown, saved_details, sd_keys, summary_table  # noqa: E402

from specmoe.engines import Engine, EngineConfig, LogitFeed, build_engine  # noqa: E402
from specmoe.engines import kernel_timeline  # noqa: E402
from specmoe.engines.helpers import free_routed_experts, random_model_on_device  # noqa: E402
from specmoe.files import write_text_atomic  # noqa: E402
from specmoe.models import adapter_for, decoder_for  # noqa: E402
from specmoe.offload import ExpertResidency, ExpertStore  # noqa: E402
from specmoe.records import (CLOSED_LOOP, AcceptanceProfile, BlockRecords, blocks_from_records,  # noqa: E402
                             open_loop, records_per_selector, synthetic_blocks)
from specmoe.routing import Calibration, preset  # noqa: E402
from specmoe.speculation import PREFETCH, SpeculativeConfig, tau as tau_of  # noqa: E402
from specmoe.verifiers import selector_preset  # noqa: E402


def source_prefixes(args) -> list[str]:
    """The source-name prefix of each --trace, in order: none with one trace ("synthetic_tau5_k8"), with several
    bench_engine's row-name prefix (`trace_prefixes`: the trace's label and "_", so "olmoe_like_margin_0_" +
    "synthetic_tau5_k8"). Exits on a --trace-calibration count that is not one per trace, or two traces of one
    label."""
    prefixes = trace_prefixes(args)
    return prefixes if len(prefixes) > 1 else [""]


def block_sources(args, trace, geometry, prefix: str = "", records: bool = True) -> dict:
    """name -> (k, {selector: (Blocks, acceptance)}, the blocks AR follows): synthetic blocks over the trace at
    each tau and k, the records cut to each k and, with records, synthetic blocks at each selector's own
    accepted-length histogram. Each selector follows its own run's records where they exist (closed loop,
    `records_per_selector`); otherwise exact's, labelled open loop (with --closed-loop: an error, and the tau
    sources, whose acceptance is one profile for every selector, keep exact only). AR follows the committed
    sequence of exact's blocks (of the first selector's where exact is not run). Every name starts with `prefix`
    (`source_prefixes`); records=False leaves --records out (they belong to the first trace)."""
    num_layers, num_experts, top_k = geometry
    selectors = list(args.selectors)
    paths = (args.records or []) if records else []
    loaded = [BlockRecords.load(path, num_layers, num_experts, top_k) for path in paths]
    matched = records_per_selector(loaded, selectors, require_own=args.closed_loop) if loaded else {}
    sources = {}

    def add(name, k, per_selector):
        reference = per_selector.get("exact", next(iter(per_selector.values())))[0]
        sources[prefix + name] = (k, per_selector, reference)

    for k in args.k:
        for tau in args.taus:
            blocks = synthetic_blocks(trace, k, AcceptanceProfile.for_tau(tau, k), seed=args.seed,
                                      max_blocks=args.max_blocks, blocks_per_request=args.blocks_per_request)
            shown = [s for s in selectors if s == "exact" or not args.closed_loop]
            if shown:
                add(f"synthetic_tau{tau:g}_k{k}", k, {s: (blocks, CLOSED_LOOP if s == "exact" else open_loop("exact"))
                                                      for s in shown})
        for drafter, runs in matched.items():
            if any(k > records.geometry["k"] for records, _ in runs.values()):
                continue
            per_selector, histogram = {}, {}
            for name, (records, acceptance) in runs.items():
                blocks = blocks_from_records(records, k=k, source=f"{drafter} records ({records.selector['kind']})")
                per_selector[name] = (_first_blocks(blocks, args.max_blocks) if args.max_blocks else blocks, acceptance)
                profile = AcceptanceProfile.of_records(records, k)
                histogram[name] = (synthetic_blocks(trace, k, profile, seed=args.seed, max_blocks=args.max_blocks,
                                                    blocks_per_request=args.blocks_per_request,
                                                    source=f"synthetic, {drafter} {records.selector['kind']} "
                                                    "accepted-length histogram"), acceptance)
            add(f"{drafter}_records_k{k}", k, per_selector)
            add(f"synthetic_{drafter}_hist_k{k}", k, histogram)
    return sources


def in_vocabulary(blocks, vocab_size: int):
    """`blocks` with tokens beyond the target's vocabulary taken modulo its size (a trace of a model with a larger
    vocabulary: only the embeddings read the tokens, routing follows the recorded logits)."""
    if blocks.tokens.max() < vocab_size:
        return blocks
    return dataclasses.replace(blocks, tokens=blocks.tokens % vocab_size)


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
            "request_ms": [float(r.ms.sum()) for r in results], "request_tokens": [len(r.tokens) for r in results],
            "copies_per_token": sum(r.counts()["copies"] for r in results) / committed,
            "moves_per_token": sum(r.moves for r in results) / committed,
            **{f"{c}_per_token": sum(r.copy_totals()[c] for r in results) / committed  # the block prefetch's
               for c in ("demand", "prefetch", "prefetch_unused")},
            "tau": tau_of(sum(r.block_committed for r in results), sum(int(r.timed.sum()) for r in results)),
            "blocks": len(block_ms), "request_blocks": [len(r.ms) for r in results],
            "committed": committed, "union_used": max(r.info["union_used"] for r in results),
            "verify": results[0].info["verify"], "host_blocks_why": results[0].info["host_blocks_why"]}




def timeline_pass(engine: Engine, blocks, first_position: int, draft_ms: float, results: list) -> dict:
    """The mean per-block timeline (ms, `DecodeResult.timeline`'s parts) over every request's blocks, drafting
    charged at draft_ms per block, and per committed token. `results`: a plain pass over the blocks (`follow`),
    taken before any profiled pass of the process (main: torch's profiler leaves CUPTI attached, and every later
    graph launch pays for it on the host). On the host path one instrumented pass (`RunSettings.instrument`: GPU
    events around each layer's gap); on the device path the plain pass's wall time per block and a pass under
    torch's profiler for their kernels (`specmoe.engines.kernel_timeline`: a block is one graph, its parts are
    its kernels by class; "copies_hidden" is the copies' time beside other kernels)."""
    weights = [int(r.timed.sum()) for r in results]
    per_block = sum(weights) / sum(r.block_committed for r in results)  # blocks per committed token
    if results[0].info["verify"] == "device":
        from torch.profiler import ProfilerActivity, profile

        step_ms = float(np.concatenate([r.ms[r.timed] for r in results]).mean())
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            engine.follow(blocks, first_position=first_position, draft_cost_s=draft_ms / 1e3)
            torch.cuda.synchronize()
        out = kernel_timeline.timeline(kernel_timeline.profiled_spans(prof), sum(weights), step_ms, draft_ms)
    else:
        engine.configure(instrument=True)
        try:
            results = engine.follow(blocks, first_position=first_position, draft_cost_s=draft_ms / 1e3)
        finally:
            engine.configure(instrument=False)
        lines = [r.timeline() for r in results]
        out = {part: float(np.average([line[part] for line in lines], weights=weights)) for part in TIMELINE_PARTS}
    out["per_token"] = {part: out[part] * per_block for part in TIMELINE_PARTS}
    out["verify"] = results[0].info["verify"]
    return out


TARGET_TOKENS = 32  # timed tokens of the target step per round


def target_pass(engine, tokens: np.ndarray, first_position: int) -> dict:
    """The target's decode step with every expert resident (the engine's default, one CUDA graph per token on a
    GPU): ms per token over `tokens` at `first_position`, the unit a verification block's compute is counted in."""
    r = engine.teacher_forced(tokens, first_position=first_position)
    return {"ms_per_token": float(r.ms[r.timed].mean()), "routing": r.info["routing"]}


def ar_pass(engine, feeds, first_position: int, floor_of: str | None = None, errors: list | None = None) -> dict:
    """An AR engine over the committed tokens' feeds: ms and copies per token, per request; with `floor_of` (the
    row's name) also each run's copies per token and layer for its schedule floor (`layer_copies`)."""
    ms, copies, tokens, request_ms, request_tokens, results = [], 0.0, 0, [], [], []
    for feed in feeds:
        r = engine.teacher_forced(feed.tokens, feed=feed, first_position=first_position)
        results.append(r)
        ms.append(r.ms[r.timed])
        request_ms.append(float(ms[-1].sum()))
        request_tokens.append(int(r.timed.sum()))
        tokens += int(r.timed.sum())
        copies += r.copy_totals()["issued"]
    ms = np.concatenate(ms)
    return {"ms_per_token": float(ms.mean()), "copies_per_token": copies / tokens, "p99": float(np.percentile(ms, 99)),
            "request_ms": request_ms, "request_tokens": request_tokens, "routing": r.info["routing"],
            "host_policy_why": r.info["host_policy_why"],
            **({"layer_copies": layer_copies(engine, results, feeds, floor_of, errors)} if floor_of else {})}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--trace", required=True, nargs="+", help="routing traces of a family target "
                    "(make_bench_trace.py) and/or synthetic routing sources (olmoe-like, docs/routing-source.md); a "
                    "shallower trace with the target's E and K is tiled over its layers (`Trace.tiled`). Several: "
                    "every trace's sources in the same rounds, each source name prefixed with its trace's label "
                    "(bench_common's `trace_label`, e.g. olmoe_like_margin_0_synthetic_tau5_k8); one: names unprefixed")
    ap.add_argument("--trace-calibration", required=True, nargs="+", help="one per --trace, in order: calibration "
                    "of the traced model (a synthetic source: its spec)")
    ap.add_argument("--records", nargs="*", help="block record files of the family (specmoe sd --records); with "
                    "several --trace they belong to the first (give the family's trace first)")
    ap.add_argument("--closed-loop", action="store_true",
                    help="every selector follows block records of its own run (an error where a selector has none); "
                    "without it a selector without records follows exact's, labelled open-loop")
    ap.add_argument("--pool", type=int, default=24)
    ap.add_argument("--union", type=int, default=None, help="union slots U per layer (default E - P)")
    ap.add_argument("--prefetch", type=int, nargs="+", default=[PREFETCH], help="block prefetch budgets per layer "
                    f"and block (docs/block-prefetch.md; 0: off; default {PREFETCH}); several give one SD row each, "
                    "interleaved in the same rounds (e.g. --prefetch 0 4)")
    ap.add_argument("--block-paths", nargs="+", choices=("device", "host"), default=["device", "host"],
                    help="verification blocks on the device (row source/selector, block_device='auto') and/or on the "
                    "host (source/selector+host_blocks, block_device='off'), in the same rounds, with the ratio host / "
                    "device, for every --prefetch budget")
    ap.add_argument("--k", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--taus", type=float, nargs="+", default=[3, 5, 7])
    ap.add_argument("--selectors", nargs="+", default=["exact", "acceptmoe", "confidence_top1"])
    ap.add_argument("--draft-ms", type=float, default=0.0,
                    help="drafting ms per verification block of the drafter the SD rows stand for (e.g. 2.20, DFlash at "
                    "Qwen3.6's geometry, scripts/bench_drafters.py; default 0: none): each SD row adds its ms per "
                    "committed token with drafting and the SD / AR ratio with drafting, with the same interval")
    ap.add_argument("--ar-capacities", type=int, nargs="*", default=[],
                    help="AR capacities beyond C = P and C = P + U_max (e.g. the paper's 64 128 148 for Qwen3.6)")
    ap.add_argument("--ar-policies", nargs="+", default=["psr"],
                    choices=["exact_lru", "exact_prefetch", "cache_prior", "psr"],
                    help="AR policies at each capacity (bench_common's `policies`: PSR at the paper's lambda for C of "
                    "E, n = 1; exact_prefetch is PSR with lambda 0)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--timeline", action="store_true",
                    help="after the rounds, the per-block timeline of each speculative configuration on its block "
                    "path (drafting at --draft-ms, selection, copy issue and checks, exposed copy wait, other idle "
                    "time, compute): the host path from an instrumented pass, the device path from its kernels "
                    "under torch's profiler")
    ap.add_argument("--max-blocks", type=int, default=None, help="blocks per source (default: all)")
    ap.add_argument("--blocks-per-request", type=int, default=None,
                    help="synthetic blocks per trace sequence (request), so that a short run keeps every request "
                    "(the units of the ratio's interval); default: up to --max-blocks from the first sequences")
    ap.add_argument("--max-seq-len", type=int, default=4096)
    ap.add_argument("--first-position", type=int, default=256)
    ap.add_argument("--model", default="olmoe-1b-7b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    prefixes = source_prefixes(args)  # exits on a calibration count or a label clash before any model is built
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.draft_ms < 0:
        ap.error(f"--draft-ms must be at least 0, got {args.draft_ms}")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {"command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": {"gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
                          "python": platform.python_version(), "torch": torch.__version__},
              "args": vars(args), "errors": [], "warnings": []}

    def save():
        write_text_atomic(out_dir / "bench_spec_engine.json", json.dumps(report, indent=1, default=float))

    t0 = time.time()
    model, adapter = random_model_on_device(args.model, args.seed, getattr(torch, args.dtype), args.device)
    store = ExpertStore.from_model(model, adapter)
    report["model_experts_freed_GB"] = free_routed_experts(model) / 1e9  # the engines read the store
    report["host_store_GB"] = store.num_layers * store.num_experts * store.expert_bytes / 1e9
    report["bandwidth_Bps"] = measure_bandwidth(args.device, 2 * 1024**3 if args.device == "cuda" else 64 * 1024**2)
    report["copy"] = measure_copy_ms(store, args.device)
    L, E, K = adapter.num_moe_layers, adapter.num_experts, adapter.top_k
    # per --trace: its calibration and its sources, named with the trace's prefix (`source_prefixes`)
    traces, sources, trace_of = {}, {}, {}
    for i, (prefix, spec, calibration_spec) in enumerate(zip(prefixes, args.trace, args.trace_calibration)):
        trace, calibration = read_tiled(spec, calibration_spec, L, E, K)
        info = {"model": trace.model, "tiled_from_layers": trace.info.get("tiled_from_layers")}
        if len(prefixes) == 1:
            report["trace"] = info
        else:
            report.setdefault("traces", {})[trace_label(spec)] = {"trace": spec, "calibration": calibration_spec,
                                                                  "prefix": prefix, **info}
        traces[prefix] = {"label": trace_label(spec), "trace": trace, "calibration": calibration}
        for name, (k, per_selector, reference) in block_sources(args, trace, (L, E, K), prefix, i == 0).items():
            if max(b.tokens.max() for b, _ in per_selector.values()) >= adapter.vocab_size:
                per_selector = {s: (in_vocabulary(b, adapter.vocab_size), a) for s, (b, a) in per_selector.items()}
                reference = in_vocabulary(reference, adapter.vocab_size)
                report["warnings"].append(f"{name}: tokens beyond the target's vocabulary taken modulo "
                                          f"{adapter.vocab_size}")
            sources[name], trace_of[name] = (k, per_selector, reference), prefix
    unit = ExpertResidency(store, E, args.device)  # one unit for every engine, used alternately
    cfg = EngineConfig(max_seq_len=args.max_seq_len)
    fingerprint = adapter_for(model.config).fingerprint(model)
    engines = {}  # one set per trace, with the trace's calibration
    for prefix, k, name, budget in itertools.product(traces, args.k, args.selectors, args.prefetch):
        for path in args.block_paths:
            config = SpeculativeConfig(selector_preset(name), k=k, pool_size=args.pool, union_slots=args.union,
                                       prefetch=budget)
            decoder = decoder_for(model.config).from_model(model, args.max_seq_len)
            block_device = "auto" if path == "device" else "off"
            engines[(prefix, k, name, budget, path)] = Engine(
                decoder, unit, None, traces[prefix]["calibration"],
                EngineConfig(max_seq_len=args.max_seq_len, block_device=block_device),
                fingerprint=fingerprint, speculative=config)
    # the target step, every expert resident: the unit of "block compute in target steps"
    target = build_engine(model, preset("exact_lru", E, K), Calibration.uniform(L, E, adapter.vocab_size), cfg,
                          residency=unit)
    target_tokens = np.random.default_rng(args.seed).integers(0, adapter.vocab_size, TARGET_TOKENS)
    first = next(iter(engines.values()))
    report["notes"] = first.notes
    report["kernels"] = {f"{prefix}k={k} {name} prefetch {b} {path}": e.kernels
                         for (prefix, k, name, b, path), e in engines.items()}
    report["sources"] = {n: {s: {"k": k, "blocks": b.num_blocks, "tau": b.tau, "source": b.source, "acceptance": a}
                             for s, (b, a) in per_selector.items()} for n, (k, per_selector, _) in sources.items()}
    print("sources", report["sources"], flush=True)
    report["setup_s"] = time.time() - t0
    print(f"setup {report['setup_s']:.0f} s", flush=True)
    save()

    # round 0 warms every speculative configuration up and gives each trace's U_max, the most union slots a block's
    # layer used on its sources; then rounds 1..R run every configuration of every trace, speculative and AR,
    # interleaved, so that round r of each is measured at the same time (paired)
    feeds = {source: committed_feeds(reference, traces[trace_of[source]]["trace"].fingerprint or None)
             for source, (_, _, reference) in sources.items()}
    rounds: dict[str, list] = {}
    details: dict[str, dict] = {}
    ar_engines: dict = {}  # (trace prefix, policy, C) -> AR engine with the trace's calibration
    union_max: dict[str, int] = {}
    for r in range(args.rounds + 1):
        try:
            step = target_pass(target, target_tokens, args.first_position)
            report["target_routing"] = step["routing"]
            if r:
                rounds.setdefault("target_step", []).append(step["ms_per_token"])
        except Exception as exc:
            report["errors"].append(f"target step round {r}: {exc!r}\n{traceback.format_exc()[-1500:]}")
        for source, (k, per_selector, _) in sources.items():
            prefix = trace_of[source]
            for name, budget, path, key in sd_keys(source, per_selector, args.prefetch, args.block_paths):
                blocks, engine = per_selector[name][0], engines[(prefix, k, name, budget, path)]
                try:
                    for skip in (False, True):
                        engine.configure(skip_copies=skip)
                        res = spec_pass(engine, blocks, args.first_position)
                        d = details.setdefault(key + ("/skip" if skip else ""), {"block_ms": []})
                        d["union_used"] = max(d.get("union_used", 0), res["union_used"])
                        union_max[prefix] = max(union_max.get(prefix, 0), res["union_used"])
                        if r:
                            rounds.setdefault(key + ("/skip" if skip else ""), []).append(res["ms_per_token"])
                            d["block_ms"].append(res["block_ms"])
                            d.setdefault("request_ms", []).append(res["request_ms"])
                            d["request_tokens"], d["request_blocks"] = res["request_tokens"], res["request_blocks"]
                            d.update({x: res[x] for x in ("copies_per_token", "demand_per_token", "prefetch_per_token",
                                                          "prefetch_unused_per_token", "moves_per_token", "tau", "blocks",
                                                          "committed", "verify", "host_blocks_why")})
                except Exception as exc:
                    report["errors"].append(f"{key} round {r}: {exc!r}\n{traceback.format_exc()[-1500:]}")
                finally:
                    engine.configure(skip_copies=False)
            if r == 0:
                continue
            for (owner, policy, c), engine in ar_engines.items():
                if owner != prefix:
                    continue
                key = f"{source}/ar_{policy}_C{c}"
                try:
                    for skip in (False, True):
                        engine.configure(skip_copies=skip)
                        res = ar_pass(engine, feeds[source], args.first_position,
                                      key if r == 1 and not skip else None, report["errors"])
                        rounds.setdefault(key + ("/skip" if skip else ""), []).append(res["ms_per_token"])
                        dd = details.setdefault(key + ("/skip" if skip else ""), {"request_ms": []})
                        dd.update({x: v for x, v in res.items() if x != "request_ms"})
                        dd["request_ms"].append(res["request_ms"])
                except Exception as exc:
                    report["errors"].append(f"{key} round {r}: {exc!r}\n{traceback.format_exc()[-1500:]}")
                finally:
                    engine.configure(skip_copies=False)
            print(f"round {r} {source} ({time.time() - t0:.0f} s):",
                  {n: round(v[-1], 3) for n, v in rounds.items() if n.startswith(source + "/") and v}, flush=True)
        if r == 0:  # per trace: U_max, the AR capacities P, P + U_max and --ar-capacities, its AR engines
            capacities = {prefix: sorted({args.pool, min(E, args.pool + union_max.get(prefix, 0)), *args.ar_capacities})
                          for prefix in traces}
            for prefix, t in traces.items():
                for c in capacities[prefix]:
                    for policy in args.ar_policies:
                        ar_engines[(prefix, policy, c)] = build_engine(model, policies(c, E, K)[policy],
                                                                       t["calibration"], cfg, residency=unit)
            if len(traces) == 1:
                report["union_max"], report["capacities"] = union_max.get("", 0), capacities[""]
            else:
                report["union_max"] = {t["label"]: union_max.get(p, 0) for p, t in traces.items()}
                report["capacities"] = {t["label"]: capacities[p] for p, t in traces.items()}
            for (prefix, policy, c), engine in ar_engines.items():  # warm-up of the AR engines, untimed
                for source in sources:
                    if trace_of[source] == prefix:
                        ar_pass(engine, feeds[source][:1], args.first_position)
        report["rounds_ms"] = rounds
        if r:  # the table and the markdown of the rounds so far (a run cut short keeps them)
            ar_keys = list(dict.fromkeys((policy, c) for _, policy, c in ar_engines))  # of every trace
            report["ar_configs"] = [f"{policy}_C{c}" for policy, c in ar_keys]
            equal_c = {source: min(E, args.pool + union_max.get(trace_of[source], 0)) for source in sources}
            for key, dd in details.items():  # AR rows: the schedule floor at this run's target step and copy
                if "layer_copies" in dd:
                    dd["schedule_floor_ms"] = mean_schedule_floor(dd["layer_copies"], np.mean(
                        rounds.get("target_step") or [np.nan]), L, report["copy"]["stream_ms"])
            report["table"] = summary_table(sources, rounds, details, ar_keys, args, equal_c)
            report["details"] = saved_details(details)
            report["rounds_done"] = r
            write_text_atomic(out_dir / "bench_spec_engine.md", markdown(report))
        save()

    if args.timeline:  # after the rounds, not part of them: each configuration on its own block path
        def attempt(key, run, *run_args, **run_kwargs):  # a failed configuration is reported, the others go on
            try:
                return run(*run_args, **run_kwargs)
            except Exception as exc:
                report["errors"].append(f"{key} timeline: {exc!r}\n{traceback.format_exc()[-1500:]}")
                return None

        keys = [(key, engines[(trace_of[source], k, name, budget, path)], per_selector[name][0])
                for source, (k, per_selector, _) in sources.items()
                for name, budget, path, key in sd_keys(source, per_selector, args.prefetch, args.block_paths)]
        plain = {key: attempt(key, engine.follow, blocks, first_position=args.first_position,
                              draft_cost_s=args.draft_ms / 1e3)
                 for key, engine, blocks in keys}  # every plain pass before the first profiled one (timeline_pass)
        report["timeline"] = {}
        for key, engine, blocks in keys:
            if plain[key] is None:  # its plain pass failed (reported)
                continue
            line = attempt(key, timeline_pass, engine, blocks, args.first_position, args.draft_ms, plain[key])
            if line is not None:
                report["timeline"][key] = line
        save()
    report["total_s"] = time.time() - t0  # the table and markdown are the last round's
    save()
    md = markdown(report)
    write_text_atomic(out_dir / "bench_spec_engine.md", md)
    print(md, flush=True)
    return 0 if not report["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
