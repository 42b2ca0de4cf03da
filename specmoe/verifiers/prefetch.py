"""Block prefetch: the copies of a verification block's missing experts started before the layer's router runs.

A block's missing experts in layer l are known only once layer l's router logits are (after its attention), so
without prediction every copy of a block is on the critical path. Each position's pre-gate logits g_{l} (router
l applied to layer l-1's MoE input, on the host with layer l-1's logits) predict them: run the block's own
selector (`select_block_into`: the same selector, position weights alpha, pool residency and router rule) on the
D positions' pre-gate logits instead of their router logits, and prefetch the predicted missing experts into free
union slots, at most `budget` per layer and block. This is the block version of PSR's part-1 insertion; unlike
it, a prefetch never changes a selection, a token or the pool's logical state (`ExpertPool`): it only places
bytes early. At the layer, the block's real missing experts that were prefetched need no copy (a hit), the others
are demand copies into free union slots, and prefetched experts the block does not execute are unused.

One implementation for every caller: the engine's `BlockRouter` (which also places the copies physically,
`place_union`), the CPU replay of block selection (`replay_block_selection`) and the harness's speculative loop
count with `predict_prefetch` and `PrefetchTally`.

Choices:
- budget: at most `budget` predicted missing experts per layer and block, and never more than U; when the
  prediction has more, the most wanted: the largest sum of alpha_d over the positions d whose predicted
  selection executes the expert (the root's, alpha_0 = 1, first), ties to the lower index. The chosen ones take
  union slots P, P+1, ... in ascending expert order.
- placement (`place_union`): a hit stays in its slot; a demand copy takes the lowest free union slot, then (only
  when none is free) the lowest slot of an unused prefetch, so U always suffices (the block misses at most U
  experts, `ExpertPool.use`) and a needed expert is never displaced. The union slots a layer writes in one block
  (prefetches plus demand copies into free slots) are its union slots used; their peak is reported.
- layer 0 has no pre-gate (its input is the embedding) and is never prefetched.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .selection import SelectionBuffers, select_block_into

NONE = np.empty(0, dtype=np.int64)


def predict_prefetch(selector, pregate: np.ndarray, resident: np.ndarray, alpha: np.ndarray, top_k: int, scoring,
                     buffers: SelectionBuffers, budget: int, union_slots: int, layer: int) -> np.ndarray:
    """The experts of `layer` to prefetch for a block (module docstring): the block's selector run on the D
    positions' pre-gate logits [D, E] with the pool's residency and the block's alpha, its missing experts capped
    at min(budget, union_slots) by priority; int64, ascending (a new array). `buffers` is overwritten."""
    cap = min(budget, union_slots)
    if cap <= 0:
        return NONE
    d = pregate.shape[0]
    _, _, n = select_block_into(selector, pregate, resident, alpha, top_k, scoring, buffers, layer=layer)
    missing = buffers.missing[:n]
    if n <= cap:
        return missing.copy()
    want = np.zeros(buffers.num_experts)
    np.add.at(want, buffers.selected[:d], np.broadcast_to(np.asarray(alpha, np.float64)[:, None], (d, top_k)))
    order = np.lexsort((missing, -want[missing]))  # most wanted first, ties to the lower index
    return np.sort(missing[order[:cap]])


def place_union(missing: np.ndarray, prefetched: np.ndarray, pool_size: int,
                union_slots: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Physical union slots of a layer's missing experts (ascending, `ExpertPool.use`) when `prefetched`
    (ascending) sit in slots P, P+1, ...: returns (slot of each missing expert, bool mask of those that need a
    demand copy, union slots the layer wrote in this block). Module docstring for the rule."""
    n, m = prefetched.size, missing.size
    if m > union_slots:  # ExpertPool.use raises before this: a block misses at most U experts
        raise ValueError(f"{m} missing experts do not fit U={union_slots} union slots")
    if not n:  # nothing prefetched (the default): slots P, P+1, ... as the pool gave them, every one a copy
        return np.arange(pool_size, pool_size + m, dtype=np.int64), np.ones(m, dtype=bool), m
    at = np.searchsorted(prefetched, missing)
    hit = at < n
    hit[hit] = prefetched[at[hit]] == missing[hit]
    slots = np.empty(m, dtype=np.int64)
    slots[hit] = pool_size + at[hit]
    demand = ~hit
    unused = pool_size + np.flatnonzero(~np.isin(prefetched, missing[hit]))
    free = np.concatenate((np.arange(pool_size + n, pool_size + union_slots, dtype=np.int64), unused))
    count = int(demand.sum())
    slots[demand] = free[:count]
    return slots, demand, n + min(count, union_slots - n)


@dataclass
class PrefetchTally:
    """Block prefetch counts without a slot buffer (the CPU replay, the harness), as the engine's copy stream
    counts them: prefetches issued, hits (prefetched and executed: a copy started early), unused (prefetched, not
    executed), demand copies (missing and not prefetched), and the peak union slots one layer of one block used
    (prefetches included, at most U). `count` every layer of every block (layer 0 with nothing prefetched)."""

    issued: int = 0
    hit: int = 0
    unused: int = 0
    demand: int = 0
    union_peak: int = 0

    def count(self, prefetched: np.ndarray, missing: np.ndarray, pool_size: int, union_slots: int) -> None:
        """One layer of one block: the experts prefetched for it and its missing experts (ascending)."""
        _, demand, used = place_union(missing, prefetched, pool_size, union_slots)
        hits = missing.size - int(demand.sum())
        self.issued += prefetched.size
        self.hit += hits
        self.unused += prefetched.size - hits
        self.demand += missing.size - hits
        self.union_peak = max(self.union_peak, used)

    def as_dict(self) -> dict:
        return {"prefetch": self.issued, "prefetch_hit": self.hit, "prefetch_unused": self.unused,
                "demand": self.demand, "union_peak": self.union_peak}
