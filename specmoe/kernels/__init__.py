"""Kernels of the decode engines: slot-indexed MoE (Triton + torch; vLLM's fused_experts where installed), fused
RMSNorm and attention prologue, decode attention over a static KV cache (torch SDPA; flash-attn where installed)."""

from .attention import decode_attention, decode_attention_flash, load_flash_attn
from .moe import (MOE_DEFAULTS, load_fused_experts, slot_moe, slot_moe_torch, slot_moe_vllm, split_route,
                  triton_available, tune_moe)
from .norm_rope import qkv_prologue_torch, rmsnorm_torch

__all__ = ["MOE_DEFAULTS", "decode_attention", "decode_attention_flash", "load_flash_attn", "load_fused_experts",
           "qkv_prologue_torch", "rmsnorm_torch", "slot_moe", "slot_moe_torch", "slot_moe_vllm", "split_route",
           "triton_available", "tune_moe"]
