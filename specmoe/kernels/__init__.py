"""Kernels of the decode engines: slot-indexed MoE (Triton + torch; vLLM's fused_experts where installed) for one
token and grouped for the D positions of a step (each distinct slot's expert read once), fused
RMSNorm and attention prologue (also the static drafters', with the greedy head of `greedy`), attention over a static KV cache (a split-KV Triton kernel that reads only the
written positions, for one query or a causal block of D, also over MLA's latent cache; torch SDPA as the
reference and CPU path; flash-attn where installed), one-row linear layers on a GEMV kernel
(`gemv`), and their self-checks on the device (`checks`); the MoE kernels' and the GEMV's launch parameters are
tuned once per device and shape and cached on disk (`tuning`)."""

from . import checks, norm_rope, pdl, tuning
from .attention import causal_step_mask, decode_attention, decode_attention_flash, load_flash_attn
from .grouped_moe import (GROUPED_DEFAULTS, GroupedMoEWorkspace, grouped_launch_params, grouped_params,
                          make_grouped_workspace, slot_moe_grouped, slot_moe_grouped_torch, slot_moe_grouped_triton)
from .moe import (MOE_DEFAULTS, load_fused_experts, moe_launch_params, slot_moe, slot_moe_torch, slot_moe_vllm,
                  split_route, triton_available, tune_moe)
from .norm_rope import qkv_prologue_torch, rmsnorm_torch
from .split_kv import (SplitKVWorkspace, make_split_kv_workspace, split_kv_attention, split_kv_attention_reference,
                       split_kv_bytes, split_kv_latent_attention)
from .tuning import TUNE_MODES, LaunchChoice, check_tune

BACKENDS = ("auto", "triton", "torch")  # our Triton kernels or their torch versions ("auto": Triton on CUDA)
# "auto": split_kv on CUDA where Triton is installed, else sdpa
ATTENTIONS = ("auto", "split_kv", "sdpa", "flash_attn")
MOE_KERNELS = ("slot", "vllm")


def check_kernel_choice(backend: str, attention: str, moe: str) -> None:
    """ValueError unless each choice is one of BACKENDS, ATTENTIONS, MOE_KERNELS."""
    for value, known, what in ((backend, BACKENDS, "backend"), (attention, ATTENTIONS, "attention"),
                               (moe, MOE_KERNELS, "moe")):
        if value not in known:
            raise ValueError(f"{what} must be one of {known}, got {value!r}")

__all__ = ["ATTENTIONS", "BACKENDS", "GROUPED_DEFAULTS", "GroupedMoEWorkspace", "LaunchChoice", "MOE_DEFAULTS",
           "MOE_KERNELS", "SplitKVWorkspace", "TUNE_MODES", "causal_step_mask", "check_kernel_choice", "check_tune",
           "checks", "grouped_launch_params", "pdl", "grouped_params", "moe_launch_params", "tuning",
           "decode_attention", "decode_attention_flash", "load_flash_attn", "load_fused_experts",
           "make_grouped_workspace", "make_split_kv_workspace", "norm_rope", "qkv_prologue_torch", "rmsnorm_torch",
           "slot_moe", "slot_moe_grouped", "slot_moe_grouped_torch", "slot_moe_grouped_triton", "slot_moe_torch",
           "slot_moe_vllm", "split_kv_attention", "split_kv_attention_reference", "split_kv_bytes",
           "split_kv_latent_attention", "split_route",
           "triton_available", "tune_moe"]
