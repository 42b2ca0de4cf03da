"""Block selection and the expert pool on the device: `select_block_into` + `ExpertPool.use` of one layer as three
Triton launches (four for a block selector), and `ExpertPool.end_block` (the refill by recency) as one more over
all layers.

`DevicePool` holds an `ExpertPool`'s state (slot table, pool mask, recency, the block number, the warm ranks) as
device tensors. `DevicePool.select(layer, router_logits, alpha)` runs, for a block of D positions (router logits
float32 [D, E], position weights alpha float64 [D]), what depends on one position in a program per position and
what joins the positions in one program: `_own_kernel` (per position: normaliser, own top-K, its terms of the
demand), `_demand_kernel` (a block selector's eligible set: the demand u, the positions' terms added in position
order, its entropy, the extra candidates, pruning), `_execute_kernel` (per position: what it executes, its weights
and displaced mass) and `_use_kernel` (the pool's use of the executions; it, the prefetch's cap and the refill are
in `device_pool`). They pass their results through scratch tensors of the pool, in stream order: one program for
all D positions, running them one after another, took 2.4-3.0x the time at OLMoE's size (BENCHMARKS.md). In order:

- every position's router distribution (softmax, or the normalised sigmoid), its selection scores (a sigmoid
  router's sigmoid + the layer's bias) and own top-K (group-limited where the scoring is);
- the selector (`SelectorConfig`: exact, or a block selector with gamma, rescue and pruning): the demand u of
  experts outside the root's top-K, its entropy, the extra candidates, pruning within the rerouting budget
  against the pool, and each position's executed experts;
- the execution weights (float32, as the engine's buffers hold them), the displaced router mass (float64);
- `ExpertPool.use`: the missing experts (executed, not in the pool; ascending) take union slots P, P+1, ...,
  executed experts' recency is marked; and the route rows (slot ids int32 [D, K]) the MoE kernel reads.

`DevicePool.predict(layer, pregate_logits, alpha)` is the block prefetch (`verifiers.predict_prefetch`): the same
selection launches over their own scratch on the pre-gate logits, then `_prefetch_kernel` caps the predicted
missing experts by priority into a copy list (slots P, P+1, ...); with a budget, `select`'s `_use_kernel` places the
missing experts as `verifiers.place_union` does (hits stay in their prefetch slots), the demand list holds only the
copies and the route rows the physical slots.

`DevicePool.end_block()` refills every layer's pool with its P most recent experts (ties to the lower index,
never executed ones in the warm ranking's order), entering experts taking the freed pool slots in ascending
order, and writes the moves (union slot -> pool slot) the slot buffer must make.

Arithmetic follows the host's (`specmoe.verifiers.selection._select`): float64 from the float32 logits, sums in
the host's order (the normalisers over E, the demand and the entropy as the host's `_halving_sum`: log2(E) steps
of pairs; the weights' sums over the selection's order, one after another), float constants from a float64
tensor, launched without FMA contraction, ties broken as the host breaks them. docs/device-cache.md ("Block
selection on the device") says what is bitwise and what is not supported.
"""

from __future__ import annotations

import numpy as np
import torch

from specmoe.routing import RouterScoring
from specmoe.routing.scoring import check_groups
from specmoe.verifiers import ExpertPool, SelectorConfig
from specmoe.verifiers.selection import ENTROPY_SLACK, TINY

from . import pdl
from .device_cache import row_warps, triton
from .ranking import score_ties

# float64 parameters (one tensor: a Python float launch argument would be float32)
F_GAMMA, F_RESCUE, F_PRUNE, F_SCALE, F_EPS, F_TINY, F_SLACK = range(7)
N_FPARAMS = 7
C_ELIGIBLE, C_UNION, C_MISSING, C_OK = range(4)  # the counts row: n_eligible, n_union, n_missing, 1 (0: over U)
MAX_EXPERTS = 1024  # the refill's recency key holds the expert index in 10 bits

