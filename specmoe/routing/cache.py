"""The logical expert cache of one sequence (one request, or one batch row).

`LogicalCache` holds the per-layer residency sets R_l, their slot assignment, the eviction statistics and
the copy counters, and runs a `PolicyConfig` on them through the numba kernels of `kernels.py`. The
harness calls `run_span` (all positions of a layer at once), the engines call `insert_predicted` (part 1)
and `select` (part 2) as the layers execute, and `replay` drives `run_span` over recorded logits: every
caller runs the same code. Nothing here depends on timing.
"""

from __future__ import annotations

import numpy as np

from . import kernels as K
from . import validate as V
from .calibration import Calibration, CalibrationError
from .policy import PolicyConfig, PolicyError
from .scoring import RouterScoring, check_groups

_KIND_CODES = {"exact": K.KIND_EXACT, "cache_prior": K.KIND_CACHE_PRIOR, "psr": K.KIND_PSR,
               "spec_exec": K.KIND_SPEC_EXEC}
_NO_TRACE = np.zeros((0, 0), dtype=np.int64)


class LogicalCache:
    """Logical cache of one sequence over `num_layers` MoE layers of `num_experts` experts each. groups:
    (n_group, topk_group) of a router with group-limited choice (`RouterScoring.groups`; (1, 1): none)."""

    def __init__(self, policy: PolicyConfig, calibration: Calibration, num_layers: int, num_experts: int,
                 groups: tuple[int, int] = (1, 1)):
        if not isinstance(policy, PolicyConfig):
            raise PolicyError(f"expected a PolicyConfig, got {type(policy).__name__}")
        if not isinstance(calibration, Calibration):
            raise CalibrationError(f"expected a Calibration, got {type(calibration).__name__}")
        num_layers = V.integer(num_layers, "num_layers", ValueError, minimum=1)
        num_experts = V.integer(num_experts, "num_experts", ValueError, minimum=1)
        policy.check_experts(num_experts)
        n_group, topk_group = check_groups(*groups, num_experts, policy.top_k)
        calibration.check(num_layers, num_experts)
        self.policy = policy
        self.calibration = calibration
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.params = np.zeros(K.N_PARAMS, dtype=np.int64)
        self.params[K.P_KIND] = _KIND_CODES[policy.kind]
        self.params[K.P_CAPACITY] = policy.capacity
        self.params[K.P_TOP_K] = policy.top_k
        self.params[K.P_BUDGET] = policy.insert_budget
        self.params[K.P_WINDOW] = policy.window
        self.params[K.P_LRU] = int(policy.priority == "lru")
        self.params[K.P_PROTECT] = policy.protect_top
        self.params[K.P_RUNNING] = int(policy.delta == "running")
        self.params[K.P_GROUPS] = n_group
        self.params[K.P_TOPK_GROUP] = topk_group
        self.warm = np.ascontiguousarray(calibration.warm_set(policy.capacity))
        self.delta = np.ascontiguousarray(calibration.delta)
        prior = calibration.token_prior
        self.prior = (np.ascontiguousarray(prior.indptr), np.ascontiguousarray(prior.experts),
                      np.ascontiguousarray(prior.values))
        self.istate = np.full((num_layers, K.N_IROWS, num_experts), -1, dtype=np.int64)  # reset reads PREFETCHED
        self.iscalar = np.empty((num_layers, K.N_ISCALARS), dtype=np.int64)
        self.fstate = np.empty((num_layers, K.N_FROWS, num_experts), dtype=np.float64)
        self.fscalar = np.empty((num_layers, K.N_FSCALARS), dtype=np.float64)
        self.counters = np.zeros((num_layers, K.N_COUNTERS), dtype=np.int64)
        self.displaced_mass = np.zeros(num_layers)
        self._inserted = np.empty(max(policy.top_k, policy.window), dtype=np.int64)
        self.demand = np.empty(policy.top_k, dtype=np.int64)  # demand insertions of `select` and `route`
        self.demand_slots = np.empty(policy.top_k, dtype=np.int64)
        self._z64 = np.empty(num_experts)
        self.reset()

    # -- sequence boundaries ------------------------------------------------------------------------
    def reset(self, unused_at: np.ndarray = _NO_TRACE) -> None:
        """Start a new sequence: R_l = warm set in slots 0..C-1, statistics zero. Counters keep
        accumulating; prefetches of the previous sequence that never executed are counted unused."""
        self._check_unused_at(unused_at)
        K.reset(self.istate, self.iscalar, self.fstate, self.fscalar, self.warm, self.counters, unused_at)

    # -- part 1 and part 2, one token at a time (engines) -------------------------------------------
    def insert_predicted(self, layer: int, pregate_logits: np.ndarray, token: int,
                         budget: int | None = None) -> np.ndarray:
        """Part 1 for `layer` and its current token: insert up to n (or `budget`, if smaller) of the
        pre-gate's candidates. Returns the inserted experts (their copies are prefetches); their slots are
        `slot_of`. A budget below n makes the cache depend on it: only the engine's physical-cache mode,
        which is timing-dependent on purpose, passes one."""
        if budget is not None and budget < 0:
            raise ValueError(f"insert_predicted: budget must be >= 0 or None, got {budget}")
        limit = self.policy.insert_budget if budget is None else budget
        n = K.part1(self.istate, self.iscalar, self.fstate, self.counters, self.params, *self.prior, layer,
                    pregate_logits, token, limit, self._inserted, _NO_TRACE)
        if n < 0:  # the kernel checks the layer and the length (cheaper than Python on the engine's hot path)
            raise V.bad_call("insert_predicted", layer, self.num_layers,
                             {"pregate_logits": (pregate_logits, self.num_experts)})
        return self._inserted[:n]

    def select(self, layer: int, router_logits: np.ndarray, token: int) -> tuple[np.ndarray, np.ndarray]:
        """Part 2 for `layer`: the executed experts S [K] (best first) and the demand insertions among them
        (their copies are demand copies). Advances the layer to the next token. `router_logits` are the
        selection scores (the logits of a softmax router; see `RouterScoring`)."""
        router_logits = np.asarray(router_logits)
        if not 0 <= layer < self.num_layers or router_logits.shape != (self.num_experts,):
            raise V.bad_call("select", layer, self.num_layers, {"router_logits": (router_logits, self.num_experts)})
        selected = np.empty(self.policy.top_k, dtype=np.int64)
        d, mass, _ = K.part2(self.istate, self.iscalar, self.fstate, self.fscalar, self.counters, self.params,
                             self.policy.bonus, self.delta, *self.prior, layer, router_logits, token, selected,
                             self.demand, _NO_TRACE)
        self.displaced_mass[layer] += mass
        return selected, self.demand[:d].copy()

    def route(self, layer: int, router_logits: np.ndarray, token: int, scoring: "RouterScoring | EngineScoring",
              logits_out: np.ndarray, selected: np.ndarray, slots: np.ndarray, weights: np.ndarray) -> int:
        """`select` for the engines, in one numba call that writes into the caller's buffers, from the raw
        router logits (float32 [E]) and the model's `scoring` (its selection scores and execution weights;
        pass `EngineScoring.of(scoring, L, E)` to skip rebuilding the kernel arguments per call; its expert
        groups become this cache's from this call on):
        logits_out [E] (float32, a copy of router_logits for the record), selected [K] (int64), slots [K]
        (int32 or int64), weights [K] (float32 or float64: the execution weights). Returns d: the demand
        insertions are `demand[:d]`, their slots `demand_slots[:d]` (both overwritten by the next call)."""
        if not isinstance(scoring, EngineScoring):
            scoring = EngineScoring.of(scoring, self.num_layers, self.num_experts)
        d = K.route(self.istate, self.iscalar, self.fstate, self.fscalar, self.counters, self.params,
                    self.policy.bonus, self.delta, *self.prior, layer, router_logits, token, scoring.code,
                    scoring.renormalise, scoring.scale, scoring.bias, scoring.n_group, scoring.topk_group,
                    self._z64, logits_out, selected, slots,
                    weights, self.demand, self.demand_slots, self.displaced_mass, _NO_TRACE)
        if d < 0:  # the kernel checks the layer and the lengths (cheaper than Python on the engine's hot path)
            k, e = self.policy.top_k, self.num_experts
            raise V.bad_call("route", layer, self.num_layers, {
                "router_logits": (router_logits, e), "logits_out": (logits_out, e), "selected": (selected, k),
                "slots": (slots, k), "weights": (weights, k)})
        return d

    # -- all positions of a layer at once (harness, replay) ------------------------------------------
    def run_span(self, layer: int, router_logits: np.ndarray, pregate_logits: np.ndarray | None,
                 token_ids: np.ndarray, valid: np.ndarray | None = None, out: dict | None = None,
                 unused_at: np.ndarray = _NO_TRACE) -> np.ndarray:
        """Parts 1 and 2 of `layer` for consecutive positions of this sequence.

        router_logits, pregate_logits: [S, E] (pre-gate None for the first MoE layer); token_ids [S];
        valid [S] marks real (not padded) positions. Returns the executed experts [S, K]. With `out`, also
        fills out["slots"] [S, K], out["demand"], out["prefetch"], out["replaced"] [S] and
        out["displaced"] [S]."""
        if not 0 <= layer < self.num_layers:
            raise V.bad_call("run_span", layer, self.num_layers, {})
        z = V.real_array(router_logits, f"router logits of layer {layer}", ValueError, 2, np.float64)
        span = z.shape[0]
        if z.shape[1] != self.num_experts:
            raise ValueError(f"router logits of layer {layer} must be [positions, {self.num_experts}], got {z.shape}")
        if pregate_logits is not None and np.shape(pregate_logits) != z.shape:
            raise ValueError(f"pre-gate logits of layer {layer} must be {z.shape}, got {np.shape(pregate_logits)}")
        if valid is None:
            valid = np.ones(span, dtype=np.bool_)
        elif np.shape(valid) != (span,):
            raise ValueError(f"valid (the mask of real positions) must be [{span}], got shape {np.shape(valid)}")
        valid = np.ascontiguousarray(valid, dtype=np.bool_)
        has_g = pregate_logits is not None and self.policy.insert_budget > 0  # else there is no part 1
        g = V.real_array(pregate_logits, f"pre-gate logits of layer {layer}", ValueError, 2, np.float64) if has_g else z
        rows = slice(None) if valid.all() else valid  # padded positions are never routed by their logits
        V.check_real(z[rows], f"router logits of layer {layer}", ValueError)
        if has_g:
            V.check_real(g[rows], f"pre-gate logits of layer {layer}", ValueError)
        tokens = V.token_ids(token_ids, span, self.calibration.vocab_size, f"token ids of layer {layer}", ValueError,
                             unknown_ok=True)
        self._check_unused_at(unused_at)
        out = {} if out is None else out
        selected = np.empty((span, self.policy.top_k), dtype=np.int64)
        out["slots"] = np.empty((span, self.policy.top_k), dtype=np.int64)
        for name in ("demand", "prefetch", "replaced"):
            out[name] = np.empty(span, dtype=np.int64)
        out["displaced"] = np.empty(span)
        K.run_span(self.istate, self.iscalar, self.fstate, self.fscalar, self.counters, self.params,
                   self.policy.bonus, self.delta, *self.prior, layer, z, g, has_g,
                   tokens, valid,
                   selected, out["slots"], out["demand"], out["prefetch"], out["displaced"], out["replaced"],
                   unused_at)
        self.displaced_mass[layer] += out["displaced"].sum()
        return selected

    def _check_unused_at(self, unused_at: np.ndarray) -> None:
        """The per-step unused-prefetch record of `replay` must be int64 [T, L]: the kernels write into it."""
        if unused_at is not _NO_TRACE and (not isinstance(unused_at, np.ndarray) or unused_at.dtype != np.int64
                                           or unused_at.ndim != 2 or unused_at.shape[1] != self.num_layers):
            raise ValueError(f"unused_at must be an int64 array [T, {self.num_layers}], got "
                             f"{getattr(unused_at, 'dtype', type(unused_at).__name__)} {np.shape(unused_at)}")

    def _check_layer(self, method: str, layer: int) -> None:
        """A layer outside [0, L) would index another layer's state (-1) or past the arrays."""
        if not 0 <= layer < self.num_layers:
            raise V.bad_call(method, layer, self.num_layers, {})

    # -- inspection --------------------------------------------------------------------------------
    def resident(self, layer: int) -> np.ndarray:
        """The experts assigned to slots 0..C-1 of `layer`."""
        self._check_layer("resident", layer)
        return self.istate[layer, K.SLOT_EXPERT, : self.policy.capacity].copy()

    def slot_of(self, layer: int, experts: np.ndarray) -> np.ndarray:
        """Slots of `experts` in `layer` (-1 for experts not logically resident). On the engine's per-layer
        path: only the layer is checked here (numpy's indexing refuses experts >= E)."""
        if not 0 <= layer < self.num_layers:
            raise V.bad_call("slot_of", layer, self.num_layers, {})
        return self.istate[layer, K.EXPERT_SLOT, np.asarray(experts, dtype=np.int64)]

    def statistics(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """The fast and slow moving averages (decay 0.5 and 0.98) of the router's own top-K in `layer`."""
        self._check_layer("statistics", layer)
        return self.fstate[layer, K.S_FAST].copy(), self.fstate[layer, K.S_SLOW].copy()

    def position(self, layer: int) -> int:
        """Index of the token that `layer` will process next."""
        self._check_layer("position", layer)
        return int(self.iscalar[layer, K.POS])

    def totals(self) -> dict:
        """Counters summed over layers since the last `clear_counters`: (token, layer) steps, copies by
        class, router slots replaced, displaced router mass."""
        total = self.counters.sum(axis=0)
        return {
            "steps": int(total[K.C_TOKENS]),
            "demand": int(total[K.C_DEMAND]),
            "prefetch": int(total[K.C_PREFETCH]),
            "unused": int(total[K.C_UNUSED]),
            "replaced": int(total[K.C_REPLACED]),
            "displaced_mass": float(self.displaced_mass.sum()),
        }

    def clear_counters(self) -> None:
        self.counters[:] = 0
        self.displaced_mass[:] = 0.0

    def snapshot(self) -> object:
        """A copy of the whole state (residency, slots, statistics, counters, displaced mass), for `restore`."""
        return tuple(a.copy() for a in (self.istate, self.iscalar, self.fstate, self.fscalar, self.counters,
                                        self.displaced_mass))

    def restore(self, snapshot) -> None:
        """Return to the state of `snapshot` (from `snapshot()` of this cache): rollback of rejected positions."""
        for target, saved in zip((self.istate, self.iscalar, self.fstate, self.fscalar, self.counters,
                                  self.displaced_mass), snapshot):
            target[...] = saved



class EngineScoring:
    """A `RouterScoring` unpacked once into the plain values `LogicalCache.route` hands its kernel."""

    __slots__ = ("code", "renormalise", "scale", "bias", "n_group", "topk_group")

    def __init__(self, code: int, renormalise: bool, scale: float, bias: np.ndarray, n_group: int = 1,
                 topk_group: int = 1):
        self.code, self.renormalise, self.scale, self.bias = code, renormalise, scale, bias
        self.n_group, self.topk_group = n_group, topk_group

    @classmethod
    def of(cls, scoring: RouterScoring, num_layers: int, num_experts: int) -> "EngineScoring":
        n_group, topk_group = check_groups(*scoring.groups, num_experts)
        return cls(scoring.code, bool(scoring.renormalise), float(scoring.scale),
                   scoring.bias_rows(num_layers, num_experts), n_group, topk_group)
