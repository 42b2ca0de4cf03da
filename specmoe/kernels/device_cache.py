"""The logical cache of Algorithm 1 on the device: `LogicalCache`'s per-layer steps as one Triton launch.

`DeviceCache` holds the state arrays of a `LogicalCache` (istate, iscalar, fstate, fscalar, counters and the
displaced mass, the layouts of `specmoe.routing.kernels`) as device tensors, and `DeviceCache.step` runs, in one
program, what the engine asks of the host per layer:

- `route` of `layer` (part 2, `kernels.route`): the selection scores (softmax: the float32 logits as float64;
  sigmoid: 1 / (1 + exp(-z)) + the layer's bias), the running logit range, the router's own top-K, the
  policy's selection (exact, spec_exec's predicted set, Cache-Prior / PSR's bonus with protection and fixed or
  running delta, group-limited choice), the demand insertions in expert index order with their victims (lowest
  priority outside S, then outside B; ties to the lower index), LRU / A bookkeeping, the EMA statistics, the
  displaced router mass, the counters, and the execution weights;
- part 1 of `layer + 1` (`kernels.part1`) from its pre-gate logits: the priority snapshot, the pre-gate
  ranking (max(K, w) entries, groups included), protection, and up to n insertions from the window.

Host and device run those two in this order for every token; they touch different layers' state, so one launch
does both. Outputs (device tensors the caller reads, in place, graph-capturable):
experts [K] int64 (S, best first); route [2K] int32 (their slots, then the float32 bits of their execution
weights as the host writes them into a float32 row, as the engines' are); demand [1 + 2K] int64 (count d, the d experts, their d slots);
prefetch [1 + 2N] int64 (count, experts, slots of part 1's insertions; N = min(n, w, E)).

Arithmetic follows the host's: float64 statistics and scores, multiplications and additions in the host's order
(launched without FMA contraction), float constants read from a float64 tensor (Triton would round a Python
float argument to float32), ties broken as the host breaks them. What is not bitwise: the softmax normaliser of
the execution weights and of the displaced mass is a tree sum here and a sequential sum on the host, and the
device's float64 exp may differ from the host's in the last bit (weights agree to float32 rounding, the
displaced mass to ~1e-15 relative; on a sigmoid router two selection scores within one float64 ulp could order
differently). docs/device-cache.md says more.
"""

from __future__ import annotations

import numpy as np
import torch

from specmoe.routing import LogicalCache, RouterScoring
from specmoe.routing import kernels as K

from . import pdl
from .ranking import score_ties
from .tuning import next_pow2

try:
    import triton
    import triton.language as tl

    from .pdl import enter
except ImportError:  # pragma: no cover - depends on the environment
    triton = None

# float64 parameters (one tensor: a Python float launch argument would be float32)
F_BONUS, F_SCALE, F_FAST, F_SLOW, F_FAST_GAIN, F_SLOW_GAIN, F_EPS = range(7)
N_FPARAMS = 7
PRIOR_CHUNK = 16  # token-prior entries read per step of a priority snapshot ([BLOCK_E, 16] comparisons each)


