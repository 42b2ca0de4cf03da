"""How a model turns router logits into what routing ranks and what the experts are weighted by.

A router produces logits z [E] per token and layer. Two things follow from them, and they differ by
architecture:
- the selection scores, which a policy ranks and adds its bonus to: z itself for softmax routers (OLMoE,
  Qwen-MoE); sigmoid(z) + bias_l for DeepSeek-V3-style routers (the bias only steers selection);
- the execution weights of the executed set S: the unmodified router probabilities at S (softmax(z) over all
  E, or sigmoid(z)), renormalised over S where the model's own router renormalises, times the model's routed
  scaling factor (1 except DeepSeek-V3).

`RouterScoring` names one model's rule; an adapter makes it (`MoEAdapter.router_scoring`) and the engines
hand it to `LogicalCache.route`, so the numba routing step applies it without knowing the architecture.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

SCORINGS = ("softmax", "sigmoid")
SOFTMAX, SIGMOID = 0, 1  # the numba kernels' codes


@dataclass(frozen=True)
class RouterScoring:
    """kind: "softmax" or "sigmoid"; renormalise: the weights are renormalised over the executed set;
    scale: routed scaling factor applied to the weights; bias: [L, E] selection bias (sigmoid routers only;
    None = zero)."""

    kind: str = "softmax"
    renormalise: bool = False
    scale: float = 1.0
    bias: np.ndarray | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in SCORINGS:
            raise ValueError(f"router scoring kind must be one of {SCORINGS}, got {self.kind!r}")
        if not (np.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"router scoring scale must be a positive number, got {self.scale!r}")
        if self.bias is not None:
            if self.kind != "sigmoid":
                raise ValueError("a selection bias is defined for sigmoid routers only")
            bias = np.ascontiguousarray(self.bias, dtype=np.float64)
            if bias.ndim != 2 or not np.isfinite(bias).all():
                raise ValueError(f"the selection bias must be a finite [L, E] array, got shape {bias.shape}")
            object.__setattr__(self, "bias", bias)

    @property
    def code(self) -> int:
        return SOFTMAX if self.kind == "softmax" else SIGMOID

    def bias_rows(self, num_layers: int, num_experts: int) -> np.ndarray:
        """The [L, E] float64 bias the kernels read (zeros without one)."""
        if self.bias is None:
            return np.zeros((num_layers, num_experts))
        if self.bias.shape != (num_layers, num_experts):
            raise ValueError(f"the selection bias has shape {self.bias.shape}, the model has "
                             f"[{num_layers}, {num_experts}]")
        return self.bias
