"""`specmoe report RUN_DIR`: markdown tables and png plots of a run directory (`specmoe run`, `sd`, `demo`,
`replay`, `replay-sd`), from its results.parquet and manifest.json alone (nothing is re-run). A section whose
figures a run does not have (latencies of a harness teacher-forced or replay run, copies of none) is left out;
a replay-sd directory gets its sources' summary table and frontier plot.

Written to RUN_DIR/report/ (or --out): report.md with

- the run (config, command, commit, versions, hardware);
- per configuration, means over rounds: tau, copies per committed token, KL and excess NLL against exact
  routing, ms per committed token split into drafting, verification compute and exposed copy wait (AR vs SD);
- the latency-divergence frontier (frontier.png: KL, or the excess NLL where there is no KL, or the displaced
  router mass in a replay, against ms per token and against copies per token; the frontier joins the points
  no other point dominates, i.e. is at most as high on both axes and lower on one, divergences below
  NOISE_FLOOR_NATS counting as 0), and a table of every configuration with yes / no for each frontier;
- per-token latency percentiles (latency_cdf.png: the distribution of every committed token's latency,
  `token_ms` as `specmoe.experiments.measure` defines it);
- copies by class (copies.png): demand, prefetch in time, late, unused prefetches stacked, and beside them the
  speculative pool's refill moves (hatched; device to device, not copies), each bar's value on it;
- under every plot with configuration numbers, a key naming each configuration;
- ratios of ms per token against a baseline configuration with 95% intervals over the workload's units
  (requests or windows; a paired bootstrap, `paired_ratios`), which needs the same requests in every
  configuration, each read as faster, slower or within noise.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import pandas as pd

from specmoe.files import check_output_dir, write_dir_atomic, write_file_atomic
from specmoe.rundir import RunDir, read_table

REPORT_FILES = ("report.md", "frontier.png", "latency_cdf.png", "copies.png")  # what a report holds

QUALITY = ("kl", "excess_nll", "displaced_per_token_layer")  # the first with a value is the frontier's y
# Divergences (KL, excess NLL; nats per committed token) whose magnitude is below this are float noise, counted as
# 0 when points are compared: exact routing through a D-position verification forward differs from the
# one-position AR forward only in float rounding, which leaves a KL of about 3e-8 nats per token. 1e-6 is ~30x
# that noise and still far below anything a reader would act on (a perplexity change of exp(1e-6) - 1 = 1e-4 %).
NOISE_FLOOR_NATS = 1e-6


def means_table(table: pd.DataFrame) -> pd.DataFrame:
    """One row per configuration: the identifying columns and the means over rounds of the figures."""
    import pandas as pd

    numeric = [c for c in table.columns if c not in ("token_ms", "request_ms", "request_tokens", "round") and
               pd.api.types.is_numeric_dtype(table[c]) and c != "config"]
    ident = ["config", "label", "kind"]
    means = table.groupby("config", sort=True)[numeric].mean()
    first = table.groupby("config", sort=True)[[c for c in ("label", "kind", "acceptance") if c in table]].first()
    out = first.join(means).reset_index()
    out["rounds"] = table.groupby("config", sort=True).size().to_numpy()
    out["verify_compute_ms_per_token"] = out["verify_ms_per_token"] - out["wait_ms_per_token"].fillna(0.0)
    return out[ident + [c for c in out.columns if c not in ident]]


def summary_table(table: pd.DataFrame) -> pd.DataFrame:
    """The main table: per configuration tau, copies per committed token, KL, excess NLL, ms per token and its
    split (columns without any value left out), and where a row replays another selector's accepted lengths, the
    acceptance of each (closed-loop / open-loop, `Configuration.acceptance`)."""
    m = means_table(table)
    columns = {"label": "configuration", "tau": "tau", "copies_per_token": "copies/token", "kl": "kl",
               "excess_nll": "excess_nll", "displaced_per_token_layer": "displaced", "ms_per_token": "ms/token",
               "draft_ms_per_token": "draft_ms", "verify_compute_ms_per_token": "verify_ms",
               "wait_ms_per_token": "wait_ms"}
    if "acceptance" in m and m["acceptance"].astype(str).str.startswith("open-loop").any():
        columns["acceptance"] = "acceptance"  # a lossy selector replayed at exact's accepted lengths: say so
    out = m[list(columns)].rename(columns=columns)
    return out[[c for c in out.columns if c == "configuration" or out[c].notna().any()]]


def paired_log_ratio(a, b) -> tuple[float, float, float]:
    """The geometric-mean ratio of paired positive values a / b and its 95% interval (`specmoe.stats.
    log_ratio_ttest`, a paired t-test on their logarithms): (ratio, lo, hi); the interval is NaN with fewer than
    two pairs."""
    from specmoe.stats import log_ratio_ttest

    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1 or a.size == 0:
        raise ValueError(f"paired_log_ratio needs two 1-D arrays of the same non-zero length, got {a.shape}, {b.shape}")
    if a.size < 2:
        return float(np.exp(np.mean(np.log(a) - np.log(b)))), math.nan, math.nan
    r = log_ratio_ttest(a, b)
    return r.ratio, r.low, r.high


def spread_table(table: pd.DataFrame) -> pd.DataFrame:
    """Per configuration, the minimum and maximum over rounds of the quality figures (perplexity exp(nll)
    where there is an NLL) and of copies and ms per token."""
    import pandas as pd

    rows = []
    for config, group in table.groupby("config", sort=True):
        row = {"configuration": group.label.iloc[0], "rounds": len(group)}
        figures = {"ppl": np.exp(group["nll"]), "excess_nll": group["excess_nll"], "kl": group["kl"],
                   "copies/token": group["copies_per_token"], "ms/token": group["ms_per_token"]}
        for name, values in figures.items():
            row[f"{name} min"], row[f"{name} max"] = values.min(), values.max()
        rows.append(row)
    out = pd.DataFrame(rows)
    return out[[c for c in out.columns if c in ("configuration", "rounds") or out[c].notna().any()]]


def _markdown(frame: pd.DataFrame, digits: int = 3) -> str:
    def cell(v):
        if isinstance(v, float):
            return "–" if math.isnan(v) else f"{v:.{digits}f}"
        return str(v)

    lines = ["| " + " | ".join(frame.columns) + " |", "|" + "---|" * len(frame.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in frame.itertuples(index=False)]
    return "\n".join(lines)


def _quality(m: pd.DataFrame) -> str | None:
    return next((q for q in QUALITY if m[q].notna().any()), None)


def frontier(x, y, y_floor: float = 0.0) -> np.ndarray:
    """Indices of the points not dominated in (x, y), both lower-is-better, by increasing x. A point is
    dominated by one no worse on both axes and better on one; |y| below `y_floor` counts as 0 (noise)."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    y = np.where(np.abs(y) < y_floor, 0.0, y)
    keep = [i for i in range(len(x)) if np.isfinite(x[i]) and np.isfinite(y[i]) and not any(
        (x[j] <= x[i] and y[j] <= y[i]) and (x[j] < x[i] or y[j] < y[i]) for j in range(len(x))
        if np.isfinite(x[j]) and np.isfinite(y[j]))]
    return np.asarray(sorted(keep, key=lambda i: x[i]), dtype=int)