def row_warps(num_experts: int, entries_per_warp: int) -> int:
    """One warp per `entries_per_warp` entries of the padded expert row (BLOCK_E, E rounded up to a power of two),
    1 to 8: the warps of a launch whose work is reductions over [E] vectors (`default_warps`,
    `device_select.select_warps`)."""
    return max(1, min(8, next_pow2(num_experts) // entries_per_warp))


def default_warps(num_experts: int) -> int:
    """Warps of the cache step's one program: one per 64 experts, so that a thread holds two entries of each [E]
    vector at every E. The step is a chain of reductions over such vectors: one warp reduces with shuffles alone,
    but at E = 256 each of its threads walks 8 float64 entries per reduction (one warp: 45 µs per layer on the
    H200 at E = 256 against 12 at E = 64; BENCHMARKS.md has the warps compared)."""
    return row_warps(num_experts, 64)


if triton is not None:
    _SLOT_EXPERT = tl.constexpr(K.SLOT_EXPERT)
    _EXPERT_SLOT = tl.constexpr(K.EXPERT_SLOT)
    _LAST_USE = tl.constexpr(K.LAST_USE)
    _PROTECTED = tl.constexpr(K.PROTECTED)
    _SELECTED = tl.constexpr(K.SELECTED)
    _PREFETCHED = tl.constexpr(K.PREFETCHED)
    _PREDICTED = tl.constexpr(K.PREDICTED)
    _N_IROWS = tl.constexpr(K.N_IROWS)
    _N_FROWS = tl.constexpr(K.N_FROWS)
    _N_ISCALARS = tl.constexpr(K.N_ISCALARS)
    _N_FSCALARS = tl.constexpr(K.N_FSCALARS)
    _N_COUNTERS = tl.constexpr(K.N_COUNTERS)
    _C_DEMAND = tl.constexpr(K.C_DEMAND)
    _C_PREFETCH = tl.constexpr(K.C_PREFETCH)
    _C_REPLACED = tl.constexpr(K.C_REPLACED)
    _C_TOKENS = tl.constexpr(K.C_TOKENS)
    _C_UNUSED = tl.constexpr(K.C_UNUSED)
    _POS = tl.constexpr(K.POS)
    _PRED_TOKEN = tl.constexpr(K.PRED_TOKEN)
    _PRIORITY = tl.constexpr(K.PRIORITY)
    _RANGE_COUNT = tl.constexpr(K.RANGE_COUNT)
    _RANGE_SUM = tl.constexpr(K.RANGE_SUM)
    _SNAP_TOKEN = tl.constexpr(K.SNAP_TOKEN)
    _S_FAST = tl.constexpr(K.S_FAST)
    _S_SLOW = tl.constexpr(K.S_SLOW)
    _F_BONUS = tl.constexpr(F_BONUS)
    _F_SCALE = tl.constexpr(F_SCALE)
    _F_FAST = tl.constexpr(F_FAST)
    _F_SLOW = tl.constexpr(F_SLOW)
    _F_FAST_GAIN = tl.constexpr(F_FAST_GAIN)
    _F_SLOW_GAIN = tl.constexpr(F_SLOW_GAIN)
    _F_EPS = tl.constexpr(F_EPS)

    from .ranking import _TIES_RAW, _pick_int, _rank

    @triton.jit
    def _priority(prio, snap, t, sf, ss, last, idx, token, pind_ptr, pexp_ptr, pval_ptr, layer, VOCAB,
                  LRU: tl.constexpr, MAXP: tl.constexpr, CHUNK: tl.constexpr):
        """`kernels._snapshot`: the priority snapshot of step t unless it was taken (snap == t). The token's prior
        row (at most MAXP entries, each expert at most once: `TokenPrior`) is read CHUNK entries at a time, not
        entry by entry (a chain of dependent loads): an expert gets its one value, so the sum over the chunks is
        the host's single addition, bit for bit. A snapshot taken at step t (by part 1, before the route) is kept
        without reading the prior again."""
        snapshot = prio
        if snap != t:
            if LRU:
                snapshot = 1.0 + last.to(tl.float64)
            else:
                fresh = sf + ss
                row = pind_ptr + layer * (VOCAB + 1)
                has = (token >= 0) & (token < VOCAB)
                safe = tl.where(has, token, 0)
                lo = tl.load(row + safe)
                hi = tl.where(has, tl.load(row + safe + 1), lo)
                add = tl.zeros_like(fresh)
                hit = idx < 0
                for c in tl.static_range(0, MAXP, CHUNK):
                    at = lo + c + tl.arange(0, CHUNK)
                    ok = at < hi
                    e = tl.load(pexp_ptr + at, mask=ok, other=-1)
                    v = tl.load(pval_ptr + at, mask=ok, other=0.0)
                    match = idx[:, None] == e[None, :]
                    add += tl.sum(tl.where(match, v[None, :], 0.0), axis=1)
                    hit = hit | (tl.max(match.to(tl.int32), axis=1) > 0)
                snapshot = tl.where(hit, fresh + add, fresh)
        return snapshot

    @triton.jit
    def _victim(es, sel_tok, prot, prio, t, spare_protected, idx, BLOCK_E: tl.constexpr):
        """`kernels._victim`: the resident expert of lowest priority outside S (and B if spare_protected), ties
        to the lower index; BLOCK_E if none."""
        cand = (es >= 0) & (sel_tok != t) & ((prot != t) | (spare_protected == 0))
        low = tl.min(tl.where(cand, prio, float("inf")), axis=0)
        return tl.min(tl.where(cand & (prio == low), idx, BLOCK_E), axis=0)

    @triton.jit
    def _insert(do, e, victim, t, prefetched, es, se, last, pref, unused, idx):
        """`kernels._insert` where `do`: `e` takes the slot of `victim` (its PREFETCHED entry becomes
        `prefetched`: t for a prefetch, -1 for a demand insertion); an unexecuted prefetched victim is unused."""
        at_victim = do & (idx == victim)
        unused += (do & (_pick_int(pref, idx, victim) >= 0)).to(tl.int64)
        slot = _pick_int(es, idx, victim)
        es = tl.where(at_victim, -1, es)
        pref = tl.where(at_victim, -1, pref)
        se = tl.where(do & (idx == slot), e, se)
        at_e = do & (idx == e)
        es = tl.where(at_e, slot, es)
        last = tl.where(at_e, t, last)
        pref = tl.where(at_e, prefetched, pref)
        return es, se, last, pref, unused, slot

    @triton.jit
    def _scores(x_ptr, bias_ptr, layer, valid, idx, E: tl.constexpr, SIGMOID: tl.constexpr):
        """`kernels.selection_scores`: float64 what routing ranks; also the float64 logits."""
        z = tl.load(x_ptr + idx, mask=valid, other=0.0).to(tl.float32).to(tl.float64)
        if SIGMOID:
            s = 1.0 / (1.0 + tl.exp(-z)) + tl.load(bias_ptr + layer * E + idx, mask=valid, other=0.0)
        else:
            s = z
        return s, z

    @triton.jit
    def _layer_state(ist_ptr, isc_ptr, fst_ptr, pind_ptr, pexp_ptr, pval_ptr, VOCAB, token, layer, idx, valid,
                     E: tl.constexpr, LRU: tl.constexpr, MAXP: tl.constexpr, CHUNK: tl.constexpr):
        """What part 1 and part 2 of `layer` both start from: its integer and float rows (per expert) and its
        scalars (pointers), its step t, and its per-expert state: expert -> slot, slot -> expert, last use,
        protection, selection and prefetch tokens, the fast and slow scores, and the priority snapshot of step t
        (`_priority`)."""
        irow = ist_ptr + layer * _N_IROWS * E + idx
        frow = fst_ptr + layer * _N_FROWS * E + idx
        isc = isc_ptr + layer * _N_ISCALARS
        t = tl.load(isc + _POS)
        snap = tl.load(isc + _SNAP_TOKEN)
        es = tl.load(irow + _EXPERT_SLOT * E, mask=valid, other=-1)
        se = tl.load(irow + _SLOT_EXPERT * E, mask=valid, other=-1)
        last = tl.load(irow + _LAST_USE * E, mask=valid, other=-1)
        prot = tl.load(irow + _PROTECTED * E, mask=valid, other=-1)
        sel_tok = tl.load(irow + _SELECTED * E, mask=valid, other=-1)
        pref = tl.load(irow + _PREFETCHED * E, mask=valid, other=-1)
        sf = tl.load(frow + _S_FAST * E, mask=valid, other=0.0)
        ss = tl.load(frow + _S_SLOW * E, mask=valid, other=0.0)
        prio = tl.load(frow + _PRIORITY * E, mask=valid, other=0.0)
        prio = _priority(prio, snap, t, sf, ss, last, idx, token, pind_ptr, pexp_ptr, pval_ptr, layer, VOCAB, LRU,
                         MAXP, CHUNK)
        return irow, frow, isc, t, es, se, last, prot, sel_tok, pref, sf, ss, prio

    @triton.jit
    def _part1(ist_ptr, isc_ptr, fst_ptr, cnt_ptr, fpar_ptr, pind_ptr, pexp_ptr, pval_ptr, bias_ptr, VOCAB,
               token, layer, g_ptr, prefetch_ptr, idx, valid,
               E: tl.constexpr, BLOCK_E: tl.constexpr, M: tl.constexpr, R: tl.constexpr, N_INS: tl.constexpr,
               BUDGET: tl.constexpr, LRU: tl.constexpr, MAXP: tl.constexpr, CHUNK: tl.constexpr,
               SIGMOID: tl.constexpr,
               N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, BLOCK_G: tl.constexpr, TIES: tl.constexpr):
        """`kernels.part1` of `layer` (BUDGET > 0)."""
        irow, frow, isc, t, es, se, last, prot, sel_tok, pref, sf, ss, prio = _layer_state(
            ist_ptr, isc_ptr, fst_ptr, pind_ptr, pexp_ptr, pval_ptr, VOCAB, token, layer, idx, valid, E, LRU, MAXP,
            CHUNK)
        g, _ = _scores(g_ptr, bias_ptr, layer, valid, idx, E, SIGMOID)
        rank = _rank(g, g, valid, idx, M, E, BLOCK_E, N_GROUP, TOPK_GROUP, BLOCK_G, TIES)
        # the ranking row holds the experts by position; entries past M keep their values
        tl.store(ist_ptr + layer * _N_IROWS * E + _PREDICTED * E + rank, idx.to(tl.int64), mask=rank >= 0)
        # The host visits the window's R experts in rank order: a resident one is protected, a missing one inserted
        # while the budget lasts and a victim exists. Here each pass jumps to the next missing expert, protecting
        # the residents it passes (nothing changes residency between insertions) and inserting it; a victim can be
        # a window expert not visited yet, which is then missing at its visit, as on the host. A pass whose victim
        # is missing has no successor that finds one (protection only grows), and past the budget the rest of the
        # window's residents are protected, as the host's visits without insertions do.
        visit = (rank >= 0) & (rank < R)
        pos = tl.zeros([], tl.int32)  # the window's next rank
        new = tl.zeros([], tl.int64)
        unused = tl.zeros([], tl.int64)
        for _ in tl.static_range(N_INS):
            ahead = visit & (rank >= pos)
            r = tl.min(tl.where(ahead & (es < 0), rank, R), axis=0)
            prot = tl.where(ahead & (rank < r) & (es >= 0), t, prot)
            victim = _victim(es, sel_tok, prot, prio, t, 1, idx, BLOCK_E)
            do = (r < R) & (victim < BLOCK_E)
            e = tl.min(tl.where(rank == r, idx, BLOCK_E), axis=0)
            es, se, last, pref, unused, slot = _insert(do, e, victim, t, t, es, se, last, pref, unused, idx)
            prot = tl.where(do & (idx == e), t, prot)
            tl.store(prefetch_ptr + 1 + new, e.to(tl.int64), mask=do)
            tl.store(prefetch_ptr + 1 + N_INS + new, slot, mask=do)
            new += do.to(tl.int64)
            pos = r + 1
        prot = tl.where(visit & (rank >= pos) & (es >= 0), t, prot)
        tl.store(prefetch_ptr, new)
        tl.store(isc + _SNAP_TOKEN, t)
        tl.store(isc + _PRED_TOKEN, t)
        tl.store(irow + _EXPERT_SLOT * E, es, mask=valid)
        tl.store(irow + _SLOT_EXPERT * E, se, mask=valid)
        tl.store(irow + _LAST_USE * E, last, mask=valid)
        tl.store(irow + _PROTECTED * E, prot, mask=valid)
        tl.store(irow + _PREFETCHED * E, pref, mask=valid)
        tl.store(frow + _PRIORITY * E, prio, mask=valid)
        cnt = cnt_ptr + layer * _N_COUNTERS
        tl.store(cnt + _C_PREFETCH, tl.load(cnt + _C_PREFETCH) + new)
        tl.store(cnt + _C_UNUSED, tl.load(cnt + _C_UNUSED) + unused)

    @triton.jit
    def _route(ist_ptr, isc_ptr, fst_ptr, fsc_ptr, cnt_ptr, disp_ptr, fpar_ptr, delta_ptr, pind_ptr, pexp_ptr,
               pval_ptr, bias_ptr, VOCAB, token, layer, z_ptr, experts_ptr, route_ptr, demand_ptr, idx, valid,
               E: tl.constexpr, BLOCK_E: tl.constexpr, TOP_K: tl.constexpr, KIND: tl.constexpr, LRU: tl.constexpr,
               MAXP: tl.constexpr, CHUNK: tl.constexpr,
               PROTECT: tl.constexpr, RUNNING: tl.constexpr, SIGMOID: tl.constexpr, RENORMALISE: tl.constexpr,
               N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, BLOCK_G: tl.constexpr, TIES: tl.constexpr):
        """`kernels.route` of `layer`: part 2, the slots and the execution weights."""
        irow, frow, isc, t, es, se, last, prot, sel_tok, pref, sf, ss, prio = _layer_state(
            ist_ptr, isc_ptr, fst_ptr, pind_ptr, pexp_ptr, pval_ptr, VOCAB, token, layer, idx, valid, E, LRU, MAXP,
            CHUNK)
        fsc = fsc_ptr + layer * _N_FSCALARS
        zs, z = _scores(z_ptr, bias_ptr, layer, valid, idx, E, SIGMOID)
        zmax = tl.max(tl.where(valid, zs, float("-inf")), axis=0)
        zmin = tl.min(tl.where(valid, zs, float("inf")), axis=0)
        range_sum = tl.load(fsc + _RANGE_SUM) + (zmax - zmin)
        range_count = tl.load(fsc + _RANGE_COUNT) + 1.0
        tl.store(fsc + _RANGE_SUM, range_sum)
        tl.store(fsc + _RANGE_COUNT, range_count)

        own = _rank(zs, zs, valid, idx, TOP_K, E, BLOCK_E, N_GROUP, TOPK_GROUP, BLOCK_G, TIES)
        if KIND == 0:  # exact
            sel = own
        elif KIND == 3:  # spec_exec: the pre-gate's top-K where part 1 ran for this token
            pred = tl.load(irow + _PREDICTED * E, mask=valid, other=-1)
            predicted = tl.full([BLOCK_E], -1, tl.int32)
            for j in tl.static_range(TOP_K):
                predicted = tl.where(idx == _pick_int(pred, idx, j), j, predicted)
            sel = tl.where(tl.load(isc + _PRED_TOKEN) == t, predicted, own)
        else:  # cache_prior, psr: the bonus to resident experts (and the router's own top-J)
            if RUNNING:
                scale = tl.load(fpar_ptr + _F_BONUS) * range_sum / range_count
            else:
                scale = tl.load(fpar_ptr + _F_BONUS) * tl.load(delta_ptr + layer)
            boosted = (es >= 0) | ((own >= 0) & (own < PROTECT))
            biased = tl.where(boosted, zs + scale, zs)
            sel = _rank(biased, zs, valid, idx, TOP_K, E, BLOCK_E, N_GROUP, TOPK_GROUP, BLOCK_G, _TIES_RAW)
        chosen = sel >= 0
        sel_tok = tl.where(chosen, t, sel_tok)

        # demand insertions, in expert index order: a pass per missing expert (the host's visits of resident ones
        # change nothing, and no chosen expert is a victim, so the missing set is known before the first)
        missing = chosen & (es < 0)
        left = tl.sum(missing.to(tl.int32), axis=0)
        d = tl.zeros([], tl.int64)
        unused = tl.zeros([], tl.int64)
        while left > 0:
            left -= 1
            e = tl.min(tl.where(missing, idx, BLOCK_E), axis=0)
            missing = missing & (idx != e)
            victim = _victim(es, sel_tok, prot, prio, t, 1, idx, BLOCK_E)
            if victim == BLOCK_E:  # every resident outside S is protected: the lowest of them
                victim = _victim(es, sel_tok, prot, prio, t, 0, idx, BLOCK_E)
            es, se, last, pref, unused, slot = _insert(e < BLOCK_E, e, victim, t, -1, es, se, last, pref, unused,
                                                       idx)
            tl.store(demand_ptr + 1 + d, e.to(tl.int64))
            tl.store(demand_ptr + 1 + TOP_K + d, slot)
            d += 1
        tl.store(demand_ptr, d)
        pref = tl.where(chosen, -1, pref)
        last = tl.where(chosen, t, last)

        # statistics of the router's own top-K; what the policy displaced from it
        mine = own >= 0
        sf = sf * tl.load(fpar_ptr + _F_FAST)
        ss = ss * tl.load(fpar_ptr + _F_SLOW)
        sf = tl.where(mine, sf + tl.load(fpar_ptr + _F_FAST_GAIN), sf)
        ss = tl.where(mine, ss + tl.load(fpar_ptr + _F_SLOW_GAIN), ss)
        p = tl.where(valid, tl.exp(zs - zmax), 0.0)
        gone = mine & (sel < 0)
        replaced = tl.sum(gone.to(tl.int64), axis=0)
        displaced = tl.zeros([], tl.float64)
        left = replaced
        while left > 0:  # in the router's order, as the host adds (its terms of the others are 0.0)
            left -= 1
            first = tl.min(tl.where(gone, own, TOP_K), axis=0)
            displaced += tl.max(tl.where(gone & (own == first), p, 0.0), axis=0)
            gone = gone & (own != first)
        displaced = tl.where(replaced > 0, displaced / tl.sum(p, axis=0), displaced)
        tl.store(disp_ptr + layer, tl.load(disp_ptr + layer) + displaced)
        cnt = cnt_ptr + layer * _N_COUNTERS
        tl.store(cnt + _C_TOKENS, tl.load(cnt + _C_TOKENS) + 1)
        tl.store(cnt + _C_DEMAND, tl.load(cnt + _C_DEMAND) + d)
        tl.store(cnt + _C_UNUSED, tl.load(cnt + _C_UNUSED) + unused)
        tl.store(cnt + _C_REPLACED, tl.load(cnt + _C_REPLACED) + replaced)
        tl.store(isc + _POS, t + 1)
        tl.store(isc + _SNAP_TOKEN, t)
        tl.store(irow + _EXPERT_SLOT * E, es, mask=valid)
        tl.store(irow + _SLOT_EXPERT * E, se, mask=valid)
        tl.store(irow + _LAST_USE * E, last, mask=valid)
        tl.store(irow + _SELECTED * E, sel_tok, mask=valid)
        tl.store(irow + _PREFETCHED * E, pref, mask=valid)
        tl.store(frow + _S_FAST * E, sf, mask=valid)
        tl.store(frow + _S_SLOW * E, ss, mask=valid)
        tl.store(frow + _PRIORITY * E, prio, mask=valid)

        # execution weights (`kernels.execution_weights`) from the raw logits, summed over S in its order
        if SIGMOID:
            w = 1.0 / (1.0 + tl.exp(-z))
        else:
            q = tl.where(valid, tl.exp(z - zmax), 0.0)  # softmax: z is zs
            w = q / tl.sum(q, axis=0)
        total = tl.zeros([], tl.float64)
        for j in tl.static_range(TOP_K):
            total += tl.max(tl.where(sel == j, w, float("-inf")), axis=0)
        if SIGMOID:
            total += tl.load(fpar_ptr + _F_EPS)
        w = w.to(tl.float32).to(tl.float64)  # the host stores the probability in the float32 row first
        if RENORMALISE:
            w = w / total
        w32 = (w * tl.load(fpar_ptr + _F_SCALE)).to(tl.float32)
        tl.store(experts_ptr + sel, idx.to(tl.int64), mask=chosen)
        tl.store(route_ptr + sel, es.to(tl.int32), mask=chosen)
        tl.store(route_ptr + TOP_K + sel, w32.to(tl.int32, bitcast=True), mask=chosen)

    @triton.jit
    def _cache_step_kernel(ist_ptr, isc_ptr, fst_ptr, fsc_ptr, cnt_ptr, disp_ptr, fpar_ptr, delta_ptr, bias_ptr,
                           pind_ptr, pexp_ptr, pval_ptr, VOCAB, token_ptr, layer, z_ptr, g_ptr,
                           experts_ptr, route_ptr, demand_ptr, prefetch_ptr,
                           E: tl.constexpr, BLOCK_E: tl.constexpr, TOP_K: tl.constexpr, M: tl.constexpr,
                           R: tl.constexpr, N_INS: tl.constexpr, BUDGET: tl.constexpr, KIND: tl.constexpr,
                           LRU: tl.constexpr, MAXP: tl.constexpr, CHUNK: tl.constexpr, PROTECT: tl.constexpr,
                           RUNNING: tl.constexpr, SIGMOID: tl.constexpr,
                           RENORMALISE: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                           BLOCK_G: tl.constexpr, TIES: tl.constexpr, DO_ROUTE: tl.constexpr,
                           DO_PART1: tl.constexpr, PDL: tl.constexpr = False):
        enter(PDL)
        idx = tl.arange(0, BLOCK_E)
        valid = idx < E
        token = tl.load(token_ptr)
        if DO_ROUTE:
            _route(ist_ptr, isc_ptr, fst_ptr, fsc_ptr, cnt_ptr, disp_ptr, fpar_ptr, delta_ptr, pind_ptr, pexp_ptr,
                   pval_ptr, bias_ptr, VOCAB, token, layer, z_ptr, experts_ptr, route_ptr, demand_ptr, idx, valid,
                   E, BLOCK_E, TOP_K, KIND, LRU, MAXP, CHUNK, PROTECT, RUNNING, SIGMOID, RENORMALISE, N_GROUP,
                   TOPK_GROUP, BLOCK_G, TIES)
        if DO_PART1:
            _part1(ist_ptr, isc_ptr, fst_ptr, cnt_ptr, fpar_ptr, pind_ptr, pexp_ptr, pval_ptr, bias_ptr, VOCAB,
                   token, layer + DO_ROUTE, g_ptr, prefetch_ptr, idx, valid, E, BLOCK_E, M, R, N_INS, BUDGET, LRU,
                   MAXP, CHUNK, SIGMOID, N_GROUP, TOPK_GROUP, BLOCK_G, TIES)


class DeviceCache:
    """The state of a `LogicalCache` on `device` and the launch that runs its per-layer steps there.

    Built from a host cache (its current state is copied; the host cache is left alone) and the model's
    `RouterScoring` (whose groups must be the cache's); `warps`: the launch's warps (default `default_warps`).
    `step` writes the outputs named in the module docstring into this object's tensors (`experts`, `route`,
    `demand`, `prefetch`), so that a CUDA graph can capture it.
    """

    def __init__(self, cache: LogicalCache, scoring: RouterScoring, device, warps: int | None = None):
        if triton is None:
            raise RuntimeError("the device cache needs Triton")
        policy, num_layers, num_experts = cache.policy, cache.num_layers, cache.num_experts
        if (int(cache.params[K.P_GROUPS]), int(cache.params[K.P_TOPK_GROUP])) != scoring.groups:
            raise ValueError(f"the scoring's expert groups {scoring.groups} are not the cache's "
                             f"{(int(cache.params[K.P_GROUPS]), int(cache.params[K.P_TOPK_GROUP]))}")
        self.policy, self.scoring, self.device = policy, scoring, torch.device(device)
        self.num_layers, self.num_experts = num_layers, num_experts
        self.warps = default_warps(num_experts) if warps is None else warps
        if self.warps not in (1, 2, 4, 8):
            raise ValueError(f"the cache step runs on 1, 2, 4 or 8 warps, got {warps}")

        def put(array, dtype):
            return torch.tensor(np.ascontiguousarray(array), dtype=dtype, device=self.device)  # a copy, on the CPU too

        self.istate, self.iscalar = put(cache.istate, torch.int64), put(cache.iscalar, torch.int64)
        self.fstate, self.fscalar = put(cache.fstate, torch.float64), put(cache.fscalar, torch.float64)
        self.counters, self.displaced_mass = put(cache.counters, torch.int64), put(cache.displaced_mass, torch.float64)
        self.warm = put(cache.warm, torch.int64)
        self.delta = put(cache.delta, torch.float64)
        self.bias = put(scoring.bias_rows(num_layers, num_experts), torch.float64)
        pind, pexp, pval = cache.prior
        self.vocab = pind.shape[1] - 1
        longest = int(np.diff(pind, axis=1).max()) if pind.size > pind.shape[0] else 0  # a prior row's entries
        prior_block = triton.next_power_of_2(max(longest, 1))
        self.pind, self.pexp = put(pind, torch.int64), put(pexp if len(pexp) else np.zeros(1), torch.int64)
        self.pval = put(pval if len(pval) else np.zeros(1), torch.float64)
        fpar = np.zeros(N_FPARAMS)
        fpar[[F_BONUS, F_SCALE, F_FAST, F_SLOW, F_EPS]] = (policy.bonus, scoring.scale, K.FAST_DECAY, K.SLOW_DECAY,
                                                         1e-20)
        fpar[F_FAST_GAIN], fpar[F_SLOW_GAIN] = 1.0 - K.FAST_DECAY, 1.0 - K.SLOW_DECAY  # as the host computes them
        self.fparams = put(fpar, torch.float64)
        k, w = policy.top_k, policy.window
        self.ranked = min(max(k, w), num_experts)  # M: the pre-gate ranking's length
        self.visited = min(w, num_experts)  # R: the window part 1 visits
        self.max_inserted = max(min(policy.insert_budget, self.visited), 1)
        self.experts = torch.zeros(k, dtype=torch.int64, device=self.device)
        self.route = torch.zeros(2 * k, dtype=torch.int32, device=self.device)
        self.demand = torch.zeros(1 + 2 * k, dtype=torch.int64, device=self.device)
        self.prefetch = torch.zeros(1 + 2 * self.max_inserted, dtype=torch.int64, device=self.device)
        self._dummy = torch.zeros(num_experts, dtype=torch.float32, device=self.device)
        self._constants = dict(
            E=num_experts, BLOCK_E=triton.next_power_of_2(num_experts), TOP_K=k, M=self.ranked, R=self.visited,
            N_INS=self.max_inserted, BUDGET=policy.insert_budget, KIND=int(cache.params[K.P_KIND]),
            LRU=int(policy.priority == "lru"), MAXP=prior_block, CHUNK=min(prior_block, PRIOR_CHUNK),
            PROTECT=policy.protect_top, RUNNING=int(policy.delta == "running"),
            SIGMOID=int(scoring.kind == "sigmoid"), RENORMALISE=int(bool(scoring.renormalise)),
            N_GROUP=scoring.n_group, TOPK_GROUP=scoring.topk_group, BLOCK_G=triton.next_power_of_2(scoring.n_group),
            TIES=score_ties(scoring))

    def step(self, token: torch.Tensor, layer: int, router_logits: torch.Tensor | None = None,
             pregate_logits: torch.Tensor | None = None, experts_out: torch.Tensor | None = None,
             route_out: torch.Tensor | None = None, prefetch_out: torch.Tensor | None = None) -> None:
        """One launch: `route` of `layer` from router_logits [E] float32 (if given), then part 1 of the next
        layer (`layer` itself when no router logits are given) from pregate_logits [E] float32 (if given; the
        raw logits: a sigmoid router's selection scores are computed here). token: int64 [1] on the device, the
        position's input token (the token prior's row). experts_out int64 [K] / route_out int32 [2K] (contiguous):
        where the selection and the route row go instead of `experts` / `route` (a step's own rows, so that the
        MoE reads them where they are); prefetch_out int64 [1 + 2N]: where part 1's list goes instead of
        `prefetch` (a layer's own, so that the next layer's part 1 can run before its copies have read it)."""
        do_route, do_part1 = router_logits is not None, pregate_logits is not None and self.policy.insert_budget > 0
        target = layer + int(do_route) if do_part1 else layer
        if not 0 <= target < self.num_layers or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} (part 1 of {target}) outside [0, {self.num_layers})")
        if not (do_route or do_part1):
            return
        for name, x in (("router_logits", router_logits), ("pregate_logits", pregate_logits)):
            if x is not None and (x.shape != (self.num_experts,) or x.dtype != torch.float32 or x.stride(0) != 1):
                raise ValueError(f"{name} must be float32 [{self.num_experts}] of unit stride, got {x.dtype} "
                                 f"{tuple(x.shape)}")
        k = self.policy.top_k
        experts_out = self.experts if experts_out is None else experts_out
        route_out = self.route if route_out is None else route_out
        if experts_out.shape != (k,) or experts_out.dtype != torch.int64 or not experts_out.is_contiguous() \
                or route_out.shape != (2 * k,) or route_out.dtype != torch.int32 or not route_out.is_contiguous():
            raise ValueError(f"experts_out must be int64 [{k}] and route_out int32 [{2 * k}], contiguous")
        prefetch_out = self.prefetch if prefetch_out is None else prefetch_out
        if prefetch_out.shape != self.prefetch.shape or prefetch_out.dtype != torch.int64 \
                or not prefetch_out.is_contiguous():
            raise ValueError(f"prefetch_out must be int64 {list(self.prefetch.shape)}, contiguous")
        z = router_logits if do_route else self._dummy
        g = pregate_logits if do_part1 else self._dummy
        _cache_step_kernel[(1,)](
            self.istate, self.iscalar, self.fstate, self.fscalar, self.counters, self.displaced_mass, self.fparams,
            self.delta, self.bias, self.pind, self.pexp, self.pval, self.vocab, token, layer, z, g,
            experts_out, route_out, self.demand, prefetch_out, **self._constants,
            DO_ROUTE=int(do_route), DO_PART1=int(do_part1), num_warps=self.warps, enable_fp_fusion=False,
            **pdl.options(self.istate))

    def reset(self) -> None:
        """`LogicalCache.reset` on the device: unexecuted prefetches count as unused, then R_l = the warm set in
        slots 0..C-1, statistics and positions zero (counters and displaced mass keep accumulating)."""
        ist, capacity = self.istate, self.policy.capacity
        self.counters[:, K.C_UNUSED] += (ist[:, K.PREFETCHED] >= 0).sum(dim=1)
        ist.fill_(-1)
        self.iscalar.fill_(-1)
        self.iscalar[:, K.POS] = 0
        self.fstate.zero_()
        self.fscalar.zero_()
        ist[:, K.SLOT_EXPERT, :capacity] = self.warm
        slots = torch.arange(capacity, device=self.device).expand(self.num_layers, capacity)
        ist[:, K.EXPERT_SLOT].scatter_(1, self.warm, slots)

    def state(self) -> dict:
        """The state arrays on the host, named as `LogicalCache`'s attributes (for checks against it)."""
        names = ("istate", "iscalar", "fstate", "fscalar", "counters", "displaced_mass")
        return {name: getattr(self, name).cpu().numpy() for name in names}
