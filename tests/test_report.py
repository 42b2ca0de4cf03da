"""`specmoe report` on a synthetic results table (no model): the frontier's noise floor, the frontier table, per-token
latencies, the copies plot's pool moves and where the legends sit."""

import json

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402

from specmoe.experiments import report  # noqa: E402
from specmoe.experiments.report import means_table  # noqa: E402
from specmoe.rundir import MANIFEST, RESULTS  # noqa: E402

FIGURES = ("requests", "tokens", "verifications", "tau", "copies_per_token", "demand_per_token",
           "prefetch_per_token", "prefetch_in_time_per_token", "prefetch_late_per_token", "unused_per_token",
           "moves_per_token", "displaced_per_token_layer", "nll", "excess_nll", "kl", "ms_per_token", "ms_p50",
           "ms_p99", "draft_ms_per_token", "verify_ms_per_token", "wait_ms_per_token", "seconds")

# (label, kind, kl, copies/token, ms/token, moves/token): AR exact beats SD exact on both axes once the SD row's
# float-noise KL counts as 0; PSR trades divergence for copies; SD acceptmoe for copies and time
ROWS = [("AR exact_lru", "ar", 5e-8, 8.0, 10.0, np.nan),
        ("SD exact", "sd", 3e-8, 9.0, 12.0, 2.0),
        ("AR psr", "ar", 0.02, 5.0, 9.0, np.nan),
        ("SD acceptmoe", "sd", 0.01, 6.0, 11.0, 3.0)]


def table(rows=ROWS) -> pd.DataFrame:
    out = []
    for config, (label, kind, kl, copies, ms, moves) in enumerate(rows):
        row = dict.fromkeys(FIGURES, np.nan)
        row.update({"config": config, "label": label, "kind": kind, "round": 0, "kl": kl, "excess_nll": kl,
                    "copies_per_token": copies, "demand_per_token": copies, "moves_per_token": moves,
                    "ms_per_token": ms, "verify_ms_per_token": ms, "wait_ms_per_token": 0.0, "tau": 1.0,
                    "token_ms": list(np.linspace(0.5, 1.5, 20) * ms), "request_ms": [ms, ms]})
        out.append(row)
    return pd.DataFrame(out)


def run_dir(tmp_path, rows=ROWS):
    path = tmp_path / "run"
    path.mkdir()
    table(rows).to_parquet(path / RESULTS, index=False)
    (path / MANIFEST).write_text(json.dumps({"name": "synthetic"}))
    return path


def test_frontier_counts_float_noise_divergence_as_zero():
    m = means_table(table())
    kl = m.kl.to_numpy()  # both exact rows carry float noise, SD exact's lower but its copies and ms higher
    assert 1 in report.frontier(m.copies_per_token, kl)  # without the floor, noise alone keeps SD exact
    assert list(report.frontier(m.copies_per_token, kl, report.NOISE_FLOOR_NATS)) == [2, 3, 0]
    assert list(report.frontier(m.ms_per_token, kl, report.NOISE_FLOOR_NATS)) == [2, 0]
    assert 1e-8 < report.NOISE_FLOOR_NATS <= 1e-5
    # a real divergence just above the floor is not noise
    assert list(report.frontier([1.0, 2.0], [2e-6, 0.0], report.NOISE_FLOOR_NATS)) == [0, 1]


