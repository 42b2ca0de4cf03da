"""The crossover map: where Cache-Prior, PSR, exact routing with prefetch and block-selected speculative decoding
win in copies per token (CPU replay) and in a latency proxy, as the synthetic routing source's parameters move.

For every point of a grid over `SourceParams` (persistence: consecutive-token reuse; pre-gate noise: pre-gate
recall; skew: load skew; margin: the top-K margin over Delta; the other parameters at the "olmoe-like" source's
values), a draw of the source (`synthetic_trace`) with its held-out calibration (`synthetic_calibration`) is
replayed at OLMoE's geometry (E 64, K 8, L 16) and each capacity C:

- AR policies (`specmoe.routing.statistics.replay_policies`, the paper's settings): exact LRU, Cache-Prior lambda
  0.2 (LRU), PSR n 1 at the paper's lambda for C (0.3 at C = 32, 0.25 at C = 16; A priority; demand and total
  copies), exact routing with prefetch (`exact_prefetch`, total copies);
- block-selected SD (`specmoe.replay.replay_block_selection`, what `specmoe replay-sd` runs): synthetic blocks
  (`synthetic_blocks`) over the same draw at k drafts and a fixed tau (geometric acceptance, the same for every
  point: open-loop), the `acceptmoe` selector's preset (and `exact` verification) with a pool of P = C.

The latency proxy (not a measurement) prices those copies with H200 figures of full-size OLMoE-1B-7B quoted in
BENCHMARKS.md (`H200`, below): AR ms/token = all-resident ms + copies x the policy's measured ms per copy above
the all-resident time; SD ms per committed token = (verification compute per block + drafting per block) / tau
+ copies x the measured exposed ms per copy. The per-copy costs carry each policy's overlap (PSR's prefetches
hide part of a copy); they were measured on random routing (AR, at short context) and at three cells of this
map (SD, its own configuration at 2k context, pooled), and are assumed to hold over the whole grid.
Beside it, each AR policy's schedule floor (`<policy>_floor_ms`; `specmoe.routing.schedule`): what its copies
leave at best per token when each is issued as the policy decides it (demand copies at their layer, prefetches one
layer ahead) over one link, at the all-resident compute and copy time the H200 measured at 2k context (`FLOOR`);
`win_floor`, the AR policy with the lowest floor, and Cache-Prior / PSR in floors. It prices the decisions, not
an engine: no fitted per-copy cost.

    python3 scripts/crossover_map.py [--out runs/crossover] [--tokens 2048] [--capacities 32,16]
        [--measured runs/map/bench_engine.json ...] [--table runs/crossover/crossover.csv]

Writes crossover.csv (one row per point and C) and crossover_C{C}.png (per C: which method wins in copies and
in the proxy, panels over skew and margin, persistence against pre-gate noise; the olmoe-like point starred,
the family's nearest point by its measured statistics circled, by its copies squared). `--measured` places on
the proxy's panels what the engine measured following synthetic sources (`scripts/bench_engine.py` and
`scripts/bench_spec_engine.py` json files, or an earlier crossover_measured.csv; `measured_points`): each cell
framed in the fastest measured method's colour, the measured Cache-Prior / PSR (and SD / AR) under the proxy's;
it writes them to crossover_measured.csv; `--table` plots an earlier run's crossover.csv instead of replaying the
grid again. See docs/crossover.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import re
import time
from pathlib import Path

import numpy as np
import pandas as pd

from specmoe.records import AcceptanceProfile, synthetic_blocks
from specmoe.records.synthetic import SOURCES, parse_source, synthetic_calibration, synthetic_trace
from specmoe.routing.statistics import replay_policies, routing_stats

AXES = ("persistence", "pregate_noise", "skew", "margin")
GRID = {"persistence": (0.3, 0.6, 0.85), "pregate_noise": (0.3, 0.6, 1.0), "skew": (0.3, 0.6, 1.0),
        "margin": (0.0, 0.5)}
AR_POLICIES = ("exact_lru", "cache_prior", "psr", "exact_prefetch")
METHODS = (*AR_POLICIES, "sd_block")  # what competes on the map (PSR and exact_prefetch: total copies)
LABELS = {"exact_lru": "exact LRU", "cache_prior": "Cache-Prior", "psr": "PSR", "exact_prefetch": "exact+prefetch",
          "sd_block": "SD (acceptmoe)"}
COLOURS = {"exact_lru": "#999999", "cache_prior": "#1f77b4", "psr": "#d62728", "exact_prefetch": "#9467bd",
           "sd_block": "#2ca02c"}

# H200, full-size OLMoE-1B-7B, bf16, quoted from BENCHMARKS.md. AR: section "AR offloading engine (issue 3)"
# (2026-11-29, random routing, 3 rounds): all-resident ms, and per policy and C (ms/token, transferred copies per
# token); per-copy cost = (ms - all-resident) / copies. SD: section "Block-selected SD and exact with prefetch at
# three cells of the map" (2026-12-02): the map's configuration (acceptmoe, P = 32, k = 8, blocks at position
# 2048), pooled over its three cells (537 committed tokens in 120 blocks, tau 4.475: compute-only 1.208 and
# exposed copies 2.696 ms per committed token at 8.555 copies; those three cells are in-sample); drafting: the
# DFlash drafter's 1.684 ms per block ("Drafters against the target's step"). The SD price before it came from a
# run at position 256 with P = 24 (3.44 ms of verification per block against 5.41 at 2k context).
H200 = {
    "all_resident_ms": 1.76,
    "ar": {32: {"exact_lru": (12.69, 44.9), "exact_prefetch": (10.74, 45.3), "cache_prior": (4.52, 10.9),
                "psr": (3.92, 15.4)},
           16: {"exact_lru": (20.86, 80.4), "exact_prefetch": (18.68, 80.6), "cache_prior": (10.15, 34.2),
                "psr": (7.33, 30.7)}},
    "sd": {"tau": 4.475, "compute_ms_per_token": 1.208, "exposed_ms_per_token": 2.696, "copies_per_token": 8.555,
           "draft_ms_per_block": 1.684},
}

# The schedule floor's prices (`specmoe.routing.schedule`; BENCHMARKS.md, "Issue 21's targets following the family's
# routing", call 2, 2026-12-04): full-size OLMoE-1B-7B's all-resident token at 2k context and an expert copy in a
# stream, measured in the same run.
FLOOR = {"all_resident_ms": 1.043, "copy_ms": 0.234}

# The shipped family, quoted from docs/routing-stats.md (`specmoe stats`, 516 tokens, in-sample calibration): its
# means over layers and its replayed copies per token at C = 32, used only to place the family on the grid, by its
# statistics (each scaled by its range over the grid, load skew on a log scale) and by its copies (log scale).
FAMILY_STATS = {"reuse_consecutive": 0.366, "pregate_recall": 0.843, "load_max_over_mean": 4.0,
                "margin_over_delta_mean": 0.018}
FAMILY_COPIES_C32 = {"exact_lru": 14.76, "cache_prior": 1.18, "psr": 7.91}


def per_copy_ms(policy: str, capacity: int) -> float:
    """The measured H200 ms per copy above the all-resident time of an AR policy at C (see `H200`)."""
    ms, copies = H200["ar"][capacity][policy]
    return (ms - H200["all_resident_ms"]) / copies


def point(params, capacities=(32, 16), tokens: int = 2048, calibration_tokens: int = 8192, k: int = 8,
          tau: float = 5.0, seed: int = 1) -> list[dict]:
    """One grid point: the source `params`' routing statistics and, per C, copies per token of every method."""
    from specmoe.replay import replay_block_selection
    from specmoe.verifiers import selector_preset

    trace = synthetic_trace(params, tokens, seed=seed)
    calibration = synthetic_calibration(params, calibration_tokens)
    stats = routing_stats(trace, calibration, capacities=(), policy_capacities=())["mean"]
    blocks = synthetic_blocks(trace, k, AcceptanceProfile.for_tau(tau, k), seed=seed)
    base = {**{a: getattr(params, a) for a in AXES}, **{s: stats[s] for s in FAMILY_STATS}, "sd_tau": blocks.tau}
    rows = []
    for capacity in capacities:
        row = {**base, "C": int(capacity)}
        floor = (FLOOR["all_resident_ms"], FLOOR["copy_ms"])
        for name, summary in replay_policies(trace, calibration, (capacity,), AR_POLICIES, floor)[capacity].items():
            row[name] = summary["copies"]
            row[f"{name}_demand"] = summary["demand"]
            row[f"{name}_floor_ms"] = summary["floor_ms"]
        for selector, column in (("acceptmoe", "sd_block"), ("exact", "sd_exact")):
            result = replay_block_selection(selector_preset(selector), blocks, calibration, capacity)
            row[column] = result.copies_per_token
            row[f"{column}_displaced"] = result.displaced_per_token_layer
        rows.append(row)
    return rows


