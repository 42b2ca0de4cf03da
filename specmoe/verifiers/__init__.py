"""Verifier expert selection for speculative decoding: selectors (registered by kind in `SELECTORS`), position
weights and the expert pool."""

from .config import (SELECTORS, CommitRate, SelectorConfig, SelectorError, SelectorKind, confidence_weights,
                     position_weights, selector_preset)
from .pool import ExpertPool
from .prefetch import PrefetchTally, place_union, predict_prefetch
from .selection import BlockSelection, SelectionBuffers, select_block, select_block_into

__all__ = [
    "BlockSelection", "CommitRate", "ExpertPool", "PrefetchTally", "SELECTORS", "SelectionBuffers",
    "SelectorConfig", "SelectorError", "SelectorKind", "confidence_weights", "place_union", "position_weights",
    "predict_prefetch", "select_block", "select_block_into", "selector_preset",
]
