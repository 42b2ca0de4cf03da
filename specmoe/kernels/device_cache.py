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

The program keeps the dependent chain short (docs/device-cache.md, "How it mirrors the host"): every ranking is one
reduction of a pairwise comparison tile (`device_rank`); the demand insertions' victims are one ranking of the
residents outside S matched to the demand experts by number; part 1 visits its window in order, one integer
reduction a visit; the priority snapshot is computed only where it was not taken; the float64 sums the host adds
in order go through a per-layer scratch row and are added in that order.

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

from .device_rank import rank_chunk

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None

# float64 parameters (one tensor: a Python float launch argument would be float32)
F_BONUS, F_SCALE, F_FAST, F_SLOW, F_FAST_GAIN, F_SLOW_GAIN, F_EPS = range(7)
N_FPARAMS = 7
PRIOR_CHUNK = 16  # token-prior entries read per step of a priority snapshot ([BLOCK_E, 16] comparisons each)


def launch_shape(num_experts: int) -> tuple[int, int]:
    """(num_warps, RANK_J) of the cache step at E experts: whole [BLOCK_E, BLOCK_E] comparison tiles
    (`device_rank.rank_chunk`) on one warp up to 64 experts, four at 128, eight at 256 (the fewest spills that
    ptxas reported for sm_90; not timed on a GPU). `DeviceCache.num_warps` / `rank_chunk` may be set before a
    step, for tuning (each pair compiles once)."""
    block_e = triton.next_power_of_2(num_experts)
    return (1 if block_e <= 64 else 4 if block_e <= 128 else 8), rank_chunk(block_e)

