"""Attention of the D query positions of one decode step over a layer's static KV cache: torch SDPA (the
default and the reference) or flash-attn's `flash_attn_with_kvcache` (optional).

A layer's cache is [NKV, S, HD] for the whole maximum sequence, so shapes never change and the call captures
into a CUDA graph. Query i of a step at first position pos attends positions 0 .. pos + i (causal within the
step: D = 1 for autoregressive decoding, k + 1 for a verification block). SDPA takes that as an additive mask
[D, S] and reads the whole cache; flash-attn takes the number of written positions (pos + D) from a device
tensor and reads only those. The flash-attn call and what remains unverified about it: docs/kernels.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

_CUDA_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """q [D, NH, HD], caches [NKV, S, HD], mask [D, S] (additive, q's dtype) -> attention output
    [D, NH * HD]."""
    num_pos, num_heads, head_dim = q.shape
    num_kv, max_seq, _ = k_cache.shape
    args = (q.transpose(0, 1).unsqueeze(0), k_cache.unsqueeze(0), v_cache.unsqueeze(0))
    kwargs = dict(attn_mask=mask.view(1, 1, num_pos, max_seq), scale=scale, enable_gqa=num_heads != num_kv)
    if q.is_cuda:  # the memory-efficient kernel takes the additive mask in one launch and captures cleanly
        with sdpa_kernel(_CUDA_BACKENDS):
            out = F.scaled_dot_product_attention(*args, **kwargs)
    else:
        out = F.scaled_dot_product_attention(*args, **kwargs)
    return out[0].transpose(0, 1).reshape(num_pos, num_heads * head_dim)


def causal_step_mask(positions: torch.Tensor, first: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The additive mask [D, S] of a step whose first position is first [1]: row i is 0 at positions
    0 .. first + i and the dtype's minimum elsewhere. positions: arange(S) on the device (int64)."""
    num_pos = out.shape[0]
    last = first + torch.arange(num_pos, device=first.device)
    visible = positions[None, :] <= last[:, None]
    return out.copy_(torch.where(visible, 0.0, torch.finfo(out.dtype).min))


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
    """`decode_attention` through flash_attn_with_kvcache: q [D, NH, HD], caches [NKV, S, HD] (passed as
    permuted views [1, S, NKV, HD], no copy), cache_seqlens int32 [1] = positions written including the D
    new ones -> attention output [D, NH * HD]. Several queries are causal (flash-attn aligns them to the last
    written positions)."""
    num_pos, num_heads, head_dim = q.shape
    out = flash_attn_with_kvcache(q.unsqueeze(0), k_cache.transpose(0, 1).unsqueeze(0),
                                  v_cache.transpose(0, 1).unsqueeze(0), cache_seqlens=cache_seqlens,
                                  softmax_scale=scale, causal=num_pos > 1)
    return out.reshape(num_pos, num_heads * head_dim)
