"""Verifier expert selection for speculative decoding: selectors, position weights and the expert pool."""

from .config import (KINDS, SELECTORS, CommitRate, SelectorConfig, SelectorError, confidence_weights,
                     position_weights, selector_preset)
from .pool import ExpertPool
from .selection import BlockSelection, SelectionBuffers, select_block, select_block_into

__all__ = [
    "BlockSelection", "CommitRate", "ExpertPool", "KINDS", "SELECTORS", "SelectionBuffers", "SelectorConfig",
    "SelectorError", "confidence_weights", "position_weights", "select_block", "select_block_into",
    "selector_preset",
]
