"""Copies per token of the paper's policies on the family's target, by replay over recorded routing.

A calibration (warm set, token prior, delta) is estimated on the calibration part of the corpus, a trace is
recorded on the evaluation part, and `specmoe.routing.replay` runs each preset at each capacity over it.
These are logical copies (what the engine would transfer), not timings.
"""

from __future__ import annotations

import numpy as np
import torch

from specmoe.harness import record_trace
from specmoe.routing import CalibrationBuilder, preset, replay

from .corpus import spread_windows

POLICIES = ("exact_lru", "exact_a", "cache_prior", "psr", "spec_exec")


def _rows(stream: np.ndarray, sequences: int, length: int) -> list[torch.Tensor]:
    return [torch.from_numpy(row) for row in spread_windows(stream, length, sequences)]


def calibrate(model, stream: np.ndarray, sequences: int, length: int, batch_size: int, name: str = ""):
    """A Calibration of `model` from `sequences` windows of `stream`, recorded `batch_size` at a time."""
    builder, fingerprint = None, ""
    rows = _rows(stream, sequences, length)
    for lo in range(0, len(rows), batch_size):
        trace = record_trace(model, rows[lo:lo + batch_size], batch_size=batch_size)
        if builder is None:
            builder = CalibrationBuilder(trace.num_layers, trace.num_experts, trace.vocab_size, trace.top_k)
            fingerprint = trace.fingerprint
        for a, b in trace.sequences():
            builder.add(trace.router_logits[a:b], trace.token_ids[a:b])
    return builder.finish({"model": name, "fingerprint": fingerprint, "text": "calibration part of the family corpus",
                           "sequences": len(rows), "window": length})


def replay_metrics(target, streams: dict, calibration_sequences: int = 256, sequences: int = 32, length: int = 512,
                   capacities=(32, 16), batch_size: int = 16, family_name: str = "") -> dict:
    """Calibrate on the calibration part, record the evaluation part, replay every policy of POLICIES at each
    capacity; per-token means of copies (demand + prefetch), unused prefetches and displaced router mass."""
    calibration = calibrate(target, streams["calibration"], calibration_sequences, length, batch_size, family_name)
    trace = record_trace(target, _rows(streams["evaluation"], sequences, length), batch_size=batch_size)
    out = {"calibration_tokens": int(calibration.provenance["tokens"]), "evaluation_tokens": trace.num_tokens,
           "dtype": str(next(target.parameters()).dtype).replace("torch.", ""), "policies": {}}
    for capacity in capacities:
        for name in POLICIES:
            policy = preset(name, capacity, trace.top_k)
            result = replay(policy, trace.router_logits, trace.pregate_logits, trace.token_ids, calibration,
                            sequence_starts=trace.sequence_starts)
            out["policies"][f"{name}@C={capacity}"] = {"policy": policy.name, **result.summary()}
    return out
