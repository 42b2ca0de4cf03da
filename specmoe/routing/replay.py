"""Replay of a routing policy over recorded router and pre-gate logits (no model, no torch).

`replay` runs `LogicalCache.run_span` layer by layer over a recorded sequence (or several, reset at each
boundary): the same code the harness and the engines run, so its decisions are theirs on the same logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import validate
from .cache import LogicalCache
from .calibration import Calibration, CalibrationError
from .policy import PolicyConfig
from .scoring import RouterScoring


@dataclass
class ReplayResult:
    """Per (token, layer) decisions of a policy. Copies of a prefetch that never executed are counted in
    `unused_prefetches` at the step that inserted it."""

    policy: PolicyConfig
    selected: np.ndarray  # int64 [T, L, K], executed experts, best first
    slots: np.ndarray  # int64 [T, L, K], slot of each executed expert
    demand_copies: np.ndarray  # int64 [T, L]
    prefetch_copies: np.ndarray  # int64 [T, L]
    unused_prefetches: np.ndarray  # int64 [T, L]
    displaced_mass: np.ndarray  # float64 [T, L], router softmax mass of its own top-K not executed
    replaced: np.ndarray  # int64 [T, L], router top-K slots not executed

    @property
    def copies(self) -> np.ndarray:
        return self.demand_copies + self.prefetch_copies

    def summary(self) -> dict:
        """Per-token means (sums over layers, averaged over tokens)."""
        tokens = max(self.selected.shape[0], 1)
        return {
            "copies": float(self.copies.sum() / tokens),
            "demand": float(self.demand_copies.sum() / tokens),
            "prefetch": float(self.prefetch_copies.sum() / tokens),
            "unused": float(self.unused_prefetches.sum() / tokens),
            "replaced": float(self.replaced.sum() / tokens),
            "displaced_mass": float(self.displaced_mass.sum() / tokens),
        }


def valid_sequence_starts(starts: np.ndarray, num_tokens: int) -> bool:
    """Whether `starts` (1-D) splits T = num_tokens positions into sequences: 0 first, strictly increasing,
    all below T (a trace and `replay` share this rule)."""
    return bool(starts.ndim == 1 and starts.size and starts[0] == 0 and np.all(np.diff(starts) > 0)
                and starts[-1] < max(num_tokens, 1))


def replay(policy: PolicyConfig, router_logits: np.ndarray, pregate_logits: np.ndarray | None,
           token_ids: np.ndarray | None, calibration: Calibration,
           sequence_starts: np.ndarray | None = None, groups: tuple[int, int] = (1, 1),
           scoring: RouterScoring | None = None) -> ReplayResult:
    """Run `policy` over router logits [T, L, E] and pre-gate logits [T, L, E] (row l = router of layer l
    on layer l-1's MoE input; row 0 is ignored; None for policies without a pre-gate), with the input
    token of each position [T] (None: the token prior is not used). `sequence_starts` lists the positions
    where a new sequence begins (default: one sequence); the cache is reset at each. `scoring`: the router's
    rule (`RouterScoring`, as traces and block records store it): the logits are the router's raw logits and
    routing ranks `scoring.selection_scores` of them (sigmoid plus bias for DeepSeek-V3) under its groups, as
    the harness and the engines do. Without it the logits are ranked as they are, under `groups` (n_group,
    topk_group): a softmax router's logits, or selection scores computed elsewhere."""
    if not isinstance(calibration, Calibration):
        raise CalibrationError(f"expected a Calibration, got {type(calibration).__name__}")
    z = validate.real_array(router_logits, "router logits [T, L, E]", ValueError, 3)
    num_tokens, num_layers, num_experts = z.shape
    if pregate_logits is not None and np.shape(pregate_logits) != z.shape:
        raise ValueError(f"pre-gate logits must have the router logits' shape {z.shape}, got {np.shape(pregate_logits)}")
    if pregate_logits is None and policy.insert_budget > 0:
        raise ValueError(f"policy {policy.name} inserts pre-gate predictions: pass pregate_logits")
    validate.check_real(z, "router logits", ValueError)
    if scoring is not None:
        groups = scoring.groups
        if scoring.kind != "softmax":
            z = scoring.selection_scores(z)
            if pregate_logits is not None:
                pregate_logits = scoring.selection_scores(pregate_logits)
    if pregate_logits is not None:  # row 0 is ignored (the harness records NaN there)
        pregate_logits = validate.real_array(pregate_logits, "pre-gate logits [T, L, E]", ValueError, 3)
        validate.check_real(pregate_logits[:, 1:], "pre-gate logits of layers 1..L-1", ValueError)
    tokens = np.full(num_tokens, -1, dtype=np.int64) if token_ids is None else \
        validate.token_ids(token_ids, num_tokens, calibration.vocab_size, "token ids", ValueError, unknown_ok=True)
    starts = validate.integer_array([0] if sequence_starts is None else sequence_starts, "sequence_starts",
                                    ValueError, 1)
    if not valid_sequence_starts(starts, num_tokens):
        raise ValueError("sequence_starts must begin at 0 and increase strictly within [0, T)")
    bounds = np.append(starts, num_tokens)

    cache = LogicalCache(policy, calibration, num_layers, num_experts, groups)
    k = policy.top_k
    selected = np.empty((num_tokens, num_layers, k), dtype=np.int64)
    slots = np.empty_like(selected)
    demand = np.empty((num_tokens, num_layers), dtype=np.int64)
    prefetch = np.empty_like(demand)
    replaced = np.empty_like(demand)
    displaced = np.empty((num_tokens, num_layers))
    unused = np.zeros_like(demand)
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        unused_seq = unused[lo:hi]
        cache.reset()
        for layer in range(num_layers):
            g = pregate_logits[lo:hi, layer] if pregate_logits is not None and layer > 0 else None
            out: dict = {}
            selected[lo:hi, layer] = cache.run_span(layer, z[lo:hi, layer], g, tokens[lo:hi], out=out,
                                                    unused_at=unused_seq)
            slots[lo:hi, layer] = out["slots"]
            demand[lo:hi, layer] = out["demand"]
            prefetch[lo:hi, layer] = out["prefetch"]
            replaced[lo:hi, layer] = out["replaced"]
            displaced[lo:hi, layer] = out["displaced"]
        cache.reset(unused_at=unused_seq)
    return ReplayResult(policy, selected, slots, demand, prefetch, unused, displaced, replaced)
