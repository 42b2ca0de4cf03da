"""Model adapters: one per MoE architecture (OLMoE, DeepSeek-V3, Qwen3.5-MoE), named configs with seeded weights,
`load_model`."""

from .adapter import ModelSourceError, MoEAdapter, extract_context_feature
from .checkpoint import CheckpointReader
from .deepseek_v3 import DEEPSEEK_V3_CONFIGS, DeepseekV3Adapter, RoutedDeepseekV3TopkRouter
from .fp8_checkpoint import quantize_experts_fp8
from .olmoe import OLMOE_CONFIGS, OlmoeAdapter, RoutedOlmoeTopKRouter, init_random_weights
from .qwen3_5_moe import QWEN3_5_MOE_CONFIGS, Qwen35MoeAdapter, RoutedQwen35MoeTopKRouter
from .registry import (ARCHITECTURES, NAMED_CONFIGS, adapter_for, decoder_for, default_model, load_model,
                       named_config, resolve_source)

__all__ = [
    "ARCHITECTURES", "CheckpointReader", "DEEPSEEK_V3_CONFIGS", "DeepseekV3Adapter", "ModelSourceError",
    "MoEAdapter", "NAMED_CONFIGS", "OLMOE_CONFIGS", "OlmoeAdapter", "QWEN3_5_MOE_CONFIGS", "Qwen35MoeAdapter",
    "RoutedDeepseekV3TopkRouter", "RoutedOlmoeTopKRouter", "RoutedQwen35MoeTopKRouter", "adapter_for",
    "decoder_for", "default_model", "extract_context_feature", "init_random_weights", "load_model",
    "named_config", "quantize_experts_fp8", "resolve_source",
]
