"""Routing policies: which experts a layer executes, given its router logits and the logical cache.

A `PolicyConfig` is plain data, validated when it is made. `kind` picks the selection rule:

- ``exact``: the router's own top-K. The logical cache is still kept (eviction by `priority`), so copies
  can be counted; with ``insert_budget > 0`` the pre-gate prefetches of PSR are added without a bonus
  (the paper's "exact + prefetch", also reachable as ``psr`` with ``bonus = 0``).
- ``cache_prior``: top-K of ``z + bonus * delta_l * m`` where ``m`` marks logically resident experts
  (and the router's own top-J when ``protect_top = J``), no pre-gate insertion (Skliar et al., 2025).
- ``psr``: prefetch-steered routing, Cache-Prior on a logical cache into which at most ``insert_budget``
  of the next layer's pre-gate candidates (the first ``window`` of its ranking) are inserted per layer
  and token (Algorithm 1 of the paper).
- ``spec_exec``: speculative execution, the layer executes the pre-gate's top-K instead of the router's
  choice (the router's own top-K where no pre-gate exists, i.e. the first MoE layer), with the same
  logical cache and prefetching as PSR.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import validate
from ..limits import MAX_EXPERTS

KINDS = ("exact", "cache_prior", "psr", "spec_exec")
PRIORITIES = ("A", "lru")
DELTAS = ("fixed", "running")


class PolicyError(ValueError):
    """A policy configuration that cannot be run (unknown kind, C > E, negative bonus, ...)."""


@dataclass(frozen=True)
class PolicyConfig:
    """One routing policy with its parameters (names follow the vocabulary of docs/design.md).

    capacity: C, logical cache slots per layer; top_k: K of the model; bonus: lambda; insert_budget: n,
    new pre-gate insertions per layer and token; window: w, pre-gate candidates visited; priority: "A"
    (EMA statistics + token prior) or "lru"; protect_top: J, router top-J treated as resident by the bonus;
    delta: "fixed" (calibrated mean logit range) or "running" (mean over the request so far).
    """

    kind: str
    capacity: int
    top_k: int
    bonus: float = 0.0
    insert_budget: int = 0
    window: int = 8
    priority: str = "A"
    protect_top: int = 0
    delta: str = "fixed"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise PolicyError(f"unknown policy kind {self.kind!r}; expected one of {', '.join(KINDS)}")
        if self.priority not in PRIORITIES:
            raise PolicyError(f"unknown eviction priority {self.priority!r}; expected 'A' or 'lru'")
        if self.delta not in DELTAS:
            raise PolicyError(f"unknown delta mode {self.delta!r}; expected 'fixed' or 'running'")
        for name in ("capacity", "top_k", "insert_budget", "window", "protect_top"):  # numpy integers too
            object.__setattr__(self, name, validate.integer(getattr(self, name), name, PolicyError,
                                                            maximum=MAX_EXPERTS))
        object.__setattr__(self, "bonus", validate.real(self.bonus, "bonus (lambda)", PolicyError, minimum=0.0))
        if self.top_k < 1:
            raise PolicyError(f"top_k must be at least 1, got {self.top_k}")
        if self.capacity < self.top_k:
            raise PolicyError(
                f"capacity C={self.capacity} is smaller than top_k K={self.top_k}: a layer could not hold "
                "the experts it executes"
            )
        if self.insert_budget < 0:
            raise PolicyError(f"insert_budget (n) must be >= 0, got {self.insert_budget}")
        if self.window < 1:
            raise PolicyError(f"window (w) must be >= 1, got {self.window}")
        if not 0 <= self.protect_top <= self.top_k:
            raise PolicyError(f"protect_top (J) must be in [0, top_k={self.top_k}], got {self.protect_top}")
        if self.kind in ("exact", "spec_exec") and (self.bonus != 0.0 or self.protect_top != 0):
            raise PolicyError(f"kind {self.kind!r} takes no routing bonus: set bonus=0 and protect_top=0")
        if self.kind == "cache_prior" and self.insert_budget != 0:
            raise PolicyError(
                "cache_prior inserts no pre-gate predictions (insert_budget must be 0); "
                "Cache-Prior with prefetch steering is kind='psr'"
            )
        if self.kind == "psr" and self.insert_budget == 0:
            raise PolicyError("psr needs insert_budget >= 1; with no insertion it is kind='cache_prior'")
        if self.kind == "spec_exec" and self.insert_budget == 0:
            raise PolicyError("spec_exec needs insert_budget >= 1 (the paper uses n=1, as PSR)")

    def check_experts(self, num_experts: int) -> None:
        """Raise if the policy cannot run on a layer of `num_experts` experts."""
        if self.capacity > num_experts:
            raise PolicyError(f"capacity C={self.capacity} exceeds the {num_experts} experts of a layer (C > E)")
        if self.top_k > num_experts:
            raise PolicyError(f"top_k K={self.top_k} exceeds the {num_experts} experts of a layer")

    @property
    def name(self) -> str:
        """A short label for tables, e.g. ``psr(C=32, lambda=0.3, n=1, A)``."""
        parts = [f"C={self.capacity}"]
        if self.kind in ("cache_prior", "psr"):
            parts.append(f"lambda={self.bonus:g}")
        if self.insert_budget:
            parts.append(f"n={self.insert_budget}")
            if self.window != 8:
                parts.append(f"w={self.window}")
        parts.append(self.priority)
        if self.protect_top:
            parts.append(f"J={self.protect_top}")
        if self.delta != "fixed":
            parts.append("running delta")
        return f"{self.kind}({', '.join(parts)})"


# The paper's named settings (Section 6.1 and Appendix B). Capacity and top_k come from the experiment.
PRESETS: dict[str, dict] = {
    "exact_lru": dict(kind="exact", priority="lru"),
    "exact_a": dict(kind="exact", priority="A"),
    "exact_prefetch": dict(kind="psr", bonus=0.0, insert_budget=1, priority="A"),
    "cache_prior": dict(kind="cache_prior", bonus=0.2, priority="lru"),
    "cache_prior_a": dict(kind="cache_prior", bonus=0.2, priority="A"),
    "cache_prior_published": dict(kind="cache_prior", bonus=0.2, priority="lru", protect_top=2, delta="running"),
    "psr": dict(kind="psr", bonus=0.3, insert_budget=1, priority="A"),
    "spec_exec": dict(kind="spec_exec", insert_budget=1, priority="A"),
}


def preset(name: str, capacity: int, top_k: int, **overrides) -> PolicyConfig:
    """The paper's setting `name` (see PRESETS) at `capacity`, with any field overridden."""
    if name not in PRESETS:
        raise PolicyError(f"unknown policy preset {name!r}; expected one of {', '.join(PRESETS)}")
    return PolicyConfig(capacity=capacity, top_k=top_k, **{**PRESETS[name], **overrides})


def psr_bonus(capacity: int, num_experts: int) -> float:
    """The paper's PSR operating points: lambda 0.3 at 50% residency, 0.25 at 25% (the bonus `specmoe demo`,
    `specmoe sd` and the rollback replay use at capacity C of E experts)."""
    return 0.3 if capacity / num_experts >= 0.375 else 0.25


def parse_policy(name: str, capacity: int, top_k: int, overrides: list[str] | None = None) -> PolicyConfig:
    """A preset (see `specmoe.routing.PRESETS`) with `field=value` overrides, e.g. ["bonus=0.25"]."""
    fields = PolicyConfig.__dataclass_fields__
    changes = {}
    for item in overrides or []:
        key, sep, value = item.partition("=")
        if not sep or key not in fields or key in ("capacity", "top_k"):
            raise PolicyError(f"bad policy override {item!r}: expected FIELD=VALUE with FIELD one of "
                              + ", ".join(f for f in fields if f not in ("capacity", "top_k")))
        kind = fields[key].type
        try:
            changes[key] = float(value) if kind == "float" else int(value) if kind == "int" else value
        except ValueError:
            raise PolicyError(f"bad policy override {item!r}: {key} takes a {kind}") from None
    return preset(name, capacity, top_k, **changes)
