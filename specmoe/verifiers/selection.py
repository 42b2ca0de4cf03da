"""Block-level verifier expert selection: which experts each position of a verification block executes in one
MoE layer (paper, Section 7 and Appendix B "Block-level selection").

This is the only implementation: the harness speculative loop, the GPU engine and the CPU replay all call
`select_block` (or `select_block_into`, its allocation-free form for the engine's critical path).

Definitions, for one layer and a block of D positions with router logits z [D, E] (position 0 the root),
under the model's router rule (`specmoe.routing.RouterScoring`):

- selection scores s_d: what the router chooses on. Softmax routers (OLMoE, Qwen): s_d = z_d. Sigmoid
  routers (DeepSeek-V3): s_d = sigmoid(z_d) + b_l, the layer's selection bias b_l included (or the scores
  the caller passes as `scores`).
- router distribution r_d over all E experts: softmax(z_d) for softmax routers; for sigmoid routers the
  unbiased sigmoid normalised to sum 1, r_d = sigmoid(z_d) / sum_e sigmoid(z_d,e) (the paper defines r_d as
  the router softmax only; this is its sigmoid counterpart, a mass that sums to 1 like a softmax's, so that
  gamma and the entropy keep their meaning; the bias steers choice only and carries no mass).
- own top-K of a position: the K largest s_d, ties to the lower expert index, under group-limited choice
  where the model has it (n_group > 1: the topk_group groups with the largest sum of their two best s_d,
  then the top-K inside them): the experts the model itself executes, as the routing core ranks them.
- ``exact``: every position executes its own top-K; the eligible set is the union.
- otherwise A = the root's own top-K (group-limited where the model is). The demand of an expert e
  outside A is u_e = sum_d alpha_d * r_{d,e} * [e in own top-K of d]; m = the number of experts outside A
  with u_e > 0; q = u / sum(u) over them; H = -sum q ln q (nats); extra = min(ceil(gamma * e^H), m), 0 if
  m = 0 (rounding noise below 1e-9 in gamma * e^H is ignored, so that n equally demanded candidates at
  gamma = 1 give exactly n; a size beyond m, however large, is m: the float is never converted to an integer
  first). The eligible set S = A plus the `extra` experts outside A with the largest u
  (ties to the lower index).
- pruning (AcceptMoE's rerouting budget, counted in token->expert assignments): v_e = the number of positions
  whose own top-K holds e; a(S) = sum of v_e over experts outside S, computed once for S before pruning (the
  assignments that forming S already displaced; the paper does not say that it is recomputed). Members of S
  outside A that are not resident are removed in increasing order of u (ties: higher index first) while the
  sum of v_e over the removed members, this one included, is at most prune_budget * a(S); pruning stops at
  the first member that would exceed it. prune_budget = 0 removes nothing (every candidate has v_e >= 1).
- execution: the root executes A. Each position d >= 1 executes the top-K of s_d among S (ties: higher
  score, then lower index; no group step: S takes the place of the kept groups, and its candidates all come
  from group-limited own top-Ks); S never has fewer than K members, because it contains A and pruning never
  removes A. With a rescue threshold, a position with alpha_d >= threshold whose own top-1 is not in S
  executes that top-1 plus the top-(K-1) of S instead.
- execution weights: as the model weights its executed set (`specmoe.routing.kernels.execution_weights`):
  the unmodified router probability at the executed experts (softmax(z_d) over all E, or sigmoid(z_d)),
  renormalised over them if the model's router renormalises (a sigmoid router's sum plus 1e-20, as
  DeepSeek-V3's), times the routed scaling factor.
- union: the experts any position executes; missing: union members not resident (the block's copies).
- displaced[d]: the r_d mass of position d's own top-K that d does not execute.

Everything is computed in float64 from float32 or float64 logits. The sums over the experts (the normalisers of
r_d, the demand and the entropy) are `_halving_sum`s: a fixed pairwise order, which the device selection
(`specmoe.kernels.device_select`) reduces in log2(E) steps to the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from specmoe.routing import RouterScoring
from specmoe.routing.kernels import keep_groups
from specmoe.routing.scoring import check_groups

from .config import SelectorConfig

IN_ROOT, ELIGIBLE, EXECUTED = 1, 2, 4  # bits of the per-expert marks
ENTROPY_SLACK = 1e-9  # rounding noise ignored in gamma * e^H before the ceiling
TINY = 1e-290  # below this a sum of exp(z - max z) may have lost precision to underflow


@njit(cache=True)
def _top_k(score, members, count, k, out, start, scratch):
    """Write the k - start best of members[:count] (ascending expert indices, count >= k - start) by score into
    out[start:k], best first; ties go to the lower index (the earlier member), the routing core's rule for the
    router's own top-K. scratch: int64, at least `count` long."""
    want = k - start
    if want == 0:
        return
    # Only members scoring at least the smallest maximum of `want` disjoint groups can be among the best (that
    # many distinct members reach it); the insertion pass below, whose branches mispredict, sees just those.
    bound = np.inf
    for g in range(want):
        group_max = -np.inf
        for i in range(g * count // want, (g + 1) * count // want):
            group_max = max(group_max, np.float64(score[members[i]]))
        bound = min(bound, group_max)
    n_candidates = 0
    for i in range(count):
        e = members[i]
        scratch[n_candidates] = e
        n_candidates += np.float64(score[e]) >= bound
    n = 0
    kth = 0.0  # score of out[k - 1] once `want` candidates are in
    for i in range(n_candidates):
        e = scratch[i]
        x = score[e]
        if n == want:
            if not x > kth:
                continue
            p = k - 1
        else:
            p = start + n
            n += 1
        while p > start and x > score[out[p - 1]]:
            out[p] = out[p - 1]
            p -= 1
        out[p] = e
        if n == want:
            kth = score[out[k - 1]]


@njit(cache=True)
def _halving_sum(values, tree):
    """The sum of `values` in a fixed order that a GPU reduces in log2 steps and the host repeats bit for bit:
    the values padded with 0.0 to a power of two, then the second half added to the first, elementwise, until
    one is left (each addition rounds once, the pairs are fixed, so the bits follow from the values alone).
    Adding a 0.0 pad leaves a nonzero value's bits unchanged, so any larger power of two gives the same sum (the
    device pads to its row width). tree: float64 scratch of at least 2 len(values) entries (the padded length
    is below twice the count)."""
    n = values.shape[0]
    size = 1
    while size < n:
        size *= 2
    for i in range(n):
        tree[i] = values[i]
    for i in range(n, size):
        tree[i] = 0.0
    while size > 1:
        size //= 2
        for i in range(size):
            tree[i] += tree[i + size]
    return tree[0]


@njit(cache=True)
def _own_top_k(s, everyone, num_experts, k, out, n_group, topk_group, members, kept, group_score, scratch):
    """The router's own top-K of one position, best first, on its selection scores s [E] (ties to the lower
    index): under group-limited choice (n_group > 1 groups of consecutive experts, topk_group kept) the groups
    are scored by the sum of their two best scores, the topk_group best kept (ties to the lower group index)
    and the top-K taken inside them, as the routing core chooses (`specmoe.routing.kernels._rank_groups`).
    members, kept, scratch: int64 scratch [E]; group_score: float64 scratch [>= n_group]; the group step is the
    routing core's (`keep_groups`)."""
    if n_group <= 1 or topk_group >= n_group:
        _top_k(s, everyone, num_experts, k, out, 0, scratch)
        return
    size = num_experts // n_group
    keep_groups(s[:num_experts], n_group, topk_group, kept, group_score)
    count = 0
    for e in range(num_experts):
        if kept[e // size]:
            members[count] = e
            count += 1
    _top_k(s, members, count, k, out, 0, scratch)


@njit(cache=True)
def _select(params, rule, z, s, bias, resident, alpha, everyone, own, prob, work, iwork, tree, sets, selected,
            weights, displaced):
    """The selection of the module docstring for one layer and block of D = z.shape[0] positions, top-K with
    K = own.shape[1]. params: `SelectorConfig.kernel_params`; rule: the router's rule, float64 [kind (0
    softmax, 1 sigmoid), renormalise, scale, n_group, topk_group, scores given]; z [D, E]: router logits;
    s [D, E]: selection scores (softmax: z itself; sigmoid: given, or written here as sigmoid(z) + bias
    unless rule[5]); bias [E]: the layer's selection bias; everyone: int64 [E], 0..E-1.
    Scratch: own [D, K] (each position's own top-K), prob [D, E] (exp(z_d - max z_d), or sigmoid(z_d)),
    work float64 [2E + D] (u, the normalisers of r_d, group scores), iwork int64 [6E] (v, marks, ranked
    candidates, last executing position, the rankings' scratch, kept groups), tree float64 [2E] (the
    sums' scratch: the normalisers, the demand and the entropy are `_halving_sum`s).
    Outputs: sets [3, E] (eligible, union, missing), selected and weights [D, K], displaced [D].
    Returns (n_eligible, n_union, n_missing), or (-1, d, e) for a non-finite logit z[d, e] and (-2, d, 0)
    for a negative or non-finite alpha[d]."""
    block = params[0] != 0.0
    gamma, rescue, prune_budget = params[1], params[2], params[3]
    sigmoid, renormalise, scale = rule[0] != 0.0, rule[1] != 0.0, rule[2]
    n_group, topk_group, given = int(rule[3]), int(rule[4]), rule[5] != 0.0
    num_positions, num_experts = z.shape
    k = own.shape[1]
    u, norm = work[:num_experts], work[num_experts:num_experts + num_positions]
    group_score = work[num_experts + num_positions:]
    v, mark = iwork[:num_experts], iwork[num_experts:2 * num_experts]
    ranked, stamp = iwork[2 * num_experts:3 * num_experts], iwork[3 * num_experts:4 * num_experts]
    scratch, kept = iwork[4 * num_experts:5 * num_experts], iwork[5 * num_experts:]
    eligible, union, missing = sets[0], sets[1], sets[2]
    for e in range(num_experts):
        mark[e] = 0
        u[e] = 0.0
        v[e] = 0
        stamp[e] = -1
    for d in range(num_positions):
        if sigmoid:
            for e in range(num_experts):
                if not np.isfinite(z[d, e]):
                    return -1, d, e
                p = 1.0 / (1.0 + np.exp(-np.float64(z[d, e])))
                prob[d, e] = p
                if not given:
                    s[d, e] = p + bias[e]
            norm[d] = max(_halving_sum(prob[d], tree), TINY)  # all underflowed: r_d = 0, no demand
        else:
            top = -np.inf
            for e in range(num_experts):
                top = max(top, np.float64(z[d, e]))
            for e in range(num_experts):
                p = np.exp(np.float64(z[d, e]) - top)
                if p == 0.0 and not z[d, e] > -np.inf:
                    return -1, d, e
                prob[d, e] = p
            total = _halving_sum(prob[d], tree)
            norm[d] = total
            if not total < np.inf:  # NaN or +inf somewhere: the exps are NaN
                for e in range(num_experts):
                    if not np.isfinite(z[d, e]):
                        return -1, d, e
        # `ranked` is free until the extra candidates are ranked: the kept groups' members
        _own_top_k(s[d], everyone, num_experts, k, own[d], n_group, topk_group, ranked, kept, group_score, scratch)
        if block and not (alpha[d] >= 0.0 and alpha[d] < np.inf):
            return -2, d, 0

    n_eligible = 0
    if block:
        for j in range(k):
            mark[own[0, j]] = IN_ROOT | ELIGIBLE
        for d in range(num_positions):
            for j in range(k):
                e = own[d, j]
                v[e] += 1
                if not mark[e] & IN_ROOT:
                    u[e] += alpha[d] * prob[d, e] / norm[d]
        m = 0
        for e in range(num_experts):
            m += u[e] > 0.0
        demand = _halving_sum(u, tree)  # u >= 0: its zeros leave the sum's bits unchanged
        extra = 0
        if m > 0:
            # H = -(the sum of q ln q over the positive u), the terms in `group_score`'s scratch (free here; at
            # least E long)
            terms = group_score[:num_experts]
            for e in range(num_experts):
                q = u[e] / demand
                terms[e] = q * np.log(q) if u[e] > 0.0 else 0.0
            entropy = -_halving_sum(terms, tree)
            size = gamma * np.exp(entropy) - ENTROPY_SLACK  # may exceed any integer (gamma 1e300): saturate
            extra = m if size >= m else int(np.ceil(size))
        if extra > 0:  # the extra experts by decreasing u, ties to the lower index (all have u > 0: extra <= m)
            _top_k(u, everyone, num_experts, extra, ranked, 0, scratch)
        for i in range(extra):
            mark[ranked[i]] |= ELIGIBLE
        # pruning within the rerouting budget, a(S) taken before pruning
        displaced_assignments = 0
        for e in range(num_experts):
            if not mark[e] & ELIGIBLE:
                displaced_assignments += v[e]
        limit = prune_budget * displaced_assignments
        removed = 0
        for i in range(extra - 1, -1, -1):
            e = ranked[i]
            if resident[e]:
                continue
            if removed + v[e] > limit:
                break
            removed += v[e]
            mark[e] &= ~ELIGIBLE
        for e in range(num_experts):
            if mark[e] & ELIGIBLE:
                eligible[n_eligible] = e
                n_eligible += 1

    for d in range(num_positions):
        row = selected[d]
        if not block or d == 0:
            for j in range(k):
                row[j] = own[d, j]
        else:
            start = 0
            top1 = own[d, 0]
            if rescue >= 0.0 and alpha[d] >= rescue and not mark[top1] & ELIGIBLE:
                row[0] = top1
                start = 1
            _top_k(s[d], eligible, n_eligible, k, row, start, scratch)
        if sigmoid:  # the router's arithmetic (`specmoe.routing.kernels.execution_weights`)
            total = 0.0
            for j in range(k):
                total += prob[d, row[j]]
            total += 1e-20
            for j in range(k):
                weights[d, j] = (prob[d, row[j]] / total if renormalise else prob[d, row[j]]) * scale
        else:
            denominator = norm[d]
            if renormalise:
                denominator = 0.0
                for j in range(k):
                    denominator += prob[d, row[j]]
            if denominator >= TINY:
                for j in range(k):
                    weights[d, j] = prob[d, row[j]] / denominator * scale
            else:  # renormalised over experts whose softmax underflows: shift by their own maximum instead
                shift = -np.inf
                for j in range(k):
                    shift = max(shift, np.float64(z[d, row[j]]))
                denominator = 0.0
                for j in range(k):
                    denominator += np.exp(np.float64(z[d, row[j]]) - shift)
                for j in range(k):
                    weights[d, j] = np.exp(np.float64(z[d, row[j]]) - shift) / denominator * scale
        for j in range(k):
            mark[row[j]] |= EXECUTED
            stamp[row[j]] = d
        lost = 0.0
        for j in range(k):
            if stamp[own[d, j]] != d:
                lost += prob[d, own[d, j]]
        displaced[d] = lost / norm[d]

    n_union = 0
    n_missing = 0
    for e in range(num_experts):
        if mark[e] & EXECUTED:
            union[n_union] = e
            n_union += 1
            if not resident[e]:
                missing[n_missing] = e
                n_missing += 1
            if not block:
                eligible[n_eligible] = e
                n_eligible += 1
    return n_eligible, n_union, n_missing


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
        if not 1 <= top_k <= num_experts or max_positions < 1:
            raise ValueError(f"need 1 <= top_k <= num_experts and max_positions >= 1, got top_k={top_k}, "
                             f"num_experts={num_experts}, max_positions={max_positions}")
        if np.dtype(weight_dtype) not in (np.float32, np.float64):
            raise ValueError(f"weight_dtype must be float32 or float64, got {weight_dtype}")
        self.max_positions, self.num_experts, self.top_k = max_positions, num_experts, top_k
        self.sets = np.empty((3, num_experts), dtype=np.int64)
        self.eligible, self.union, self.missing = self.sets
        self.selected = np.empty((max_positions, top_k), dtype=np.int64)
        self.weights = np.empty((max_positions, top_k), dtype=weight_dtype)
        self.displaced = np.empty(max_positions)
        self._everyone = np.arange(num_experts, dtype=np.int64)
        self._own = np.empty((max_positions, top_k), dtype=np.int64)
        self._prob = np.empty((max_positions, num_experts))
        self._scores = np.empty((max_positions, num_experts))  # a sigmoid router's selection scores
        self._zero_bias = np.zeros(num_experts)
        self._work = np.empty(2 * num_experts + max_positions)
        self._iwork = np.empty(6 * num_experts, dtype=np.int64)
        self._tree = np.empty(2 * num_experts)
        self._rule_of: tuple = (None, None, None)  # the last scoring's key, its kernel rule, the scoring

    def rule(self, scoring, given: bool) -> np.ndarray:
        """The kernel's float64 rule of `scoring` (a `RouterScoring`, or a bool: a softmax router that
        renormalises or not), remembered for the next call with the same scoring."""
        key = (scoring if isinstance(scoring, bool) else id(scoring), given)
        if self._rule_of[0] != key:
            if isinstance(scoring, (bool, np.bool_)):
                rule = np.array([0.0, float(scoring), 1.0, 1.0, 1.0, 0.0])
            elif isinstance(scoring, RouterScoring):
                rule = np.array([float(scoring.kind == "sigmoid"), float(scoring.renormalise), scoring.scale,
                                 scoring.n_group, scoring.topk_group, float(given)])
                check_groups(scoring.n_group, scoring.topk_group, self.num_experts, self.top_k)
            else:
                raise ValueError(f"scoring must be a RouterScoring or a bool (softmax, renormalised or not), "
                                 f"got {type(scoring).__name__}")
            self._rule_of = (key, rule, scoring)
        return self._rule_of[1]

    def selection(self, positions: int, counts: tuple[int, int, int]) -> BlockSelection:
        """A `BlockSelection` of copies of the results of the last call (for tests and records)."""
        n_eligible, n_union, n_missing = counts
        return BlockSelection(self.eligible[:n_eligible].copy(), self.selected[:positions].copy(),
                              self.weights[:positions].copy(), self.union[:n_union].copy(),
                              self.missing[:n_missing].copy(), self.displaced[:positions].copy())


def select_block(config: SelectorConfig, router_logits: np.ndarray, resident: np.ndarray, alpha: np.ndarray,
                 top_k: int, scoring: RouterScoring | bool, *, layer: int = 0,
                 scores: np.ndarray | None = None) -> BlockSelection:
    """Select the experts of one layer for one verification block.

    router_logits: float32 or float64 [D, E] (D >= 1 positions, row 0 the root); resident: bool [E], the
    experts present before the block (the pool); alpha: float [D], the position weights (`position_weights`
    or `confidence_weights`; ignored by ``exact``); top_k: K of the model (K <= E); scoring: the model's
    router rule (`RouterScoring`: softmax or sigmoid, its selection bias, expert groups, renormalisation and
    scaling), or for a softmax router just whether it renormalises its top-K weights (True / False); layer:
    the MoE layer, whose row of the scoring's selection bias applies; scores: float [D, E], a sigmoid router's
    selection scores to rank by instead of sigmoid(z) + bias in float64 (the harness, the engine and the
    replays pass none). Weights come back in float64. Raises ValueError on wrong shapes or
    non-finite values.
    """
    shape = np.shape(router_logits)
    if len(shape) != 2 or shape[0] < 1 or isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) \
            or not 1 <= top_k <= shape[1]:
        raise ValueError(f"router logits must be [D >= 1, E >= top_k] with top_k >= 1, got shape {shape} and "
                         f"top_k={top_k!r}")
    buffers = SelectionBuffers(shape[0], shape[1], int(top_k), np.float64)
    counts = select_block_into(config, router_logits, resident, alpha, top_k, scoring, buffers, layer=layer,
                               scores=scores)
    return buffers.selection(shape[0], counts)


def select_block_into(config: SelectorConfig, router_logits: np.ndarray, resident: np.ndarray, alpha: np.ndarray,
                      top_k: int, scoring: RouterScoring | bool, buffers: SelectionBuffers, *, layer: int = 0,
                      scores: np.ndarray | None = None) -> tuple[int, int, int]:
    """`select_block` writing into `buffers` instead of allocating (the engine's per-layer call): returns
    (n_eligible, n_union, n_missing). The same checks as `select_block`; the weights take the buffers' dtype."""
    if not isinstance(config, SelectorConfig):
        raise ValueError(f"expected a SelectorConfig, got {type(config).__name__}")
    z = router_logits
    if not isinstance(z, np.ndarray) or z.dtype not in _FLOATS:
        z = np.asarray(z, dtype=np.float64)
    if z.ndim != 2 or not 1 <= z.shape[0] <= buffers.max_positions or z.shape[1] != buffers.num_experts \
            or top_k != buffers.top_k:
        raise ValueError(f"router logits must be [D, E] with 1 <= D <= {buffers.max_positions}, E = "
                         f"{buffers.num_experts} and top_k = {buffers.top_k}, got shape {z.shape} and top_k={top_k}")
    if not isinstance(resident, np.ndarray) or resident.dtype != np.bool_ or resident.shape != (z.shape[1],):
        raise ValueError(f"resident must be a bool array [E={z.shape[1]}], got {_describe(resident)}")
    if not isinstance(alpha, np.ndarray) or alpha.dtype != np.float64:
        alpha = np.asarray(alpha, dtype=np.float64)
    if alpha.shape != (z.shape[0],):
        raise ValueError(f"alpha must have one weight per position, [D={z.shape[0]}], got shape {alpha.shape}")
    b = buffers
    rule = b.rule(scoring, scores is not None)
    s, bias = z, b._zero_bias
    if rule[0] != 0.0:  # sigmoid: rank the selection scores
        if scores is None:
            s = b._scores[:z.shape[0]]
            if scoring.bias is not None:
                if not 0 <= layer < scoring.bias.shape[0] or scoring.bias.shape[1] != z.shape[1]:
                    raise ValueError(f"layer {layer} has no row of E={z.shape[1]} in the selection bias of shape "
                                     f"{scoring.bias.shape}")
                bias = scoring.bias[layer]
        else:
            s = np.asarray(scores)
            if s.dtype not in _FLOATS:
                s = s.astype(np.float64)
            if s.shape != z.shape or not np.isfinite(s).all():
                raise ValueError(f"selection scores must be finite and shaped like the router logits {z.shape}, "
                                 f"got shape {s.shape}")
    first, second, third = _select(config.kernel_params, rule, z, s, bias, resident, alpha, b._everyone, b._own,
                                   b._prob, b._work, b._iwork, b._tree, b.sets, b.selected, b.weights, b.displaced)
    if first == -1:
        raise ValueError(f"router logit [{second}, {third}] is not finite ({z[second, third]})")
    if first == -2:
        raise ValueError(f"alpha[{second}] must be finite and >= 0, got {alpha[second]}")
    return first, second, third


_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def _describe(array) -> str:
    return f"{type(array).__name__} of shape {np.shape(array)} and dtype {getattr(array, 'dtype', None)}"
