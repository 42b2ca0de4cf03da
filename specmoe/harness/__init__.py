"""HF evaluation harness: transformers models routed by a policy, perplexity / selfgen KL, copy accounting."""

from .calibrate import collect_calibration, router_logits_of
from .diagnostics import Selfgen, copy_stats, excess_nll, perplexity, sample_selfgen, token_nll
from .patch import (
    RoutingContext, attach_context, check_calibration, exact_policy, exact_routing, neutral_calibration,
    original_routing, patch_model, routed_by, unpatch,
)

__all__ = [
    "RoutingContext", "Selfgen", "attach_context", "check_calibration", "collect_calibration", "copy_stats",
    "exact_policy", "exact_routing", "excess_nll", "neutral_calibration", "original_routing", "patch_model",
    "perplexity", "routed_by", "router_logits_of", "sample_selfgen", "token_nll", "unpatch",
]
