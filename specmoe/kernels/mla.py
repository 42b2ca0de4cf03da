"""Multi-head latent attention (MLA, DeepSeek-V2/V3) at decode over a compressed latent cache: torch versions,
the CPU path and the reference for device kernels.

A layer's cache holds, per position, one latent "head" of R + P values: the normed compressed KV c (R =
kv_lora_rank) followed by the rotated shared key part k_pe (P = qk_rope_head_dim); it is [S, R + P] for the
whole static sequence, so shapes never change. With the key projection absorbed into the query (q_lat =
W_uk^T q_nope per head, R values) every head's query is [q_lat | q_pe] (R + P) and attends that one latent
head; the values are the first R columns of the same rows (c), and the output, R values per head, leaves
latent space through the value projection W_uv afterwards. This is what FlashMLA reads (one 576-wide head of
which the first 512 are also the value, for kv_lora_rank 512 and qk_rope_head_dim 64); the device kernel,
`specmoe.kernels.split_kv.split_kv_latent_attention`, takes the same q and cache and reads only the written
positions (the number written, a device tensor, instead of the mask).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """The rotary embedding of transformers' DeepSeek-V3 on x [..., P] with cos, sin [..., P/2] (broadcast, in
    x's dtype): the pairs are (x[2i], x[2i + 1]) when `interleaved` (rope_interleave), else (x[i], x[i + P/2]);
    the output is [x1 cos - x2 sin | x2 cos + x1 sin] (the halves, not interleaved again, for both layouts:
    queries and keys get the same order, so their dot products are the model's)."""
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def mla_decode_attention(q: torch.Tensor, latent_cache: torch.Tensor, mask: torch.Tensor, scale: float,
                         kv_lora_rank: int) -> torch.Tensor:
    """q [D, NH, R + P] (absorbed queries), latent_cache [S, R + P], mask [D, S] (additive, q's dtype) ->
    latent attention output [D, NH, R] (softmax(q k^T scale + mask) c per head, through torch SDPA with
    one shared key-value head)."""
    num_pos, num_heads, _ = q.shape
    key = latent_cache.unsqueeze(0).unsqueeze(0)  # [1, 1, S, R + P]
    value = latent_cache[:, :kv_lora_rank].unsqueeze(0).unsqueeze(0)  # [1, 1, S, R], a view
    out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), key, value,
                                         attn_mask=mask.view(1, 1, num_pos, -1), scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)
