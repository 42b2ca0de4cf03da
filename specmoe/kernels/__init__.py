"""Kernels of the decode engines: slot-indexed MoE (Triton + torch), fused RMSNorm and attention prologue,
decode attention over a static KV cache (torch SDPA)."""

from .attention import decode_attention
from .moe import MOE_DEFAULTS, slot_moe, slot_moe_torch, split_route, triton_available, tune_moe
from .norm_rope import qkv_prologue_torch, rmsnorm_torch

__all__ = ["MOE_DEFAULTS", "decode_attention", "qkv_prologue_torch", "rmsnorm_torch", "slot_moe",
           "slot_moe_torch", "split_route", "triton_available", "tune_moe"]
