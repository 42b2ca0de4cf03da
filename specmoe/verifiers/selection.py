"""Block-level verifier expert selection: which experts each position of a verification block executes in one
MoE layer (paper, Section 7 and Appendix B "Block-level selection").

This is the only implementation: the harness speculative loop, the GPU engine and the CPU replay all call
`select_block` (or `select_block_into`, its allocation-free form for the engine's critical path).

Definitions, for one layer and a block of D positions with router logits z [D, E] (position 0 the root):

- own top-K of a position: the K largest z_d, ties to the lower expert index (as the routing core ranks).
- ``exact``: every position executes its own top-K; the eligible set is the union.
- otherwise A = the root's own top-K and r_d = softmax(z_d) over all E experts. The demand of an expert e
  outside A is u_e = sum_d alpha_d * r_{d,e} * [e in own top-K of d]; m = the number of experts outside A
  with u_e > 0; q = u / sum(u) over them; H = -sum q ln q (nats); extra = min(ceil(gamma * e^H), m), 0 if
  m = 0 (rounding noise below 1e-9 in gamma * e^H is ignored, so that n equally demanded candidates at
  gamma = 1 give exactly n). The eligible set S = A plus the `extra` experts outside A with the largest u
  (ties to the lower index).
- pruning (AcceptMoE's rerouting budget, counted in token->expert assignments): v_e = the number of positions
  whose own top-K holds e; a(S) = sum of v_e over experts outside S, computed once for S before pruning (the
  assignments that forming S already displaced; the paper does not say that it is recomputed). Members of S
  outside A that are not resident are removed in increasing order of u (ties: higher index first) while the
  sum of v_e over the removed members, this one included, is at most prune_budget * a(S); pruning stops at
  the first member that would exceed it. prune_budget = 0 removes nothing (every candidate has v_e >= 1).
- execution: the root executes A. Each position d >= 1 executes the top-K of z_d among S (ties: higher
  logit, then lower index); S never has fewer than K members, because it contains A and pruning never removes
  A. With a rescue threshold, a position with alpha_d >= threshold whose own top-1 is not in S executes that
  top-1 plus the top-(K-1) of S instead.
- execution weights: the unmodified softmax of z_d at the executed experts, renormalised over them if the
  model's router renormalises.
- union: the experts any position executes; missing: union members not resident (the block's copies).
- displaced[d]: the router softmax mass of position d's own top-K that d does not execute.

Everything is computed in float64 from float32 or float64 logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import SelectorConfig


@dataclass(frozen=True)
class BlockSelection:
    """What one layer executes for one verification block of D positions (see the module docstring).

    eligible: int64 [n], the eligible set after pruning, ascending (``exact``: the union).
    selected: int64 [D, K], the experts each position executes; row 0 is the root's own top-K in rank order,
    other rows the rescued top-1 (if any) first, then by descending logit.
    weights: float64 [D, K], execution weights aligned with `selected`.
    union: int64 [u], ascending; missing: int64 [c], the union members not resident, ascending.
    displaced: float64 [D], router softmax mass of each position's own top-K that it does not execute.
    """

    eligible: np.ndarray
    selected: np.ndarray
    weights: np.ndarray
    union: np.ndarray
    missing: np.ndarray
    displaced: np.ndarray


class SelectionBuffers:
    """Preallocated outputs and scratch of `select_block_into` for blocks of up to `max_positions`
    positions over `num_experts` experts, top-`top_k` (one per engine, reused for every layer and block).

    After a call that returned (n_eligible, n_union, n_missing) for a block of D positions, the results are
    eligible[:n_eligible], selected[:D], weights[:D] (dtype `weight_dtype`), union[:n_union],
    missing[:n_missing] and displaced[:D], with the meanings of `BlockSelection`.
    """

    def __init__(self, max_positions: int, num_experts: int, top_k: int, weight_dtype=np.float32):
        raise NotImplementedError

    def selection(self, positions: int, counts: tuple[int, int, int]) -> BlockSelection:
        """A `BlockSelection` of copies of the results of the last call (for tests and records)."""
        raise NotImplementedError


def select_block(config: SelectorConfig, router_logits: np.ndarray, resident: np.ndarray, alpha: np.ndarray,
                 top_k: int, renormalise: bool) -> BlockSelection:
    """Select the experts of one layer for one verification block.

    router_logits: float32 or float64 [D, E] (D >= 1 positions, row 0 the root); resident: bool [E], the
    experts present before the block (the pool); alpha: float [D], the position weights (`position_weights`
    or `confidence_weights`; ignored by ``exact``); top_k: K of the model (K <= E); renormalise: whether the
    model's router renormalises its top-K weights. Raises ValueError on wrong shapes or non-finite values.
    """
    raise NotImplementedError


def select_block_into(config: SelectorConfig, router_logits: np.ndarray, resident: np.ndarray, alpha: np.ndarray,
                      top_k: int, renormalise: bool, buffers: SelectionBuffers) -> tuple[int, int, int]:
    """`select_block` writing into `buffers` instead of allocating (the engine's per-layer call): returns
    (n_eligible, n_union, n_missing). The same checks as `select_block`."""
    raise NotImplementedError
