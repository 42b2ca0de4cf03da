"""The speculative engine's configuration (`SpecConfig`: the harness loop's settings plus union slots) and
the check that a drafter fits the target."""

from __future__ import annotations

from dataclasses import dataclass

from specmoe.drafters import Drafter, DrafterError
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


def check_drafter_fits(drafter: Drafter, geometry) -> None:
    """DrafterError unless the drafter's vocabulary is the target's and, for a drafter that reads the target's
    hidden states, every layer it names exists in the target and its hidden size is the target's (drafters
    say what they know: `vocab_size`, `hidden_size`)."""
    g, problems = geometry, []
    vocab = getattr(drafter, "vocab_size", None)
    if vocab is not None and vocab != g.vocab_size:
        problems.append(f"vocabulary {vocab} (target {g.vocab_size})")
    layers = list(drafter.target_layer_ids)
    if layers:
        missing = [i for i in layers if not 0 <= i < g.num_layers]
        if missing:
            problems.append(f"needs the hidden states after target layers {missing}, the target has layers "
                            f"0..{g.num_layers - 1}")
        hidden = getattr(drafter, "hidden_size", None)
        if hidden is not None and hidden != g.hidden:
            problems.append(f"hidden size {hidden} (target {g.hidden})")
    if problems:
        raise DrafterError(f"the {drafter.name} drafter does not fit the target: " + "; ".join(problems))