def latency_proxy(table: pd.DataFrame) -> pd.DataFrame:
    """Add the proxy ms per token of every method (`<method>_ms`, module docstring) and the winners in copies
    and in the proxy (`win_copies`, `win_ms`), and Cache-Prior / PSR in both."""
    table = table.copy()
    sd = H200["sd"]
    verify_ms_per_block = sd["compute_ms_per_token"] * sd["tau"]
    sd_per_copy = sd["exposed_ms_per_token"] / sd["copies_per_token"]
    for name in AR_POLICIES:
        cost = table.C.map(lambda c, name=name: per_copy_ms(name, int(c)))
        table[f"{name}_ms"] = H200["all_resident_ms"] + table[name] * cost
    table["sd_block_ms"] = (verify_ms_per_block + sd["draft_ms_per_block"]) / table.sd_tau \
        + table.sd_block * sd_per_copy
    table["win_copies"] = table[list(METHODS)].idxmin(axis=1)
    table["win_ms"] = table[[f"{m}_ms" for m in METHODS]].idxmin(axis=1).str.removesuffix("_ms")
    table["cache_prior_over_psr_copies"] = table.cache_prior / table.psr
    table["cache_prior_over_psr_ms"] = table.cache_prior_ms / table.psr_ms
    floors = [f"{name}_floor_ms" for name in AR_POLICIES]
    if set(floors) <= set(table.columns):  # csvs written before the floor have none
        table["win_floor"] = table[floors].idxmin(axis=1).str.removesuffix("_floor_ms")
        table["cache_prior_over_psr_floor"] = table.cache_prior_floor_ms / table.psr_floor_ms
    return table


