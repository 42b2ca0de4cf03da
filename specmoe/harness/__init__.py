"""HF evaluation harness: transformers models routed by a policy, perplexity / selfgen KL, copy accounting,
and the speculative decoding loop with block-level expert selection (its semantics: `specmoe.speculation`)."""

from .calibrate import collect_calibration, record_trace, router_logits_of
from .diagnostics import Selfgen, copy_stats, excess_nll, perplexity, sample_selfgen, token_nll
from .patch import (
    RoutingContext, attach_context, check_calibration, exact_policy, exact_routing,
    original_routing, patch_model, routed_by, unpatch,
)
from .speculative import (
    BlockRoutingContext, SpeculativeResult, divergence_from_exact, exact_continuation, greedy_decode,
    speculative_generate,
)

__all__ = [
    "BlockRoutingContext", "RoutingContext", "Selfgen", "SpeculativeResult", "attach_context",
    "check_calibration", "collect_calibration", "copy_stats", "divergence_from_exact", "exact_policy",
    "exact_continuation", "exact_routing", "excess_nll", "greedy_decode", "original_routing", "patch_model",
    "perplexity", "record_trace", "routed_by", "router_logits_of", "sample_selfgen", "speculative_generate",
    "token_nll", "unpatch",
]
