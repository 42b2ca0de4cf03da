"""Frontier sweeps, the matched-mass comparison, tables and the frontier plot of `specmoe replay-sd`.

For one source of blocks (`Blocks`) and a capacity C (= the pool's P for every method):
- the rollback cache swept over the bonus lambda and the insertion budget n (PSR for n >= 1, Cache-Prior
  with A priority for n = 0, exact routing at lambda = 0 and n = 0);
- block-level selection for each selector swept over gamma and the prune budget, plus `exact`;
- AR-PSR (the paper's lambda for C, n = 1) on the same committed sequence, and the rollback cache with the
  same policy;
- frontiers: per method the points not dominated in (displaced mass per committed token-layer, copies per
  committed token); at every rollback frontier point with nonzero displaced mass, the ratio of its copies to
  the block frontier's, interpolated linearly at the same mass (`ratio_min`, `ratio_max`); and the ratio at the
  block preset's mass, where the rollback frontier reaches it (`ratio_at_preset`; NaN where it does not);
- from sources with a known true continuation, the fraction of committed token-layers whose executed set
  changes when the rejected positions carry the drafter's tokens instead of it (the selectors' presets);
- with prefetch budgets (`--prefetch`), exact and each selector's preset with the block prefetch
  (`specmoe.verifiers.prefetch`) at each budget: demand copies (those left on the critical path), prefetches,
  their hits and unused ones per committed token, and the peak union slots (rows `prefetch_<selector>`; summary
  columns `<selector>_prefetch<n>_demand` / `_unused`, with `<selector>_prefetch0_demand` = all copies);
- per block-selection row, `union_peak`: the most union slots one layer of one block needed (its missing experts
  beside the pool of P), and in the summary `exact_union_peak` / `<selector>_union_peak` for the presets: the U
  that sizes `SpeculativeConfig(union_slots=...)` by measurement (at least K; the engine's peak slot memory is then
  P + U per layer instead of E).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from specmoe.routing import Calibration, preset, psr_bonus
from specmoe.verifiers import selector_preset

from specmoe.records import Blocks
from .rollback import replay_ar, replay_block_selection, replay_rollback

from .sweeps import BUDGETS, GAMMAS, LAMBDAS, PRUNE_BUDGETS, SELECTORS


def rollback_policy(capacity: int, top_k: int, bonus: float, budget: int):
    """The AR policy of the rollback sweep at (lambda, n)."""
    if budget > 0:
        return preset("psr", capacity, top_k, bonus=bonus, insert_budget=budget)
    if bonus > 0:
        return preset("cache_prior_a", capacity, top_k, bonus=bonus)
    return preset("exact_a", capacity, top_k)


def sweep(blocks: Blocks, calibration: Calibration, capacity: int, *, lambdas=LAMBDAS, budgets=BUDGETS,
          gammas=GAMMAS, prune_budgets=PRUNE_BUDGETS, selectors=SELECTORS, source: str = "",
          prefetch=()) -> pd.DataFrame:
    """Every method's point over `blocks` (rows of the results table)."""
    top_k, num_experts = blocks.top_k, blocks.num_experts
    counterfactual = blocks.true_rows is not None and bool(np.any(blocks.accepted < blocks.k))
    rows = []

    def add(result, method, **extra):
        row = result.row()
        if "union_peak" in result.extra:  # block selection: the most union slots one layer of one block needed
            row["union_peak"] = result.extra["union_peak"]
        row.update(method=method, **extra)
        rows.append(row)

    bonus = psr_bonus(capacity, num_experts)
    psr = preset("psr", capacity, top_k, bonus=bonus)
    add(replay_ar(psr, blocks, calibration), "ar_psr", bonus=bonus, n=1)
    for lam in lambdas:
        for n in budgets:
            add(replay_rollback(rollback_policy(capacity, top_k, lam, n), blocks, calibration), "rollback",
                bonus=lam, n=n)
    if not any(lam == bonus and n == 1 for lam in lambdas for n in budgets):
        add(replay_rollback(psr, blocks, calibration), "rollback", bonus=bonus, n=1)
    add(replay_block_selection(selector_preset("exact"), blocks, calibration, capacity), "block_exact")
    for name in selectors:
        base = selector_preset(name)
        for gamma in gammas:
            for prune in prune_budgets:
                config = selector_preset(name, gamma=gamma, prune_budget=prune)
                add(replay_block_selection(config, blocks, calibration, capacity), f"block_{name}", gamma=gamma,
                    prune=prune, preset=False)
        add(replay_block_selection(base, blocks, calibration, capacity, counterfactual=counterfactual),
            f"block_{name}", gamma=base.gamma, prune=base.prune_budget, preset=True)
    for name in ("exact", *selectors) if prefetch else ():
        for n in sorted({0, *prefetch}):
            result = replay_block_selection(selector_preset(name), blocks, calibration, capacity, prefetch=n)
            per_token = {f"{key}_per_token": value / max(result.committed, 1) for key, value in result.extra.items()
                         if key != "union_peak"}
            add(result, f"prefetch_{name}", prefetch=n, **per_token)
    table = pd.DataFrame(rows)
    table.insert(0, "source", source or blocks.source)
    table.insert(1, "k", blocks.k)
    table.insert(2, "tau", blocks.tau)
    table.insert(3, "C", capacity)
    return table.drop(columns=[c for c in table.columns if c.startswith("param_")])


