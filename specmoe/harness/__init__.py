"""HF evaluation harness: transformers models routed by a policy, perplexity / selfgen KL, copy accounting."""

from .calibrate import collect_calibration, router_logits_of
from .diagnostics import Selfgen, copy_stats, excess_nll, perplexity, sample_selfgen, token_nll
from .patch import (
    RoutingContext, exact_policy, exact_routing, original_routing, patch_model, unpatch,
)

__all__ = [
    "RoutingContext", "Selfgen", "collect_calibration", "copy_stats", "exact_policy", "exact_routing",
    "excess_nll", "original_routing", "patch_model", "perplexity", "router_logits_of",
    "sample_selfgen", "token_nll", "unpatch",
]