def test_report_frontier_table_says_yes_or_no_per_configuration(tmp_path):
    text = report.render(run_dir(tmp_path)).read_text()
    section = text.split("## Latency-divergence frontier")[1].split("\n## ")[0]
    assert "1e-06 nats per token count as 0" in section
    lines = [line for line in section.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert "on the copies frontier" in header and "on the ms frontier" in header
    rows = {r[header.index("configuration")]: r for r in
            ([c.strip() for c in line.strip("|").split("|")] for line in lines[2:])}
    assert len(rows) == len(ROWS)
    copies, ms = header.index("on the copies frontier"), header.index("on the ms frontier")
    assert {label: (r[copies], r[ms]) for label, r in rows.items()} == {
        "AR exact_lru": ("yes", "yes"), "SD exact": ("no", "no"), "AR psr": ("yes", "yes"),
        "SD acceptmoe": ("yes", "no")}


def test_speculative_token_ms_spreads_each_block_over_its_committed_tokens():
    from specmoe.experiments.measure import block_token_ms

    assert block_token_ms([0, 3, 1], [3.0, 8.0, 1.0]) == [3.0, 2.0, 2.0, 2.0, 2.0, 0.5, 0.5]
    assert block_token_ms(np.array([2]), np.array([6.0])) == [2.0, 2.0, 2.0]
    with pytest.raises(ValueError):
        block_token_ms([0, 1], [1.0])


def outside(fig, ax) -> bool:
    """Whether every legend of `ax` lies outside its axes (drawn boxes in display units)."""
    fig.canvas.draw()
    box, legend = ax.get_window_extent(), ax.get_legend().get_window_extent()
    return not box.overlaps(legend)


def test_copies_plot_draws_the_pools_moves_and_the_cdf_legend_sits_below_the_axes():
    import matplotlib.pyplot as plt

    m = means_table(table())
    fig = report.copies_figure(report._copy_classes(m))
    ax = fig.axes[0]
    bars = {c.get_label(): [p.get_height() for p in c.patches] for c in ax.containers}
    assert bars[report.MOVES_LABEL] == [0.0, 2.0, 0.0, 3.0]  # SD rows' moves; AR rows have none
    assert bars["demand"] == [8.0, 9.0, 5.0, 6.0]
    assert outside(fig, ax)
    labels = [t.get_text() for t in ax.texts]  # each bar's value on it: stacks' totals, then the moves
    assert labels[-2:] == ["2", "3"] and len(labels) == 6
    assert all(t.get_position()[1] < ax.get_ylim()[1] for t in ax.texts)  # inside the axes
    key = "\n".join(t.get_text() for t in fig.texts)  # configuration # -> label under the plot
    assert all(f"{row.config}: {row.label}" in key for row in m.itertuples())
    plt.close(fig)

    fig = report.cdf_figure(table())
    ax = fig.axes[0]
    assert len(ax.lines) == len(ROWS) and outside(fig, ax)
    assert ax.get_legend().get_window_extent().y1 <= ax.get_window_extent().y0  # below
    plt.close(fig)


def units_table(rng, a_scale=0.8, units=6, rounds=3):
    """Two configurations (0: baseline, 1: a_scale times as slow per token, with noise per unit) over `units`
    requests and `rounds` rounds, each request its own token count."""
    tokens = rng.integers(5, 40, units)
    base_ms = rng.uniform(5.0, 15.0, units)  # ms per token of each request
    rows = []
    for r in range(rounds):
        for config, scale in ((0, 1.0), (1, a_scale)):
            noise = rng.uniform(0.9, 1.1, units) if config else np.ones(units)
            ms = base_ms * scale * noise * rng.uniform(0.99, 1.01)
            row = dict.fromkeys(FIGURES, np.nan)
            row.update({"config": config, "label": f"c{config}", "kind": "ar", "round": r, "tau": 1.0,
                        "ms_per_token": float((ms * tokens).sum() / tokens.sum()), "token_ms": [],
                        "request_ms": list(ms), "request_tokens": list(tokens)})
            rows.append(row)
    return pd.DataFrame(rows)


def test_report_ratio_intervals_are_over_the_workloads_units():
    """paired_ratios: the ratio of total ms over total tokens, each unit's time a mean over rounds, with a paired
    bootstrap over the units; checked against a computation written out here."""
    rng = np.random.default_rng(3)
    t = units_table(rng)
    out = report.paired_ratios(t, 0)
    assert len(out) == 1
    row = out.iloc[0]
    assert row.unit == "request" and row.units == 6 and row.rounds == 3
    # independent: per request, the mean over rounds of ms x tokens; resample requests with numpy
    a = np.mean([np.asarray(x.request_ms) * np.asarray(x.request_tokens) for x in t[t.config == 1].itertuples()], 0)
    b = np.mean([np.asarray(x.request_ms) * np.asarray(x.request_tokens) for x in t[t.config == 0].itertuples()], 0)
    n = np.asarray(t.request_tokens.iloc[0], float)
    assert row.ratio == pytest.approx(a.sum() / b.sum(), rel=1e-12)
    draws = np.random.default_rng(0)
    values = []
    for _ in range(10000):
        i = draws.integers(0, 6, 6)
        values.append((a[i].sum() / n[i].sum()) / (b[i].sum() / n[i].sum()))
    low, high = np.quantile(values, [0.025, 0.975])
    assert (row.lo95, row.hi95) == pytest.approx((low, high), rel=1e-12)
    assert row.hi95 < 1.0 and row.verdict == "faster"
    # a configuration as fast as the baseline, up to noise: the interval holds 1
    same = report.paired_ratios(units_table(np.random.default_rng(4), a_scale=1.0), 0).iloc[0]
    assert same.lo95 < 1.0 < same.hi95 and same.verdict == "within noise"
    # one request: the rounds are the unit (paired t on log ms per token)
    one = t.copy()
    one["request_ms"] = [x[:1] for x in one.request_ms]
    one["request_tokens"] = [x[:1] for x in one.request_tokens]
    row = report.paired_ratios(one, 0, "window").iloc[0]
    assert row.unit == "round" and row.units == 3
    ratio, lo, hi = report.paired_log_ratio(t[t.config == 1].ms_per_token, t[t.config == 0].ms_per_token)
    assert (row.ratio, row.lo95, row.hi95) == pytest.approx((ratio, lo, hi))
    # a run directory of an older version (no request_tokens): each unit weighs one
    old = report.paired_ratios(t.drop(columns=["request_tokens"]), 0).iloc[0]
    per_token = [np.mean([x.request_ms for x in t[t.config == c].itertuples()], 0) for c in (1, 0)]
    assert old.ratio == pytest.approx(per_token[0].sum() / per_token[1].sum())


def test_report_states_the_unit_and_the_verdict(tmp_path):
    path = tmp_path / "run"
    path.mkdir()
    units_table(np.random.default_rng(5)).to_parquet(path / RESULTS, index=False)
    (path / MANIFEST).write_text(json.dumps({"name": "units", "config": {"mode": "generation", "rounds": 3}}))
    text = report.render(path).read_text()
    assert "over the workload's units (requests)" in text and "| faster | request | 6 | 3 |" in text
