"""CPU replay of speculative decoding's verification blocks: a rollback logical cache against block-level
expert selection, and AR decoding on the same committed sequence (`specmoe replay-sd`). The blocks come from
`specmoe.records` (`blocks_from_records`, `synthetic_blocks`). No torch needed."""

import importlib

__all__ = ["MethodResult", "RollbackCache", "replay_ar", "replay_block_selection", "replay_rollback"]


def __getattr__(name: str):
    """The names of `rollback`, loaded on first use: the command line's parser imports `specmoe.replay.command`
    and must not load numba."""
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(".rollback", __name__), name)
    globals()[name] = value
    return value
