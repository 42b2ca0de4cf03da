"""What the benchmark scripts share: the policies they compare (`policies`, PSR at the paper's operating point),
the paired ratio over rounds (`ratio_ci`), AR runs' schedule floors (`layer_copies`, `mean_schedule_floor`), the device's bandwidth, an expert copy's time and the host's time to
issue copies (`measure_bandwidth`, `measure_copy_ms`, `measure_issue_us`), routing traces and sources tiled over a
target's layers and cut into logit feeds (`read_tiled`, `load_trace_windows`), the row-name prefixes of several
traces (`trace_label`, `trace_prefixes`) and the random context below timed windows (`randomize_caches`)."""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path

import numpy as np
import torch

from specmoe.engines.results import LogitFeed
from specmoe.engines.schedule import policy_copies, schedule_floor
from specmoe.offload import ExpertStore
from specmoe.records.synthetic import is_source
from specmoe.routing import preset, psr_bonus
from specmoe.stats import log_ratio_ttest


def psr(capacity: int, num_experts: int, top_k: int, window: int = 8):
    """PSR at the paper's operating point for C of E (`psr_bonus`), n = 1, pre-gate window `window`."""
    return preset("psr", capacity, top_k, bonus=psr_bonus(capacity, num_experts), insert_budget=1, window=window)


def policies(capacity: int, num_experts: int, top_k: int, window: int = 8) -> dict:
    return {
        "exact_lru": preset("exact_lru", capacity, top_k),
        "exact_prefetch": preset("exact_prefetch", capacity, top_k),
        "cache_prior": preset("cache_prior", capacity, top_k, bonus=0.2),
        "psr": psr(capacity, num_experts, top_k, window),
        "spec_exec": preset("spec_exec", capacity, top_k),
    }


def ratio_ci(a: list[float], b: list[float]) -> dict:
    """a / b over paired rounds (`specmoe.stats.log_ratio_ttest`: paired t on log latency): point, 95% interval,
    p; the interval and p are NaN with one round. Rounds repeat the same work: this interval says how repeatable
    the machine is, `window_ratio`'s how the ratio varies over the workload."""
    if len(a) < 2:
        return {"ratio": float(np.exp(np.mean(np.log(a) - np.log(b)))), "lo": math.nan, "hi": math.nan, "p": math.nan,
                "over": "rounds"}
    r = log_ratio_ttest(a, b)
    return {"ratio": r.ratio, "lo": r.low, "hi": r.high, "p": r.p_value, "over": "rounds"}


class _Timer:
    """Elapsed seconds of a region: CUDA events on a CUDA device, the host clock on the CPU."""

    def __init__(self, device: str, stream=None):
        self.cuda = device == "cuda"
        self.stream = stream

    def __enter__(self):
        if self.cuda:
            self.s, self.e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.s.record(self.stream or torch.cuda.current_stream())
        else:
            self.t = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.e.record(self.stream or torch.cuda.current_stream())
            self.e.synchronize()
            self.seconds = self.s.elapsed_time(self.e) / 1e3
        else:
            self.seconds = time.perf_counter() - self.t
        return False


def layer_copies(engine, results, feeds, name: str, errors: list) -> list | None:
    """Each AR run's demand copies and prefetches per timed token and layer (`policy_copies`: the run's routing
    replayed through its policy and checked against its counts; feeds: the `LogitFeed` each run followed, or None),
    for `mean_schedule_floor`; None (and an error line naming `name`) where a replay disagrees with its run."""
    try:
        return [policy_copies(engine, x, None if feeds is None else feeds[i]) for i, x in enumerate(results)]
    except ValueError as exc:
        errors.append(f"{name} schedule floor: {exc}")
        return None


def mean_schedule_floor(copies: list | None, all_resident_ms: float, num_layers: int, copy_ms: float) -> float | None:
    """The schedule floor (`specmoe.engines.schedule`) in ms per token over the runs' timed tokens: `layer_copies`'
    output priced at the all-resident token's ms per layer and the measured ms per copy."""
    if not copies or not all_resident_ms > 0:
        return None
    return float(np.concatenate([schedule_floor(*x, all_resident_ms / num_layers, copy_ms) for x in copies]).mean())


