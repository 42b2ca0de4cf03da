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

The prologue of a layer's attention (`mla_prologue`): from the latent projection's output [c | k_pe] and the
query's rope part q_pe, the cache rows of the step's positions (c normed, k_pe rotated) and the queries [q_lat |
q_pe rotated]. `mla_prologue_torch` is transformers' arithmetic (its rounding points: the norm's float32 sum and
cast, cos / sin cast to the model dtype, every product and sum of the rotation rounded to it);
`mla_prologue_triton` is the same in one launch (about thirty small torch launches per layer otherwise).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import pdl
from .norm_rope import rmsnorm_torch

try:  # Triton is optional: CPU machines run the torch version
    import triton
    import triton.language as tl

    from .pdl import enter
except ImportError:  # pragma: no cover - depends on the environment
    triton = None


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


def mla_prologue_torch(kv: torch.Tensor, q_pe: torch.Tensor, q_lat: torch.Tensor, kv_norm: torch.Tensor, eps: float,
                       cos: torch.Tensor, sin: torch.Tensor, first: torch.Tensor, cache: torch.Tensor,
                       query: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """The attention prologue of the step's D positions at first [1] + 0 .. D - 1 (module docstring): kv [D, R + P]
    (the latent projection's output, c then k_pe), q_pe [D, NH, P] (the query's rope part, any strides), q_lat
    [NH, D, R] (the absorbed query, `torch.bmm`'s output), kv_norm [R] (kv_a_layernorm's weight), cos / sin
    float32 tables [S, P / 2]; writes cache [S, R + P] rows first .. first + D - 1 = [RMSNorm(c) | rotate(k_pe)]
    and query [D, NH, R + P] = [q_lat | rotate(q_pe)]; returns query."""
    d, r = kv.shape[0], q_lat.shape[-1]
    positions = first + torch.arange(d, device=kv.device)
    c, s = cos.index_select(0, positions).to(kv.dtype), sin.index_select(0, positions).to(kv.dtype)
    latent, k_pe = kv.split([r, kv.shape[1] - r], dim=-1)
    cache.index_copy_(0, positions, torch.cat([rmsnorm_torch(latent, kv_norm, eps),
                                               rotate_pairs(k_pe, c, s, interleaved)], dim=-1))
    query[..., :r] = q_lat.transpose(0, 1)
    query[..., r:] = rotate_pairs(q_pe, c[:, None], s[:, None], interleaved)
    return query


if triton is not None:

    @triton.jit
    def _mla_prologue_kernel(kv_ptr, KV_ROW, qpe_ptr, QPE_ROW, QPE_HEAD, qlat_ptr, QLAT_HEAD, QLAT_ROW, w_ptr,
                             cos_ptr, sin_ptr, first_ptr, cache_ptr, query_ptr, eps, NH,
                             R: tl.constexpr, P: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
                             INTERLEAVED: tl.constexpr, PDL: tl.constexpr = False):
        """Program (i, h): position i's query row of head h (h < NH: q_lat copied, q_pe rotated), or its cache
        row (h = NH: c normed, k_pe rotated), with `mla_prologue_torch`'s rounding points."""
        enter(PDL)
        dt = query_ptr.dtype.element_ty
        i = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        pos = tl.load(first_ptr).to(tl.int64) + i
        half = tl.arange(0, BLOCK_P)
        hm = half < P // 2
        cs = tl.load(cos_ptr + pos * (P // 2) + half, mask=hm, other=0.0).to(dt).to(tl.float32)
        sn = tl.load(sin_ptr + pos * (P // 2) + half, mask=hm, other=0.0).to(dt).to(tl.float32)
        cols = tl.arange(0, BLOCK_R)
        cm = cols < R
        if h < NH:
            src = qpe_ptr + i * QPE_ROW + h * QPE_HEAD
            dst = query_ptr + (i * NH + h) * (R + P)
            y = tl.load(qlat_ptr + h * QLAT_HEAD + i * QLAT_ROW + cols, mask=cm, other=0.0)
        else:
            src = kv_ptr + i * KV_ROW + R
            dst = cache_ptr + pos * (R + P)
            x = tl.load(kv_ptr + i * KV_ROW + cols, mask=cm, other=0.0).to(tl.float32)
            r = tl.rsqrt(tl.sum(x * x, axis=0) / R + eps)
            w = tl.load(w_ptr + cols, mask=cm, other=0.0).to(tl.float32)
            y = (w * (x * r).to(dt).to(tl.float32)).to(dt)
        tl.store(dst + cols, y.to(dt), mask=cm)
        if INTERLEAVED:
            x1 = tl.load(src + 2 * half, mask=hm, other=0.0).to(tl.float32)
            x2 = tl.load(src + 2 * half + 1, mask=hm, other=0.0).to(tl.float32)
        else:
            x1 = tl.load(src + half, mask=hm, other=0.0).to(tl.float32)
            x2 = tl.load(src + P // 2 + half, mask=hm, other=0.0).to(tl.float32)
        a = (x1 * cs).to(dt).to(tl.float32) - (x2 * sn).to(dt).to(tl.float32)
        b = (x2 * cs).to(dt).to(tl.float32) + (x1 * sn).to(dt).to(tl.float32)
        tl.store(dst + R + half, a.to(dt), mask=hm)
        tl.store(dst + R + P // 2 + half, b.to(dt), mask=hm)


def mla_prologue_triton(kv: torch.Tensor, q_pe: torch.Tensor, q_lat: torch.Tensor, kv_norm: torch.Tensor, eps: float,
                        cos: torch.Tensor, sin: torch.Tensor, first: torch.Tensor, cache: torch.Tensor,
                        query: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """`mla_prologue_torch` in one launch of D (NH + 1) programs: kv's, q_pe's and q_lat's rows unit-stride,
    cache, query, cos and sin contiguous."""
    d, r = kv.shape[0], q_lat.shape[-1]
    nh, p = q_pe.shape[1], kv.shape[1] - r
    if kv.stride(1) != 1 or q_pe.stride(2) != 1 or q_lat.stride(2) != 1 or not (
            cache.is_contiguous() and query.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError("mla_prologue_triton needs unit-stride rows of kv, q_pe and q_lat and contiguous cache, "
                         "query, cos and sin")
    _mla_prologue_kernel[(d, nh + 1)](kv, kv.stride(0), q_pe, q_pe.stride(0), q_pe.stride(1), q_lat, q_lat.stride(0),
                                      q_lat.stride(1), kv_norm, cos, sin, first, cache, query, eps, nh, R=r, P=p,
                                      BLOCK_R=triton.next_power_of_2(r), BLOCK_P=triton.next_power_of_2(p // 2),
                                      INTERLEAVED=interleaved, num_warps=4, enable_fp_fusion=False, **pdl.options(kv))
    return query
