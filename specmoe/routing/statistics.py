"""Routing statistics of recorded exact routing: how much a model's routing leaves for a cache to exploit.

The statistics that decide which policy wins (docs/routing-stats.md), per MoE layer, from a routing trace
(`specmoe.records.Trace`, or anything with its fields) and a calibration:

- router entropy: H(r) in nats of the router distribution r (softmax(z); for sigmoid routers the unbiased
  sigmoid normalised to sum 1, as block selection defines r_d), mean over tokens, and H / ln E;
- top-K margin over Delta_l: (lowest selection score of the router's own top-K - highest score outside it) /
  Delta_l, with Delta_l the calibration's mean logit range. A bonus lambda * Delta_l can flip a selection only
  where this margin is below lambda, so `margin_below` gives that share at the paper's bonuses, and
  `flippable` the mean number of own top-K members whose lead over the best expert outside is below lambda *
  Delta_l (the selections a bonus on a resident outsider could displace: 0 to K);
- consecutive-token reuse: the share of a token's own top-K that the previous token of its sequence selected;
- pre-gate top-K recall: the share of a layer's own top-K that the pre-gate's top-K predicted (layer 0: none);
- distinct experts per window: the mean size of the union of own top-Ks over non-overlapping windows of w
  consecutive tokens of a sequence (w = k + 1: a verification block of k drafts);
- load skew: selection load per expert (selections / tokens); max / mean over experts, and the load's entropy
  over ln E (1 for a balanced load);
- LRU miss rate as a function of C: demand copies / (T K) of exact routing with an LRU cache of C experts per
  layer, from the routing core's replay (`specmoe.routing.replay`, preset exact_lru);
- copies per token of the paper's policies at given capacities (`replay_policies`: the presets, PSR at the
  paper's operating point `psr_bonus(C, E)`), for comparison with published figures.

Own top-K and pre-gate rankings are on the selection scores (`RouterScoring.selection_scores`), group-limited
where the router is, ties to the lower index (the calibration's `_top_k`, the routing core's rule).
`routing_stats` returns a JSON-ready dict; `stats_tables` turns it into pandas tables (pandas imported there).
"""

from __future__ import annotations

import math

import numpy as np

from .calibration import Calibration, CalibrationBuilder, _top_k
from .policy import preset, psr_bonus
from .replay import replay
from .schedule import schedule_floor
from .scoring import RouterScoring

WINDOWS = (9, 17)  # verification blocks of k = 8 and 16 drafts
BONUSES = (0.2, 0.3)  # the paper's Cache-Prior and PSR bonuses
POLICIES = ("exact_lru", "cache_prior", "psr", "spec_exec")  # the paper's Section 6.5 comparison


def router_distribution(router_logits: np.ndarray, scoring: RouterScoring) -> np.ndarray:
    """r over the last axis, float64: softmax(z), or sigmoid(z) / sum sigmoid(z) for sigmoid routers."""
    z = np.asarray(router_logits, dtype=np.float64)
    if scoring.kind == "softmax":
        w = np.exp(z - z.max(axis=-1, keepdims=True))
    else:
        w = 1.0 / (1.0 + np.exp(-z))
    return w / w.sum(axis=-1, keepdims=True)


def _members(top: np.ndarray, num_experts: int) -> np.ndarray:
    """Boolean membership [..., E] of index sets [..., K]."""
    member = np.zeros((*top.shape[:-1], num_experts), dtype=bool)
    np.put_along_axis(member, top, True, axis=-1)
    return member


def _consecutive(starts: np.ndarray, num_tokens: int) -> np.ndarray:
    """Positions t >= 1 whose previous position belongs to the same sequence."""
    first = np.zeros(num_tokens, dtype=bool)
    first[starts] = True
    return np.flatnonzero(~first)


def _windows(member: np.ndarray, bounds: np.ndarray, w: int) -> np.ndarray:
    """Distinct experts [L] per non-overlapping window of w tokens, mean over the windows (NaN if none)."""
    sizes = [member[s:s + w].any(axis=0).sum(axis=-1) for lo, hi in zip(bounds[:-1], bounds[1:])
             for s in range(lo, hi - w + 1, w)]
    return np.mean(sizes, axis=0) if sizes else np.full(member.shape[1], np.nan)


