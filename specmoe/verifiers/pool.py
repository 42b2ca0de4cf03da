"""The expert pool of speculative decoding: the experts each layer keeps on the GPU between verification blocks.

Per layer, P pool slots (0..P-1) hold the pool, the experts that `select_block` treats as resident, and U
union slots (P..P+U-1) take the block's missing experts. It starts as the calibration's warm set (ascending
in slots 0..P-1) and after each block is refilled by recency (paper, Section 7 and Appendix B): it keeps the
P experts most recently executed, where an expert's recency is the last (block, position) at which it
executed, counting every position of each verified block (rejected drafts included: their experts ran and
are on the GPU); later blocks, then later positions, are more recent; equal recency goes to the lower expert
index; experts never executed rank after all executed ones, in the warm ranking's order.

The pool is a function of the token history and the drafts only (deterministic), and so is its slot
assignment: a kept expert keeps its slot, experts entering the pool take the freed pool slots in ascending
order (entering experts in ascending index), and a block's missing experts take union slots P, P+1, ... in
ascending expert order.

Copy accounting, per layer:
- copies: host-to-device copies, one per missing expert of each block (into its union slot);
- moves: device-to-device moves at refill, one per expert entering the pool (each one comes from a union
  slot: the P most recent experts were all on the GPU after the block, so a refill never reads the host).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..routing.validate import integer

POSITIONS_PER_BLOCK = 1 << 20  # recency = 1 + block * POSITIONS_PER_BLOCK + position; 0 = never executed


@njit(cache=True)
def _use(selected, slot, pool_mask, recency, base, pool_size, union_slots, missing, missing_slots):
    """Mark the recency of every expert in selected [D, K] and give the ones outside the pool union slots
    (ascending expert order). Writes missing[:c], missing_slots[:c]; returns c, or (changing nothing) -1 if
    more than `union_slots` are missing, -2 if an entry is not an expert index."""
    num_experts = slot.shape[0]
    executed = np.zeros(num_experts, dtype=np.bool_)
    for d in range(selected.shape[0]):
        for j in range(selected.shape[1]):
            e = selected[d, j]
            if e < 0 or e >= num_experts:
                return -2
            executed[e] = True
    count = 0
    for e in range(num_experts):
        if executed[e] and not pool_mask[e]:
            missing[count] = e
            missing_slots[count] = pool_size + count
            count += 1
    if count > union_slots:
        return -1
    for i in range(count):
        slot[missing[i]] = missing_slots[i]
    for d in range(selected.shape[0]):
        for j in range(selected.shape[1]):
            recency[selected[d, j]] = base + d + 1
    return count


class ExpertPool:
    """The pool of one request over `num_layers` MoE layers of `num_experts` experts, top-`top_k`.

    pool_size: P experts per layer kept between blocks (K <= P <= E). warm_ranking: a `Calibration` or an
    int array [L, E] of each layer's experts by calibration frequency; the pool starts as its first P
    (ascending). union_slots: U slots per layer for one block's missing experts (default E - P, always
    enough); a block with more missing experts in a layer raises ValueError.
    """

    def __init__(self, num_layers: int, num_experts: int, top_k: int, pool_size: int, warm_ranking,
                 union_slots: int | None = None):
        num_layers = integer(num_layers, "num_layers", minimum=1)
        num_experts = integer(num_experts, "num_experts", minimum=1)
        top_k = integer(top_k, "top_k", minimum=1, maximum=num_experts)
        pool_size = integer(pool_size, "pool_size (P)")
        if not top_k <= pool_size <= num_experts:
            raise ValueError(f"pool size P={pool_size} must satisfy K <= P <= E (K={top_k}, E={num_experts})")
        ranking = np.asarray(getattr(warm_ranking, "warm_ranking", warm_ranking), dtype=np.int64)
        if ranking.shape != (num_layers, num_experts) or np.any(np.sort(ranking, axis=1) != np.arange(num_experts)):
            raise ValueError(f"the warm ranking must order the {num_experts} experts of each of {num_layers} layers, "
                             f"got shape {ranking.shape}")
        union_slots = num_experts - pool_size if union_slots is None else integer(union_slots, "union_slots (U)")
        if not 0 <= union_slots <= num_experts - pool_size:
            raise ValueError(f"union slots U={union_slots} must be in [0, E - P = {num_experts - pool_size}]")
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        self.pool_size, self.union_slots = pool_size, union_slots
        self.warm_ranking = ranking
        self.warm_rank = np.argsort(ranking, axis=1)  # position of each expert in its layer's ranking
        self.slot = np.empty((num_layers, num_experts), dtype=np.int64)
        self.pool_mask = np.empty((num_layers, num_experts), dtype=np.bool_)
        self.recency = np.empty((num_layers, num_experts), dtype=np.int64)
        self.used = np.empty(num_layers, dtype=np.bool_)
        self.copies = np.zeros(num_layers, dtype=np.int64)
        self.moves = np.zeros(num_layers, dtype=np.int64)
        self.blocks = 0
        self._missing = np.empty(num_experts, dtype=np.int64)
        self._missing_slots = np.empty(num_experts, dtype=np.int64)
        self._refill_moves = [(np.empty(0, np.int64), np.empty(0, np.int64))] * num_layers
        self.reset()

    def reset(self) -> None:
        """Start a request: the warm set in slots 0..P-1, no recency. Counters keep accumulating."""
        self.block = 0
        self._block_copies = 0
        self.slot[:] = -1
        self.pool_mask[:] = False
        self.recency[:] = 0
        self.used[:] = False
        for layer in range(self.num_layers):
            warm = np.sort(self.warm_ranking[layer, : self.pool_size])
            self.slot[layer, warm] = np.arange(self.pool_size)
            self.pool_mask[layer, warm] = True

    def _layer(self, layer) -> int:
        """`layer` as an int in [0, L): negative indices would silently name the last layers."""
        return integer(layer, "layer", minimum=0, maximum=self.num_layers - 1)

    def resident(self, layer: int) -> np.ndarray:
        """bool [E]: the pool of `layer` (what `select_block` may treat as resident). A view: read it, do not
        keep it across `end_block`."""
        return self.pool_mask[self._layer(layer)]

    def use(self, layer: int, selected: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Record what `layer` executed in the current block, selected: int [D, K] (`BlockSelection.selected`):
        every executed expert's recency is marked, and the executed experts outside the pool (the block's
        missing experts, ascending) take union slots; each is one copy. Returns (missing experts, their
        slots), views overwritten by the next call. Once per layer and block."""
        layer = self._layer(layer)
        if self.used[layer]:
            raise ValueError(f"layer {layer} was already used in block {self.block}; call end_block first")
        selected = np.asarray(selected)
        if selected.dtype.kind not in "iu":  # float expert ids would be truncated
            raise ValueError(f"selected must hold integer expert ids, got dtype {selected.dtype}")
        selected = selected.astype(np.int64, copy=False)
        if selected.ndim != 2 or not 1 <= selected.shape[0] < POSITIONS_PER_BLOCK or selected.shape[1] != self.top_k:
            raise ValueError(f"selected must be [D, K={self.top_k}], got shape {selected.shape}")
        count = _use(selected, self.slot[layer], self.pool_mask[layer], self.recency[layer],
                     self.block * POSITIONS_PER_BLOCK, self.pool_size, self.union_slots, self._missing,
                     self._missing_slots)
        if count == -2:
            raise ValueError(f"selected holds an expert outside [0, {self.num_experts}): {selected.tolist()}")
        if count < 0:
            raise ValueError(f"layer {layer} misses more than the U={self.union_slots} union slots' worth of experts "
                             f"in block {self.block}; make the pool with more union_slots")
        self.used[layer] = True
        self.copies[layer] += count
        self._block_copies += count
        return self._missing[:count], self._missing_slots[:count]

    def slot_table(self, layer: int) -> np.ndarray:
        """int64 [E]: the slot of each expert of `layer` (-1 if not on the GPU); index it with `selected`.
        A view, valid until the next `end_block`."""
        return self.slot[self._layer(layer)]

    def ranking(self, layer: int) -> np.ndarray:
        """The experts of `layer` by recency, most recent first: executed experts by their last (block,
        position), ties to the lower index, then the never executed ones in the warm ranking's order."""
        layer = self._layer(layer)
        recency = self.recency[layer]
        secondary = np.where(recency > 0, np.arange(self.num_experts), self.warm_rank[layer])
        return np.lexsort((secondary, -recency))

    def end_block(self) -> tuple[int, int]:
        """Refill every layer's pool with its P most recent experts (`ranking`) and free the union slots;
        starts the next block. Returns this block's (copies, moves) summed over layers."""
        moves = 0
        for layer in range(self.num_layers):
            keep = np.zeros(self.num_experts, dtype=np.bool_)
            keep[self.ranking(layer)[: self.pool_size]] = True
            old = self.pool_mask[layer]
            slot = self.slot[layer]
            entering = np.flatnonzero(keep & ~old)
            # every entering expert sits in a union slot: the P most recent were all on the GPU (pool.py docstring)
            assert np.all(slot[entering] >= self.pool_size)
            freed = np.sort(slot[old & ~keep])
            self._refill_moves[layer] = (slot[entering].copy(), freed)
            slot[~keep] = -1
            slot[entering] = freed
            old[:] = keep
            self.moves[layer] += entering.size
            moves += entering.size
        copies, self._block_copies = self._block_copies, 0
        self.used[:] = False
        self.block += 1
        self.blocks += 1
        return copies, moves

    def refill_moves(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """The last `end_block`'s moves in `layer`: (union slots the entering experts leave, pool slots they
        take), aligned; what the physical slot buffer must copy to follow the slot table."""
        return self._refill_moves[self._layer(layer)]

    def totals(self) -> dict:
        """Counters summed over layers since construction: blocks, copies (host to device, one per missing
        expert of a block), moves (union slot to pool slot at refill)."""
        return {"blocks": self.blocks, "copies": int(self.copies.sum()), "moves": int(self.moves.sum())}
