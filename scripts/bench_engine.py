"""Benchmark of the AR offloading engine on one CUDA GPU, at the context lengths of real use.

Full-size OLMoE-1B-7B config, bf16, seeded random weights drawn on the device, a static KV cache of
--max-seq-len positions (default 4096); teacher-forced windows of random tokens: a prompt of --prompt tokens
(default 256, decoded through the same path but not timed) then --tokens timed tokens (random weights route
without temporal locality, so copy counts are those of a worst case, not of a trained model).
Configurations run in one process, rounds interleaved (A B C ... A B C ...):
- all experts resident (C = E = 64), exact routing: this engine (routing on the device, one launch per token)
  vs the same engine routing on the host (`all_resident_host_routing`, `EngineConfig(device_routing="off")`:
  one host round trip per layer), vs transformers' own generate on the same weights (eager and batched_mm
  experts), and vs the memory-bandwidth floor (bytes read per token / measured device bandwidth);
- C = 32 and C = 16: exact LRU, exact + A priority + prefetch (exact_prefetch), Cache-Prior lambda 0.2, PSR
  lambda 0.3 (C=32) / 0.25 (C=16) n=1, speculative execution; each with the policy on the device (`C32_psr`,
  `EngineConfig(policy_device="on")`: the logical cache and its copy kernels in one graph per token,
  `specmoe.engines.device_policy`) and on the host (`C32_psr_host_policy`, `policy_device="off"`: a host
  round trip per layer), in the same rounds, with the ratio host policy / device policy (--policy-paths);
- with --trace (a `specmoe trace` of a trained model with the same L, E, K, or a synthetic routing source) and
  --trace-calibration, the same policies again, on both paths, following the trace's router and pre-gate logits
  and tokens (realistic copy patterns on the full-size random weights): rows `trace_C32_psr` and
  `trace_C32_psr_host_policy` (with several traces `LABEL_C32_psr`, `LABEL_C32_psr_host_policy`).
Reported per configuration: mean and p99 ms/token, copies per token by class, engine efficiency =
max(all-resident ms, transferred copies x measured copy ms) / ms, the schedule floor (`specmoe.engines.schedule`:
the all-resident compute plus the waits that copies leave at best when each is issued as the policy decides it,
demand copies at their layer, prefetches one layer ahead; from the round-1 routing replayed per layer) and the
row's ms over it, ratios with 95% intervals (paired t-test on log latency over rounds), and from separate passes
(not in the rounds) the host gap per layer with instrumentation and the compute-only time with copies skipped
(trace-following the round-1 routing); the
instrumented pass runs the host policy (instrumentation is a host-path feature), also for device-policy rows; the
copies-skipped pass runs the row's own path.
The policy cell says which path the timed rounds ran (device, device_policy or host).

Then a sweep of decode position (--positions, default 100 500 1000 2000 4000) for all-resident and PSR at
each capacity, rounds interleaved: --sweep-tokens timed tokens starting at each position over a KV cache
filled with random values below it (`teacher_forced(first_position=)`: attention costs what the written
context costs, whatever its values), with the ratio of each position's time to the first position's.
`--max-seq-len 128 --prompt 0 --positions` (no sweep) reproduces the earlier short-cache setting.
`--first-position P` puts the timed windows at positions P onwards over random keys and values below them (attention
at a real context length; routing unchanged).
`--configs NAME ...` runs a subset (all_resident always); the names come from the arguments and the named config's
E and K alone (`config_rows`), so an unknown name exits at once with the known list, before any model is built;
only the engines the subset (and the position sweep) run are built (`needed_engines`).

    PYTHONPATH=. python3 scripts/bench_engine.py --out runs/bench_engine
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
from bench_common import (layer_copies, load_trace_windows, measure_bandwidth, measure_copy_ms,  # noqa: E402
                          mean_schedule_floor, measure_issue_us, policies, psr, randomize_caches, ratio_ci,
                          trace_prefixes)

from specmoe.engines import EngineConfig, build_engine  # noqa: E402
from specmoe.engines.helpers import (calibration_from_engine, random_model_on_device,  # noqa: E402
                                     weight_bytes_per_token)
from specmoe.engines.results import LogitFeed  # noqa: E402
from specmoe.files import write_text_atomic  # noqa: E402
from specmoe.models import adapter_for, named_config  # noqa: E402
from specmoe.offload import ExpertResidency, ExpertStore  # noqa: E402
from specmoe.routing import Calibration, preset  # noqa: E402
from specmoe.stats import unit_ratio  # noqa: E402


def window_ratio(a: dict, b: dict) -> dict:
    """a / b, two configurations' ms per token over the same windows, with a 95% paired bootstrap interval over
    the windows (`specmoe.stats.unit_ratio`; each window's time a mean over the interleaved rounds), and the
    paired t over rounds beside it (`ratio_ci`). a and b: {"rounds": [ms per round], "windows": [[window ms sum
    per window] per round], "tokens": [timed tokens per window]}. Falls back to the rounds' interval with one
    window."""
    rounds = ratio_ci(a["rounds"], b["rounds"])
    if len(a["tokens"]) < 2 or a["tokens"] != b["tokens"]:
        return rounds
    r = unit_ratio(np.mean(a["windows"], axis=0), a["tokens"], np.mean(b["windows"], axis=0), b["tokens"])
    return {"ratio": r.estimate, "lo": r.low, "hi": r.high, "p": math.nan, "over": f"{len(a['tokens'])} windows",
            "rounds": rounds}


def time_hf_generate(model, prompt: np.ndarray, new: int, impl: str) -> float:
    """transformers' generate, greedy: ms per decoded token = (t(new) - t(1)) / (new - 1)."""
    model.set_experts_implementation(impl)
    device = next(model.parameters()).device
    ids = torch.as_tensor(prompt, device=device)[None]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def run(n):
        sync()
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        sync()
        return time.perf_counter() - t

    run(4)
    run(4)
    return (run(new) - run(1)) / (new - 1) * 1e3


def row_name(prefix: str, capacity: int, policy: str, host_policy: bool = False) -> str:
    """A C < E row's name: "C32_psr", "trace_C32_psr", "C32_psr_host_policy" (the policy on the host)."""
    return f"{prefix}C{capacity}_{policy}" + ("_host_policy" if host_policy else "")


def config_rows(args, num_experts: int, top_k: int) -> dict[str, list]:
    """Every configuration of the timed rounds from the arguments alone (no model): {row-name prefix: [(name,
    engine key, policy)]}, prefix "" for the random-token rows (all-resident with device and host routing, then
    each capacity's policies) and one per --trace (`trace_prefixes`) for its trace-following policy rows; per
    capacity and policy (`policies`) the device path's row, then the host path's (--policy-paths). E and K are
    the named config's (`adapter_for(named_config(...))`), so --configs is checked before a model is built."""
    E, K = num_experts, top_k

    def policy_rows(prefix: str) -> list:
        rows = []
        for c in args.capacities:
            for name, pol in policies(c, E, K, args.psr_window).items():
                if "device" in args.policy_paths:
                    rows.append((row_name(prefix, c, name), c, pol))
                if "host" in args.policy_paths:
                    rows.append((row_name(prefix, c, name, host_policy=True), f"{c}_host_policy", pol))
        return rows

    rows = {"": [("all_resident", E, preset("exact_lru", E, K)),
                 ("all_resident_host_routing", "host", preset("exact_lru", E, K))] + policy_rows("")}
    rows.update({prefix: policy_rows(prefix) for prefix in trace_prefixes(args)})
    return rows


def needed_engines(rows: dict, args, num_experts: int) -> set:
    """The engines (keys as in `config_rows`: E, "host", C, "C_host_policy") that the configurations --configs
    selects (all without it) and the position sweep (--positions: E, "host", every C) run; E always (the
    calibration and the reference). A full-size model's engines each hold decode buffers and tuning scratch, so
    only these are built."""
    keys = {num_experts}
    for group in rows.values():
        keys |= {c for name, c, _ in group if not args.configs or name in args.configs}
    if args.positions:
        keys |= {"host", *args.capacities}
    return keys


def check_configs(wanted, rows: dict) -> None:
    """Exit with the unknown names and the known list where --configs names a configuration `config_rows` does
    not make."""
    known = [name for group in rows.values() for name, _, _ in group]
    unknown = set(wanted or []) - set(known)
    if unknown:
        raise SystemExit(f"unknown configurations {sorted(unknown)}; known: {known}")


def run_windows(engine, windows, trace=None, prompt: int = 0, first_position: int = 0) -> dict:
    ms, results = [], []
    for i, w in enumerate(windows):
        r = engine.teacher_forced(w, prompt_len=prompt, feed=None if trace is None else trace[i],
                                  first_position=first_position)
        ms.append(r.ms[r.timed])
        results.append(r)
    summaries = [r.summary() for r in results]
    n = sum(s["tokens"] for s in summaries)
    copies = {k: sum(s["copies_per_token"][k] * s["tokens"] for s in summaries) / n
              for k in summaries[0]["copies_per_token"]}
    out = {"ms_tokens": np.concatenate(ms), "copies_per_token": copies, "results": results,
           "window_ms": [float(x.sum()) for x in ms], "window_tokens": [int(x.size) for x in ms],
           "host_us_per_layer": float(np.mean([s["host_us_per_layer"] for s in summaries])),
           "host_us_per_layer_parts": {k: float(np.mean([s["host_us_per_layer_parts"][k] for s in summaries]))
                                       for k in summaries[0]["host_us_per_layer_parts"]}}
    for key in ("gpu_gap_us_per_layer", "gap_without_wait_us_per_layer", "exposed_wait_ms_per_token"):
        if key in summaries[0]:
            out[key] = float(np.mean([s[key] for s in summaries]))
    return out


def position_sweep(engines: dict, calibration, args, top_k: int, vocab_size: int, report: dict) -> dict:
    """Decode time by position: all-resident and PSR at each capacity, --sweep-tokens timed tokens from each
    position over a KV cache of random values, rounds interleaved; ratios to the first position (paired t on log
    latency over rounds) and the all-resident bandwidth floor at each position."""
    E = max(c for c in engines if isinstance(c, int))
    positions = [p for p in args.positions if p + args.sweep_tokens <= args.max_seq_len]
    if len(positions) < len(args.positions):
        report["errors"].append(f"sweep positions beyond --max-seq-len - --sweep-tokens skipped: "
                                f"{sorted(set(args.positions) - set(positions))}")
    configs = [("all_resident", E, preset("exact_lru", E, top_k)),
               ("all_resident_host_routing", "host", preset("exact_lru", E, top_k))]
    configs += [(row_name("", c, "psr"), c, psr(c, E, top_k, args.psr_window)) for c in args.capacities]
    randomize_caches(engines)  # the context below each window: random keys and values
    rng = np.random.default_rng(300)
    tokens = rng.integers(0, vocab_size, args.sweep_tokens)
    rounds = {(name, p): [] for name, _, _ in configs for p in positions}
    for r in range(args.rounds + 1):  # round 0 warms up every (configuration, position)
        for p in positions:
            for name, c, pol in configs:
                try:
                    engines[c].configure(policy=pol, calibration=calibration, instrument=False,
                                         skip_copies=False)
                    res = run_windows(engines[c], [tokens], first_position=p)
                    if r:
                        rounds[(name, p)].append(float(res["ms_tokens"].mean()))
                except Exception as exc:
                    report["errors"].append(f"sweep {name} at {p}: {exc!r}\n{traceback.format_exc()[-1500:]}")
        if r:
            print(f"sweep round {r}:", {f"{n}@{p}": round(v[-1], 3) for (n, p), v in rounds.items() if v}, flush=True)
    floor = {p: weight_bytes_per_token(engines[E], p) / report["bandwidth_Bps"] * 1e3 for p in positions}
    out = {"positions": positions, "tokens": args.sweep_tokens, "floor_ms": floor, "rows": {}}
    for name, _, pol in configs:
        base = rounds[(name, positions[0])]
        out["rows"][name] = {"policy": pol.name, "ms": {p: float(np.mean(rounds[(name, p)])) if rounds[(name, p)]
                                                        else math.nan for p in positions},
                             "rounds_ms": {p: rounds[(name, p)] for p in positions},
                             "ratio_to_first": {p: ratio_ci(rounds[(name, p)], base) for p in positions[1:]
                                                if rounds[(name, p)] and len(rounds[(name, p)]) == len(base)}}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--windows", type=int, default=4, help="teacher-forced windows: the units of the ratios' intervals")
    ap.add_argument("--tokens", type=int, default=64, help="timed tokens per teacher-forced window")
    ap.add_argument("--prompt", type=int, default=256, help="untimed prompt tokens before each window's timed ones")
    ap.add_argument("--max-seq-len", type=int, default=4096, help="positions of the static KV cache")
    ap.add_argument("--first-position", type=int, default=0,
                    help="the timed windows (prompt and tokens) sit at positions from this one, over a KV cache of "
                    "seeded random values below it (attention at that context; routing is unchanged: each window "
                    "starts from the warm set and follows its trace or router), e.g. 2048")
    ap.add_argument("--attention", default="auto", help="EngineConfig.attention: auto, split_kv, sdpa, flash_attn")
    ap.add_argument("--positions", type=int, nargs="*", default=[100, 500, 1000, 2000, 4000],
                    help="decode positions of the sweep (none: no sweep)")
    ap.add_argument("--sweep-tokens", type=int, default=32, help="timed tokens per window of the sweep")
    ap.add_argument("--calib-windows", type=int, default=4)
    ap.add_argument("--hf-tokens", type=int, default=32)
    ap.add_argument("--warmup-tokens", type=int, default=16)
    ap.add_argument("--capacities", type=int, nargs="+", default=[32, 16])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="olmoe-1b-7b", help="named config of specmoe.models")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run of the script's logic")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--trace", nargs="+", help="routing traces of a trained model with the same L, E, K (`specmoe trace`) or a "
                    "synthetic routing source NAME[:key=value,...] (docs/routing-source.md): "
                    "adds trace-following rows (router and pre-gate logits and tokens from the trace); several traces give "
                    "several sets of rows, named by each trace's label (one trace: trace_C32_psr, ...)")
    ap.add_argument("--trace-calibration", nargs="+", help="one per --trace: calibration file of the traced model (needed with --trace; for a "
                    "synthetic routing source such as olmoe-like, its name)")
    ap.add_argument("--configs", nargs="+", help="run only these configurations (names as in the table; "
                    "all_resident is always run, efficiencies need it); checked before any model is built, an "
                    "unknown name exits with the known ones")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers' generate")
    ap.add_argument("--psr-window", type=int, default=8, help="PSR's pre-gate window w (the paper's Moonlight: 4)")
    ap.add_argument("--policy-paths", nargs="+", choices=("device", "host"), default=["device", "host"],
                    help="C < E rows with the policy on the device (C32_psr) and/or on the host (C32_psr_host_policy)")
    ap.add_argument("--unbatched-copies", action="store_true",
                    help="issue one cudaMemcpyAsync per copy even where cudaMemcpyBatchAsync works (A/B runs)")
    args = ap.parse_args(argv)
    geometry = adapter_for(named_config(args.model))  # E and K of the named config, no weights built
    rows = config_rows(args, geometry.num_experts, geometry.top_k)
    check_configs(args.configs, rows)  # a typo exits here, not after minutes of model and engine setup
    window = args.prompt + args.tokens  # positions per teacher-forced window
    end = args.first_position + window
    if args.first_position < 0 or end > args.max_seq_len:
        raise SystemExit(f"--first-position + --prompt + --tokens = {end} positions do not fit --max-seq-len "
                         f"{args.max_seq_len} (or --first-position is negative)")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {"command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": {"gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu", "python": platform.python_version(),
                          "torch": torch.__version__, "cuda": torch.version.cuda,
                          "transformers": __import__("transformers").__version__},
              "args": vars(args), "errors": []}
    try:
        import triton

        report["machine"]["triton"] = triton.__version__
    except ImportError:
        pass

    def save():
        write_text_atomic(out_dir / "bench_engine.json", json.dumps(report, indent=1, default=float))

    t0 = time.time()
    dtype = getattr(torch, args.dtype)
    model, adapter = random_model_on_device(args.model, args.seed, dtype, args.device)
    store = ExpertStore.from_model(model, adapter)
    report["host_store_GB"] = store.num_layers * store.num_experts * store.expert_bytes / 1e9
    report["setup_s"] = {"model_and_store": time.time() - t0}
    report["bandwidth_Bps"] = measure_bandwidth(args.device, 2 * 1024**3 if args.device == "cuda" else 64 * 1024**2)
    report["copy"] = measure_copy_ms(store, args.device)
    print("bandwidth GB/s", report["bandwidth_Bps"] / 1e9, "copy", report["copy"], flush=True)
    save()

    L, E, K, V = adapter.num_moe_layers, adapter.num_experts, adapter.top_k, adapter.vocab_size
    cfg = EngineConfig(max_seq_len=args.max_seq_len, attention=args.attention)  # the defaults
    # the C < E rows' device path, asked for explicitly ("auto", the default, keeps PSR on the host)
    cfg_device = EngineConfig(max_seq_len=args.max_seq_len, attention=args.attention, policy_device="on")
    unit = ExpertResidency(store, E, args.device)  # one unit of E slots for every engine (a full-size model's
    # slots fit the device once, not once per engine); each engine reloads its warm set when it runs
    engines = {E: build_engine(model, preset("exact_lru", E, K), Calibration.uniform(L, E, V), cfg, residency=unit)}
    rng = np.random.default_rng(100)
    calib = calibration_from_engine(engines[E], [rng.integers(0, V, args.tokens) for _ in range(args.calib_windows)],
                                    {"model": f"{args.model} random (device draws) seed {args.seed}",
                                     "text": "uniform random tokens, seed 100"})
    engines[E].configure(calibration=calib)
    needed = needed_engines(rows, args, E)
    for c in args.capacities:
        if c in needed:
            engines[c] = build_engine(model, preset("exact_lru", c, K), calib, cfg_device, residency=unit)
        if f"{c}_host_policy" in needed:  # the same capacity with the policy on the host (a round trip per layer)
            engines[f"{c}_host_policy"] = build_engine(
                model, preset("exact_lru", c, K), calib, EngineConfig(max_seq_len=args.max_seq_len,
                                                                      attention=args.attention, policy_device="off"),
                residency=unit)
    if "host" in needed:
        engines["host"] = build_engine(model, preset("exact_lru", E, K), calib,  # all resident, routed on the host
                                       EngineConfig(max_seq_len=args.max_seq_len, attention=args.attention,
                                                    device_routing="off"), residency=unit)
    report["engine_notes"] = {str(c): e.notes for c, e in engines.items()}
    report["kernels"] = engines[E].kernels
    if args.unbatched_copies:
        for engine in engines.values():
            if getattr(engine.copies, "runtime", None) is not None:
                engine.copies.runtime.batched, engine.copies.runtime.note = False, "--unbatched-copies"
    report["copy_issue_path"] = engines[E].copies.issue_path
    offloaded = [c for c in args.capacities if c in engines]
    if engines[E].copies.cuda and offloaded:
        report["issue_us"] = measure_issue_us(engines[min(offloaded)].copies)
        engines[min(offloaded)].reset()  # re-copies the slots the measurement overwrote
        print("host µs to issue copies:", report["issue_us"], flush=True)
    report["setup_s"]["engines"] = time.time() - t0
    print("engines ready", report["engine_notes"], flush=True)
    save()

    rng = np.random.default_rng(200)
    windows = [rng.integers(0, V, window) for _ in range(args.windows)]
    # per configuration: the calibration, the windows and the trace each window follows (None: own router)
    configs, setting, prefixes = [], {}, list(rows)
    traces = dict(zip(prefixes[1:], zip(args.trace or [], args.trace_calibration or [])))
    if traces:
        report["traces"] = {}
    for prefix, group in rows.items():
        if prefix:
            spec, calibration_spec = traces[prefix]
            traced = load_trace_windows(spec, calibration_spec, (L, E, K, V), args.windows, window)
            report["traces"][prefix] = {"file": spec, "calibration": calibration_spec, **traced["info"]}
            feeds = (traced["calibration"], traced["windows"], traced["traces"])
        else:
            feeds = (calib, windows, None)
        configs += group
        setting.update({name: feeds for name, _, _ in group})
    if args.configs:
        configs = [x for x in configs if x[0] == "all_resident" or x[0] in args.configs]
    hf_impls = [] if args.no_hf else ["eager", "batched_mm"]
    rounds: dict[str, list] = {name: [] for name, _, _ in configs}
    rounds.update({f"hf_{impl}": [] for impl in hf_impls})
    details: dict[str, dict] = {}
    if args.first_position:  # the context below the windows: random keys and values (never overwritten below it)
        randomize_caches(engines)
    for name, c, pol in configs:  # warm-up (first calls, compilation): not timed
        try:
            cal, wins, tr = setting[name]
            engines[c].configure(policy=pol, calibration=cal)
            engines[c].teacher_forced(wins[0][: args.warmup_tokens], feed=None if tr is None else tr[0],  # noqa
                                      first_position=args.first_position)
        except Exception as exc:
            report["errors"].append(f"{name} warm-up: {exc!r}\n{traceback.format_exc()[-1500:]}")
    for r in range(args.rounds):
        for name, c, pol in configs:
            try:
                engine = engines[c]
                cal, wins, tr = setting[name]
                engine.configure(policy=pol, calibration=cal, instrument=False, skip_copies=False)
                res = run_windows(engine, wins, trace=tr, prompt=args.prompt, first_position=args.first_position)
                rounds[name].append(float(res["ms_tokens"].mean()))
                d = details.setdefault(name, {"ms_tokens": [], "policy": pol.name, "capacity": c, "windows": [],
                                              "tokens": res["window_tokens"],
                                              "routing": res["results"][0].info["routing"],
                                              "host_policy_why": res["results"][0].info.get("host_policy_why")})
                d["ms_tokens"].append(res["ms_tokens"])
                d["windows"].append(res["window_ms"])
                d.setdefault("copies_per_token_rounds", []).append(res["copies_per_token"])
                d.setdefault("host_us_per_layer_rounds", []).append(res["host_us_per_layer"])
                d.setdefault("host_parts_rounds", []).append(res["host_us_per_layer_parts"])
                if r == 0:
                    d["trace"] = [LogitFeed.of(x) for x in res["results"]]
                    if c != E:
                        d["layer_copies"] = layer_copies(engine, res["results"], tr, name, report["errors"])
            except Exception as exc:
                report["errors"].append(f"{name} round {r}: {exc!r}\n{traceback.format_exc()[-1500:]}")
        for impl in hf_impls:
            try:
                rounds[f"hf_{impl}"].append(time_hf_generate(model, windows[0][:16], args.hf_tokens, impl))
            except Exception as exc:
                report["errors"].append(f"hf {impl} round {r}: {exc!r}")
        print(f"round {r} ({time.time() - t0:.0f} s):", {k: (round(v[-1], 3) if v else None) for k, v in rounds.items()}, flush=True)
        report["rounds_ms"] = rounds
        report["rounds_done"] = r + 1  # the table and markdown of the rounds so far (a run cut short keeps them)
        summarize(report, rounds, details, configs, engines[E], args, prefixes, hf_impls, E, K)
        write_text_atomic(out_dir / "bench_engine.md", markdown(report))
        save()

    # separate passes, not part of the rounds: instrumented (host gap) and copies skipped (compute only)
    for name, c, pol in configs:
        if name not in details:
            continue
        engine = engines[c]
        try:
            cal, wins, tr = setting[name]
            engine.configure(policy=pol, calibration=cal, instrument=True, skip_copies=False)
            inst = run_windows(engine, wins[:1], trace=None if tr is None else tr[:1], prompt=args.prompt,
                               first_position=args.first_position)
            details[name]["instrumented"] = {k: inst[k] for k in ("gpu_gap_us_per_layer",
                                             "gap_without_wait_us_per_layer", "exposed_wait_ms_per_token",
                                             "host_us_per_layer") if k in inst}
            details[name]["instrumented"]["ms_mean"] = float(inst["ms_tokens"].mean())
            engine.configure(instrument=False, skip_copies=True)
            # the routing the rounds recorded, so that the same copies are skipped; every expert resident there
            # are none, and a recorded feed would move its routing to the host: it follows its own input
            feed = tr if c == E else details[name]["trace"]
            skip = run_windows(engine, wins, trace=feed, prompt=args.prompt, first_position=args.first_position)
            details[name]["copies_skipped_ms"] = float(skip["ms_tokens"].mean())
        except Exception as exc:
            report["errors"].append(f"{name} extra passes: {exc!r}\n{traceback.format_exc()[-1500:]}")
        finally:
            engine.configure(instrument=False, skip_copies=False)

    if args.positions:
        report["sweep"] = position_sweep(engines, calib, args, K, V, report)
        save()

    summarize(report, rounds, details, configs, engines[E], args, prefixes, hf_impls, E, K)
    report["total_s"] = time.time() - t0
    save()
    md = markdown(report)
    write_text_atomic(out_dir / "bench_engine.md", md)
    print(md, flush=True)
    return 0 if not report["errors"] else 1


