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

from .selection import BlockSelection


class ExpertPool:
    """The pool of one request over `num_layers` MoE layers of `num_experts` experts, top-`top_k`.

    pool_size: P experts per layer kept between blocks (K <= P <= E). warm_ranking: a `Calibration` or an
    int array [L, E] of each layer's experts by calibration frequency; the pool starts as its first P
    (ascending). union_slots: U slots per layer for one block's missing experts (default E - P, always
    enough); a block with more missing experts in a layer raises ValueError.
    """

    def __init__(self, num_layers: int, num_experts: int, top_k: int, pool_size: int, warm_ranking,
                 union_slots: int | None = None):
        raise NotImplementedError

    def reset(self) -> None:
        """Start a request: the warm set in slots 0..P-1, no recency. Counters keep accumulating."""
        raise NotImplementedError

    def resident(self, layer: int) -> np.ndarray:
        """bool [E]: the pool of `layer` (what `select_block` may treat as resident)."""
        raise NotImplementedError

    def use(self, layer: int, selection: BlockSelection) -> np.ndarray:
        """Record what `layer` executed in the current block: gives the block's missing experts union slots
        (their copies) and marks every executed expert's recency. Returns the slots of `selection.missing`.
        Once per layer and block."""
        raise NotImplementedError

    def slot_table(self, layer: int) -> np.ndarray:
        """int64 [E]: the slot of each expert of `layer` (-1 if not on the GPU); index it with `selected`."""
        raise NotImplementedError

    def end_block(self) -> None:
        """Refill every layer's pool by recency and free the union slots; starts the next block."""
        raise NotImplementedError

    def totals(self) -> dict:
        """Counters summed over layers: blocks, copies (host to device), moves (union slot to pool slot)."""
        raise NotImplementedError
