"""How a model turns router logits into what routing ranks and what the experts are weighted by.

A router produces logits z [E] per token and layer. Two things follow from them, and they differ by
architecture:
- the selection scores, which a policy ranks and adds its bonus to: z itself for softmax routers (OLMoE,
  Qwen-MoE); sigmoid(z) + bias_l for DeepSeek-V3-style routers (the bias only steers selection);
- the execution weights of the executed set S: the unmodified router probabilities at S (softmax(z) over all
  E, or sigmoid(z)), renormalised over S where the model's own router renormalises, times the model's routed
  scaling factor (1 except DeepSeek-V3);
- group-limited choice (DeepSeek-V3 with n_group > 1): the E experts form n_group groups of consecutive
  indices, a group scores the sum of its two best selection scores, the topk_group best groups are kept and
  the top-K is taken inside them (`check_groups`, `kernels._rank_groups`).

`RouterScoring` names one model's rule; an adapter makes it (`MoEAdapter.router_scoring`) and the engines
hand it to `LogicalCache.route`, so the numba routing step applies it without knowing the architecture.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import json

import numpy as np

from specmoe.geometry import tiled_layers

SCORINGS = ("softmax", "sigmoid")
SOFTMAX, SIGMOID = 0, 1  # the numba kernels' codes


@dataclass(frozen=True)
class RouterScoring:
    """kind: "softmax" or "sigmoid"; renormalise: the weights are renormalised over the executed set;
    scale: routed scaling factor applied to the weights; bias: [L, E] selection bias (sigmoid routers only;
    None = zero); n_group, topk_group: group-limited choice (1, 1: none)."""

    kind: str = "softmax"
    renormalise: bool = False
    scale: float = 1.0
    bias: np.ndarray | None = field(default=None, compare=False)
    n_group: int = 1
    topk_group: int = 1

    def __post_init__(self) -> None:
        if self.kind not in SCORINGS:
            raise ValueError(f"router scoring kind must be one of {SCORINGS}, got {self.kind!r}")
        if not (np.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"router scoring scale must be a positive number, got {self.scale!r}")
        check_groups(self.n_group, self.topk_group)
        if self.bias is not None:
            if self.kind != "sigmoid":
                raise ValueError("a selection bias is defined for sigmoid routers only")
            bias = np.ascontiguousarray(self.bias, dtype=np.float64)
            if bias.ndim != 2 or not np.isfinite(bias).all():
                raise ValueError(f"the selection bias must be a finite [L, E] array, got shape {bias.shape}")
            object.__setattr__(self, "bias", bias)

    @property
    def groups(self) -> tuple[int, int]:
        """(n_group, topk_group): what `LogicalCache`, `replay` and `CalibrationBuilder` take as `groups`."""
        return (self.n_group, self.topk_group)

    @property
    def code(self) -> int:
        return SOFTMAX if self.kind == "softmax" else SIGMOID

    def selection_scores(self, router_logits: np.ndarray, layer: int | None = None) -> np.ndarray:
        """What routing ranks, float64: the logits of a softmax router, sigmoid(z) + bias of a sigmoid router,
        computed by the routing core's own kernel (the engines' `route` step), so that the harness, the replays
        and the engines rank the same numbers. router_logits: [..., L, E] (layer None) or [..., E] of `layer`."""
        z = np.asarray(router_logits)
        if self.kind == "softmax":
            return z.astype(np.float64)
        from .kernels import selection_score_rows

        num_experts = z.shape[-1]
        if layer is None:
            num_layers = z.shape[-2]
            layers = np.broadcast_to(np.arange(num_layers), z.shape[:-1]).reshape(-1)
            bias = self.bias_rows(num_layers, num_experts)
        else:
            bias = self.bias if self.bias is not None else np.zeros((layer + 1, num_experts))
            if not 0 <= layer < bias.shape[0] or bias.shape[1] != num_experts:
                raise ValueError(f"layer {layer} has no row of E={num_experts} in the selection bias {bias.shape}")
            layers = np.full(int(np.prod(z.shape[:-1])), layer, dtype=np.int64)
        rows = np.ascontiguousarray(z.reshape(-1, num_experts))
        out = np.empty(rows.shape)
        selection_score_rows(rows, self.code, np.ascontiguousarray(bias), np.ascontiguousarray(layers), out)
        return out.reshape(z.shape)

    def to_metadata(self) -> tuple[str, np.ndarray | None]:
        """(JSON of kind, renormalise, scale and groups; the [L, E] bias or None): how records store the rule."""
        return json.dumps({"kind": self.kind, "renormalise": bool(self.renormalise), "scale": float(self.scale),
                           "groups": [self.n_group, self.topk_group]}, sort_keys=True), self.bias

    @classmethod
    def from_metadata(cls, text: str | None, bias: np.ndarray | None = None,
                      groups: tuple[int, int] = (1, 1)) -> "RouterScoring":
        """The rule `to_metadata` wrote; without one (files written before records carried it) a softmax
        router with `groups`. Raises ValueError for a malformed rule."""
        if text is None:
            return cls("softmax", n_group=int(groups[0]), topk_group=int(groups[1]))
        try:
            rule = json.loads(text)
            n_group, topk_group = rule.get("groups", [1, 1])
            return cls(str(rule["kind"]), renormalise=bool(rule.get("renormalise", False)),
                       scale=float(rule.get("scale", 1.0)), bias=bias, n_group=n_group, topk_group=topk_group)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"invalid router scoring {text!r}: {exc}") from None

    def tiled(self, num_layers: int) -> "RouterScoring":
        """This rule for a deeper model whose layers follow this one's repeated (`specmoe.geometry.tiled_layers`):
        the per-layer selection bias tiled; everything else is per model."""
        if self.bias is None:
            return self
        return replace(self, bias=self.bias[tiled_layers(num_layers, self.bias.shape[0])])

    def bias_rows(self, num_layers: int, num_experts: int) -> np.ndarray:
        """The [L, E] float64 bias the kernels read (zeros without one)."""
        if self.bias is None:
            return np.zeros((num_layers, num_experts))
        if self.bias.shape != (num_layers, num_experts):
            raise ValueError(f"the selection bias has shape {self.bias.shape}, the model has "
                             f"[{num_layers}, {num_experts}]")
        return self.bias


def check_groups(n_group, topk_group, num_experts: int | None = None, top_k: int | None = None) -> tuple[int, int]:
    """Check a group-limited choice rule (n_group groups, topk_group kept) and return it as ints; with
    `num_experts` and `top_k`, also that the groups split the experts evenly into groups of at least two (a
    group scores its two best experts) and that the kept groups hold at least K experts."""
    if isinstance(n_group, bool) or isinstance(topk_group, bool) or int(n_group) != n_group \
            or int(topk_group) != topk_group or not 1 <= topk_group <= n_group:
        raise ValueError(f"expert groups must satisfy 1 <= topk_group <= n_group, got n_group={n_group!r}, "
                         f"topk_group={topk_group!r}")
    n_group, topk_group = int(n_group), int(topk_group)
    if num_experts is not None and n_group > 1:
        if num_experts % n_group or num_experts // n_group < 2:
            raise ValueError(f"{num_experts} experts do not split into {n_group} groups of two or more")
        if top_k is not None and top_k > topk_group * (num_experts // n_group):
            raise ValueError(f"top-K={top_k} exceeds the {topk_group * (num_experts // n_group)} experts of the "
                             f"{topk_group} kept groups")
    return n_group, topk_group