def summarize(report: dict, rounds: dict, details: dict, configs, resident_engine, args, prefixes, hf_impls,
              E: int, K: int) -> None:
    """The report's table (per configuration: ms mean / p50 / p99, copies by class, link floor, efficiency, host
    time, and the instrumented and copies-skipped passes where they ran) and its ratios with intervals, from the
    rounds measured so far. Called after every round, so a run cut short keeps its table."""
    copy_ms = report["copy"]["stream_ms"]
    resident_ms = float(np.mean(rounds["all_resident"])) if rounds["all_resident"] else math.nan
    floor_bytes = weight_bytes_per_token(resident_engine, args.first_position + args.prompt + args.tokens // 2)
    report["bandwidth_floor_ms"] = floor_bytes / report["bandwidth_Bps"] * 1e3
    report["bytes_per_token"] = floor_bytes
    table = {}
    for name, c, pol in configs:
        if name not in details or not rounds[name]:
            continue
        d = details[name]
        ms_all = np.concatenate(d["ms_tokens"])
        copies = d["copies_per_token_rounds"][0]
        logical = ("demand", "prefetch", "prefetch_unused")  # timing-independent; in time / late / dropped are not
        same = all(all(x[k] == copies[k] for k in logical) for x in d["copies_per_token_rounds"])
        ms = float(np.mean(rounds[name]))
        link = copies["issued"] * copy_ms
        row = {"policy": d["policy"], "C": c, "routing": d["routing"],
               "host_policy_why": d["host_policy_why"], "ms_mean": ms, "ms_p50": float(np.percentile(ms_all, 50)),
               "ms_p99": float(np.percentile(ms_all, 99)), "rounds_ms": rounds[name],
               "copies_per_token": copies, "logical_copies_identical_across_rounds": same,
               "copies_per_token_rounds": d["copies_per_token_rounds"],
               "link_floor_ms": link, "efficiency": max(resident_ms, link) / ms,
               "schedule_floor_ms": mean_schedule_floor(d.get("layer_copies"), resident_ms,
                                                        resident_engine.num_layers, copy_ms),
               "host_us_per_layer": float(np.mean(d["host_us_per_layer_rounds"])),
               "host_us_per_layer_parts": {k: float(np.mean([x[k] for x in d["host_parts_rounds"]]))
                                           for k in d["host_parts_rounds"][0]},
               "instrumented": d.get("instrumented"), "copies_skipped_ms": d.get("copies_skipped_ms")}
        row["over_schedule_floor"] = None if row["schedule_floor_ms"] is None else ms / row["schedule_floor_ms"]
        table[name] = row
    ratios = {}

    def units(name):
        d = details.get(name)
        if not d or len(d["windows"]) != len(rounds[name]):
            return None
        return {"rounds": rounds[name], "windows": d["windows"], "tokens": d["tokens"]}

    if units("all_resident_host_routing") and units("all_resident"):
        ratios["all-resident: host routing / device routing"] = window_ratio(units("all_resident_host_routing"),
                                                                             units("all_resident"))
    for impl in hf_impls:
        if rounds[f"hf_{impl}"] and rounds["all_resident"]:
            ratios[f"hf_{impl} / engine all-resident"] = ratio_ci(rounds[f"hf_{impl}"], rounds["all_resident"])
    ratios.update(policy_ratios(units, prefixes, args.capacities, list(policies(E, E, K))))
    report["table"] = table
    report["ratios"] = ratios
    report["hf_ms"] = {impl: float(np.mean(rounds[f"hf_{impl}"])) for impl in hf_impls if rounds[f"hf_{impl}"]}


def policy_ratios(units, prefixes: list[str], capacities: list[int], names: list[str]) -> dict:
    """The C < E rows' ratios (`window_ratio`) per row prefix and capacity: each policy's host path over its device
    path, and each policy over PSR on each path (the host path's keys end in "(host policy)"), wherever both rows
    ran with the same rounds. units(name): a row's `window_ratio` input, None where it did not run."""
    ratios = {}

    def add(key, a, b):
        if a and b and len(a["rounds"]) == len(b["rounds"]):
            ratios[key] = window_ratio(a, b)

    for prefix in prefixes:
        for c in capacities:
            for name in names:
                add(f"{prefix}C{c}: {name} host policy / device policy",
                    units(row_name(prefix, c, name, host_policy=True)), units(row_name(prefix, c, name)))
    for prefix in prefixes:
        for c in capacities:
            for host_policy in (False, True):
                for base in (n for n in names if n != "psr"):
                    add(f"{prefix}C{c}: {base} / psr" + (" (host policy)" if host_policy else ""),
                        units(row_name(prefix, c, base, host_policy)), units(row_name(prefix, c, "psr", host_policy)))
    return ratios


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = [f"# AR engine benchmark ({report['date']})", "",
             f"{m['gpu']}; torch {m['torch']} (CUDA {m['cuda']}), transformers {m['transformers']}, "
             f"triton {m.get('triton', '-')}, Python {m['python']}. Command: `{report['command']}`. Rounds measured: "
             f"{report.get('rounds_done', 0)} of {report['args']['rounds']}.", "",
             f"Device bandwidth (D2D copy, read+write): {report['bandwidth_Bps'] / 1e9:.0f} GB/s. Expert copy "
             f"({report['copy']['expert_MB']:.1f} MB, pinned host to device): {report['copy']['stream_ms']:.3f} ms "
             f"each in a stream ({report['copy']['stream_GBps']:.1f} GB/s), {report['copy']['alone_ms']:.3f} ms alone. "
             f"Bytes read per token with all experts resident: {report['bytes_per_token'] / 1e9:.2f} GB -> "
             f"bandwidth floor {report['bandwidth_floor_ms']:.3f} ms/token. Engine copies issued through: "
             f"{report.get('copy_issue_path')}." + (" Host µs to issue copies + one event record: " + ", ".join(
                 f"{k} {v:.1f}" for k, v in report["issue_us"].items()) + "." if report.get("issue_us") else ""), "",
             "Random weights route without temporal locality: copy counts are far above a trained model's. "
             "Rows trace_* (or LABEL_*) follow the router and pre-gate logits (and tokens) of a trace"
             + ("".join(f"; {p[:-1]}: {t['model']}" for p, t in report.get("traces", {}).items())) + ".", "",
             "| config | policy | mean ms | p50 | p99 | copies/token (demand / pf in time / late / unused / "
             "transferred) | link floor ms | efficiency | schedule floor ms (ms / floor) | host µs/layer (routing / copy "
             "issue / copy checks) | GPU gap µs/layer, of it copy wait (instr.) | compute-only ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, row in report["table"].items():
        cp = row["copies_per_token"]
        inst = row.get("instrumented") or {}
        gap = inst.get("gpu_gap_us_per_layer")
        if gap is not None:
            gap = f"{gap:.1f}, {gap - inst['gap_without_wait_us_per_layer']:.1f}"
        skip = row.get("copies_skipped_ms")
        floor = row.get("schedule_floor_ms")
        floor = "-" if floor is None else f"{floor:.2f} ({row['over_schedule_floor']:.2f})"
        lines.append(
            f"| {name} | {row['policy']} ({row.get('routing', '-')}) | {row['ms_mean']:.2f} | {row['ms_p50']:.2f} | {row['ms_p99']:.2f} | "
            f"{cp['demand']:.1f} / {cp['prefetch_in_time']:.1f} / {cp['prefetch_late']:.1f} / "
            f"{cp['prefetch_unused']:.1f} / {cp['issued']:.1f} | {row['link_floor_ms']:.2f} | "
            f"{row['efficiency']:.2f} | {floor} | {row['host_us_per_layer']:.1f} ("
            + " / ".join(f"{v:.1f}" for v in row["host_us_per_layer_parts"].values()) + ") | "
            f"{'-' if gap is None else gap} | {'-' if skip is None else f'{skip:.2f}'} |")
    lines += ["", "| ratio | point | 95% interval | over | over rounds (paired t) |", "|---|---|---|---|---|"]
    for name, r in report["ratios"].items():
        t = r.get("rounds", r)
        lines.append(f"| {name} | {r['ratio']:.3f} | {r['lo']:.3f}-{r['hi']:.3f} | {r['over']} | "
                     f"{t['lo']:.3f}-{t['hi']:.3f} |")
    sweep = report.get("sweep")
    if sweep:
        pos = sweep["positions"]
        lines += ["", f"Decode position sweep ({sweep['tokens']} timed tokens per position; ms/token, and the ratio "
                  f"to position {pos[0]} with its 95% interval):", "",
                  "| config | " + " | ".join(str(p) for p in pos) + " |", "|---|" + "---|" * len(pos)]
        for name, row in sweep["rows"].items():
            cells = [f"{row['ms'][pos[0]]:.3f}"]
            for p in pos[1:]:
                r = row["ratio_to_first"].get(p)
                cells.append(f"{row['ms'][p]:.3f}" + ("" if r is None else
                             f" ({r['ratio']:.3f}, {r['lo']:.3f}-{r['hi']:.3f})"))
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("| bandwidth floor, all resident | " + " | ".join(f"{sweep['floor_ms'][p]:.3f}" for p in pos) + " |")
    if report.get("hf_ms"):
        lines += ["", "transformers generate ms/token: " + ", ".join(f"{k} {v:.2f}" for k, v in report["hf_ms"].items())]
    if report["errors"]:
        lines += ["", "Errors:"] + [f"- {e.splitlines()[0]}" for e in report["errors"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