def _calibration_of(trace, calibration: Calibration | None) -> tuple[Calibration, str]:
    if calibration is not None:
        calibration.check(trace.num_layers, trace.num_experts, trace.vocab_size)
        return calibration, "given"
    builder = CalibrationBuilder(trace.num_layers, trace.num_experts, trace.vocab_size, trace.top_k, _scoring(trace).groups)
    scores = _scoring(trace).selection_scores(trace.router_logits)
    for lo, hi in trace.sequences():
        builder.add(scores[lo:hi], trace.token_ids[lo:hi])
    return builder.finish({"text": "the trace itself (in-sample)"}), "in-sample (from the trace)"


def _scoring(trace) -> RouterScoring:
    return trace.scoring if trace.scoring is not None else RouterScoring("softmax")


def paper_policy(name: str, capacity: int, num_experts: int, top_k: int):
    """The paper's setting of preset `name` at C of E experts: the preset, and PSR at `psr_bonus(C, E)` (lambda 0.3
    at half residency, 0.25 at a quarter)."""
    return preset(name, capacity, top_k, **({"bonus": psr_bonus(capacity, num_experts)} if name == "psr" else {}))


def replay_policies(trace, calibration: Calibration, capacities, names=POLICIES,
                    floor: tuple[float, float] | None = None) -> dict:
    """The replay summaries (`ReplayResult.summary`, with "policy": its name) of the paper's settings of `names`
    (`paper_policy`) over `trace` at each capacity in [K, E]: {C: {name: summary}}. The one loop that `routing_stats`,
    the synthetic source's fit and the crossover map replay the paper's policies through. floor: (all-resident ms
    per token, ms per copy): each summary also gets "floor_ms", the mean schedule floor per token of its copies
    (`specmoe.routing.schedule`; the trace's tokens decoded one after another)."""
    num_experts, k = trace.router_logits.shape[-1], trace.top_k
    out = {}
    for capacity in capacities:
        if not k <= capacity <= num_experts:
            continue
        row = out[int(capacity)] = {}
        for name in names:
            policy = paper_policy(name, capacity, num_experts, k)
            result = replay(policy, trace.router_logits, trace.pregate_logits, trace.token_ids, calibration,
                            sequence_starts=trace.sequence_starts, scoring=trace.scoring)
            row[name] = {"policy": policy.name, **result.summary()}
            if floor is not None:
                all_resident_ms, copy_ms = floor
                row[name]["floor_ms"] = float(schedule_floor(result.demand_copies, result.prefetch_copies,
                                                             all_resident_ms / trace.router_logits.shape[1], copy_ms).mean())
    return out


def _per_layer(values) -> list:
    return [None if not np.isfinite(v) else float(v) for v in np.asarray(values, dtype=np.float64)]


