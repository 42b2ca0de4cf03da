"""CPU replay of speculative decoding's verification blocks: a rollback logical cache against block-level
expert selection, and AR decoding on the same committed sequence (`specmoe replay-sd`). No torch needed."""

from .blocks import (AcceptanceProfile, Blocks, BlockSourceError, blocks_from_records, synthetic_blocks,
                     with_true_continuation)
from .rollback import (MethodResult, RollbackCache, replay_ar, replay_block_selection,
                       replay_rollback)

__all__ = [
    "AcceptanceProfile", "BlockSourceError", "Blocks", "MethodResult", "RollbackCache",
    "blocks_from_records", "replay_ar", "replay_block_selection", "replay_rollback", "synthetic_blocks",
    "with_true_continuation",
]
