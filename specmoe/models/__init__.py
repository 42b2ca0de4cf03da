"""Model adapters: one per MoE architecture (OLMoE now), named configs with seeded weights, `load_model`."""

from .adapter import ModelSourceError, MoEAdapter, extract_context_feature
from .checkpoint import CheckpointReader
from .olmoe import OLMOE_CONFIGS, OlmoeAdapter, RoutedOlmoeTopKRouter, init_random_weights
from .registry import (ARCHITECTURES, NAMED_CONFIGS, adapter_for, decoder_for, default_model, load_model,
                       named_config)

__all__ = [
    "ARCHITECTURES", "CheckpointReader", "ModelSourceError", "MoEAdapter", "NAMED_CONFIGS", "OLMOE_CONFIGS",
    "OlmoeAdapter", "RoutedOlmoeTopKRouter", "adapter_for", "decoder_for", "default_model", "extract_context_feature",
    "init_random_weights", "load_model", "named_config",
]