def frontier(points: pd.DataFrame) -> pd.DataFrame:
    """The points not dominated in (displaced mass, copies), by increasing displaced mass."""
    ordered = points.sort_values(["displaced_per_token_layer", "copies_per_token"])
    keep, best = [], math.inf
    for index, row in ordered.iterrows():
        if row.copies_per_token < best - 1e-12:
            keep.append(index)
            best = row.copies_per_token
    return ordered.loc[keep]


def interpolate(front: pd.DataFrame, displaced: float) -> float:
    """Copies of a frontier at `displaced` (linear between its points; NaN outside its range)."""
    x = front.displaced_per_token_layer.to_numpy()
    y = front.copies_per_token.to_numpy()
    if not x.size or displaced < x[0] - 1e-12 or displaced > x[-1] + 1e-12:
        return float("nan")
    return float(np.interp(displaced, x, y))


def summarize(table: pd.DataFrame) -> dict:
    """One summary row of a source's sweep (see the module docstring)."""
    first = table.iloc[0]
    ar = table[table.method == "ar_psr"].iloc[0]
    rollback = table[table.method == "rollback"]
    same = rollback[(rollback.bonus == ar.bonus) & (rollback.n == 1)].iloc[0]
    rb_front = frontier(rollback)
    summary = {"source": first.source, "k": int(first.k), "tau": float(first.tau), "C": int(first.C),
               "blocks": int(first.blocks), "committed": int(first.committed),
               "ar_psr_copies": float(ar.copies_per_token), "ar_psr_displaced": float(ar.displaced_per_token_layer),
               "rollback_psr_copies": float(same.copies_per_token),
               "rollback_psr_displaced": float(same.displaced_per_token_layer),
               "rollback_over_ar_psr": float(same.copies_per_token / ar.copies_per_token),
               "exact_block_copies": float(table[table.method == "block_exact"].iloc[0].copies_per_token),
               "exact_union_peak": int(table[table.method == "block_exact"].iloc[0].union_peak)}
    for method in sorted(m for m in table.method.unique() if m.startswith("block_") and m != "block_exact"):
        points = table[table.method == method]
        name = method[len("block_"):]
        chosen = points[points.preset == True].iloc[0]  # noqa: E712 (pandas column of bools and NaN)
        front = frontier(points)
        # matched mass: the rollback frontier's points that displace something, against the block frontier
        # interpolated there (it holds exact verification at zero mass)
        ratios = [p.copies_per_token / interpolate(front, p.displaced_per_token_layer)
                  for p in rb_front.itertuples() if p.displaced_per_token_layer > 0]
        ratios = [r for r in ratios if np.isfinite(r)]
        at_preset = interpolate(rb_front, chosen.displaced_per_token_layer)
        summary.update({
            f"{name}_copies": float(chosen.copies_per_token),
            f"{name}_displaced": float(chosen.displaced_per_token_layer),
            f"{name}_ratio_at_preset": (at_preset / chosen.copies_per_token if chosen.copies_per_token > 0
                                        else float("nan")),
            f"{name}_ratio_min": min(ratios) if ratios else float("nan"),
            f"{name}_ratio_max": max(ratios) if ratios else float("nan"),
            f"{name}_changed": float(chosen.changed_fraction),
            f"{name}_changed_drafts": float(chosen.changed_fraction_drafts),
            f"{name}_union_peak": int(chosen.union_peak),
        })
    for method in sorted(m for m in table.method.unique() if m.startswith("prefetch_")):
        name = method[len("prefetch_"):]
        for row in table[table.method == method].itertuples():
            n = int(row.prefetch)
            summary[f"{name}_prefetch{n}_demand"] = float(row.demand_per_token)
            summary[f"{name}_prefetch{n}_unused"] = float(row.prefetch_unused_per_token)
            summary[f"{name}_prefetch{n}_union_peak"] = int(row.union_peak)
    return summary


