"""The recorded routing that runs without a model: two file formats and the in-memory blocks read from them.

- `traces` (routing traces, "specmoe-trace" files): per token. Router and pre-gate logits [T, L, E] and input
  tokens of exact autoregressive decoding over one or more sequences (recorded by `specmoe.harness.record_trace`,
  `specmoe trace`). Read by `specmoe.routing.replay` (any policy over recorded logits), by the engine's
  trace-following (`specmoe.engines.LogitFeed`) and by `synthetic_blocks`.
- `block_records` (block records, "specmoe-blocks" files): per verification block of a speculative run. The
  block's root and drafts, the drafter's confidences, accepted length, bonus token, and the router and
  pre-gate logits the target computed at every position [N, D, L, E], written by the harness's speculative
  loop (`speculative_generate(..., record=True)`, `specmoe sd`). A position's logits sit where a trace keeps
  a token's.
- `blocks` (`Blocks`, no file): the in-memory view that the CPU replay (`specmoe.replay`) and the speculative
  engine's trace-following read, N blocks of D = k + 1 positions as row indices into one logits table. Made
  from block records (`blocks_from_records`) or from a trace with a synthetic drafter (`synthetic_blocks`).

File formats only: no torch, and nothing here records (the harness does).
"""

from .block_records import BlockRecordError, BlockRecords
from .blocks import (CLOSED_LOOP, AcceptanceProfile, Blocks, BlockSourceError, blocks_from_records, open_loop,
                     records_per_selector, synthetic_blocks, with_true_continuation)
from .traces import Trace, TraceError

__all__ = [
    "CLOSED_LOOP", "AcceptanceProfile", "BlockRecordError", "BlockRecords", "BlockSourceError", "Blocks", "Trace", "TraceError",
    "blocks_from_records", "open_loop", "records_per_selector", "synthetic_blocks", "with_true_continuation",
]