def measure_bandwidth(device: str, nbytes: int = 2 * 1024**3, reps: int = 10) -> float:
    """Device memory bandwidth, bytes read + written per second, of a large device-to-device copy."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    b = torch.empty_like(a)
    b.copy_(a)
    times = []
    for _ in range(reps):
        with _Timer(device) as t:
            b.copy_(a)
        times.append(t.seconds)
    del a, b
    return 2 * nbytes / float(np.median(times))


def measure_copy_ms(store: ExpertStore, device: str, n: int = 64) -> dict:
    """Host-to-device copy of one expert row from the pinned store: per copy in a stream of n back-to-back
    copies, and alone (median of 20)."""
    dst = torch.empty((n, store.width), dtype=store.dtype, device=device)
    stream = torch.cuda.Stream() if device == "cuda" else None
    ctx = (lambda: torch.cuda.stream(stream)) if stream is not None else contextlib.nullcontext
    srcs = [store.expert(i % store.num_layers, i % store.num_experts) for i in range(n)]
    streams, alone = [], []
    for rep in range(4):
        with ctx(), _Timer(device, stream) as t:
            for i in range(n):
                dst[i].copy_(srcs[i], non_blocking=True)
        if rep:
            streams.append(t.seconds * 1e3 / n)
    for i in range(20):
        with ctx(), _Timer(device, stream) as t:
            dst[i % n].copy_(srcs[(i * 7) % n], non_blocking=True)
        alone.append(t.seconds * 1e3)
    # host time of one non-blocking copy_ call: link idle, and with 4 copies already queued (backpressure)
    idle, backlog = [], []
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for i in range(10):
        sync()
        with ctx():
            t = time.perf_counter()
            dst[0].copy_(srcs[i], non_blocking=True)
            idle.append((time.perf_counter() - t) * 1e6)
            for j in range(1, 5):
                dst[j].copy_(srcs[i + j], non_blocking=True)
            t = time.perf_counter()
            dst[5].copy_(srcs[i + 5], non_blocking=True)
            backlog.append((time.perf_counter() - t) * 1e6)
    sync()
    del dst
    per = float(np.median(streams))
    return {"stream_ms": per, "alone_ms": float(np.median(alone)),
            "stream_GBps": store.expert_bytes / per / 1e6, "expert_MB": store.expert_bytes / 1e6,
            "host_issue_us_idle": float(np.median(idle)), "host_issue_us_after_4_queued": float(np.median(backlog))}


def measure_issue_us(copies, counts=(1, 5), reps: int = 50) -> dict:
    """Host time to issue n expert copies plus one event record through the engine's copy stream, one
    `cudaMemcpyAsync` per copy against one `cudaMemcpyBatchAsync` (median over reps, link idle, the two
    ways interleaved). Empty where the copy stream does not issue through the CUDA runtime."""
    runtime = getattr(copies, "runtime", None)
    if runtime is None or not hasattr(runtime, "copy_many"):  # torch path, or a version without batches
        return {}
    ways = [False, True] if runtime.batched else [False]
    batched, out = runtime.batched, {}
    for n in counts:
        slots = list(range(n))
        experts = [(7 * s + 3) % copies.store.num_experts for s in slots]
        times = {way: [] for way in ways}
        for _ in range(reps):
            for way in ways:
                copies.stream.synchronize()
                runtime.batched = way
                t = time.perf_counter()
                runtime.copy_many(0, slots, experts)
                runtime.record(0)
                times[way].append((time.perf_counter() - t) * 1e6)
        for way in ways:
            out[f"{n} copies, {'one batch call' if way else 'one call each'}"] = float(np.median(times[way]))
    runtime.batched = batched
    copies.stream.synchronize()
    copies.content[0, : max(counts)] = -1  # those slots no longer hold what the copy stream thinks
    return out


def trace_label(spec: str) -> str:
    """A --trace argument as a row-name prefix: a file's stem, or a source spec's name and parameters
    ("olmoe-like:margin=0" -> "olmoe_like_margin_0")."""
    if is_source(spec):
        name, _, rest = spec.partition(":")
        text = "_".join([name] + [x for x in rest.split(",") if x and not x.startswith(("tokens=", "seed="))])
    else:
        text = Path(spec).stem
    return "".join(ch if ch.isalnum() else "_" for ch in text).strip("_")


def trace_prefixes(args) -> list[str]:
    """The row-name prefix of each --trace, in order: "trace_" for one trace, each trace's label (`trace_label`)
    with several. Exits on a --trace-calibration count that is not one per trace, or two traces of one label."""
    traces = args.trace or []
    if len(args.trace_calibration or []) != len(traces):
        raise SystemExit(f"--trace-calibration: one per --trace ({len(traces)}), "
                         f"got {len(args.trace_calibration or [])}")
    prefixes = ["trace_" if len(traces) == 1 else trace_label(spec) + "_" for spec in traces]
    for i, prefix in enumerate(prefixes):
        if prefix in prefixes[:i]:
            raise SystemExit(f"--trace: two traces are labelled {prefix[:-1]!r}")
    return prefixes


def read_tiled(trace_spec, calibration_spec, num_layers: int, num_experts: int, top_k: int):
    """(trace, calibration) of a --trace / --trace-calibration pair (a file or a synthetic source spec each),
    checked against each other and the target's E and K, and tiled over the target's L layers where the traced
    model is shallower (`Trace.tiled`, `Calibration.tiled`)."""
    from specmoe.records.synthetic import read_calibration, read_trace

    trace = read_trace(trace_spec, num_experts=num_experts, top_k=top_k)
    calibration = read_calibration(calibration_spec)
    calibration.check(trace.num_layers, num_experts)
    return trace.tiled(num_layers), calibration.tiled(num_layers)


def load_trace_windows(path: str, calibration_path: str | None, geometry: tuple[int, int, int, int], count: int,
                       length: int) -> dict:
    """The first `count` sequences of a recorded trace, cut to `length` tokens, as engine logit feeds (router and
    pre-gate logits and input tokens), with the traced model's calibration. A trace of a shallower model with the
    same E and K (a trained member of the family standing for a full-size config) is tiled over the L layers,
    and so is its calibration (`Trace.tiled`, `Calibration.tiled`); the info says so."""
    if not calibration_path:
        raise ValueError("--trace needs --trace-calibration (the calibration of the traced model)")
    num_layers, num_experts, top_k, vocab_size = geometry
    rec, calibration = read_tiled(path, calibration_path, num_layers, num_experts, top_k)
    bounds = list(rec.sequence_starts) + [len(rec.token_ids)]
    spans = [(lo, min(hi, lo + length)) for lo, hi in zip(bounds[:-1], bounds[1:]) if hi - lo >= length][:count]
    if len(spans) < count:
        raise ValueError(f"the trace has {len(spans)} sequences of at least {length} tokens; {count} needed")
    traces = [LogitFeed(rec.router_logits[lo:hi].astype(np.float32), rec.pregate_logits[lo:hi].astype(np.float32),
                        rec.token_ids[lo:hi] % vocab_size, rec.fingerprint or None, rec.scoring) for lo, hi in spans]
    # (only the embeddings read the tokens, routing follows the trace: a smaller vocabulary takes them modulo V)
    return {"calibration": calibration, "traces": traces, "windows": [t.tokens for t in traces],
            "info": {"model": rec.model, "sequences": len(spans), "tokens_per_window": length,
                     "tiled_from_layers": rec.info.get("tiled_from_layers")}}


def randomize_caches(engines: dict) -> None:
    """Each engine's KV cache (and recurrent state) filled with seeded random values (`randomize_cache`): the
    context below positions timed from `first_position` on."""
    with torch.no_grad():
        for i, engine in enumerate(engines.values()):
            engine.decoder.randomize_cache(seed=i)