def _floor(quality: str) -> float:
    """The noise floor of a quality figure: NOISE_FLOOR_NATS for divergences in nats, 0 for displaced mass
    (exactly 0 under exact routing)."""
    return NOISE_FLOOR_NATS if quality in ("kl", "excess_nll") else 0.0


def frontier_table(m: pd.DataFrame, quality: str) -> pd.DataFrame:
    """Every configuration's copies and ms per token and quality figure, and whether it is on the copies
    frontier and on the ms frontier ("yes" / "no"; "–" where the configuration has no such figure)."""
    out = m[["config", "label", "copies_per_token", "ms_per_token", quality]].rename(
        columns={"label": "configuration", "copies_per_token": "copies/token", "ms_per_token": "ms/token"})
    for x, name in (("copies_per_token", "on the copies frontier"), ("ms_per_token", "on the ms frontier")):
        if not m[x].notna().any():
            continue
        on = set(m.index[frontier(m[x], m[quality], _floor(quality))])
        out[name] = ["yes" if i in on else "no" if np.isfinite(m.at[i, x]) and np.isfinite(m.at[i, quality])
                     else "–" for i in m.index]
    return out[[c for c in out.columns if out[c].notna().any()]]


def request_units(group: pd.DataFrame) -> tuple[np.ndarray, np.ndarray] | None:
    """One configuration's rows (its rounds) as units of the workload: (ms, tokens) per request or window, the
    ms a mean over the rounds of the unit's total (request_ms x request_tokens). Rows without request_tokens
    (run directories of older versions) count each unit as one token, so the ratio is then that of the mean
    per-request ms per token. None if the rounds disagree on the units or hold none."""
    times, counts = [], []
    for r in group.itertuples():
        ms = np.asarray(r.request_ms, float)
        tokens = np.asarray(getattr(r, "request_tokens", None) if getattr(r, "request_tokens", None) is not None
                            else [], float)
        if tokens.size != ms.size:
            tokens = np.ones_like(ms)
        times.append(ms * tokens)
        counts.append(tokens)
    if not times or not times[0].size or any(t.shape != times[0].shape for t in times):
        return None
    return np.mean(times, axis=0), np.mean(counts, axis=0)


