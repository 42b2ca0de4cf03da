"""Numba kernels of the logical cache: Algorithm 1 of the paper, parts 1 and 2, for one layer and token.

This is the only implementation of the routing policies: `LogicalCache` (harness and engines) and `replay`
call these functions. State lives in a few plain arrays (see `new_state`) so that one call crosses the
Python/numba boundary cheaply; the row indices below name their contents. Token indices t count the
positions of the current sequence; "-1" means never.

Conventions (docs/design.md, "The routing contract"): statistics in float64; EMA decays 0.5 and 0.98 over the
router's own top-K; A priority = s_fast + s_slow + pi_l(x_t); lru priority = 1 + last token index of
execution or insertion (warm experts 0). The priority is a snapshot taken once per (token, layer) before
any insertion. Eviction picks the lowest priority, ties to the lowest expert index. The biased top-K
breaks ties by the higher raw logit, then the lower index; plain rankings by the lower index.
"""

from __future__ import annotations

import numpy as np
from numba import njit

# istate: int64 [L, N_IROWS, E]
SLOT_EXPERT = 0  # [:C] the expert each slot is assigned to
EXPERT_SLOT = 1  # slot of each expert, -1 if not logically resident
LAST_USE = 2  # token of the last execution or insertion, -1 never
PROTECTED = 3  # token at which the expert joined the protected set B
SELECTED = 4  # token at which the expert was in the executed set S
PREFETCHED = 5  # token of a prefetch insertion whose expert has not executed since, -1 otherwise
PREDICTED = 6  # [:M] the pre-gate ranking of the token PRED_TOKEN, M = max(K, w)
N_IROWS = 7

# iscalar: int64 [L, N_ISCALARS]
POS = 0  # index of the current token: tokens completed by part 2 in this layer
SNAP_TOKEN = 1  # token whose priority snapshot is in fstate[:, PRIORITY]
PRED_TOKEN = 2  # token whose pre-gate ranking is in istate[:, PREDICTED]
N_ISCALARS = 3

# fstate: float64 [L, N_FROWS, E]
S_FAST = 0
S_SLOW = 1
PRIORITY = 2
N_FROWS = 3

# fscalar: float64 [L, N_FSCALARS]
RANGE_SUM = 0  # running logit range of this sequence (delta = "running")
RANGE_COUNT = 1
N_FSCALARS = 2

# counters: int64 [L, N_COUNTERS], accumulated over sequences until cleared
C_TOKENS = 0  # (token, layer) steps
C_DEMAND = 1  # demand copies
C_PREFETCH = 2  # prefetch copies (insertions by part 1)
C_UNUSED = 3  # prefetches evicted, or left at the end of the sequence, without executing
C_REPLACED = 4  # router top-K slots not executed
N_COUNTERS = 5

# params: int64 [N_PARAMS]
P_KIND = 0  # KIND_* below
P_CAPACITY = 1
P_TOP_K = 2
P_BUDGET = 3
P_WINDOW = 4
P_LRU = 5  # 1 for lru priority, 0 for A
P_PROTECT = 6
P_RUNNING = 7  # 1 for a running delta
P_GROUPS = 8  # expert groups of group-limited choice (1: none)
P_TOPK_GROUP = 9  # groups kept per token
N_PARAMS = 10

KIND_EXACT, KIND_CACHE_PRIOR, KIND_PSR, KIND_SPEC_EXEC = 0, 1, 2, 3
SCORE_SOFTMAX, SCORE_SIGMOID = 0, 1  # RouterScoring.code
FAST_DECAY, SLOW_DECAY = 0.5, 0.98


@njit(cache=True, inline="always")
def _ahead(sa, za, a, sb, zb, b):
    """True if candidate a ranks before b: higher score, then higher raw logit, then lower index."""
    if sa != sb:
        return sa > sb
    if za != zb:
        return za > zb
    return a < b


@njit(cache=True)
def _rank(score, raw, k, out):
    """Write the k best experts by (score, raw, -index) into out[:k], best first (one insertion pass)."""
    n = 0
    for e in range(score.shape[0]):
        s = score[e]
        r = raw[e]
        if n == k and not _ahead(s, r, e, score[out[k - 1]], raw[out[k - 1]], out[k - 1]):
            continue
        i = n if n < k else k - 1
        while i > 0 and _ahead(s, r, e, score[out[i - 1]], raw[out[i - 1]], out[i - 1]):
            out[i] = out[i - 1]
            i -= 1
        out[i] = e
        if n < k:
            n += 1


