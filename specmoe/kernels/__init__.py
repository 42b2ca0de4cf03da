"""Kernels of the decode engines: slot-indexed MoE (Triton + torch; vLLM's fused_experts where installed), fused
RMSNorm and attention prologue, decode attention over a static KV cache (torch SDPA; flash-attn where installed;
split-KV Triton kernel reading only the written positions, for one query or a causal block of D)."""

from .attention import decode_attention, decode_attention_flash, load_flash_attn
from .moe import (MOE_DEFAULTS, load_fused_experts, slot_moe, slot_moe_torch, slot_moe_vllm, split_route,
                  triton_available, tune_moe)
from .norm_rope import qkv_prologue_torch, rmsnorm_torch
from .split_kv import (SplitKVWorkspace, make_split_kv_workspace, split_kv_attention, split_kv_attention_reference,
                       split_kv_bytes)

__all__ = ["MOE_DEFAULTS", "SplitKVWorkspace", "decode_attention", "decode_attention_flash", "load_flash_attn",
           "load_fused_experts", "make_split_kv_workspace", "qkv_prologue_torch", "rmsnorm_torch", "slot_moe",
           "slot_moe_torch", "slot_moe_vllm", "split_kv_attention", "split_kv_attention_reference", "split_kv_bytes",
           "split_route", "triton_available", "tune_moe"]
