"""Decode attention of one query over a static KV cache: torch SDPA (default) or flash-attn (optional).

The cache of a layer is [NKV, S, HD] for the whole maximum sequence, so shapes never change and the call
captures into a CUDA graph (gpt-fast's approach). The two paths differ in how they skip positions not yet
written:

- SDPA: an additive mask [S] (0 where attended, the dtype's minimum elsewhere) that the decode step opens one
  position at a time; every step reads the whole cache.
- flash-attn's `flash_attn_with_kvcache`: the number of valid positions, `cache_seqlens` (int32 [1]), read
  from a device tensor that the step computes from its position, so it too captures in a graph; a step
  reads only the written positions. Used when `EngineConfig(attention="flash_attn")` and the flash-attn
  package is installed (`pip install 'specmoe[flash-attn]'`).

Written against flash-attn 2.8.4 (github.com/Dao-AILab/flash-attention, commit 0251105a, 2026-08-15):
`flash_attn/flash_attn_interface.py` (flash_attn_with_kvcache, line 1485) and `csrc/flash_attn/flash_api.cpp`
(mha_fwd_kvcache, line 1244). It wants caches as [B, S, NKV, HD] and checks only that their last dimension is
contiguous (flash_attn_interface.py:1593-1594, flash_api.cpp:1282-1283); the kernel addresses rows and heads
through their strides (set_params_fprop, flash_api.cpp:83-88: row stride = stride(-3), head stride =
stride(-2)). So the head-major cache goes in as a permuted view [1, S, NKV, HD], with no copy and no layout
change; each head's keys stay contiguous, which is how the kernel walks them. Its other requirements: fp16 or
bf16 for q and both caches (flash_api.cpp:1274-1277), head dim at most 256 (one not divisible by 8 makes it
pad, i.e. copy, both caches on every call), int32 contiguous cache_seqlens of shape [B] (flash_api.cpp:1429),
an Ampere or newer GPU. Its split-KV heuristic depends on shapes only (set_params_splitkv, flash_api.cpp:317),
so the launch is the same for every step; its few allocations come from the graph's pool when captured.

Not verified, as the package is not installed on our machines: that it runs, that it captures, and that the
permuted view works in the kernel as the strides say (flash-attn's own test of this function,
tests/test_flash_attn.py:1907, uses contiguous caches only). The engine checks the real function against SDPA
at build and falls back with a note if they disagree; the tests use a stand-in implementing the documented
interface. FlashAttention 3 (`hopper/`, module `flash_attn_interface`), faster on H100/H200, has a
flash_attn_with_kvcache with the same cache arguments and stride checks but is not wired in.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

_CUDA_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """q [NH, HD], caches [NKV, S, HD], mask [S] (additive, q's dtype) -> attention output [NH * HD]."""
    num_heads, head_dim = q.shape
    num_kv, max_seq, _ = k_cache.shape
    args = (q.view(1, num_heads, 1, head_dim), k_cache.unsqueeze(0), v_cache.unsqueeze(0))
    kwargs = dict(attn_mask=mask.view(1, 1, 1, max_seq), scale=scale, enable_gqa=num_heads != num_kv)
    if q.is_cuda:  # the memory-efficient kernel takes the additive mask in one launch and captures cleanly
        with sdpa_kernel(_CUDA_BACKENDS):
            out = F.scaled_dot_product_attention(*args, **kwargs)
    else:
        out = F.scaled_dot_product_attention(*args, **kwargs)
    return out.reshape(num_heads * head_dim)


def load_flash_attn():
    """flash-attn's `flash_attn_with_kvcache`; an ImportError that names the package and the extra if missing."""
    try:
        from flash_attn import flash_attn_with_kvcache
    except ImportError as exc:
        raise ImportError(f"attention='flash_attn' needs the flash-attn package, which could not be imported "
                          f"({exc}); install it with pip install 'specmoe[flash-attn]' or use "
                          "attention='sdpa'") from exc
    return flash_attn_with_kvcache


def decode_attention_flash(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor,
                           scale: float, flash_attn_with_kvcache) -> torch.Tensor:
    """`decode_attention` through flash_attn_with_kvcache: q [NH, HD], caches [NKV, S, HD], cache_seqlens int32
    [1] = positions written (attended: 0 .. cache_seqlens - 1) -> attention output [NH * HD]."""
    num_heads, head_dim = q.shape
    out = flash_attn_with_kvcache(q.view(1, 1, num_heads, head_dim), k_cache.transpose(0, 1).unsqueeze(0),
                                  v_cache.transpose(0, 1).unsqueeze(0), cache_seqlens=cache_seqlens,
                                  softmax_scale=scale)
    return out.reshape(num_heads * head_dim)
