"""CPU replay of speculative decoding's verification blocks: a rollback logical cache against block-level
expert selection, and AR decoding on the same committed sequence (`specmoe replay-sd`). The blocks come from
`specmoe.records` (`blocks_from_records`, `synthetic_blocks`). No torch needed."""

from .rollback import MethodResult, RollbackCache, replay_ar, replay_block_selection, replay_rollback

__all__ = ["MethodResult", "RollbackCache", "replay_ar", "replay_block_selection", "replay_rollback"]