if triton is not None:
    from .device_rank import _count_ahead, _match, _rank

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

    @triton.jit
    def _priority(prio, snap, t, sf, ss, last, idx, token, pind_ptr, pexp_ptr, pval_ptr, layer, VOCAB,
                  LRU: tl.constexpr, MAXP: tl.constexpr, CHUNK: tl.constexpr):
        """`kernels._snapshot`: the priority snapshot of step t, computed only where it was not taken (snap != t).
        The token's prior row (at most MAXP entries, each expert at most once: `TokenPrior`) is read CHUNK entries
        at a time, not entry by entry (a chain of dependent loads): an expert gets its one value, so the sum over
        the chunks is the host's single addition, bit for bit."""
        if snap != t:
            if LRU:
                prio = 1.0 + last.to(tl.float64)
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
                prio = tl.where(hit, fresh + add, fresh)
        return prio

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
    def _state_rows(irow, frow, valid, E: tl.constexpr):
        """A layer's per-expert state rows that part 1 and part 2 both read: expert -> slot, slot -> expert, last
        use, protection, selection and prefetch tokens, the fast and slow scores and the stored priority."""
        es = tl.load(irow + _EXPERT_SLOT * E, mask=valid, other=-1)
        se = tl.load(irow + _SLOT_EXPERT * E, mask=valid, other=-1)
        last = tl.load(irow + _LAST_USE * E, mask=valid, other=-1)
        prot = tl.load(irow + _PROTECTED * E, mask=valid, other=-1)
        sel_tok = tl.load(irow + _SELECTED * E, mask=valid, other=-1)
        pref = tl.load(irow + _PREFETCHED * E, mask=valid, other=-1)
        sf = tl.load(frow + _S_FAST * E, mask=valid, other=0.0)
        ss = tl.load(frow + _S_SLOW * E, mask=valid, other=0.0)
        prio = tl.load(frow + _PRIORITY * E, mask=valid, other=0.0)
        return es, se, last, prot, sel_tok, pref, sf, ss, prio

    @triton.jit
    def _part1(ist_ptr, isc_ptr, fst_ptr, cnt_ptr, pind_ptr, pexp_ptr, pval_ptr, bias_ptr, iscr_ptr, VOCAB,
               token, layer, g_ptr, prefetch_ptr, idx, valid,
               E: tl.constexpr, BLOCK_E: tl.constexpr, M: tl.constexpr, R: tl.constexpr, N_INS: tl.constexpr,
               BUDGET: tl.constexpr, LRU: tl.constexpr, MAXP: tl.constexpr, CHUNK: tl.constexpr,
               SIGMOID: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, RANK_J: tl.constexpr):
        """`kernels.part1` of `layer` (BUDGET > 0). The window is visited in rank order as on the host, each visit
        one reduction: the victims come from one pool ordered once by (priority, index) (resident, outside S and
        B when the visits start), taken in that order; a pool expert is out of it once evicted (its order is at
        most the last victim's) or once visited (a resident window expert visited is protected), so a visit's
        victim is the least pool order above the last victim's among the experts not yet visited. A window
        expert is resident at its visit unless it was a victim before; the window experts resident at the end
        are exactly those the host protected (resident at their visit, or inserted)."""
        irow = ist_ptr + layer * _N_IROWS * E + idx
        frow = fst_ptr + layer * _N_FROWS * E + idx
        isc = isc_ptr + layer * _N_ISCALARS
        t = tl.load(isc + _POS)
        snap = tl.load(isc + _SNAP_TOKEN)
        es, se, last, prot, sel_tok, pref, sf, ss, prio = _state_rows(irow, frow, valid, E)
        prio = _priority(prio, snap, t, sf, ss, last, idx, token, pind_ptr, pexp_ptr, pval_ptr, layer, VOCAB, LRU,
                         MAXP, CHUNK)
        g, _ = _scores(g_ptr, bias_ptr, layer, valid, idx, E, SIGMOID)
        rank = _rank(g, g, valid, idx, M, E, BLOCK_E, N_GROUP, TOPK_GROUP, RANK_J)
        # the ranking row's first M positions (the entries past M keep their values)
        tl.store(ist_ptr + (layer * _N_IROWS + _PREDICTED) * E + rank, idx.to(tl.int64), mask=rank >= 0)
        window = (rank >= 0) & (rank < R)
        pool = (es >= 0) & (sel_tok != t) & (prot != t)
        order = tl.where(pool, _count_ahead(-prio, tl.zeros_like(prio), -idx, pool, BLOCK_E, RANK_J), BLOCK_E)
        order = order.to(tl.int64)
        # what a visit reads of window rank r (its expert, pool order and residency), through this layer's row of
        # the scratch: the visits' scalars are loads, not reductions
        srow = iscr_ptr + layer * R
        tl.store(srow + rank, (order * BLOCK_E + idx) * 2 + (es >= 0).to(tl.int64), mask=window)
        tl.debug_barrier()
        victim_key = ((order * BLOCK_E + es) * BLOCK_E + idx) * 2 + (pref >= 0).to(tl.int64)  # order, slot, expert
        none = 2 * BLOCK_E * BLOCK_E * BLOCK_E
        visit = tl.where(window, rank, R)
        past = tl.full([], -1, tl.int64)  # the pool order of the last victim
        new = tl.zeros([], tl.int64)
        unused = tl.zeros([], tl.int64)
        for r in tl.static_range(R):
            info = tl.load(srow + r, volatile=True)
            e = (info // 2) % BLOCK_E
            resident = ((info % 2) == 1) & (info // (2 * BLOCK_E) > past)
            v = tl.min(tl.where(pool & (order > past) & (visit >= r), victim_key, none), axis=0)
            do = (resident == 0) & (new < BUDGET) & (v < none)
            victim = (v // 2) % BLOCK_E
            slot = (v // (2 * BLOCK_E)) % BLOCK_E
            past = tl.where(do, v // (2 * BLOCK_E * BLOCK_E), past)
            unused += (do & ((v % 2) == 1)).to(tl.int64)
            tl.store(prefetch_ptr + 1 + new, e, mask=do)
            tl.store(prefetch_ptr + 1 + N_INS + new, slot, mask=do)
            at_victim = do & (idx == victim)
            at_e = do & (idx == e)
            es = tl.where(at_victim, -1, tl.where(at_e, slot, es))
            pref = tl.where(at_victim, -1, tl.where(at_e, t, pref))
            last = tl.where(at_e, t, last)
            se = tl.where(do & (idx == slot), e, se)
            new += do.to(tl.int64)
        prot = tl.where(window & (es >= 0), t, prot)
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
               pval_ptr, bias_ptr, fscr_ptr, VOCAB, token, layer, z_ptr, experts_ptr, route_ptr, demand_ptr, idx,
               valid, E: tl.constexpr, BLOCK_E: tl.constexpr, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr,
               KIND: tl.constexpr, LRU: tl.constexpr, MAXP: tl.constexpr, CHUNK: tl.constexpr,
               PROTECT: tl.constexpr, RUNNING: tl.constexpr, SIGMOID: tl.constexpr, RENORMALISE: tl.constexpr,
               N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, RANK_J: tl.constexpr):
        """`kernels.route` of `layer`: part 2, the slots and the execution weights. The demand loop's victims are
        one ranking: the host takes, per demand expert in index order, the least (priority, index) resident
        outside S and B, then (none left) outside S; the snapshot does not change inside the loop and an inserted
        expert is in S, so its victims are, in order, the first d of the residents outside S ranked by (protected
        or not, priority, index), and demand number r takes victim number r."""
        irow = ist_ptr + layer * _N_IROWS * E + idx
        frow = fst_ptr + layer * _N_FROWS * E + idx
        isc = isc_ptr + layer * _N_ISCALARS
        fsc = fsc_ptr + layer * _N_FSCALARS
        t = tl.load(isc + _POS)
        snap = tl.load(isc + _SNAP_TOKEN)
        es, se, last, prot, sel_tok, pref, sf, ss, prio = _state_rows(irow, frow, valid, E)
        prio = _priority(prio, snap, t, sf, ss, last, idx, token, pind_ptr, pexp_ptr, pval_ptr, layer, VOCAB, LRU,
                         MAXP, CHUNK)
        zs, z = _scores(z_ptr, bias_ptr, layer, valid, idx, E, SIGMOID)
        zmax = tl.max(tl.where(valid, zs, float("-inf")), axis=0)
        zmin = tl.min(tl.where(valid, zs, float("inf")), axis=0)
        range_sum = tl.load(fsc + _RANGE_SUM) + (zmax - zmin)
        range_count = tl.load(fsc + _RANGE_COUNT) + 1.0
        tl.store(fsc + _RANGE_SUM, range_sum)
        tl.store(fsc + _RANGE_COUNT, range_count)

        own = _rank(zs, zs, valid, idx, TOP_K, E, BLOCK_E, N_GROUP, TOPK_GROUP, RANK_J)
        if KIND == 0:  # exact
            sel = own
        elif KIND == 3:  # spec_exec: the pre-gate's top-K where part 1 ran for this token
            ks = tl.arange(0, BLOCK_K)
            first = tl.load(ist_ptr + (layer * _N_IROWS + _PREDICTED) * E + ks, mask=ks < TOP_K, other=-1)
            predicted = tl.max(tl.where(first[None, :] == idx[:, None], ks[None, :], -1), axis=1)
            sel = tl.where(tl.load(isc + _PRED_TOKEN) == t, predicted, own)
        else:  # cache_prior, psr: the bonus to resident experts (and the router's own top-J)
            if RUNNING:
                scale = tl.load(fpar_ptr + _F_BONUS) * range_sum / range_count
            else:
                scale = tl.load(fpar_ptr + _F_BONUS) * tl.load(delta_ptr + layer)
            boosted = (es >= 0) | ((own >= 0) & (own < PROTECT))
            biased = tl.where(boosted, zs + scale, zs)
            sel = _rank(biased, zs, valid, idx, TOP_K, E, BLOCK_E, N_GROUP, TOPK_GROUP, RANK_J)
        chosen = sel >= 0
        sel_tok = tl.where(chosen, t, sel_tok)

        # demand insertions, in expert index order, and their victims
        needed = chosen & (es < 0)
        outside = (es >= 0) & (sel_tok != t)
        victim_no = _count_ahead(tl.where(prot == t, -1.0, 0.0), -prio, -idx, outside, BLOCK_E, RANK_J)
        demand_no = tl.cumsum(needed.to(tl.int32), axis=0) - needed.to(tl.int32)
        d = tl.sum(needed.to(tl.int32), axis=0)
        slot = _match(demand_no, victim_no, es.to(tl.int32), outside, BLOCK_E, RANK_J)  # of each demand expert
        evicted = outside & (victim_no < d)
        unused = tl.sum((evicted & (pref >= 0)).to(tl.int64), axis=0)
        taker = _match(idx, slot, idx, needed, BLOCK_E, RANK_J)  # slot -> the demand expert taking it
        se = tl.where(taker >= 0, taker.to(tl.int64), se)
        es = tl.where(evicted, -1, tl.where(needed, slot.to(tl.int64), es))
        pref = tl.where(evicted | chosen, -1, pref)
        last = tl.where(chosen, t, last)
        tl.store(demand_ptr + 1 + demand_no, idx.to(tl.int64), mask=needed)
        tl.store(demand_ptr + 1 + TOP_K + demand_no, slot.to(tl.int64), mask=needed)
        tl.store(demand_ptr, d.to(tl.int64))

        # statistics of the router's own top-K; what the policy displaced from it
        mine = own >= 0
        sf = sf * tl.load(fpar_ptr + _F_FAST)
        ss = ss * tl.load(fpar_ptr + _F_SLOW)
        sf = tl.where(mine, sf + tl.load(fpar_ptr + _F_FAST_GAIN), sf)
        ss = tl.where(mine, ss + tl.load(fpar_ptr + _F_SLOW_GAIN), ss)
        p = tl.where(valid, tl.exp(zs - zmax), 0.0)
        norm = tl.sum(p, axis=0)
        gone = mine & (sel < 0)
        replaced = tl.sum(gone.to(tl.int64), axis=0)

        # execution weights (`kernels.execution_weights`) from the raw logits
        if SIGMOID:
            w = 1.0 / (1.0 + tl.exp(-z))
        else:
            w = p / norm  # softmax: z is zs, p its exp(z - zmax)
        # the float64 sums the host adds in order (the weights over S in its order, the displaced mass over the
        # router's top-K in its order, adding 0.0 for an executed expert: exact): K values each, through this
        # layer's row of the scratch, added in order
        srow = fscr_ptr + layer * 2 * TOP_K
        tl.store(srow + sel, w, mask=chosen)
        tl.store(srow + TOP_K + own, tl.where(gone, p, 0.0), mask=mine)
        tl.debug_barrier()
        total = tl.zeros([], tl.float64)
        displaced = tl.zeros([], tl.float64)
        for j in tl.static_range(TOP_K):
            total += tl.load(srow + j, volatile=True)
            displaced += tl.load(srow + TOP_K + j, volatile=True)
        displaced = tl.where(replaced > 0, displaced / norm, displaced)
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
                           pind_ptr, pexp_ptr, pval_ptr, fscr_ptr, iscr_ptr, VOCAB, token_ptr, layer, z_ptr, g_ptr,
                           experts_ptr, route_ptr, demand_ptr, prefetch_ptr,
                           E: tl.constexpr, BLOCK_E: tl.constexpr, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr,
                           M: tl.constexpr, R: tl.constexpr, N_INS: tl.constexpr, BUDGET: tl.constexpr,
                           KIND: tl.constexpr, LRU: tl.constexpr, MAXP: tl.constexpr, CHUNK: tl.constexpr,
                           PROTECT: tl.constexpr, RUNNING: tl.constexpr, SIGMOID: tl.constexpr,
                           RENORMALISE: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                           RANK_J: tl.constexpr, DO_ROUTE: tl.constexpr, DO_PART1: tl.constexpr):
        idx = tl.arange(0, BLOCK_E)
        valid = idx < E
        token = tl.load(token_ptr)
        if DO_ROUTE:
            _route(ist_ptr, isc_ptr, fst_ptr, fsc_ptr, cnt_ptr, disp_ptr, fpar_ptr, delta_ptr, pind_ptr, pexp_ptr,
                   pval_ptr, bias_ptr, fscr_ptr, VOCAB, token, layer, z_ptr, experts_ptr, route_ptr, demand_ptr, idx,
                   valid, E, BLOCK_E, TOP_K, BLOCK_K, KIND, LRU, MAXP, CHUNK, PROTECT, RUNNING, SIGMOID,
                   RENORMALISE, N_GROUP, TOPK_GROUP, RANK_J)
        if DO_PART1:
            _part1(ist_ptr, isc_ptr, fst_ptr, cnt_ptr, pind_ptr, pexp_ptr, pval_ptr, bias_ptr, iscr_ptr, VOCAB,
                   token, layer + DO_ROUTE, g_ptr, prefetch_ptr, idx, valid, E, BLOCK_E, M, R, N_INS, BUDGET, LRU,
                   MAXP, CHUNK, SIGMOID, N_GROUP, TOPK_GROUP, RANK_J)


class DeviceCache:
    """The state of a `LogicalCache` on `device` and the launch that runs its per-layer steps there.

    Built from a host cache (its current state is copied; the host cache is left alone) and the model's
    `RouterScoring` (whose groups must be the cache's). `step` writes the outputs named in the module docstring
    into this object's tensors (`experts`, `route`, `demand`, `prefetch`), so that a CUDA graph can capture it.
    """

    def __init__(self, cache: LogicalCache, scoring: RouterScoring, device):
        if triton is None:
            raise RuntimeError("the device cache needs Triton")
        policy, num_layers, num_experts = cache.policy, cache.num_layers, cache.num_experts
        if (int(cache.params[K.P_GROUPS]), int(cache.params[K.P_TOPK_GROUP])) != scoring.groups:
            raise ValueError(f"the scoring's expert groups {scoring.groups} are not the cache's "
                             f"{(int(cache.params[K.P_GROUPS]), int(cache.params[K.P_TOPK_GROUP]))}")
        self.policy, self.scoring, self.device = policy, scoring, torch.device(device)
        self.num_layers, self.num_experts = num_layers, num_experts

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
        self._fscratch = torch.zeros(num_layers, 2 * k, dtype=torch.float64, device=self.device)
        self._iscratch = torch.zeros(num_layers, max(self.visited, 1), dtype=torch.int64, device=self.device)
        block_e = triton.next_power_of_2(num_experts)
        self.num_warps, self.rank_chunk = launch_shape(num_experts)  # read at every launch: settable, for tuning
        self._constants = dict(
            E=num_experts, BLOCK_E=block_e, TOP_K=k, BLOCK_K=triton.next_power_of_2(k), M=self.ranked,
            R=self.visited, N_INS=self.max_inserted, BUDGET=policy.insert_budget, KIND=int(cache.params[K.P_KIND]),
            LRU=int(policy.priority == "lru"), MAXP=prior_block, CHUNK=min(prior_block, PRIOR_CHUNK),
            PROTECT=policy.protect_top, RUNNING=int(policy.delta == "running"),
            SIGMOID=int(scoring.kind == "sigmoid"), RENORMALISE=int(bool(scoring.renormalise)),
            N_GROUP=scoring.n_group, TOPK_GROUP=scoring.topk_group)

    def step(self, token: torch.Tensor, layer: int, router_logits: torch.Tensor | None = None,
             pregate_logits: torch.Tensor | None = None, experts_out: torch.Tensor | None = None,
             route_out: torch.Tensor | None = None) -> None:
        """One launch: `route` of `layer` from router_logits [E] float32 (if given), then part 1 of the next
        layer (`layer` itself when no router logits are given) from pregate_logits [E] float32 (if given; the
        raw logits: a sigmoid router's selection scores are computed here). token: int64 [1] on the device, the
        position's input token (the token prior's row). experts_out int64 [K] / route_out int32 [2K] (contiguous):
        where the selection and the route row go instead of `experts` / `route` (a step's own rows, so that the
        MoE reads them where they are)."""
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
        z = router_logits if do_route else self._dummy
        g = pregate_logits if do_part1 else self._dummy
        _cache_step_kernel[(1,)](
            self.istate, self.iscalar, self.fstate, self.fscalar, self.counters, self.displaced_mass, self.fparams,
            self.delta, self.bias, self.pind, self.pexp, self.pval, self._fscratch, self._iscratch, self.vocab,
            token, layer, z, g, experts_out, route_out, self.demand, self.prefetch, **self._constants,
            RANK_J=self.rank_chunk, DO_ROUTE=int(do_route), DO_PART1=int(do_part1), num_warps=self.num_warps,
            enable_fp_fusion=False)

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
