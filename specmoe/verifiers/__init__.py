"""Verifier expert selection for speculative decoding: selectors (registered by kind in `SELECTORS`), position
weights and the expert pool."""

from .config import (SELECTORS, CommitRate, SelectorConfig, SelectorError, SelectorKind, confidence_weights,
                     position_weights, selector_preset)
from .pool import ExpertPool
from .selection import BlockSelection, SelectionBuffers, select_block, select_block_into

__all__ = [
    "BlockSelection", "CommitRate", "ExpertPool", "SELECTORS", "SelectionBuffers", "SelectorConfig",
    "SelectorError", "SelectorKind", "confidence_weights", "position_weights", "select_block", "select_block_into",
    "selector_preset",
]