def paired_ratios(table: pd.DataFrame, baseline: int, unit: str = "request") -> pd.DataFrame:
    """ms per committed token of every configuration over the baseline's, with a 95% interval over the workload's
    units (requests, or windows in a teacher-forced run): `specmoe.stats.unit_ratio`, a paired bootstrap that
    resamples units, each unit's time a mean over the interleaved rounds (rounds repeat the same deterministic
    work, so they measure the machine's repeatability, not the workload's variation); `unit` names them in the
    table. With a single unit, a paired t-test on log ms per token over rounds (unit "round"). The verdict is
    "within noise" where the interval holds 1."""
    import pandas as pd

    from specmoe.stats import unit_ratio

    rows = []
    groups = dict(tuple(table.groupby("config", sort=True)))
    base = request_units(groups[baseline])
    for config, group in groups.items():
        ours = request_units(group)
        if config == baseline or ours is None or base is None or ours[0].shape != base[0].shape:
            continue
        keep = (ours[0] > 0) & (ours[1] > 0) & (base[0] > 0) & (base[1] > 0)
        row = {"configuration": group.label.iloc[0], "rounds": len(group)}
        if keep.sum() >= 2:
            r = unit_ratio(ours[0][keep], ours[1][keep], base[0][keep], base[1][keep])
            row.update(ratio=r.estimate, lo95=r.low, hi95=r.high, unit=unit, units=int(keep.sum()))
        else:
            a, b = [], []
            rounds = {x.round: x for x in groups[baseline].itertuples()}
            for x in group.itertuples():
                if x.round in rounds and x.ms_per_token > 0 and rounds[x.round].ms_per_token > 0:
                    a.append(x.ms_per_token)
                    b.append(rounds[x.round].ms_per_token)
            if not a:
                continue
            ratio, lo, hi = paired_log_ratio(a, b)
            row.update(ratio=ratio, lo95=lo, hi95=hi, unit="round", units=len(a))
        row["verdict"] = verdict(row["ratio"], row["lo95"], row["hi95"])
        rows.append(row)
    return pd.DataFrame(rows, columns=["configuration", "ratio", "lo95", "hi95", "verdict", "unit", "units", "rounds"])


def latency_ratios(table: pd.DataFrame, mode: str, baseline: int | None = None):
    """The run's latency comparison, as the report and `specmoe run`'s printout give it: (baseline, unit,
    `paired_ratios` against it), the baseline by default the first configuration with timed units, the units
    windows in a teacher-forced run and requests otherwise; None where no row is timed."""
    timed = table[table.request_ms.map(len) > 0] if "request_ms" in table.columns else table.iloc[:0]
    if not len(timed):
        return None
    baseline = int(timed.config.min()) if baseline is None else baseline
    unit = "window" if mode == "teacher_forced" else "request"
    return baseline, unit, paired_ratios(table, baseline, unit)


def verdict(ratio: float, low: float, high: float) -> str:
    """How a latency ratio with its 95% interval reads: "faster" / "slower" where the interval excludes 1,
    "within noise" where it holds it, "no interval" without one."""
    if not (math.isfinite(low) and math.isfinite(high)):
        return "no interval"
    return "within noise" if low <= 1.0 <= high else "faster" if high < 1.0 else "slower"