def nearest(table: pd.DataFrame, target: dict, log=("load_max_over_mean",), capacity: int | None = None) -> pd.Series:
    """The grid point (the row at C = `capacity`, or the first C) nearest to `target` ({column: value}), each
    column scaled by its range over the grid, the columns in `log` on a log scale."""
    rows = table[table.C == (capacity or table.C.iloc[0])]
    names = list(target)
    columns = np.stack([rows[n].to_numpy(float) for n in names], axis=1)
    goal = np.array([target[n] for n in names], dtype=float)
    on_log = [i for i, n in enumerate(names) if n in log]
    columns[:, on_log], goal[on_log] = np.log(columns[:, on_log]), np.log(goal[on_log])
    span = np.maximum(columns.max(0) - columns.min(0), 1e-9)
    return rows.iloc[int(np.argmin((((columns - goal) / span) ** 2).sum(1)))]


def family_points(table: pd.DataFrame) -> dict:
    """The family's place on the grid: {"statistics": row, "copies": row} (see FAMILY_STATS)."""
    return {"statistics": nearest(table, FAMILY_STATS),
            "copies": nearest(table, FAMILY_COPIES_C32, log=tuple(FAMILY_COPIES_C32), capacity=32)}


def crossover_map(grid: dict = GRID, capacities=(32, 16), progress: bool = False, **options) -> pd.DataFrame:
    """Every point of `grid` (axis -> values; axes missing from it at the olmoe-like values) through `point` and
    `latency_proxy`: one row per point and C."""
    base = SOURCES["olmoe-like"]
    values = [grid.get(a, (getattr(base, a),)) for a in AXES]
    rows = []
    for i, combo in enumerate(itertools.product(*values)):
        start = time.perf_counter()
        rows += point(dataclasses.replace(base, **dict(zip(AXES, combo))), capacities, **options)
        if progress:
            print(f"{i + 1}/{int(np.prod([len(v) for v in values]))} {dict(zip(AXES, combo))} "
                  f"{time.perf_counter() - start:.1f} s", flush=True)
    return latency_proxy(pd.DataFrame(rows))


