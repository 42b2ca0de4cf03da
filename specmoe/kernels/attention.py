"""Decode attention of one query over a static KV cache, through torch's scaled_dot_product_attention.

The cache of a layer is [NKV, S, HD] for the whole maximum sequence; positions not yet written are hidden
by an additive mask [S] (0 where attended, the dtype's minimum elsewhere) that the decode step opens one
position at a time, so shapes never change and the call captures into a CUDA graph (gpt-fast's approach).
flash-attn's `flash_attn_with_kvcache` would avoid reading the masked tail; it is not installed on the
machines we measure on, so there is no such backend yet.
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
