"""What one decoding run of an engine returns: the tokens, every routing decision and the logits routing
saw (so `specmoe.routing.replay` can re-derive the decisions and a later run can follow them as a trace),
and per-token timing and copy accounting."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from specmoe.offload import CopyStats

COPY_FIELDS = CopyStats.FIELDS
HOST_PARTS = ("routing", "copy_issue", "copy_checks")  # routing + slots + weights; demand copies; need + wait


@dataclass
class DecodeResult:
    """Per decode step t (one position of the sequence): input token, routing and timing.

    router_logits [T, L, E] float32: z as routing saw it (from the model or a logit feed); pregate_logits
    [T, L, E]: g (row 0 zero: no pre-gate for the first MoE layer); selected [T, L, K]; output_tokens [T]:
    the greedy token after step t; timed [T]: decode steps (not prompt processing); ms [T]: wall time of the
    step; host_us [T]: host time on the critical path (routing, copy issue, waits set up), summed over
    layers; copies [T, F] per COPY_FIELDS; wait_ms [T]: exposed copy wait (CPU: measured; GPU: only with
    instrumentation); gap_us / wait_us [T, L]: GPU idle time between graph A's end and graph B's start and
    the part of it spent waiting for copies (instrumented GPU runs only)."""

    input_tokens: np.ndarray
    output_tokens: np.ndarray
    selected: np.ndarray
    router_logits: np.ndarray
    pregate_logits: np.ndarray
    timed: np.ndarray
    ms: np.ndarray
    host_us: np.ndarray
    copies: np.ndarray
    wait_ms: np.ndarray | None = None
    gap_us: np.ndarray | None = None
    wait_us: np.ndarray | None = None
    logits: np.ndarray | None = None
    generated: list[int] = field(default_factory=list)
    unused_at_end: int = 0  # prefetches never executed when the run ended (counted unused at the next reset)
    host_parts_us: np.ndarray | None = None  # [T, 3]: host_us split into HOST_PARTS
    info: dict = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return self.selected.shape[1]

    def copy_totals(self, timed_only: bool = True) -> dict:
        rows = self.copies[self.timed] if timed_only else self.copies
        totals = dict(zip(COPY_FIELDS, rows.sum(axis=0).tolist()))
        totals["prefetch_unused"] += self.unused_at_end
        return totals

    def summary(self) -> dict:
        """Means over the timed steps: ms (mean, p50, p99), copies per token by class, host time per layer,
        exposed copy wait."""
        n = int(self.timed.sum())
        out = {"tokens": n}
        if n == 0:
            return out
        ms = self.ms[self.timed]
        out.update(ms_mean=float(ms.mean()), ms_p50=float(np.percentile(ms, 50)), ms_p99=float(np.percentile(ms, 99)))
        totals = self.copy_totals()
        per_token = {k: v / n for k, v in totals.items() if k != "warm"}
        per_token["transferred"] = per_token["issued"]
        out["copies_per_token"] = per_token
        out["host_us_per_layer"] = float(self.host_us[self.timed].mean() / self.num_layers)
        if self.host_parts_us is not None:
            parts = self.host_parts_us[self.timed].mean(axis=0) / self.num_layers
            out["host_us_per_layer_parts"] = dict(zip(HOST_PARTS, parts.tolist()))
        if self.wait_ms is not None:
            out["exposed_wait_ms_per_token"] = float(self.wait_ms[self.timed].mean())
        if self.gap_us is not None:
            gap = self.gap_us[self.timed]
            wait = self.wait_us[self.timed]
            out["gpu_gap_us_per_layer"] = float(gap.mean())
            out["gpu_gap_us_per_layer_p50"] = float(np.median(gap))
            out["exposed_wait_ms_per_token"] = float(wait.sum(axis=1).mean() / 1000.0)
            out["gap_without_wait_us_per_layer"] = float((gap - wait).mean())
        return out


class LogitFeed:
    """Where the engine's routing reads router logits z and pre-gate logits g: the model's own router
    (`model_feed`, the default) or a recording [T, L, E] (`LogitFeed(...)`: a previous DecodeResult, or the
    logits of a trained model with the same L, E, K, e.g. from a `specmoe.records.Trace`). With `tokens` [T],
    the engine also feeds these input tokens (also in `generate`), so routing is the recorded run's exactly
    even when this model's outputs differ (copies-skipped mode computes on stale slots). `fingerprint`: the
    router fingerprint of the model the logits come from (the run's calibration is checked against it)."""

    def __init__(self, router_logits: np.ndarray, pregate_logits: np.ndarray, tokens: np.ndarray | None = None,
                 fingerprint: str | None = None):
        self.fingerprint = fingerprint
        self.router_logits = np.ascontiguousarray(router_logits, dtype=np.float32)
        self.pregate_logits = np.ascontiguousarray(pregate_logits, dtype=np.float32)
        self.tokens = None if tokens is None else np.asarray(tokens, dtype=np.int64)

    @classmethod
    def of(cls, result: DecodeResult, with_tokens: bool = True) -> "LogitFeed":
        return cls(result.router_logits, result.pregate_logits, result.input_tokens if with_tokens else None,
                   result.info.get("fingerprint"))

    def router(self, t: int, layer: int) -> np.ndarray:
        return self.router_logits[t, layer]

    def pregate(self, t: int, layer: int) -> np.ndarray:
        return self.pregate_logits[t, layer]

    def check(self, num_tokens: int, num_layers: int, num_experts: int) -> None:
        for name, arr in (("router", self.router_logits), ("pre-gate", self.pregate_logits)):
            if arr.ndim != 3 or arr.shape[1:] != (num_layers, num_experts) or arr.shape[0] < num_tokens:
                raise ValueError(f"the logit feed's {name} logits have shape {arr.shape}; need at least "
                                 f"[{num_tokens}, {num_layers}, {num_experts}]")
        if self.tokens is not None and len(self.tokens) < num_tokens:
            raise ValueError(f"the logit feed has {len(self.tokens)} tokens; the run needs {num_tokens}")


class ModelFeed:
    """The model's own router and pre-gate logits, as the decoder's last step wrote them ([E] rows)."""

    tokens = None

    def __init__(self, step):
        top = step.logits_np.shape[-1] // 2
        self.rows_z = [step.logits_np[l, 0, :top] for l in range(step.logits_np.shape[0])]
        self.rows_g = [None] + [step.logits_np[l - 1, 0, top:] for l in range(1, step.logits_np.shape[0])]

    def router(self, t: int, layer: int) -> np.ndarray:
        return self.rows_z[layer]

    def pregate(self, t: int, layer: int) -> np.ndarray:
        return self.rows_g[layer]