MEASURED = ("cache_prior", "psr", "exact_prefetch", "sd_block")  # the methods a measured point can carry
MEASURED_COLUMNS = [*AXES, "C", *(f"{m}_ms" for m in MEASURED), "measured_ratio", "lo", "hi", "over", "sd_over_ar",
                    "sd_lo", "sd_hi", "sd_config", "winner", "clear", "file"]


def _read_report(path) -> dict:
    try:
        report = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a readable bench_engine.json or bench_spec_engine.json ({exc})") from None
    if isinstance(report, dict) and "traces" not in report and "ar_configs" in report:
        # a bench_spec_engine run of one --trace names its sources without a prefix and keeps the spec in its args
        specs = (report.get("args") or {}).get("trace") or []
        if len(specs) == 1:
            report["traces"] = {specs[0]: {"trace": specs[0], "prefix": "", **(report.get("trace") or {})}}
    if not isinstance(report, dict) or "traces" not in report or "table" not in report \
            or not ("ratios" in report or "ar_configs" in report):
        raise ValueError(f"{path}: not a bench_engine.json or bench_spec_engine.json of a run with --trace "
                         "(no traces, table, ratios or ar_configs)")
    return report


def _point(trace: dict):
    """A run's trace entry as a map point's parameters (a synthetic source spec), or None (a recorded trace)."""
    parsed = parse_source(trace.get("file") or trace.get("trace") or "")
    return None if parsed is None else {a: getattr(parsed[0], a) for a in AXES}


def _engine_points(report: dict, path) -> list[dict]:
    """bench_engine.json: per synthetic source and C with both host-policy rows, Cache-Prior / PSR with its
    interval over windows (exact with prefetch's ms where the run has its row)."""
    rows = []
    for prefix, trace in report["traces"].items():
        params = _point(trace)
        if params is None:
            continue
        for key, ratio in report.get("ratios", {}).items():
            found = re.fullmatch(rf"{re.escape(prefix)}C(\d+): cache_prior / psr \(host policy\)", key)
            if not found:
                continue
            c = int(found.group(1))
            ms = {p: report["table"].get(f"{prefix}C{c}_{p}_host_policy", {}).get("ms_mean", np.nan)
                  for p in ("cache_prior", "psr", "exact_prefetch")}
            rows.append({**params, "C": c, **{f"{p}_ms": v for p, v in ms.items()}, "measured_ratio": ratio["ratio"],
                         "lo": ratio["lo"], "hi": ratio["hi"], "over": ratio.get("over"), "file": str(path)})
    return rows


def _spec_points(report: dict, path) -> list[dict]:
    """bench_spec_engine.json: per synthetic source and acceptmoe row, the map's configuration measured: AR at
    C = P (Cache-Prior, PSR, exact with prefetch, those the run has) and SD with pool P, its time with the run's
    drafting (--draft-ms); Cache-Prior / PSR and SD / the fastest of those ARs with 95% intervals over the
    requests (bench_spec_engine's `request_ratio`)."""
    from spec_report import request_ratio

    pool, draft_ms = report["args"]["pool"], report["args"].get("draft_ms") or 0.0
    rows = []
    for row in report["table"]:
        # the row's trace: the longest prefix of its source name ("olmoe_like_skew_1_" is also a prefix of
        # "olmoe_like_skew_1_margin_0_...")
        trace = max((t for t in report["traces"].values() if row["source"].startswith(t["prefix"])),
                    key=lambda t: len(t["prefix"]), default=None)
        params = None if trace is None else _point(trace)
        if params is None or row["selector"] != "acceptmoe" or row.get("prefetch"):
            continue
        ar = {p: row.get(f"ar_{p}_C{pool}_ms_per_token", np.nan) for p in ("cache_prior", "psr", "exact_prefetch")}
        sd_ms = row["ms_per_token_with_drafting"] if draft_ms else row["ms_per_token"]
        details = {p: report["details"].get(f"{row['source']}/ar_{p}_C{pool}") for p in ("cache_prior", "psr")}
        cp_psr = request_ratio(details["cache_prior"], details["psr"]) if all(details.values()) else None
        best = min((p for p in ar if np.isfinite(ar[p])), key=ar.get, default=None)
        sd = row.get(f"ratio_sd{'_drafting' if draft_ms else '0'}_over_ar_{best}_C{pool}_over_requests") or {}
        rows.append({**params, "C": pool, **{f"{p}_ms": v for p, v in ar.items()}, "sd_block_ms": sd_ms,
                     "measured_ratio": cp_psr["ratio"] if cp_psr else ar["cache_prior"] / ar["psr"],
                     "lo": cp_psr["low"] if cp_psr else np.nan, "hi": cp_psr["high"] if cp_psr else np.nan,
                     "over": f"{cp_psr['units']} requests" if cp_psr else None,
                     "sd_over_ar": sd.get("ratio", np.nan), "sd_lo": sd.get("low", np.nan),
                     "sd_hi": sd.get("high", np.nan),
                     "sd_config": f"acceptmoe k {row['k']}, tau {row['tau']:.2f}, P {pool}, drafting "
                                  f"{draft_ms:g} ms/block", "file": str(path)})
    return rows


