"""The expert pool's kernels of the device block path (`device_select.DevicePool`): `ExpertPool.use` of a layer's
executions (`_use_kernel`: the missing experts' union slots, recency, the route rows, the demand copy list),
the block prefetch's cap (`_prefetch_kernel`: `predict_prefetch`'s copy list) and `ExpertPool.end_block`
(`_refill_kernel`: every layer's refill by recency and its moves). Each is one program over a layer's [D, E]
tiles, launched after the selection kernels of `device_select` in stream order."""

from __future__ import annotations

from specmoe.verifiers.pool import POSITIONS_PER_BLOCK

from .device_cache import triton

if triton is not None:
    import triton.language as tl

    from .pdl import enter
    from .ranking import _TIES_SCORE, _order, _pick_int

    _POSITIONS_PER_BLOCK = tl.constexpr(POSITIONS_PER_BLOCK)

    @triton.jit
    def _block_rows(ptr, D, E: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr):
        """A block's int32 rows [BLOCK_D, BLOCK_E] of per-expert ranks at ptr (the selection scratch's own or
        executed ranks; rows past D read as -1), with the row and expert indices and their masks: (rows, idx,
        rows < D, idx < E, the rows)."""
        rows = tl.arange(0, BLOCK_D)
        idx = tl.arange(0, BLOCK_E)
        vrow = rows < D
        tile = tl.load(ptr + rows[:, None] * BLOCK_E + idx[None, :], mask=vrow[:, None], other=-1)
        return rows, idx, vrow, idx < E, tile

    @triton.jit
    def _use_kernel(pool_ptr, slot_ptr, rec_ptr, block_ptr, D, elig_ptr, exec_ptr, eligible_ptr, union_ptr,
                    list_ptr, route_ptr, RS, counts_ptr, pf_rank_ptr, pf_list_ptr, phys_ptr, layer_ptr, free_ptr,
                    E: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr,
                    P: tl.constexpr, U: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr = False):
        """`ExpertPool.use` of the block's executions: the missing experts (ascending) take union slots P, P+1,
        ...; the recency of executed experts; the route rows; the union, eligible and demand lists; the counts,
        and the layer's row layer_ptr [4]: missing experts (counted also past U, where the pool is left unchanged
        and the route rows point at slot 0, so that nothing reads outside the slots), prefetched, prefetch hits,
        union slots written. PREFETCH: the layer's prefetched experts (pf_rank_ptr: each expert's rank in the
        prefetch list, or -1; pf_list_ptr: the list, its count first) sit in slots P, P+1, ...: the missing experts
        are placed as `place_union` places them (a hit stays where it is; a demand copy takes the lowest free union
        slot, then the lowest slot of an unused prefetch, through the scratch row free_ptr), the route rows and the
        demand list (only the copies) get the physical slots, and phys_ptr [U] the physical slot of each logical
        union slot."""
        enter(PDL)
        rows, idx, vrow, valid, executed = _block_rows(exec_ptr, D, E, BLOCK_D, BLOCK_E)
        last = tl.max(tl.where(executed >= 0, rows[:, None], -1), axis=0).to(tl.int64)  # the last position running e
        resident = tl.load(pool_ptr + idx, mask=valid, other=0).to(tl.int32)
        ran = (last >= 0) & valid
        missing = ran & (resident == 0)
        n_missing = tl.sum(missing.to(tl.int32), axis=0)
        ok = n_missing <= U
        order = tl.cumsum(missing.to(tl.int32), axis=0) - 1
        slot = tl.load(slot_ptr + idx, mask=valid, other=-1)
        slot = tl.where(missing & ok, P + order, slot)
        tl.store(slot_ptr + idx, slot, mask=valid)
        if PREFETCH:
            n_pf = tl.load(pf_list_ptr).to(tl.int32)
            rank = tl.load(pf_rank_ptr + idx, mask=valid, other=-1)
            hit = missing & (rank >= 0)
            copy = missing & (rank < 0)
            unused = (rank >= 0) & (missing == 0)
            # the free union slots in order: P + n_pf, ..., P + U - 1, then the unused prefetches' (ascending)
            tl.store(free_ptr + tl.cumsum(unused.to(tl.int32), axis=0) - 1, P + rank, mask=unused)
            tl.debug_barrier()
            at = tl.cumsum(copy.to(tl.int32), axis=0) - 1
            spill = at - (U - n_pf)
            taken = tl.load(free_ptr + tl.where(copy & (spill >= 0), spill, 0), mask=copy & (spill >= 0), other=0)
            placed = tl.where(hit, P + rank, tl.where(spill >= 0, taken, P + n_pf + at))
            n_copy = tl.sum(copy.to(tl.int32), axis=0)
            tl.store(list_ptr + 1 + at, idx.to(tl.int64), mask=copy & ok)
            tl.store(list_ptr + 1 + E + at, placed.to(tl.int64), mask=copy & ok)
            tl.store(list_ptr, tl.where(ok, n_copy, 0).to(tl.int64))
            tl.store(phys_ptr + order, placed.to(tl.int64), mask=missing & ok)
            tl.store(layer_ptr + 1, n_pf.to(tl.int64))
            tl.store(layer_ptr + 2, tl.sum(hit.to(tl.int64), axis=0))
            tl.store(layer_ptr + 3, (n_pf + tl.minimum(n_copy, U - n_pf)).to(tl.int64))
            tl.debug_barrier()  # every thread has read the free row before the next layer writes it
            route_slot = tl.where(missing & ok, placed, slot)
        else:
            tl.store(list_ptr + 1 + order, idx.to(tl.int64), mask=missing)
            tl.store(list_ptr + 1 + E + order, (P + order).to(tl.int64), mask=missing)
            tl.store(list_ptr, tl.where(ok, n_missing, 0).to(tl.int64))
            tl.store(layer_ptr + 3, tl.minimum(n_missing, U).to(tl.int64))
            route_slot = slot
        tl.store(layer_ptr, n_missing.to(tl.int64))
        route_slot = tl.where(route_slot >= 0, route_slot, 0)  # past U: missing experts have no slot
        recency = tl.load(rec_ptr + idx, mask=valid, other=0)
        base = tl.load(block_ptr) * _POSITIONS_PER_BLOCK
        tl.store(rec_ptr + idx, tl.where(ran & ok, base + last + 1, recency), mask=valid)
        tl.store(route_ptr + rows[:, None] * RS + executed, route_slot[None, :].to(tl.int32),
                 mask=(executed >= 0) & vrow[:, None])
        n_union = tl.sum(ran.to(tl.int32), axis=0)
        tl.store(union_ptr + tl.cumsum(ran.to(tl.int32), axis=0) - 1, idx.to(tl.int64), mask=ran)
        if BLOCK:
            chosen = (tl.load(elig_ptr + idx) != 0) & valid
        else:
            chosen = ran
        tl.store(eligible_ptr + tl.cumsum(chosen.to(tl.int32), axis=0) - 1, idx.to(tl.int64), mask=chosen)
        tl.store(counts_ptr + 0, tl.sum(chosen.to(tl.int64), axis=0))
        tl.store(counts_ptr + 1, n_union.to(tl.int64))
        tl.store(counts_ptr + 2, n_missing.to(tl.int64))
        tl.store(counts_ptr + 3, ok.to(tl.int64))

    @triton.jit
    def _prefetch_kernel(exec_ptr, alpha_ptr, pool_ptr, D, rank_ptr, list_ptr,
                         E: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, P: tl.constexpr,
                         CAP: tl.constexpr, PDL: tl.constexpr = False):
        """`predict_prefetch` from the predicted executions (exec_ptr, as `_execute_kernel` wrote them for the
        pre-gate logits): the missing experts, at most CAP, the most wanted (the largest sum of alpha over the
        positions executing them, added in position order as the host adds) first, ties to the lower index; their
        ranks (ascending expert order, else -1) into rank_ptr [BLOCK_E], and the copy list (count, experts, slots
        P, P+1, ...) into list_ptr [1 + 2E]."""
        enter(PDL)
        _, idx, _, valid, executed = _block_rows(exec_ptr, D, E, BLOCK_D, BLOCK_E)
        ran = (tl.max(executed, axis=0) >= 0) & valid
        missing = ran & (tl.load(pool_ptr + idx, mask=valid, other=1) == 0)
        if tl.sum(missing.to(tl.int32), axis=0) > CAP:
            want = tl.zeros([BLOCK_E], tl.float64)
            for d in range(D):
                runs = tl.load(exec_ptr + d * BLOCK_E + idx) >= 0
                want = tl.where(runs, want + tl.load(alpha_ptr + d), want)
            missing = _order(want, want, missing, idx, CAP, BLOCK_E, _TIES_SCORE) >= 0
        order = tl.cumsum(missing.to(tl.int32), axis=0) - 1
        tl.store(rank_ptr + idx, tl.where(missing, order, -1))
        tl.store(list_ptr + 1 + order, idx.to(tl.int64), mask=missing)
        tl.store(list_ptr + 1 + E + order, (P + order).to(tl.int64), mask=missing)
        tl.store(list_ptr, tl.sum(missing.to(tl.int64), axis=0))

    @triton.jit
    def _refill_kernel(pool_ptr, slot_ptr, rec_ptr, warm_rank_ptr, block_ptr, moves_ptr, phys_ptr,
                       E: tl.constexpr, BLOCK_E: tl.constexpr, P: tl.constexpr, U: tl.constexpr,
                       PREFETCH: tl.constexpr, PDL: tl.constexpr = False):
        """`ExpertPool.end_block` of layer program_id(0): keep the P most recent experts, entering experts (in
        ascending index) take the freed pool slots (ascending); moves [L, 1 + 2E]: per layer their count, their
        union slots (PREFETCH: the physical ones, phys_ptr [L, U]), their pool slots (a copy list of `expert_copy`
        from the slots to the slots)."""
        enter(PDL)
        layer = tl.program_id(0)
        idx = tl.arange(0, BLOCK_E)
        valid = idx < E
        row = layer * E + idx
        pool = tl.load(pool_ptr + row, mask=valid, other=0).to(tl.int32)
        slot = tl.load(slot_ptr + row, mask=valid, other=-1)
        recency = tl.load(rec_ptr + row, mask=valid, other=0)
        warm = tl.load(warm_rank_ptr + row, mask=valid, other=0)
        # one key, larger = more recent: executed by (recency, lower index), then the warm ranking's order
        key = tl.where(recency > 0, recency * 1024 + (1023 - idx), 1023 - warm)
        key = tl.where(valid, key, -1)
        lo = tl.zeros([], tl.int64)
        hi = tl.max(key, axis=0)
        for _ in range(64):  # the P-th largest key (keys are distinct): the largest t with P keys >= t
            mid = lo + (hi - lo + 1) // 2
            enough = tl.sum((key >= mid).to(tl.int32), axis=0) >= P
            lo = tl.where(enough, mid, lo)
            hi = tl.where(enough, hi, mid - 1)
        keep = (key >= lo) & valid
        entering = keep & (pool == 0)
        leaving = (pool != 0) & (keep == 0) & valid
        n = tl.sum(entering.to(tl.int32), axis=0)
        new = tl.where(keep, slot, -1)
        for i in range(n):
            e = tl.min(tl.where(entering, idx, BLOCK_E), axis=0)
            free = tl.min(tl.where(leaving, slot, BLOCK_E), axis=0)
            f = tl.min(tl.where(leaving & (slot == free), idx, BLOCK_E), axis=0)
            source = _pick_int(slot, idx, e)
            if PREFETCH:  # entering experts are this block's missing ones: in union slots
                source = tl.load(phys_ptr + layer * U + source - P)
            tl.store(moves_ptr + layer * (1 + 2 * E) + 1 + i, source)
            tl.store(moves_ptr + layer * (1 + 2 * E) + 1 + E + i, free)
            new = tl.where(idx == e, free, new)
            entering = entering & (idx != e)
            leaving = leaving & (idx != f)
        tl.store(slot_ptr + row, new, mask=valid)
        tl.store(pool_ptr + row, keep.to(tl.int8), mask=valid)
        tl.store(moves_ptr + layer * (1 + 2 * E), n.to(tl.int64))
        if layer == 0:
            tl.store(block_ptr, tl.load(block_ptr) + 1)