# -- plots ------------------------------------------------------------------------------------------------------
def _save(fig, path: Path) -> bool:
    """Write `fig` as a png at `path` (atomically) and close it; False (nothing written) for no figure."""
    import matplotlib.pyplot as plt

    if fig is None:
        return False
    write_file_atomic(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight"))
    plt.close(fig)
    return True


def _key(fig, configs, labels) -> None:
    """Below the figure, what each configuration # of its points and bars is ("#: label", two columns)."""
    entries = [f"{c}: {label}" for c, label in zip(configs, labels)]
    half = math.ceil(len(entries) / 2)
    columns = [entries[:half], entries[half:]] if len(entries) > 4 else [entries]
    for i, column in enumerate(columns):
        fig.text(0.02 + 0.5 * i, 0.0, "\n".join(column), ha="left", va="top", fontsize=8, family="monospace",
                 transform=fig.transFigure)


def _plot_frontier(m: pd.DataFrame, quality: str, path: Path) -> bool:
    import matplotlib.pyplot as plt

    axes_x = [x for x in ("ms_per_token", "copies_per_token") if m[x].notna().any()]
    if not axes_x:
        return False
    fig, axes = plt.subplots(1, len(axes_x), figsize=(6.5 * len(axes_x), 4.5), squeeze=False)
    for ax, x in zip(axes[0], axes_x):
        for kind, marker in (("ar", "o"), ("sd", "s"), ("rollback", "^"), ("ar_replay", "v"), ("block", "D")):
            part = m[m.kind == kind]
            if len(part):
                ax.scatter(part[x], part[quality], marker=marker, label=kind, alpha=0.8)
        best = frontier(m[x], m[quality], _floor(quality))
        if best.size:
            ax.plot(m[x].to_numpy()[best], m[quality].to_numpy()[best], "k--", lw=1, label="frontier")
        for row in m.itertuples():
            if np.isfinite(getattr(row, x)) and np.isfinite(getattr(row, quality)):
                ax.annotate(str(row.config), (getattr(row, x), getattr(row, quality)), fontsize=9,
                            xytext=(4, 3), textcoords="offset points")
        ax.set_xlabel({"ms_per_token": "ms per committed token", "copies_per_token": "copies per committed token"}[x])
        ax.set_ylabel("displaced router mass per token-layer" if quality == "displaced_per_token_layer"
                      else f"{quality} against exact routing (nats per token)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=3, frameon=False)
    what = "latency-divergence" if "ms_per_token" in axes_x else "copies-divergence"  # a replay has no latency
    fig.suptitle(f"{what} frontier (numbers: configuration #, named below)")
    fig.tight_layout()
    _key(fig, m.config, m.label)
    _save(fig, path)
    return True


def cdf_figure(table: pd.DataFrame):
    """The latency CDF (one curve per configuration over its `token_ms`), the legend below the axes; None if
    no configuration has a latency."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    drawn = 0
    for config, group in table.groupby("config", sort=True):
        ms = np.sort(np.concatenate([np.asarray(v, float) for v in group.token_ms]))
        if ms.size:
            ax.plot(ms, np.arange(1, ms.size + 1) / ms.size, label=f"{config}: {group.label.iloc[0]}"[:70])
            drawn += 1
    if not drawn:
        plt.close(fig)
        return None
    ax.set_xscale("log")
    from matplotlib.ticker import FuncFormatter

    plain = FuncFormatter(lambda v, _: f"{v:g}")
    ax.xaxis.set_major_formatter(plain)
    ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:g}"[0] in "25" else ""))
    ax.tick_params(axis="x", which="minor", labelsize=8)
    ax.set_xlabel("ms per committed token")
    ax.set_ylabel("fraction of tokens")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2 if drawn > 4 else 1,
              frameon=False)
    return fig


COPY_CLASSES = {"demand_per_token": "demand", "prefetch_in_time_per_token": "prefetch in time",
                "prefetch_late_per_token": "prefetch late", "unused_per_token": "prefetch unused",
                "moves_per_token": "pool moves (device to device)"}
MOVES_LABEL = "pool moves (device to device, no copy)"


def _copy_classes(m: pd.DataFrame) -> pd.DataFrame:
    return m[["config", "label", "copies_per_token", "prefetch_per_token", *COPY_CLASSES]]


def copies_figure(c: pd.DataFrame):
    """Copies per committed token by class, stacked per configuration, and beside each stack the speculative
    pool's refill moves (hatched: they move experts between device slots and copy nothing); None if no
    configuration counts copies."""
    import matplotlib.pyplot as plt

    if not c["copies_per_token"].notna().any():
        return None
    moves = c["moves_per_token"].to_numpy(dtype=float)
    has_moves = np.isfinite(moves).any()
    width = 0.4 if has_moves else 0.8
    x = np.arange(len(c))
    left = x - width / 2 if has_moves else x
    fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(c) + 2), 4.5))
    bottom = np.zeros(len(c))
    for key, name in (("demand_per_token", "demand"), ("prefetch_in_time_per_token", "prefetch in time"),
                      ("prefetch_late_per_token", "prefetch late"), ("unused_per_token", "prefetch unused")):
        values = c[key].fillna(0.0).to_numpy()
        if key == "prefetch_in_time_per_token":  # harness and replay: executed prefetches, class unknown
            known = c[key].notna().to_numpy()
            executed = (c["prefetch_per_token"] - c["unused_per_token"].fillna(0.0)).fillna(0.0).to_numpy()
            values = np.where(known, values, executed)
            name = "prefetch executed (in time where known)"
        if values.any():
            ax.bar(left, values, width, bottom=bottom, label=name)
            bottom += values
    for xi, total in zip(left, bottom):  # each stack's total copies on top of it
        ax.annotate(f"{total:.3g}", (xi, total), xytext=(0, 2), textcoords="offset points", ha="center",
                    va="bottom", fontsize=8, rotation=90 if has_moves else 0)
    if has_moves:
        ax.bar(x + width / 2, np.nan_to_num(moves), width, label=MOVES_LABEL, color="white", edgecolor="0.3",
               hatch="//")
        for xi, value in zip(x + width / 2, moves):
            if np.isfinite(value):
                ax.annotate(f"{value:.3g}", (xi, value), xytext=(0, 2), textcoords="offset points", ha="center",
                            va="bottom", fontsize=8, color="0.3", rotation=90)
    top = max(np.nanmax(bottom), np.nanmax(moves) if has_moves else 0.0)
    ax.set_ylim(0, top * 1.18 if top > 0 else 1.0)  # room for the value labels
    ax.set_xticks(x, [str(i) for i in c["config"]])
    ax.set_xlabel("configuration #")
    ax.set_ylabel("copies (and moves) per committed token")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    _key(fig, c["config"], c["label"])
    return fig


# -- the report -------------------------------------------------------------------------------------------------
def render(run_dir: str | Path, out: str | Path | None = None, baseline: int | None = None) -> Path:
    """Write report.md and the plots for `run_dir` into `out` (default RUN_DIR/report); returns report.md. Every
    argument is checked before anything is written, and the report is made in a temporary directory renamed
    into place (an earlier report at `out` is replaced whole)."""
    run_dir = Path(run_dir)
    table = read_table(run_dir)
    manifest = RunDir(run_dir).manifest() or {}
    out = Path(out) if out is not None else run_dir / "report"
    if baseline is not None and baseline not in set(table.config):
        raise ValueError(f"--baseline {baseline}: no configuration # {baseline} in {run_dir}")
    check_output_dir(out, REPORT_FILES, "report directory")
    comparison = latency_ratios(table, manifest.get("config", {}).get("mode", ""), baseline)
    write_dir_atomic(out, lambda tmp: _write_report(tmp, run_dir, table, manifest, comparison), REPORT_FILES,
                     "report directory")
    return out / "report.md"


def _header(run_dir: Path, table, manifest: dict) -> list[str]:
    """The report's title and the run's provenance (what, command, commit, versions, hardware)."""
    lines = [f"# {manifest.get('name', run_dir.name)}", ""]
    if manifest.get("description"):
        lines += [manifest["description"], ""]
    config = manifest.get("config", {})
    git = manifest.get("git", {})
    cells = (f"cells {manifest.get('cells_done', len(table))} of {manifest.get('cells_total', '?')} "
             f"({manifest.get('status', '?')})")
    if manifest.get("kind", "run") == "run":
        what = (f"- config: `{manifest.get('config_file', '?')}` (digest {manifest.get('digest', '?')}); mode "
                f"{config.get('mode', '?')}, engine {config.get('engine', '?')}, device {config.get('device', '?')}, "
                f"{config.get('rounds', '?')} rounds; {cells}")
    else:
        inputs = ", ".join(f"{k} `{v.get('path')}`" for k, v in manifest.get("inputs", {}).items())
        what = f"- `specmoe {manifest['kind']}` (digest {manifest.get('digest', '?')}) of {inputs}; {cells}"
    return lines + [what, f"- command: `{' '.join(manifest.get('command', []))}`; commit {git.get('commit')}"
                    + (" (with local changes)" if git.get("dirty") else ""),
                    f"- versions: {', '.join(f'{k} {v}' for k, v in manifest.get('versions', {}).items() if v)}",
                    f"- hardware: {json.dumps(manifest.get('hardware', {}))}", ""]


def _transposed(frame: pd.DataFrame) -> pd.DataFrame:
    """One column per row of `frame` (named by its index), one row per column (named in the column "figure")."""
    out = frame.T.astype(object)
    out.columns = [str(c) for c in out.columns]
    out.insert(0, "figure", [str(i) for i in out.index])
    return out.reset_index(drop=True)


def _write_replay_sd_report(out: Path, run_dir: Path, table, manifest: dict) -> None:
    """report.md of a `specmoe replay-sd` run directory: the summary row of every source and the frontier plot
    of its sweeps (`specmoe.replay.report`); no latency (a replay has none)."""
    from specmoe.replay import report as replay_report
    from specmoe.replay.command import points_of

    lines = _header(run_dir, table, manifest)
    summary = table.drop(columns=["points", "config", "round", "kind"]).rename(columns={"label": "cell"})
    lines += ["## Sources (one row per source of blocks)", "",
              "Copies per committed token of AR-PSR and the rollback cache on the same committed sequence, exact "
              "block verification, each selector's preset; ratio_min / ratio_max: the rollback frontier's copies "
              "over the block frontier's at matched displaced mass (`specmoe replay-sd --help`).", "",
              _markdown(_transposed(summary.set_index("cell")), 3), ""]
    replay_report.plot(points_of(table), out / "frontier.png")
    lines += ["## Frontiers", "", "Copies per committed token against displaced router mass per committed "
              "token-layer, one panel per source.", "", "![frontier](frontier.png)", ""]
    (out / "report.md").write_text("\n".join(lines))


def _write_eval_report(out: Path, run_dir: Path, table, manifest: dict) -> None:
    """report.md of a `specmoe eval` run directory: the model arguments, lm-eval's figures per task (and
    subtask, filter, metric) and what each task cost (seconds, routing summary); no plot."""
    from specmoe.evaluation.run import cost_table, task_table

    config = manifest.get("config", {})
    options = {k: config.get(k) for k in ("num_fewshot", "limit", "apply_chat_template", "include_path")}
    lines = _header(run_dir, table, manifest)
    model_args = " ".join(f"{k}={v}" for k, v in config.get("model_args", {}).items())
    chosen = ", ".join(f"{k} {v}" for k, v in options.items() if v not in (None, False)) or "the tasks' defaults"
    lines += [f"- model arguments: `{model_args}`; lm-eval options: {chosen}", ""]
    if config.get("limit") is not None:
        lines += [f"**--limit {config['limit']}: a subset of each task's questions, not a benchmark figure.**", ""]
    lines += ["## Tasks", "", "lm-eval's figures as it reports them (value and its standard error; n: questions "
              "scored). Pair two runs question by question with `specmoe compare RUN_A RUN_B`.", "",
              _markdown(task_table(table), 4), "",
              "## Cost per task", "", "Wall seconds of the task, seconds inside the model, and the routing summary "
              "(a routing policy: copies, demand, prefetch, unused prefetches, replaced slots and displaced router "
              "mass per routed token; speculative decoding: tau and copies per committed token).", "",
              _markdown(cost_table(table), 3), ""]
    (out / "report.md").write_text("\n".join(lines))


def _write_report(out: Path, run_dir: Path, table, manifest: dict, comparison) -> None:
    """Write report.md and its plots into the (new, temporary) directory `out`."""
    import pandas as pd

    if manifest.get("kind") == "replay-sd":
        return _write_replay_sd_report(out, run_dir, table, manifest)
    if manifest.get("kind") == "eval":
        return _write_eval_report(out, run_dir, table, manifest)
    m = means_table(table)
    quality = _quality(m)
    lines = _header(run_dir, table, manifest)
    lines += ["## Configurations (means over rounds)", "",
              "ms per committed token = drafting + verification compute + exposed copy wait; harness times are "
              "CPU wall times of transformers' eager expert loop (no copies), not latencies.", "",
              _markdown(summary_table(table)), ""]
    written = []
    if quality:
        lines += ["## Latency-divergence frontier", "",
                  f"{quality} ({'per committed token-layer' if quality.startswith('displaced') else 'against exact routing, nats per committed token'}) "
                  "against ms and copies per token; frontier: no other configuration is at most as high on both and lower on "
                  f"one; divergences below {NOISE_FLOOR_NATS:g} nats per token count as 0 (float noise: exact routing "
                  "through a verification block differs from AR only in float rounding).", ""]
        if _plot_frontier(m, quality, out / "frontier.png"):
            lines += ["![frontier](frontier.png)", ""]
            written.append("frontier.png")
        lines += [_markdown(frontier_table(m, quality)), ""]
    if table["round"].nunique() > 1:
        lines += ["## Spread over rounds", "",
                  "Minimum and maximum over rounds: a figure that moves between repeated runs of one configuration "
                  "depends on something other than the configuration (timing, for routing on the physical cache).",
                  "", _markdown(spread_table(table), 4), ""]
    latencies = [np.asarray(v, float) for v in table.token_ms]
    if any(v.size for v in latencies):
        rows = []
        for config, group in table.groupby("config", sort=True):
            ms = np.concatenate([np.asarray(v, float) for v in group.token_ms])
            if ms.size:
                p50, p90, p99 = np.percentile(ms, [50, 90, 99])
                rows.append({"configuration": group.label.iloc[0], "tokens": ms.size, "mean": ms.mean(), "p50": p50,
                             "p90": p90, "p99": p99})
        lines += ["## Per-token latency (ms per committed token)", "",
                  "Every committed token's latency (`token_ms`): an AR step's time; a speculative block's drafting + "
                  "verification time divided by the tokens it commits, given to each of them.", "",
                  _markdown(pd.DataFrame(rows)), ""]
        if _save(cdf_figure(table), out / "latency_cdf.png"):
            lines += ["![latency CDF](latency_cdf.png)", ""]
            written.append("latency_cdf.png")
    copies = _copy_classes(m)
    if copies["copies_per_token"].notna().any():
        shown = copies[["config", "label", "copies_per_token", "demand_per_token", "prefetch_per_token",
                        "prefetch_in_time_per_token", "prefetch_late_per_token", "unused_per_token", "moves_per_token"]]
        shown = shown[[c for c in shown.columns if shown[c].notna().any()]]
        lines += ["## Copies by class (per committed token)", "",
                  "The harness and the replay count logical copies (no timing: in time / late unknown); the "
                  "speculative pool's copies are all demand copies into union slots, its refill moves stay on the "
                  "device.", "", _markdown(shown), ""]
        if _save(copies_figure(copies), out / "copies.png"):
            lines += ["![copies](copies.png)", ""]
            written.append("copies.png")
    if comparison is not None:
        base, unit, ratios = comparison
        label = table[table.config == base].label.iloc[0]
        lines += [f"## ms per token against #{base} {label}", "",
                  f"Ratio of ms per committed token (total time over total tokens) with its 95% interval over the "
                  f"workload's units ({unit}s): a paired bootstrap that resamples the units, each unit's time a mean "
                  "over the interleaved rounds (`specmoe.stats.unit_ratio`); with one unit, a paired t-test on log "
                  "ms per token over rounds (unit: round). An interval that holds 1 is within noise: no evidence of a "
                  "difference (docs/measurement.md).", "", _markdown(ratios), ""]
    (out / "report.md").write_text("\n".join(lines))


def add_parser(sub) -> None:
    parser = sub.add_parser("report", help="markdown tables and png plots of a run directory",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="a run directory of `specmoe run`, sd, demo, replay or replay-sd (holds "
                        "results.parquet)")
    parser.add_argument("--out", default=None, help="output directory (default RUN_DIR/report)")
    parser.add_argument("--baseline", type=int, default=None,
                        help="configuration # the paired ratios compare against (default: the first timed one)")
    parser.set_defaults(func=main)


def main(args) -> int:
    import matplotlib

    matplotlib.use("Agg")
    path = render(args.run_dir, args.out, args.baseline)
    print(path.read_text())
    print(f"report: {path}")
    return 0