def _winner(row) -> tuple[str, object]:
    """The fastest measured method at a point, and whether its lead over the next is outside the 95% interval
    (True / False; None where the two have no interval between them)."""
    ms = {m: row[f"{m}_ms"] for m in MEASURED if np.isfinite(row[f"{m}_ms"])}
    first, second = sorted(ms, key=ms.get)[:2]
    pair = {first, second}
    if pair == {"cache_prior", "psr"}:
        lo, hi = row["lo"], row["hi"]
    elif "sd_block" in pair:
        lo, hi = row["sd_lo"], row["sd_hi"]
    else:
        return first, None
    return first, (None if not (np.isfinite(lo) and np.isfinite(hi)) else bool(hi < 1 or lo > 1))


def measured_points(paths) -> pd.DataFrame:
    """Latency measured on the engine at points of the map, one row per synthetic source and C (recorded traces,
    e.g. the family, are no point of the map and are left out), from each file in `paths`:
    - a `scripts/bench_engine.json` with --trace: Cache-Prior and PSR on the host policy (and exact with prefetch
      where the run has it), Cache-Prior / PSR with its interval over windows;
    - a `scripts/bench_spec_engine.json` with --trace: AR at C = P and acceptmoe SD with pool P (`_spec_points`);
    - a crossover_measured.csv of an earlier run (its rows as they are).
    Each row carries the fastest measured method (`winner`) and whether its lead is outside the interval
    (`clear`)."""
    rows, frames = [], []
    for path in paths:
        if str(path).endswith(".csv"):
            try:
                frame = pd.read_csv(path)
            except (OSError, ValueError) as exc:
                raise ValueError(f"{path}: not a readable crossover_measured.csv ({exc})") from None
            if not {*AXES, "C", "cache_prior_ms", "psr_ms", "measured_ratio"} <= set(frame.columns):
                raise ValueError(f"{path}: not a crossover_measured.csv (its columns: {list(frame.columns)})")
            frames.append(frame.reindex(columns=MEASURED_COLUMNS))
            continue
        report = _read_report(path)
        rows += _spec_points(report, path) if "ar_configs" in report else _engine_points(report, path)
    measured = pd.concat(frames + [pd.DataFrame(rows, columns=MEASURED_COLUMNS)], ignore_index=True)
    floats = [f"{m}_ms" for m in MEASURED] + ["measured_ratio", "lo", "hi", "sd_over_ar", "sd_lo", "sd_hi"]
    measured = measured.astype(dict.fromkeys(floats, float))
    if len(measured):
        winners = [_winner(r) for _, r in measured.iterrows()]
        measured["winner"] = [w for w, _ in winners]
        measured["clear"] = pd.array([c for _, c in winners], dtype="boolean")
    return measured


def _measured_at(measured: pd.DataFrame | None, row, capacity: int) -> pd.DataFrame:
    """The measured rows (`measured_points`) at a map row's point and C."""
    if measured is None or measured.empty:
        return pd.DataFrame(columns=MEASURED_COLUMNS)
    return measured[(measured.C == capacity) & np.logical_and.reduce(
        [np.isclose(measured[a].to_numpy(float), float(row[a])) for a in AXES])]