def figure(tables: list[pd.DataFrame]):
    """Copies per committed token against displaced mass per committed token-layer, one panel per source, at
    most two panels a row (four sources: 2 x 2) on shared axes, one legend below the panels."""
    import matplotlib.pyplot as plt

    columns = min(len(tables), 2)
    rows = math.ceil(len(tables) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5.5 * columns, 4.2 * rows), squeeze=False, sharex=True,
                             sharey=True)
    styles = {"rollback": ("C3", "o-", "rollback cache (λ, n)"), "block_acceptmoe": ("C0", "s-", "acceptmoe (γ, prune)"),
              "block_confidence_top1": ("C2", "^-", "confidence_top1 (γ, prune)")}
    legend = {}
    for ax, table in zip(axes.flat, tables):
        for method, (color, marker, label) in styles.items():
            points = table[table.method == method]
            if points.empty:
                continue
            ax.scatter(points.displaced_per_token_layer, points.copies_per_token, color=color, s=10, alpha=0.4)
            front = frontier(points)
            legend[label], = ax.plot(front.displaced_per_token_layer, front.copies_per_token, marker, color=color,
                                     ms=4, label=label)
        for method, color, marker, label in (("block_exact", "k", "x", "exact verification"),
                                             ("ar_psr", "C1", "*", "AR-PSR")):
            point = table[table.method == method]
            if len(point):
                legend[label], = ax.plot(point.displaced_per_token_layer, point.copies_per_token, marker,
                                         color=color, ms=10, label=label)
        first = table.iloc[0]
        ax.set_title(f"{first.source} (k={first.k}, tau={first.tau:.2f})", fontsize=11)
        ax.tick_params(labelsize=9, labelbottom=True, labelleft=True)
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("displaced mass / committed token-layer", fontsize=10)
    for ax in axes[:, 0]:
        ax.set_ylabel("copies / committed token", fontsize=10)
    for ax in list(axes.flat)[len(tables):]:
        ax.axis("off")
    fig.tight_layout(rect=(0, 0.7 / fig.get_size_inches()[1], 1, 1))  # 0.7 inch below for the legend
    fig.legend(list(legend.values()), list(legend), loc="lower center", ncol=min(len(legend), 3 if columns > 1 else 2),
               fontsize=10, frameon=False)
    return fig


def plot(tables: list[pd.DataFrame], path) -> None:
    """Write `figure(tables)` as a png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = figure(tables)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
