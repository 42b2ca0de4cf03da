"""Kernels of the decode engines: slot-indexed MoE (Triton + torch; vLLM's fused_experts where installed), fused
RMSNorm and attention prologue, attention over a static KV cache (torch SDPA; flash-attn where installed), and
their self-checks on the device (`checks`)."""

from . import checks, norm_rope

BACKENDS = ("auto", "triton", "torch")  # our Triton kernels or their torch versions ("auto": Triton on CUDA)
ATTENTIONS = ("sdpa", "flash_attn")
MOE_KERNELS = ("slot", "vllm")
from .attention import causal_step_mask, decode_attention, decode_attention_flash, load_flash_attn
from .moe import (MOE_DEFAULTS, load_fused_experts, slot_moe, slot_moe_torch, slot_moe_vllm, split_route,
                  triton_available, tune_moe)
from .norm_rope import qkv_prologue_torch, rmsnorm_torch

__all__ = ["ATTENTIONS", "BACKENDS", "MOE_DEFAULTS", "MOE_KERNELS", "causal_step_mask", "checks", "decode_attention", "decode_attention_flash",
           "load_flash_attn", "load_fused_experts", "norm_rope", "qkv_prologue_torch", "rmsnorm_torch", "slot_moe",
           "slot_moe_torch", "slot_moe_vllm", "split_route", "triton_available", "tune_moe"]