def _span(values, digits: int = 2) -> str:
    """"1.11" or "1.09-1.13": one value, or the range of several runs'."""
    lo, hi = min(values), max(values)
    return f"{lo:.{digits}f}" + (f"-{hi:.{digits}f}" if hi - lo >= 0.5 * 10 ** -digits else "")


def plot(table: pd.DataFrame, capacity: int, path: Path, measured: pd.DataFrame | None = None) -> None:
    """Winners at C = capacity: a row of panels over skew per (margin, copies | proxy); each panel persistence
    (x) against pre-gate noise (y), the cell coloured by the winner and labelled with Cache-Prior / PSR; on the
    proxy's panels, a point with `measured` ratios (`measured_points`) is framed and shows them ("m", the range
    where several runs measured it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    family = {how: tuple(row[a] for a in AXES) for how, row in family_points(table).items()}
    table = table[table.C == capacity]
    skews, margins = sorted(table["skew"].unique()), sorted(table.margin.unique(), reverse=True)
    xs, ys = sorted(table.persistence.unique()), sorted(table.pregate_noise.unique())
    rows = [(m, what) for m in margins for what in ("copies", "ms")]
    fig, axes = plt.subplots(len(rows), len(skews), figsize=(2.3 * len(skews) + 0.6, 2.0 * len(rows) + 0.9),
                             squeeze=False, sharex=True, sharey=True)
    olmoe = SOURCES["olmoe-like"]
    for (r, (margin, what)), (c, skew) in itertools.product(enumerate(rows), enumerate(skews)):
        ax = axes[r, c]
        part = table[(table["skew"] == skew) & (table.margin == margin)]
        for _, row in part.iterrows():
            x, y = xs.index(row.persistence), ys.index(row.pregate_noise)
            ax.add_patch(plt.Rectangle((x - 0.5, y - 0.5), 1, 1, color=COLOURS[row[f"win_{what}"]], alpha=0.75))
            seen = _measured_at(measured if what == "ms" else None, row, capacity)
            ax.text(x, y + (0.22 if len(seen) else 0), f"{row[f'cache_prior_over_psr_{what}']:.2f}", ha="center",
                    va="center", fontsize=7)
            if len(seen):
                winners = set(seen.winner)
                edge = COLOURS[winners.pop()] if len(winners) == 1 else "k"
                style = "--" if (seen["clear"] == False).any() else "-"  # noqa: E712 (a nullable boolean column)
                ax.add_patch(plt.Rectangle((x - 0.47, y - 0.47), 0.94, 0.94, fill=False, lw=2.2, ec=edge, ls=style))
                text = f"m {_span(seen.measured_ratio)}"
                sd = seen.sd_over_ar.dropna()
                if len(sd):
                    text += f"\nSD/AR {_span(sd)}"
                ax.text(x, y - 0.17, text, ha="center", va="center", fontsize=5.5, fontweight="bold")
            here = tuple(row[a] for a in AXES)
            if here == tuple(getattr(olmoe, a) for a in AXES):
                ax.plot(x + 0.3, y + 0.3, "*", color="k", ms=9)
            if here == family["statistics"]:
                ax.plot(x - 0.3, y + 0.3, "o", mfc="none", mec="k", ms=8)
            if here == family["copies"]:
                ax.plot(x - 0.3, y - 0.3, "s", mfc="none", mec="k", ms=7)
        ax.set_xlim(-0.5, len(xs) - 0.5)
        ax.set_ylim(-0.5, len(ys) - 0.5)
        ax.set_xticks(range(len(xs)), [f"{v:g}" for v in xs])
        ax.set_yticks(range(len(ys)), [f"{v:g}" for v in ys])
        ax.set_title(f"skew {skew:g}, margin {margin:g}: {'copies' if what == 'copies' else 'proxy ms'}", fontsize=8)
        if r == len(rows) - 1:
            ax.set_xlabel("persistence (reuse)", fontsize=8)
        if c == 0:
            ax.set_ylabel("pre-gate noise", fontsize=8)
    handles = [Patch(color=COLOURS[m], alpha=0.75, label=LABELS[m]) for m in METHODS]
    handles += [plt.Line2D([], [], marker="*", color="k", ls="", label="olmoe-like"),
                plt.Line2D([], [], marker="o", mfc="none", mec="k", ls="", label="family: nearest statistics"),
                plt.Line2D([], [], marker="s", mfc="none", mec="k", ls="", label="family: nearest C=32 copies")]
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=7, frameon=False)
    fig.suptitle(f"Which method wins at C = {capacity} of 64 experts, OLMoE geometry (CPU replay)\n'proxy ms': a "
                 "latency proxy from H200 figures, not a measurement; cell text: Cache-Prior / PSR"
                 + ("\nframed: measured on the H200, full-size OLMoE; frame colour: the fastest measured (dashed: "
                    "within\nthe 95% interval of the next); m: Cache-Prior / PSR; SD/AR: SD with drafting / the "
                    "fastest AR" if measured is not None and not measured.empty else ""),
                 fontsize=8)
    fig.tight_layout(rect=(0, 0.07, 1, 0.91 if measured is not None and not measured.empty else 0.95))
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _values(text: str) -> tuple[float, ...]:
    return tuple(float(v) for v in text.split(","))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/crossover", help="output directory (csv and png)")
    for axis in AXES:
        parser.add_argument(f"--{axis.replace('_', '-')}", default=",".join(map(str, GRID[axis])),
                            help=f"values of {axis} (default {','.join(map(str, GRID[axis]))})")
    parser.add_argument("--capacities", default="32,16", help="C values (default 32,16)")
    parser.add_argument("--tokens", type=int, default=2048, help="positions per draw (default 2048)")
    parser.add_argument("--calibration-tokens", type=int, default=8192, help="held-out calibration draw (8192)")
    parser.add_argument("--tau", type=float, default=5.0, help="SD blocks' tau (geometric acceptance; default 5)")
    parser.add_argument("-k", type=int, default=8, help="SD drafts per block (default 8)")
    parser.add_argument("--measured", nargs="*", default=[],
                        help="bench_engine.json and bench_spec_engine.json files of runs following synthetic sources, "
                        "or an earlier crossover_measured.csv: their measured points on the map (and in "
                        "crossover_measured.csv)")
    parser.add_argument("--table", help="plot this crossover.csv (an earlier run's) instead of replaying the grid")
    args = parser.parse_args(argv)
    try:
        measured = measured_points(args.measured) if args.measured else None
    except ValueError as exc:
        parser.error(str(exc))
    if args.table and not Path(args.table).is_file():
        parser.error(f"--table {args.table}: no such file (a crossover.csv of an earlier run)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    grid = {a: _values(getattr(args, a)) for a in AXES}
    capacities = tuple(int(c) for c in _values(args.capacities))
    start = time.perf_counter()
    if args.table:
        table = pd.read_csv(args.table)
        capacities = tuple(c for c in capacities if c in set(table.C))
    else:
        table = crossover_map(grid, capacities, progress=True, tokens=args.tokens,
                              calibration_tokens=args.calibration_tokens, k=args.k, tau=args.tau)
        table.to_csv(out / "crossover.csv", index=False, float_format="%.4g")
    if measured is not None:
        measured.to_csv(out / "crossover_measured.csv", index=False, float_format="%.4g")
        print(f"{len(measured)} measured points:")
        print(measured.drop(columns=["file"]).to_string(index=False))
    for capacity in capacities:
        plot(table, capacity, out / f"crossover_C{capacity}.png", measured)
    print(f"{len(table)} rows in {time.perf_counter() - start:.0f} s")
    for how, row in family_points(table).items():
        print(f"the family's nearest grid point by {how}: " + ", ".join(f"{a} {row[a]:g}" for a in AXES))
    shown = ["C", *AXES, *METHODS, "psr_demand", "win_copies", "win_ms", "cache_prior_over_psr_ms"]
    with pd.option_context("display.width", 250, "display.max_rows", 500):
        print(table[shown].to_string(index=False, float_format=lambda v: f"{v:.3g}"))
        for capacity in capacities:
            part = table[table.C == capacity]
            print(f"C = {capacity}: wins in copies", part.win_copies.value_counts().to_dict(),
                  "; in the proxy", part.win_ms.value_counts().to_dict())
    written = ([] if args.table else ["crossover.csv"]) + ([] if measured is None else ["crossover_measured.csv"])
    print(f"wrote in {out}: {', '.join(written + [f'crossover_C{c}.png' for c in capacities])}")


if __name__ == "__main__":
    main()