@njit(cache=True)
def keep_groups(score, n_group, topk_group, kept, group_score):
    """Group-limited choice's group step (DeepSeek-V3): the E experts of `score` [E] form n_group groups of
    consecutive indices; a group scores the sum of its two best scores (float64, into group_score [>= n_group]);
    kept [n_group] (bool) marks the topk_group best groups, ties to the lower group index. Shared by the routing
    core and block-level selection (`specmoe.verifiers.selection`)."""
    size = score.shape[0] // n_group
    for grp in range(n_group):
        best1 = -np.inf
        best2 = -np.inf
        for e in range(grp * size, (grp + 1) * size):
            x = np.float64(score[e])
            if x > best1:
                best2 = best1
                best1 = x
            elif x > best2:
                best2 = x
        group_score[grp] = best1 + best2
        kept[grp] = False
    for _ in range(topk_group):
        best = -1
        for grp in range(n_group):
            if not kept[grp] and (best < 0 or group_score[grp] > group_score[best]):
                best = grp
        kept[best] = True


@njit(cache=True)
def _rank_groups(score, raw, k, out, n_group, topk_group):
    """`_rank` under group-limited choice (DeepSeek-V3): the E experts form n_group groups of consecutive
    indices; a group scores the sum of its two best scores; the topk_group best groups are kept (ties to the
    lower group index) and the k best experts of the kept groups come first. Experts of the other groups follow
    (by raw, then index) where k exceeds the kept experts (the pre-gate window of part 1). Without groups
    (n_group 1, or every group kept) this is `_rank`."""
    if n_group <= 1 or topk_group >= n_group:
        _rank(score, raw, k, out)
        return
    size = score.shape[0] // n_group
    kept = np.zeros(n_group, dtype=np.bool_)
    keep_groups(score, n_group, topk_group, kept, np.empty(n_group))
    masked = np.empty(score.shape[0])
    for e in range(score.shape[0]):
        masked[e] = score[e] if kept[e // size] else -np.inf
    _rank(masked, raw, k, out)


@njit(cache=True)
def _snapshot(ist, isc, fst, params, pind, pexp, pval, layer, token):
    """Take the priority snapshot of this (token, layer) step unless part 1 already took it."""
    t = isc[layer, POS]
    if isc[layer, SNAP_TOKEN] == t:
        return
    isc[layer, SNAP_TOKEN] = t
    prio = fst[layer, PRIORITY]
    if params[P_LRU] == 1:
        for e in range(prio.shape[0]):
            prio[e] = 1.0 + ist[layer, LAST_USE, e]
        return
    for e in range(prio.shape[0]):
        prio[e] = fst[layer, S_FAST, e] + fst[layer, S_SLOW, e]
    if token >= 0 and token < pind.shape[1] - 1:
        for i in range(pind[layer, token], pind[layer, token + 1]):
            prio[pexp[i]] += pval[i]


@njit(cache=True)
def _victim(ist, fst, params, layer, t, spare_protected):
    """Resident expert to evict: lowest priority outside S (and outside B if spare_protected), ties to
    the lowest index; -1 if every resident expert is excluded."""
    best = -1
    best_p = np.inf
    for s in range(params[P_CAPACITY]):
        e = ist[layer, SLOT_EXPERT, s]
        if ist[layer, SELECTED, e] == t or (spare_protected and ist[layer, PROTECTED, e] == t):
            continue
        p = fst[layer, PRIORITY, e]
        if p < best_p or (p == best_p and e < best):
            best = e
            best_p = p
    return best


@njit(cache=True)
def _insert(ist, cnt, layer, expert, victim, t, prefetch, unused_at):
    """Give `expert` the slot of `victim`; a victim that was prefetched and never executed is unused."""
    t0 = ist[layer, PREFETCHED, victim]
    if t0 >= 0:
        cnt[layer, C_UNUSED] += 1
        if unused_at.shape[0] > t0:
            unused_at[t0, layer] += 1
    slot = ist[layer, EXPERT_SLOT, victim]
    ist[layer, EXPERT_SLOT, victim] = -1
    ist[layer, PREFETCHED, victim] = -1
    ist[layer, SLOT_EXPERT, slot] = expert
    ist[layer, EXPERT_SLOT, expert] = slot
    ist[layer, LAST_USE, expert] = t
    ist[layer, PREFETCHED, expert] = t if prefetch else -1


@njit(cache=True)
def part1(ist, isc, fst, cnt, params, pind, pexp, pval, layer, g, token, budget, inserted, unused_at):
    """Algorithm 1, part 1: insertion for `layer` from its pre-gate logits g [E] (the router of `layer`
    applied to the previous layer's MoE input) for the layer's current token, at most `budget` (<= n) new
    experts. Inserted experts go to inserted[:count]; returns count. Touches only this layer's state.
    Returns -1, touching nothing, for a layer outside [0, L) or a g that is not [E] (a bad call)."""
    if not (0 <= layer < ist.shape[0] and g.shape[0] == ist.shape[2]):
        return -1
    if params[P_BUDGET] == 0:  # a policy without insertion has no part 1: B stays empty (spec_exec has n >= 1)
        return 0
    t = isc[layer, POS]
    _snapshot(ist, isc, fst, params, pind, pexp, pval, layer, token)
    k = params[P_TOP_K]
    w = params[P_WINDOW]
    m = max(k, w)
    _rank_groups(g, g, m, ist[layer, PREDICTED], params[P_GROUPS], params[P_TOPK_GROUP])
    isc[layer, PRED_TOKEN] = t
    budget = min(budget, params[P_BUDGET])
    new = 0
    for r in range(min(w, g.shape[0])):
        e = ist[layer, PREDICTED, r]
        if ist[layer, EXPERT_SLOT, e] >= 0:
            ist[layer, PROTECTED, e] = t
        elif new < budget:
            victim = _victim(ist, fst, params, layer, t, True)
            if victim < 0:
                continue
            _insert(ist, cnt, layer, e, victim, t, True, unused_at)
            ist[layer, PROTECTED, e] = t
            inserted[new] = e
            new += 1
    cnt[layer, C_PREFETCH] += new
    return new


@njit(cache=True)
def part2(ist, isc, fst, fsc, cnt, params, bonus, delta, pind, pexp, pval, layer, z, token, selected, demand,
          unused_at):
    """Algorithm 1, part 2: selection for `layer` from selection scores z [E] (the router logits of a
    softmax router, sigmoid(z) + bias of a sigmoid one); selected[:K] gets the executed set S (best first),
    demand[:d] the demand insertions (index order). The bonus goes to the logically resident experts; with
    group-limited choice the groups are scored and kept on the scores plus bonus, then S is the top-K inside
    the kept groups. Updates the statistics with the
    router's own top-K and advances the layer to the next token. Returns (d, displaced router mass, router
    top-K slots replaced)."""
    t = isc[layer, POS]
    _snapshot(ist, isc, fst, params, pind, pexp, pval, layer, token)
    num_experts = z.shape[0]
    k = params[P_TOP_K]
    kind = params[P_KIND]
    zmax = -np.inf
    zmin = np.inf
    for e in range(num_experts):
        zmax = max(zmax, z[e])
        zmin = min(zmin, z[e])
    fsc[layer, RANGE_SUM] += zmax - zmin
    fsc[layer, RANGE_COUNT] += 1.0

    n_group, topk_group = params[P_GROUPS], params[P_TOPK_GROUP]
    own = np.empty(k, dtype=np.int64)
    _rank_groups(z, z, k, own, n_group, topk_group)
    if kind == KIND_EXACT:
        selected[:k] = own
    elif kind == KIND_SPEC_EXEC:
        if isc[layer, PRED_TOKEN] == t:
            selected[:k] = ist[layer, PREDICTED, :k]
        else:
            selected[:k] = own
    else:
        if params[P_RUNNING] == 1:
            scale = bonus * fsc[layer, RANGE_SUM] / fsc[layer, RANGE_COUNT]
        else:
            scale = bonus * delta[layer]
        biased = z.copy()
        for e in range(num_experts):
            if ist[layer, EXPERT_SLOT, e] >= 0:
                biased[e] += scale
        for j in range(params[P_PROTECT]):
            e = own[j]
            if ist[layer, EXPERT_SLOT, e] < 0:
                biased[e] += scale
        _rank_groups(biased, z, k, selected, n_group, topk_group)
    for j in range(k):
        ist[layer, SELECTED, selected[j]] = t

    # demand insertions, in expert index order
    order = np.sort(selected[:k])
    d = 0
    for j in range(k):
        e = order[j]
        if ist[layer, EXPERT_SLOT, e] >= 0:
            continue
        victim = _victim(ist, fst, params, layer, t, True)
        if victim < 0:
            victim = _victim(ist, fst, params, layer, t, False)
        _insert(ist, cnt, layer, e, victim, t, False, unused_at)
        demand[d] = e
        d += 1
    for j in range(k):
        e = selected[j]
        ist[layer, PREFETCHED, e] = -1
        ist[layer, LAST_USE, e] = t

    # statistics of the router's own top-K; what the policy displaced from it
    sf = fst[layer, S_FAST]
    ss = fst[layer, S_SLOW]
    for e in range(num_experts):
        sf[e] *= FAST_DECAY
        ss[e] *= SLOW_DECAY
    displaced = 0.0
    replaced = 0
    for j in range(k):
        e = own[j]
        sf[e] += 1.0 - FAST_DECAY
        ss[e] += 1.0 - SLOW_DECAY
        if ist[layer, SELECTED, e] != t:
            displaced += np.exp(z[e] - zmax)
            replaced += 1
    if replaced:  # the softmax normaliser only when something was displaced
        norm = 0.0
        for e in range(num_experts):
            norm += np.exp(z[e] - zmax)
        displaced /= norm
    cnt[layer, C_TOKENS] += 1
    cnt[layer, C_DEMAND] += d
    cnt[layer, C_REPLACED] += replaced
    isc[layer, POS] = t + 1
    return d, displaced, replaced


@njit(cache=True)
def selection_scores(z, scoring, bias, out):
    """out = what routing ranks: z (softmax routers) or sigmoid(z) + bias (sigmoid routers), float64."""
    if scoring == SCORE_SOFTMAX:
        for e in range(z.shape[0]):
            out[e] = z[e]
    else:
        for e in range(z.shape[0]):
            out[e] = 1.0 / (1.0 + np.exp(-np.float64(z[e]))) + bias[e]


@njit(cache=True)
def selection_score_rows(z, scoring, bias, layers, out):
    """`selection_scores` of many rows: out[i] of z[i] [E] with the bias row of layer layers[i]."""
    for i in range(z.shape[0]):
        selection_scores(z[i], scoring, bias[layers[i]], out[i])


@njit(cache=True)
def execution_weights(z, selected, scoring, renormalise, scale, out):
    """out[j] = the unmodified router probability of selected[j] (softmax over all E of z, or sigmoid(z)),
    renormalised over the selection if the model's router renormalises, times the routed scaling factor."""
    s = 0.0
    if scoring == SCORE_SOFTMAX:
        zmax = -np.inf
        for e in range(z.shape[0]):
            zmax = max(zmax, np.float64(z[e]))
        total = 0.0
        for e in range(z.shape[0]):
            total += np.exp(np.float64(z[e]) - zmax)
        for j in range(selected.shape[0]):
            w = np.exp(np.float64(z[selected[j]]) - zmax) / total
            out[j] = w
            s += w
    else:
        for j in range(selected.shape[0]):
            w = 1.0 / (1.0 + np.exp(-np.float64(z[selected[j]])))
            out[j] = w
            s += w
        s += 1e-20  # as DeepSeek-V3's router: the denominator of its renormalisation
    for j in range(selected.shape[0]):
        out[j] = (out[j] / s if renormalise else out[j]) * scale


@njit(cache=True)
def route(ist, isc, fst, fsc, cnt, params, bonus, delta, pind, pexp, pval, layer, z, token, scoring, renormalise,
          scale, bias, n_group, topk_group, zbuf, z_out, selected, slots, weights, demand, demand_slots,
          displaced_mass, unused_at):
    """Part 2 of one layer and everything an engine needs from it, in one call (each Python->numba
    crossing costs about a microsecond, and this runs on the critical path of every layer): the router
    logits z (float32 as the router wrote them) are recorded in z_out and turned into selection scores in
    zbuf for `part2` (`selection_scores`, with the layer's row of bias [L, E]; the scoring's expert groups
    n_group / topk_group become the cache's group rule, parts 1 and 2); selected[:K] gets S, slots[:K] their
    slots, weights[:K] their execution weights (`execution_weights`), demand[:d] / demand_slots[:d] the
    demand insertions and their slots; the displaced router mass is added to displaced_mass[layer].
    Returns d, or -1, touching nothing, for a layer outside [0, L) or a buffer of the wrong length (a bad
    call)."""
    num_experts, k = ist.shape[2], params[P_TOP_K]
    if not (0 <= layer < ist.shape[0] and z.shape[0] == num_experts and z_out.shape[0] == num_experts
            and selected.shape[0] == k and slots.shape[0] == k and weights.shape[0] == k
            and bias.shape[0] == ist.shape[0] and bias.shape[1] == num_experts):
        return -1
    params[P_GROUPS] = n_group
    params[P_TOPK_GROUP] = topk_group
    for e in range(z.shape[0]):
        z_out[e] = z[e]
    selection_scores(z, scoring, bias[layer], zbuf)
    d, displaced, _ = part2(ist, isc, fst, fsc, cnt, params, bonus, delta, pind, pexp, pval, layer, zbuf, token,
                            selected, demand, unused_at)
    displaced_mass[layer] += displaced
    for j in range(selected.shape[0]):
        slots[j] = ist[layer, EXPERT_SLOT, selected[j]]
    for j in range(d):
        demand_slots[j] = ist[layer, EXPERT_SLOT, demand[j]]
    execution_weights(z, selected, scoring, renormalise, scale, weights)
    return d


@njit(cache=True)
def reset(ist, isc, fst, fsc, warm, cnt, unused_at):
    """Start a sequence: prefetches still unexecuted count as unused, then R_l = warm[l] (ascending) in
    slots 0..C-1, statistics zero."""
    num_layers = ist.shape[0]
    for layer in range(num_layers):
        for e in range(ist.shape[2]):
            t0 = ist[layer, PREFETCHED, e]
            if t0 >= 0:
                cnt[layer, C_UNUSED] += 1
                if unused_at.shape[0] > t0:
                    unused_at[t0, layer] += 1
    ist[:] = -1
    isc[:] = -1
    isc[:, POS] = 0
    fst[:] = 0.0
    fsc[:] = 0.0
    for layer in range(num_layers):
        for s in range(warm.shape[1]):
            e = warm[layer, s]
            ist[layer, SLOT_EXPERT, s] = e
            ist[layer, EXPERT_SLOT, e] = s


@njit(cache=True)
def run_span(ist, isc, fst, fsc, cnt, params, bonus, delta, pind, pexp, pval, layer, z, g, has_g, tokens,
             valid, selected, slots, demand, prefetch, displaced, replaced, unused_at):
    """Parts 1 and 2 of `layer` for consecutive tokens: z, g [S, E], tokens [S], valid [S]. Invalid
    (padded) positions get the router's own top-K and leave the state untouched. Writes per position:
    selected/slots [S, K], demand/prefetch copies, displaced mass, replaced router slots."""
    k = params[P_TOP_K]
    scratch = np.empty(max(k, params[P_WINDOW]), dtype=np.int64)
    for i in range(z.shape[0]):
        if not valid[i]:
            _rank_groups(z[i], z[i], k, selected[i], params[P_GROUPS], params[P_TOPK_GROUP])
            slots[i, :] = -1
            demand[i] = 0
            prefetch[i] = 0
            displaced[i] = 0.0
            replaced[i] = 0
            continue
        n = 0
        if has_g:
            n = part1(ist, isc, fst, cnt, params, pind, pexp, pval, layer, g[i], tokens[i], params[P_BUDGET],
                      scratch, unused_at)
        d, mass, rep = part2(ist, isc, fst, fsc, cnt, params, bonus, delta, pind, pexp, pval, layer, z[i],
                             tokens[i], selected[i], scratch, unused_at)
        for j in range(k):
            slots[i, j] = ist[layer, EXPERT_SLOT, selected[i, j]]
        demand[i] = d
        prefetch[i] = n
        displaced[i] = mass
        replaced[i] = rep