def routing_stats(trace, calibration: Calibration | None = None, capacities=(8, 16, 32, 48),
                  windows=WINDOWS, bonuses=BONUSES, policy_capacities=(32, 16),
                  floor: tuple[float, float] | None = None) -> dict:
    """The statistics of the module docstring for `trace` (router and pre-gate logits of exact routing).

    calibration: the model's (held-out text; Delta_l, warm sets, token prior for the replays); None builds one
    from the trace itself, which the result says (in-sample). capacities: C of the LRU miss-rate curve;
    policy_capacities: C at which the presets of POLICIES are replayed (capacities outside [K, E] are
    skipped); floor: (all-resident ms per token, ms per copy) adds each replay's "floor_ms" (`replay_policies`). Returns {"tokens", "sequences", "geometry", "model", "calibration", "per_layer": {name: [L]},
    "mean": {name: mean over layers}, "random_routing": {name: the value under uniform random routing},
    "lru_miss_rate": {C: [L]}, "lru_copies_per_token": {C: float}, "policies": {"name@C=c": replay summary}}."""
    scoring = _scoring(trace)
    calibration, calibration_kind = _calibration_of(trace, calibration)
    num_tokens, num_layers, num_experts = trace.router_logits.shape
    k = trace.top_k
    scores = scoring.selection_scores(trace.router_logits)  # [T, L, E] float64
    own = _top_k(scores, k, scoring.groups)
    member = _members(own, num_experts)
    per_layer: dict[str, np.ndarray] = {}

    r = router_distribution(trace.router_logits, scoring)
    entropy = -(r * np.log(np.where(r > 0, r, 1.0))).sum(-1)  # [T, L], nats
    per_layer["router_entropy"] = entropy.mean(0)
    per_layer["router_entropy_normalised"] = entropy.mean(0) / math.log(num_experts)

    inside = np.where(member, scores, np.inf).min(-1)
    outside = np.where(member, -np.inf, scores).max(-1)
    delta = np.asarray(calibration.delta, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        margin = (inside - outside) / delta[None, :]  # [T, L]; a layer with Delta 0 gives inf / NaN
    per_layer["delta"] = delta
    per_layer["margin_over_delta_mean"] = margin.mean(0)
    per_layer["margin_over_delta_median"] = np.median(margin, axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        lead = (scores - outside[..., None]) / delta[None, :, None]  # [T, L, E], own top-K members' lead
    for bonus in bonuses:
        per_layer[f"margin_below_{bonus:g}"] = (margin < bonus).mean(0)
        per_layer[f"flippable_{bonus:g}"] = (member & (lead < bonus)).sum(-1).mean(0)

    pairs = _consecutive(trace.sequence_starts, num_tokens)
    per_layer["reuse_consecutive"] = (member[pairs] & member[pairs - 1]).sum(-1).mean(0) / k if pairs.size \
        else np.full(num_layers, np.nan)

    pre_scores = scoring.selection_scores(trace.pregate_logits)[:, 1:]  # row l predicts layer l (its bias)
    pre = _members(_top_k(pre_scores, k, scoring.groups), num_experts)
    per_layer["pregate_recall"] = np.concatenate([[np.nan], (pre & member[:, 1:]).sum(-1).mean(0) / k])

    bounds = np.append(trace.sequence_starts, num_tokens)
    for w in windows:
        per_layer[f"distinct_w{w}"] = _windows(member, bounds, w)

    load = member.sum(0) / num_tokens  # [L, E]
    share = load / load.sum(-1, keepdims=True)
    per_layer["load_max_over_mean"] = load.max(-1) / load.mean(-1)
    per_layer["load_entropy_normalised"] = -(share * np.log(np.where(share > 0, share, 1.0))).sum(-1) \
        / math.log(num_experts)

    miss, lru_copies, policies = {}, {}, {}
    run = dict(sequence_starts=trace.sequence_starts, scoring=trace.scoring)
    for capacity in capacities:
        if k <= capacity <= num_experts:
            result = replay(preset("exact_lru", capacity, k), trace.router_logits, None, trace.token_ids,
                            calibration, **run)
            miss[int(capacity)] = _per_layer(result.demand_copies.sum(0) / (num_tokens * k))
            lru_copies[int(capacity)] = float(result.demand_copies.sum() / num_tokens)
    for capacity, row in replay_policies(trace, calibration, policy_capacities, floor=floor).items():
        policies.update({f"{name}@C={capacity}": summary for name, summary in row.items()})

    chance = k / num_experts
    return {
        "tokens": int(num_tokens), "sequences": int(trace.sequence_starts.size),
        "geometry": {"num_layers": num_layers, "num_experts": num_experts, "top_k": k},
        "model": getattr(trace, "model", ""), "calibration": calibration_kind,
        "per_layer": {name: _per_layer(values) for name, values in per_layer.items()},
        "mean": {name: float(np.nanmean(values)) if np.isfinite(values).any() else None
                 for name, values in per_layer.items()},
        "random_routing": {"reuse_consecutive": chance, "pregate_recall": chance, "load_max_over_mean": 1.0,
                           "load_entropy_normalised": 1.0,
                           **{f"distinct_w{w}": num_experts * (1 - (1 - chance) ** w) for w in windows}},
        "lru_miss_rate": miss, "lru_copies_per_token": lru_copies, "policies": policies,
    }


def stats_tables(stats: dict):
    """pandas tables of a `routing_stats` result: (per layer, with a mean and a random-routing row; LRU miss
    rate by capacity, per layer; copies per token of the replayed policies)."""
    import pandas as pd

    layers = pd.DataFrame(stats["per_layer"])
    layers.index.name = "layer"
    layers.loc["mean"] = pd.Series(stats["mean"])
    layers.loc["random routing"] = pd.Series(stats["random_routing"])
    miss = pd.DataFrame({f"C={c}": v for c, v in stats["lru_miss_rate"].items()})
    miss.index.name = "layer"
    if len(miss.columns):
        miss.loc["mean"] = miss.mean()
        miss.loc["copies per token"] = pd.Series({f"C={c}": v for c, v in stats["lru_copies_per_token"].items()})
    policies = pd.DataFrame(stats["policies"]).T
    return layers, miss, policies
