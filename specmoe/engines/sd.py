"""The speculative engine's configuration (`SpecConfig`: the harness loop's settings plus union slots)."""

from __future__ import annotations

from dataclasses import dataclass

from specmoe.drafters import Drafter, check_drafter_fits
from specmoe.harness.speculative import SpeculativeConfig


@dataclass(frozen=True)
class SpecConfig(SpeculativeConfig):
    """The harness loop's settings (selector, k, pool P, max_new_tokens, stop tokens) plus U union slots per
    layer for a block's missing experts (None: E - P, always enough)."""

    union_slots: int | None = None

    def union(self, num_experts: int) -> int:
        return num_experts - self.pool_size if self.union_slots is None else self.union_slots

    def check(self, geometry, drafter: Drafter | None = None) -> None:
        """ValueError unless K <= P <= E, min(K, E - P) <= U <= E - P, k + 1 fits the KV cache and the drafter
        drafts k tokens; DrafterError unless the drafter fits the target (`check_drafter_fits`)."""
        super().check(geometry, drafter)
        g, u = geometry, self.union(geometry.num_experts)
        low = min(g.top_k, g.num_experts - self.pool_size)
        if not low <= u <= g.num_experts - self.pool_size:
            raise ValueError(f"union slots U={u} must be in [min(K, E - P) = {low}, E - P = "
                             f"{g.num_experts - self.pool_size}] (the root alone may miss K experts)")
        if self.k + 1 > g.max_seq_len:
            raise ValueError(f"a block of k + 1 = {self.k + 1} positions does not fit the static KV cache of "
                             f"{g.max_seq_len} positions")
        if drafter is not None:
            check_drafter_fits(drafter, geometry)