if triton is not None:
    import triton.language as tl

    from .device_pool import _block_rows, _prefetch_kernel, _refill_kernel, _use_kernel
    from .pdl import enter
    from .ranking import _PAIRWISE_MAX, _TIES_SCORE, _order, _pick_int, _rank

    _F_GAMMA = tl.constexpr(F_GAMMA)
    _F_RESCUE = tl.constexpr(F_RESCUE)
    _F_PRUNE = tl.constexpr(F_PRUNE)
    _F_SCALE = tl.constexpr(F_SCALE)
    _F_EPS = tl.constexpr(F_EPS)
    _F_TINY = tl.constexpr(F_TINY)
    _F_SLACK = tl.constexpr(F_SLACK)

    @triton.jit
    def _position(z_ptr, ZS, bias_ptr, d, top_ptr, norm_ptr, idx, valid, SIGMOID: tl.constexpr):
        """Position d's float64 logits (row stride ZS), router probabilities (exp(z - max z), or sigmoid(z):
        `prob` of the host), selection scores and normaliser (top_ptr, norm_ptr: the positions' max logit and
        normaliser in the scratch rows `_own_kernel` writes)."""
        z = tl.load(z_ptr + d * ZS + idx, mask=valid, other=0.0).to(tl.float64)
        if SIGMOID:
            p = 1.0 / (1.0 + tl.exp(-z))
            s = p + tl.load(bias_ptr + idx, mask=valid, other=0.0)
        else:
            p = tl.exp(z - tl.load(top_ptr + d))
            s = z
        return z, tl.where(valid, p, 0.0), s, tl.load(norm_ptr + d)

    @triton.jit
    def _ordered_sum(vec, order, sum_ptr, K: tl.constexpr, BLOCK_K: tl.constexpr):
        """sum over j = 0..K-1 of vec at order == j (0.0 where no expert has order j), added in that order (vec
        >= 0). The K values go through the scratch row sum_ptr [BLOCK_K] and are read back one by one: a sum in a
        fixed order, without K reductions over the experts."""
        tl.store(sum_ptr + tl.arange(0, BLOCK_K), tl.zeros([BLOCK_K], tl.float64))
        tl.debug_barrier()
        tl.store(sum_ptr + order, vec, mask=(order >= 0) & (order < K))
        tl.debug_barrier()
        total = tl.zeros([], tl.float64)
        for j in tl.static_range(K):
            total += tl.load(sum_ptr + j)
        tl.debug_barrier()  # every thread has read before the row is written again
        return total

    @triton.jit
    def _halving_sum(x, BLOCK_E: tl.constexpr):
        """The sum of x [BLOCK_E] (float64; entries past E 0.0) in the host's order (`selection._halving_sum`): the
        second half added to the first, elementwise, until one entry is left, log2(BLOCK_E) steps. Each step is a
        reduction over pairs, one addition per pair, so its bits do not depend on how the reduction is laid out."""
        for _ in tl.static_range(10):  # MAX_EXPERTS = 2 ** 10
            if x.shape[0] > 1:
                x = tl.sum(tl.reshape(x, [2, x.shape[0] // 2]), axis=0)
        return tl.sum(x, axis=0)

    @triton.jit
    def _order_positive(u, positive, idx, limit, m, f_ptr, r_ptr, BLOCK_E: tl.constexpr):
        """`_order(u, u, positive, idx, limit, BLOCK_E, TIES_SCORE)` for the m positive u (the extra candidates,
        decreasing u, ties to the lower index). Where m <= PAIRWISE_MAX < BLOCK_E (a block's candidates at
        E = 256: 27 at the median on the olmoe-like source) they are packed, in ascending expert order, into
        PAIRWISE_MAX entries and ranked there by `_order`'s one [64, 64] comparison, instead of up to ORDER_PICKS
        picks of two reductions across the warps or the [E, 8] tiles. Scratch: the float64 row f_ptr [BLOCK_E]
        (the packed u, then their indices) and the int32 row r_ptr [BLOCK_E] (the ranks by expert)."""
        if BLOCK_E <= _PAIRWISE_MAX:
            rank = _order(u, u, positive, idx, limit, BLOCK_E, _TIES_SCORE)
        elif m <= _PAIRWISE_MAX:
            at = tl.cumsum(positive.to(tl.int32), axis=0) - 1
            tl.debug_barrier()  # the rows' earlier readers are done
            tl.store(f_ptr + at, u, mask=positive)
            tl.store(f_ptr + _PAIRWISE_MAX + at, idx.to(tl.float64), mask=positive)
            tl.store(r_ptr + idx, tl.full([BLOCK_E], -1, tl.int32))
            tl.debug_barrier()
            c = tl.arange(0, _PAIRWISE_MAX)
            live = c < m
            packed = tl.load(f_ptr + c, mask=live, other=0.0)
            expert = tl.load(f_ptr + _PAIRWISE_MAX + c, mask=live, other=0.0).to(tl.int32)
            tl.store(r_ptr + expert, _order(packed, packed, live, expert, limit, _PAIRWISE_MAX, _TIES_SCORE),
                     mask=live)
            tl.debug_barrier()
            rank = tl.load(r_ptr + idx)
            tl.debug_barrier()  # every thread has read the row before it is written again
        else:
            rank = _order(u, u, positive, idx, limit, BLOCK_E, _TIES_SCORE)
        return rank

    @triton.jit
    def _own_kernel(z_ptr, ZS, alpha_ptr, bias_ptr, fpar_ptr, fs_ptr, own_ptr,
                    E: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, K: tl.constexpr,
                    SIGMOID: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                    TIES: tl.constexpr, DEMAND: tl.constexpr, PDL: tl.constexpr = False):
        """Position program_id(0) of the block: its max logit and normaliser (`_halving_sum` over the experts)
        into the float scratch (fs_ptr: top [BLOCK_D], norm [BLOCK_D]), its own top-K ranks into own_ptr's row;
        with DEMAND (a block selector) its terms of the demand, alpha_d p / n_d on its own top-K (0 elsewhere),
        into its row of terms, which `_demand_kernel` adds in position order."""
        enter(PDL)
        d = tl.program_id(0)
        idx = tl.arange(0, BLOCK_E)
        valid = idx < E
        tiny = tl.load(fpar_ptr + _F_TINY)
        z = tl.load(z_ptr + d * ZS + idx, mask=valid, other=float("-inf")).to(tl.float64)
        top = tl.max(z, axis=0)
        if SIGMOID:
            term = 1.0 / (1.0 + tl.exp(-z))
        else:
            term = tl.exp(z - top)
        total = _halving_sum(tl.where(valid, term, 0.0), BLOCK_E)
        if SIGMOID:
            norm = tl.where(tiny > total, tiny, total)
        else:
            norm = total
        tl.store(fs_ptr + d, top)
        tl.store(fs_ptr + BLOCK_D + d, norm)
        tl.debug_barrier()
        z, p, s, nd = _position(z_ptr, ZS, bias_ptr, d, fs_ptr, fs_ptr + BLOCK_D, idx, valid, SIGMOID)
        rank = _rank(s, s, valid, idx, K, E, BLOCK_E, N_GROUP, TOPK_GROUP, BLOCK_G, TIES)
        tl.store(own_ptr + d * BLOCK_E + idx, rank)
        if DEMAND:  # this position's row of terms
            tl.store(fs_ptr + 2 * BLOCK_D + d * BLOCK_E + idx,
                     tl.where((rank >= 0) & valid, tl.load(alpha_ptr + d) * p / nd, 0.0))

    @triton.jit
    def _demand_kernel(fpar_ptr, pool_ptr, D, fs_ptr, own_ptr, elig_ptr,
                       E: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
        """A block selector's eligible set (the root's top-K, the extra candidates, pruning against the pool):
        into elig_ptr [BLOCK_E] (1 / 0)."""
        enter(PDL)
        _, idx, _, valid, own = _block_rows(own_ptr, D, E, BLOCK_D, BLOCK_E)
        v = tl.sum((own >= 0).to(tl.int32), axis=0)
        in_root = tl.load(own_ptr + idx) >= 0
        resident = tl.load(pool_ptr + idx, mask=valid, other=0).to(tl.int32)
        # u: the positions' terms (`_own_kernel`'s rows, 0 off each position's own top-K) added in position order
        # outside the root's top-K; the rows' loads do not depend on the running sum, so the unrolled loop has
        # them in flight together (adding a 0 term, or a row past D read as 0, leaves u's bits unchanged)
        terms_ptr = fs_ptr + 2 * BLOCK_D
        outside_root = (in_root == 0) & valid
        u = tl.zeros([BLOCK_E], tl.float64)
        for d in tl.static_range(BLOCK_D):
            term = tl.load(terms_ptr + d * BLOCK_E + idx, mask=valid & (d < D), other=0.0)
            u = tl.where(outside_root, u + term, u)
        positive = (u > 0.0) & valid
        m = tl.sum(positive.to(tl.int32), axis=0)
        # the demand and its entropy over the positive u, summed as the host sums them (u >= 0: its zeros leave
        # the sum's bits unchanged)
        demand = _halving_sum(tl.where(positive, u, 0.0), BLOCK_E)
        q = u / demand
        entropy = -_halving_sum(tl.where(positive, q * tl.log(tl.where(positive, q, 1.0)), 0.0), BLOCK_E)
        size = tl.load(fpar_ptr + _F_GAMMA) * tl.exp(entropy) - tl.load(fpar_ptr + _F_SLACK)
        saturated = size >= m.to(tl.float64)  # may exceed any integer (gamma 1e300)
        extra = tl.where(saturated, m, tl.ceil(tl.where(saturated, 0.0, size)).to(tl.int32))
        extra = tl.where(m > 0, extra, 0)
        ranked = _order_positive(u, positive, idx, extra, m, terms_ptr, elig_ptr, BLOCK_E)  # decreasing u
        eligible = in_root | (ranked >= 0)
        lost = tl.sum(tl.where(eligible | (valid == 0), 0, v), axis=0)
        limit = tl.load(fpar_ptr + _F_PRUNE) * lost.to(tl.float64)
        # pruning walks the candidates in increasing u (from the last back), removing those outside the pool while
        # the rows they remove stay within the limit, and stops at the first that would exceed it: as the removed
        # rows only grow, a candidate goes iff it is outside the pool and the rows of the candidates outside the
        # pool up to it in the walk (an integer prefix sum, exact) are within the limit. The prefix sum runs over
        # the walk's order through the eligible row, which is written last.
        walk = extra - 1 - ranked
        candidate = ranked >= 0
        outside = resident == 0
        tl.store(elig_ptr + walk, tl.where(outside, v, 0), mask=candidate)
        tl.debug_barrier()
        through = tl.cumsum(tl.load(elig_ptr + idx, mask=idx < extra, other=0), axis=0)
        tl.debug_barrier()
        tl.store(elig_ptr + idx, through)
        tl.debug_barrier()
        through = tl.load(elig_ptr + walk, mask=candidate, other=0)
        tl.debug_barrier()
        gone = candidate & outside & (through.to(tl.float64) <= limit)
        eligible = eligible & (gone == 0)
        tl.store(elig_ptr + idx, eligible.to(tl.int32))

    @triton.jit
    def _execute_kernel(z_ptr, ZS, alpha_ptr, bias_ptr, fpar_ptr, fs_ptr, own_ptr, elig_ptr, exec_ptr,
                        selected_ptr, weights_ptr, displaced_ptr, route_ptr, RS, WEIGHTS_IN_ROUTE: tl.constexpr,
                        E: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, K: tl.constexpr,
                        BLOCK_K: tl.constexpr, BLOCK: tl.constexpr, SIGMOID: tl.constexpr,
                        RENORMALISE: tl.constexpr, TIES: tl.constexpr, PDL: tl.constexpr = False):
        """Position program_id(0): what it executes (its own top-K, or the selector's choice among the eligible
        with the top-1 rescue), its execution weights and displaced mass; its executed ranks into exec_ptr's row."""
        enter(PDL)
        d = tl.program_id(0)
        idx = tl.arange(0, BLOCK_E)
        valid = idx < E
        tiny = tl.load(fpar_ptr + _F_TINY)
        scale = tl.load(fpar_ptr + _F_SCALE)
        sum_ptr = fs_ptr + 2 * BLOCK_D + BLOCK_D * BLOCK_E + d * BLOCK_K  # this position's ordered-sum row
        z, p, s, nd = _position(z_ptr, ZS, bias_ptr, d, fs_ptr, fs_ptr + BLOCK_D, idx, valid, SIGMOID)
        mine = tl.load(own_ptr + d * BLOCK_E + idx)
        if BLOCK:
            eligible = tl.load(elig_ptr + idx) != 0
            rescue = tl.load(fpar_ptr + _F_RESCUE)
            top1 = tl.min(tl.where(mine == 0, idx, BLOCK_E), axis=0)
            rescued = (d > 0) & (rescue >= 0.0) & (tl.load(alpha_ptr + d) >= rescue) & \
                (_pick_int(eligible.to(tl.int32), idx, top1) == 0)
            # a rescued top-1 executes first, then the best eligible experts (top1 is not eligible then)
            start = rescued.to(tl.int32)
            sel = _order(s, s, eligible & valid, idx, K - start, BLOCK_E, TIES)
            sel = tl.where(sel >= 0, sel + start, sel)
            sel = tl.where(rescued & (idx == top1), 0, sel)
            sel = tl.where(d == 0, mine, sel)
        else:
            sel = mine
        if SIGMOID:
            den = _ordered_sum(p, sel, sum_ptr, K, BLOCK_K) + tl.load(fpar_ptr + _F_EPS)
            if RENORMALISE:
                w = p / den * scale
            else:
                w = p * scale
        else:
            if RENORMALISE:
                den = _ordered_sum(p, sel, sum_ptr, K, BLOCK_K)
            else:
                den = nd
            # renormalised over experts whose softmax underflows: shift by their own maximum instead
            shift = tl.max(tl.where(sel >= 0, z, float("-inf")), axis=0)
            q = tl.where(sel >= 0, tl.exp(z - shift), 0.0)
            w = tl.where(den >= tiny, p / den * scale, q / _ordered_sum(q, sel, sum_ptr, K, BLOCK_K) * scale)
        tl.store(selected_ptr + d * K + sel, idx.to(tl.int64), mask=sel >= 0)
        tl.store(weights_ptr + d * K + sel, w.to(tl.float32), mask=sel >= 0)
        if WEIGHTS_IN_ROUTE:
            tl.store(route_ptr + d * RS + K + sel, w.to(tl.float32).to(tl.int32, bitcast=True), mask=sel >= 0)
        gone = tl.where(sel >= 0, K, mine)  # own ranks not executed; executed ones moved out of 0..K-1
        tl.store(displaced_ptr + d, _ordered_sum(p, gone, sum_ptr, K, BLOCK_K) / nd)
        tl.store(exec_ptr + d * BLOCK_E + idx, sel)



def select_warps(num_experts: int) -> int:
    """Warps of the block selection's launches: one per 32 entries of the padded expert row (2 at E = 64, 8 at
    E = 256), twice the cache step's `default_warps`: besides [E] rows the selection holds [D, E] tiles (a block's
    positions by the experts) and ranks by [E, 8] comparison tiles, and more threads hold fewer of their entries.
    On an H200 (BENCHMARKS.md, 2026-12-04) 2 warps took 0.70-0.82 of one warp's time at E = 64 (OLMoE's and
    Moonlight's geometries, D = 9 and 17) and 8 warps 0.89-0.91 of four's at E = 256; at E = 64, 4 and 8 warps
    took 5.8-19 times as long as 2."""
    return row_warps(num_experts, 32)


class _Scratch:
    """What a selection's launches pass on (`DevicePool._selection`): positions' max logits and normalisers, a row
    of demand terms per position, an ordered-sum row per position (floats); own ranks and executed ranks per
    position; the eligible set."""

    def __init__(self, block_d: int, block_e: int, block_k: int, device):
        self.floats = torch.zeros(2 * block_d + block_d * block_e + block_d * block_k, dtype=torch.float64,
                                  device=device)
        self.own = torch.full((block_d, block_e), -1, dtype=torch.int32, device=device)
        self.executed = torch.full((block_d, block_e), -1, dtype=torch.int32, device=device)
        self.eligible = torch.zeros(block_e, dtype=torch.int32, device=device)


class DevicePool:
    """An `ExpertPool` and the block selection over it on the device (see the module docstring).

    pool: the host pool whose current state is copied (the host is untouched; `load` copies it again);
    selector, scoring: as `select_block_into` takes them (a bool scoring: a softmax router that renormalises or
    not); max_positions: the largest block D. Outputs (device tensors, written by each `select` of a layer):
    selections int64 [L, D, K] (`selected`: the layer's rows), weights float32 [D, K], displaced_rows float64
    [L, D] (`displaced`: the layer's row), route int32 [D, K] (the slot of each selected expert, unless the
    route rows are given), eligible / union int64 [E] and counts int64 [4] (n_eligible, n_union, n_missing, 1,
    or 0 if more than U experts are missing: then the pool is unchanged, as the host's raises), and the layer's
    demand list demands[layer] int64 [1 + 2E] (`demand`: the count, 0 if over U; the missing experts
    (`missing`), their union slots (`missing_slots`): a copy list of `kernels.expert_copy`); by `end_block`:
    move_lists int64 [L, 1 + 2E] (per layer the count, the union slots left, the pool slots taken: a copy list
    from the slots to the slots), as moves [L, 2, E] and n_moves [L].

    warps: the selection launches' warps (default `select_warps(E)`; a benchmark's choice).

    prefetch: the block prefetch's budget per layer and block (0: none; `predict`). With a budget, `predict`
    writes prefetches[layer] int64 [1 + 2E] (count, experts ascending, slots P, P+1, ...: a copy list), and
    `select` writes the demand list with the copies only (the missing experts not prefetched, in their physical
    union slots), the route rows with physical slots, physical[layer] int64 [U] (the physical slot of each logical
    union slot). Every `select` writes layer_counts[layer] int64 [4]: missing experts (also past U), prefetched,
    prefetch hits, union slots written (the missing experts without a prefetch).
    """

    def __init__(self, pool: ExpertPool, selector: SelectorConfig, scoring: RouterScoring | bool,
                 max_positions: int, device, prefetch: int = 0, warps: int | None = None):
        if triton is None:
            raise RuntimeError("DevicePool needs Triton")
        if warps not in (None, 1, 2, 4, 8):
            raise ValueError(f"the block selection runs on 1, 2, 4 or 8 warps, got {warps}")
        if not isinstance(selector, SelectorConfig):
            raise ValueError(f"expected a SelectorConfig, got {type(selector).__name__}")
        if isinstance(scoring, (bool, np.bool_)):
            scoring = RouterScoring("softmax", renormalise=bool(scoring))
        E, k, L = pool.num_experts, pool.top_k, pool.num_layers
        if E > MAX_EXPERTS:
            raise ValueError(f"at most {MAX_EXPERTS} experts, got {E}")
        check_groups(scoring.n_group, scoring.topk_group, E, k)
        self.pool, self.selector, self.scoring, self.device = pool, selector, scoring, torch.device(device)
        self.num_layers, self.num_experts, self.top_k, self.max_positions = L, E, k, max_positions

        def put(array, dtype):
            return torch.tensor(np.ascontiguousarray(array), dtype=dtype, device=self.device)

        self.slot, self.recency = put(pool.slot, torch.int64), put(pool.recency, torch.int64)
        self.pool_mask = put(pool.pool_mask, torch.int8)
        self.warm_rank = put(pool.warm_rank, torch.int64)
        self.block = put([pool.block], torch.int64)
        self.bias = put(scoring.bias_rows(L, E), torch.float64)
        fpar = np.zeros(N_FPARAMS)
        params = selector.kernel_params
        fpar[[F_GAMMA, F_RESCUE, F_PRUNE]] = params[1], params[2], params[3]
        fpar[[F_SCALE, F_EPS, F_TINY, F_SLACK]] = scoring.scale, 1e-20, TINY, ENTROPY_SLACK
        self.fparams = put(fpar, torch.float64)
        self.selections = torch.zeros(L, max_positions, k, dtype=torch.int64, device=self.device)
        self.weights = torch.zeros(max_positions, k, dtype=torch.float32, device=self.device)
        self.displaced_rows = torch.zeros(L, max_positions, dtype=torch.float64, device=self.device)
        self.route = torch.zeros(max_positions, k, dtype=torch.int32, device=self.device)
        self.sets = torch.zeros(2, E, dtype=torch.int64, device=self.device)
        self.eligible, self.union = self.sets
        self.demands = torch.zeros(L, 1 + 2 * E, dtype=torch.int64, device=self.device)
        self._layer_views(0)
        self.counts = torch.zeros(4, dtype=torch.int64, device=self.device)
        block_d, block_k = (triton.next_power_of_2(n) for n in (max_positions, k))
        block_e = triton.next_power_of_2(E)
        self.scratch = _Scratch(block_d, block_e, block_k, self.device)
        # the block prefetch (`predict`): its own selection scratch and outputs (it runs beside the layer's
        # selection), each layer's prefetch rank row and copy list, the physical slot of each logical union slot,
        # the counts per layer (missing, prefetched, hits, union slots written) and the placement's free-slot row
        if isinstance(prefetch, bool) or not isinstance(prefetch, (int, np.integer)) or prefetch < 0:
            raise ValueError(f"prefetch must be an integer >= 0 (experts per layer and block), got {prefetch!r}")
        self.prefetch = int(prefetch)
        u = max(pool.union_slots, 1)
        self.predicted = None
        if self.prefetch:
            self.predicted = _Scratch(block_d, block_e, block_k, self.device)
            self.predicted_rows = (torch.zeros(max_positions, k, dtype=torch.int64, device=self.device),
                                   torch.zeros(max_positions, k, dtype=torch.float32, device=self.device),
                                   torch.zeros(max_positions, dtype=torch.float64, device=self.device),
                                   torch.zeros(max_positions, k, dtype=torch.int32, device=self.device))
        self.prefetch_ranks = torch.full((L, block_e), -1, dtype=torch.int32, device=self.device)
        self.prefetches = torch.zeros(L, 1 + 2 * E, dtype=torch.int64, device=self.device)
        self.physical = torch.zeros(L, u, dtype=torch.int64, device=self.device)
        self.layer_counts = torch.zeros(L, 4, dtype=torch.int64, device=self.device)
        self.free_scratch = torch.zeros(block_e, dtype=torch.int64, device=self.device)
        self.move_lists = torch.zeros(L, 1 + 2 * E, dtype=torch.int64, device=self.device)
        self.moves = self.move_lists[:, 1:].view(L, 2, E)
        self.n_moves = self.move_lists[:, 0]
        self._constants = dict(
            E=E, BLOCK_E=block_e, BLOCK_D=block_d, K=k, BLOCK_K=block_k,
            BLOCK=int(params[0] != 0.0), SIGMOID=int(scoring.kind == "sigmoid"),
            RENORMALISE=int(bool(scoring.renormalise)), N_GROUP=scoring.n_group, TOPK_GROUP=scoring.topk_group,
            BLOCK_G=triton.next_power_of_2(scoring.n_group), P=pool.pool_size, U=pool.union_slots,
            PREFETCH=int(self.prefetch > 0), CAP=min(self.prefetch, pool.union_slots), TIES=score_ties(scoring))
        self.warps = select_warps(E) if warps is None else warps  # the refill's launch keeps its own 4

    def _layer_views(self, layer: int) -> None:
        e = self.num_experts
        self.selected, self.displaced = self.selections[layer], self.displaced_rows[layer]
        self.demand = self.demands[layer]
        self.missing, self.missing_slots = self.demand[1:1 + e], self.demand[1 + e:]

    def load(self, pool: ExpertPool | None = None) -> None:
        """The state of `pool` (default the one given at construction) copied into the device tensors in place
        (captured graphs keep reading them): a request's start, or a pool the host path has stepped."""
        pool = self.pool if pool is None else pool
        for dst, src in ((self.slot, pool.slot), (self.recency, pool.recency), (self.pool_mask, pool.pool_mask),
                         (self.warm_rank, pool.warm_rank), (self.block, np.array([pool.block]))):
            dst.copy_(torch.from_numpy(np.ascontiguousarray(src)).to(dst.dtype))

    def select(self, layer: int, router_logits: torch.Tensor, alpha: torch.Tensor,
               route_out: torch.Tensor | None = None) -> None:
        """Three launches, four for a block selector: the selection of `layer` for the block's D positions
        (router_logits float32 [D, E] with unit column stride, e.g. the step's logits rows; alpha float64 [D],
        finite and >= 0: the host checks both, the kernels do not) and `ExpertPool.use` of its executions.
        route_out: int32 [D, 2K] contiguous (the step's route rows of the layer) receives the slots and the
        execution weights' float32 bits; else `route` gets the slots. Once per layer and block (not checked)."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} outside [0, {self.num_layers})")
        z, k = router_logits, self.top_k
        self._check_block("router logits", z, alpha)
        route = self.route if route_out is None else route_out
        if route_out is not None and (route_out.dtype != torch.int32 or route_out.shape != (z.shape[0], 2 * k)
                                      or not route_out.is_contiguous()):
            raise ValueError(f"route_out must be contiguous int32 [{z.shape[0]}, {2 * k}], got {route_out.dtype} "
                             f"{tuple(route_out.shape)}")
        self._layer_views(layer)
        sc = self.scratch
        self._selection(layer, z, alpha, sc, self.selected, self.weights, self.displaced, route, route_out is not None)
        c = self._constants
        _use_kernel[(1,)](self.pool_mask[layer], self.slot[layer], self.recency[layer], self.block, z.shape[0],
                          sc.eligible, sc.executed, self.eligible, self.union, self.demand, route, route.stride(0),
                          self.counts, self.prefetch_ranks[layer], self.prefetches[layer], self.physical[layer],
                          self.layer_counts[layer], self.free_scratch, E=c["E"], BLOCK_E=c["BLOCK_E"],
                          BLOCK_D=c["BLOCK_D"], BLOCK=c["BLOCK"], P=c["P"], U=c["U"], PREFETCH=c["PREFETCH"],
                          num_warps=self.warps, **pdl.options(self.pool_mask[layer]))

    def _check_block(self, what: str, z: torch.Tensor, alpha: torch.Tensor) -> None:
        """ValueError unless `z` is float32 [D, E] with unit column stride, 1 <= D <= max_positions, and alpha
        float64 [D] (the launches' inputs: `select`'s router logits, `predict`'s pre-gate logits)."""
        if z.dtype != torch.float32 or z.dim() != 2 or not 1 <= z.shape[0] <= self.max_positions \
                or z.shape[1] != self.num_experts or z.stride(1) != 1:
            raise ValueError(f"{what} must be float32 [D <= {self.max_positions}, {self.num_experts}] with "
                             f"unit column stride, got {z.dtype} {tuple(z.shape)} strides {z.stride()}")
        if alpha.dtype != torch.float64 or alpha.shape != (z.shape[0],):
            raise ValueError(f"alpha must be float64 [{z.shape[0]}], got {alpha.dtype} {tuple(alpha.shape)}")

    def _selection(self, layer: int, z, alpha, scratch: _Scratch, selected, weights, displaced, route,
                   weights_in_route: bool) -> None:
        """The selector's launches over `scratch` into the outputs: own top-K, the eligible set (a block
        selector), the executions."""
        c, d, layer_bias = self._constants, z.shape[0], self.bias[layer]
        fs, own, elig, ex = scratch.floats, scratch.own, scratch.eligible, scratch.executed
        shape = dict(E=c["E"], BLOCK_E=c["BLOCK_E"], BLOCK_D=c["BLOCK_D"])
        _own_kernel[(d,)](z, z.stride(0), alpha, layer_bias, self.fparams, fs, own, **shape, K=c["K"],
                          SIGMOID=c["SIGMOID"], N_GROUP=c["N_GROUP"], TOPK_GROUP=c["TOPK_GROUP"],
                          BLOCK_G=c["BLOCK_G"], TIES=c["TIES"], DEMAND=c["BLOCK"], num_warps=self.warps,
                          enable_fp_fusion=False, **pdl.options(z))
        if c["BLOCK"]:
            _demand_kernel[(1,)](self.fparams, self.pool_mask[layer], d, fs, own, elig, **shape, num_warps=self.warps,
                                 enable_fp_fusion=False, **pdl.options(self.fparams))
        _execute_kernel[(d,)](z, z.stride(0), alpha, layer_bias, self.fparams, fs, own, elig, ex, selected,
                              weights, displaced, route, route.stride(0), WEIGHTS_IN_ROUTE=int(weights_in_route),
                              **shape, K=c["K"], BLOCK_K=c["BLOCK_K"], BLOCK=c["BLOCK"], SIGMOID=c["SIGMOID"],
                              RENORMALISE=c["RENORMALISE"], TIES=c["TIES"], num_warps=self.warps,
                              enable_fp_fusion=False, **pdl.options(z))

    def predict(self, layer: int, pregate_logits: torch.Tensor, alpha: torch.Tensor) -> None:
        """The block prefetch of `layer` (>= 1; `predict_prefetch`): the block's selector on the D positions'
        pre-gate logits (float32 [D, E], unit column stride) over the pool's residency of `layer`, its missing
        experts capped at min(prefetch, U) by priority, into `prefetches[layer]` (count, experts ascending, union
        slots P, P+1, ...: a copy list) and the rank row `select` places them by. Call it before `select` of
        `layer` in the same block; it reads only the pool's members, so it may run beside `select` of another
        layer. Four launches (five for a block selector)."""
        if not self.prefetch:
            raise ValueError("this DevicePool has no prefetch budget (DevicePool(prefetch=n))")
        if not 1 <= layer < self.num_layers:
            raise ValueError(f"the block prefetch predicts layers 1 .. {self.num_layers - 1}, got {layer}")
        g, q, c = pregate_logits, self.predicted, self._constants
        self._check_block("pre-gate logits", g, alpha)
        self._selection(layer, g, alpha, q, *self.predicted_rows, False)
        _prefetch_kernel[(1,)](q.executed, alpha, self.pool_mask[layer], g.shape[0], self.prefetch_ranks[layer],
                               self.prefetches[layer], E=c["E"], BLOCK_E=c["BLOCK_E"], BLOCK_D=c["BLOCK_D"],
                               P=c["P"], CAP=c["CAP"], num_warps=self.warps, **pdl.options(q.executed))

    def end_block(self) -> None:
        """`ExpertPool.end_block` on the device, every layer in one launch (move_lists)."""
        c = self._constants
        _refill_kernel[(self.num_layers,)](self.pool_mask, self.slot, self.recency, self.warm_rank, self.block,
                                           self.move_lists, self.physical, E=c["E"], BLOCK_E=c["BLOCK_E"], P=c["P"],
                                           U=self.physical.shape[1], PREFETCH=c["PREFETCH"], num_warps=4,
                                           **pdl.options(self.pool_mask))

    def state(self) -> dict:
        """The pool's state on the host, named as `ExpertPool`'s attributes (for checks against it)."""
        return {"slot": self.slot.cpu().numpy(), "pool_mask": self.pool_mask.cpu().numpy().astype(bool),
                "recency": self.recency.cpu().numpy(), "block": int(self.block.item())}
