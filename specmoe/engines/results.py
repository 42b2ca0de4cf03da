"""What one decoding run of an engine returns: the tokens, every routing decision and the logits routing
saw (so `specmoe.routing.replay` can re-derive the decisions and a later run can follow them as a trace),
and per-token timing and copy accounting."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from specmoe.offload import CopyStats
from specmoe.routing import RouterScoring
from specmoe.speculation import tau as tau_of

COPY_FIELDS = CopyStats.FIELDS
HOST_PARTS = ("routing", "copy_issue", "copy_checks")  # routing + slots + weights; demand copies; need + wait


@dataclass
class DecodeResult:
    """One run of the engine: a request (`Engine.generate`), a teacher-forced window, or one request of a
    followed trace. A run is a sequence of decode steps, each one forward of the target: one position for
    autoregressive decoding (k = 0; every step commits one token, tau = 1) or a verification block of the root
    and k drafts (D = k + 1; the step commits the accepted drafts and the bonus token).

    Per step (N; the prefill of a `generate` excluded, a teacher-forced window's prompt steps included with
    timed False): roots [N] the first position; accepted [N] the accepted drafts (0 for autoregressive steps);
    ms [N] wall time; draft_ms [N] drafting time charged to the step; copies [N, F] per COPY_FIELDS (the
    block's moves included); wait_ms [N]: exposed copy wait (CPU: measured; GPU: with instrumentation only,
    else None); host_us [N]: host time on the critical path (routing, copy issue, waits set up) and
    host_parts_us [N, 3] its parts (host-routed autoregressive steps); gap_us / wait_us [N, L]: GPU idle time
    between graph A's end and graph B's start and the part spent waiting for copies (instrumented GPU runs; NaN in
    the rows of a prompt chunk but its last, which holds the chunk's one step).

    Per position of an autoregressive run (T = N): input_tokens, output_tokens (the greedy token after each),
    selected [T, L, K], router_logits [T, L, E] (z as routing saw it, from the model or a logit feed),
    pregate_logits [T, L, E] (row 0 zero), logits [T, V] with return_logits. A speculative run recorded with
    record=True keeps each block's selections [D, L, K] in `block_selected` (rejected positions included).

    tokens: the new tokens the run committed (`generate`; `generated` is the same list); displaced: displaced
    router mass summed over layers and committed positions (speculative runs); prefill_ms: the prompt's time,
    which ends with the first new token (time to first token; `generate` only)."""

    ms: np.ndarray
    copies: np.ndarray
    timed: np.ndarray
    roots: np.ndarray
    accepted: np.ndarray
    draft_ms: np.ndarray
    host_us: np.ndarray
    num_layers: int
    k: int = 0
    wait_ms: np.ndarray | None = None
    gap_us: np.ndarray | None = None
    wait_us: np.ndarray | None = None
    host_parts_us: np.ndarray | None = None  # [N, 3]: host_us split into HOST_PARTS
    input_tokens: np.ndarray | None = None
    output_tokens: np.ndarray | None = None
    selected: np.ndarray | None = None
    router_logits: np.ndarray | None = None
    pregate_logits: np.ndarray | None = None
    logits: np.ndarray | None = None
    tokens: list[int] = field(default_factory=list)
    block_selected: list[np.ndarray] = field(default_factory=list)
    displaced: float = 0.0
    prefill_ms: float = 0.0
    prefill_tokens: int = 0  # new tokens committed outside the steps (the prefill's greedy token of `generate`)
    unused_at_end: int = 0  # prefetches never executed when the run ended (counted unused at the next reset)
    info: dict = field(default_factory=dict)

    @property
    def generated(self) -> list[int]:
        return self.tokens

    @generated.setter
    def generated(self, tokens: list[int]) -> None:
        self.tokens = list(tokens)

    @property
    def block_committed(self) -> int:
        """Tokens the timed steps committed: accepted drafts + 1 each, a block cut by max_new_tokens or a stop
        token counting only the tokens kept (`tokens` less the prefill's first token, `prefill_tokens`)."""
        made = int((self.accepted[self.timed] + 1).sum())
        if self.k == 0 or not self.tokens:
            return made
        return min(made, len(self.tokens) - self.prefill_tokens)

    @property
    def tau(self) -> float:
        """Committed tokens per timed step (`specmoe.speculation.tau`; 1 for autoregressive steps)."""
        return float(tau_of(self.block_committed, int(self.timed.sum())))

    @property
    def moves(self) -> int:
        """Pool refill moves between GPU slots over the timed steps."""
        return int(self.copies[self.timed, COPY_FIELDS.index("moved")].sum())

    def copy_totals(self, timed_only: bool = True) -> dict:
        rows = self.copies[self.timed] if timed_only else self.copies
        totals = dict(zip(COPY_FIELDS, rows.sum(axis=0).tolist()))
        totals["prefetch_unused"] += self.unused_at_end
        return totals

    def counts(self) -> dict:
        """The sums `specmoe.speculation.summarize` pools over requests (no divergence: KL is NaN)."""
        timed = self.timed
        accepted = self.accepted[timed]
        return {"requests": 1, "verifications": int(timed.sum()), "block_tokens": int((accepted + 1).sum()),
                "block_committed": self.block_committed,
                "committed": len(self.tokens), "accepted_hist": np.bincount(accepted, minlength=self.k + 1),
                "copies": int(self.copies[timed][:, [COPY_FIELDS.index("issued"), COPY_FIELDS.index("skipped")]].sum()),
                "moves": self.moves, "displaced": self.displaced,
                "num_layers": self.num_layers, "draft_s": float(self.draft_ms[timed].sum()) / 1e3,
                "verify_s": float(self.ms[timed].sum()) / 1e3, "prefill_s": self.prefill_ms / 1e3,
                "kl_sum": 0.0, "excess_nll_sum": 0.0, "positions": 0}

    def timeline(self) -> dict:
        """Where a timed step's time goes, ms per step (per verification block for a speculative run), means over
        the timed steps: "draft" (drafting charged to the step), "step" (its wall time), and the step split into
        "selection" (host time choosing the experts: routing, or a block's selection and pool use), "copy_issue"
        and "copy_checks" (host time issuing and checking copies), "copy_wait" (exposed copy wait: measured on the
        CPU; the GPU's wait events with instrumentation), "idle_other" (the GPU's other idle time between each
        layer's two graphs: the logits' round trip and launches; instrumented GPU runs, else NaN) and "compute"
        (the rest: on the GPU the step's time less its idle gaps, on the CPU less host time and copy wait);
        "per_token": each of these summed over the timed steps, divided by the tokens they committed."""
        timed = self.timed
        n = int(timed.sum())
        if n == 0:
            return {}
        parts = (self.host_parts_us[timed] if self.host_parts_us is not None
                 else np.zeros((n, len(HOST_PARTS)))) / 1e3
        step = self.ms[timed]
        rows = {"draft": self.draft_ms[timed], "step": step, "selection": parts[:, 0], "copy_issue": parts[:, 1],
                "copy_checks": parts[:, 2]}
        host = parts.sum(axis=1)
        if self.gap_us is not None:
            gap = np.nan_to_num(self.gap_us[timed]).sum(axis=1) / 1e3
            rows["copy_wait"] = np.nan_to_num(self.wait_us[timed]).sum(axis=1) / 1e3
            rows["idle_other"] = gap - rows["copy_wait"] - host
            rows["compute"] = step - gap
        else:
            rows["copy_wait"] = self.wait_ms[timed] if self.wait_ms is not None else np.full(n, np.nan)
            rows["idle_other"] = np.full(n, np.nan)
            rows["compute"] = step - host - np.nan_to_num(rows["copy_wait"])
        out = {name: float(v.mean()) for name, v in rows.items()}
        committed = max(self.block_committed, 1)
        out["per_token"] = {name: float(v.sum()) / committed for name, v in rows.items()}
        return out

    def summary(self) -> dict:
        """Means over the timed steps: ms (mean, p50, p99), copies per step by class, host time per layer,
        exposed copy wait; and per committed token: tau, copies, drafting and verification ms."""
        n = int(self.timed.sum())
        out = {"tokens": n}
        if n == 0:
            return out
        out["tau"] = self.tau
        out["prefill_ms"] = self.prefill_ms  # time to the first new token (generate)
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
        if self.k > 0:
            out["timeline_ms"] = self.timeline()
        return out


class LogitFeed:
    """Where the engine's routing reads router logits z and pre-gate logits g: the model's own router
    (`model_feed`, the default) or a recording [T, L, E] (`LogitFeed(...)`: a previous DecodeResult, or the
    logits of a trained model with the same L, E, K, e.g. from a `specmoe.records.Trace`). With `tokens` [T],
    the engine also feeds these input tokens (also in `generate`), so routing is the recorded run's exactly
    even when this model's outputs differ (copies-skipped mode computes on stale slots). `fingerprint`: the
    router fingerprint of the model the logits come from (the run's calibration is checked against it).
    The logits are raw router logits z (as traces and `DecodeResult` hold them); `scoring`: the rule of the
    router they come from (`RouterScoring`, a trace's `scoring`), which routing applies to them (selection
    scores, execution weights, groups); None, or a softmax rule with the engine's groups (a file without a rule):
    the engine's own model's rule."""

    def __init__(self, router_logits: np.ndarray, pregate_logits: np.ndarray, tokens: np.ndarray | None = None,
                 fingerprint: str | None = None, scoring: RouterScoring | None = None):
        self.fingerprint = fingerprint
        self.scoring = scoring
        self.router_logits = np.ascontiguousarray(router_logits, dtype=np.float32)
        self.pregate_logits = np.ascontiguousarray(pregate_logits, dtype=np.float32)
        self.tokens = None if tokens is None else np.asarray(tokens, dtype=np.int64)

    @classmethod
    def of(cls, result: DecodeResult, with_tokens: bool = True) -> "LogitFeed":
        return cls(result.router_logits, result.pregate_logits, result.input_tokens if with_tokens else None,
                   result.info.get("fingerprint"))

    @classmethod
    def of_trace(cls, trace, with_tokens: bool = True) -> "LogitFeed":
        """Follow a routing trace (`specmoe.records.Trace`): its raw logits, tokens, fingerprint and rule."""
        return cls(trace.router_logits, trace.pregate_logits, trace.token_ids if with_tokens else None,
                   trace.fingerprint or None, trace.scoring)

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
    scoring = None  # routed by the model's own rule

    def __init__(self, step):
        top = step.logits_np.shape[-1] // 2
        self.rows_z = [step.logits_np[l, 0, :top] for l in range(step.logits_np.shape[0])]
        self.rows_g = [None] + [step.logits_np[l - 1, 0, top:] for l in range(1, step.logits_np.shape[0])]

    def router(self, t: int, layer: int) -> np.ndarray:
        return self.rows_z[layer]

    def pregate(self, t: int, layer: int) -> np.ndarray:
        return self.rows_g[layer]
