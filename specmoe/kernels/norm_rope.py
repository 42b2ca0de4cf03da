"""RMSNorm and the attention prologue of the D positions of one decode step (QK-norm, rotary embedding,
KV-cache write): D = 1 for autoregressive decoding, k + 1 for a verification block.

Each comes as a single Triton launch for the device and as plain torch for the CPU (and as the reference in
tests). Fusing them matters at batch 1: transformers' eager versions are 6 kernels per RMSNorm and about 20
for the prologue, each only a few microseconds of work, which inside a CUDA graph still costs launch gaps.
Rounding follows transformers' OLMoE: normalise in float32, round to the model dtype, multiply by the weight.
The first position comes from a device tensor, so the same captured graph serves every step.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


def default_rope_theta(config, who: str, error: type[Exception] = ValueError) -> float:
    """The rope theta of a transformers config with default rotary embeddings; `error` naming `who` for any
    other rope type (the decode paths implement the default one only)."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    kind = rope.get("rope_type", "default")
    if kind != "default":
        raise error(f"{who} supports default rotary embeddings only, got {kind!r}")
    return float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def rope_tables(head_dim: int, theta: float, max_seq_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [S, HD/2] float32 of the default rotary embedding (float32 positions, as transformers)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.arange(max_seq_len).float()[:, None] * inv_freq[None, :]
    return freqs.cos().to(device).contiguous(), freqs.sin().to(device).contiguous()


def rmsnorm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' OlmoeRMSNorm over the last dimension of x [..., N]."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def qkv_prologue_torch(qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor, pos: torch.Tensor, q_out: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, eps: float, clip: float | None) -> None:
    """For each of D positions pos, pos + 1, ..., pos + D - 1 (pos: [1] device tensor): split its row of
    qkv [D, (NH + 2 NKV) HD], QK-norm (over all heads, as OLMoE does), clip, rotary embedding (cos/sin
    tables [S, HD/2], float32), write q_out [D, NH, HD] and the caches [NKV, S, HD] at the position."""
    num_pos, num_heads, head_dim = q_out.shape
    num_kv = k_cache.shape[0]
    q, k, v = qkv.split([num_heads * head_dim, num_kv * head_dim, num_kv * head_dim], dim=-1)
    q, k = rmsnorm_torch(q, q_norm, eps), rmsnorm_torch(k, k_norm, eps)
    if clip is not None:
        q, k, v = q.clamp(-clip, clip), k.clamp(-clip, clip), v.clamp(-clip, clip)
    positions = pos + torch.arange(num_pos, device=pos.device)
    c = cos.index_select(0, positions).repeat(1, 2).to(q.dtype)[:, None]  # [D, 1, HD], as transformers' cat((f, f))
    s = sin.index_select(0, positions).repeat(1, 2).to(q.dtype)[:, None]
    q = q.view(num_pos, num_heads, head_dim)
    k = k.view(num_pos, num_kv, head_dim)
    q_out.copy_(q * c + rotate_half(q) * s)
    k_cache.index_copy_(1, positions, (k * c + rotate_half(k) * s).transpose(0, 1))
    v_cache.index_copy_(1, positions, v.view(num_pos, num_kv, head_dim).transpose(0, 1))


if triton is not None:

    @triton.jit
    def _rmsnorm_kernel(x_ptr, w_ptr, out_ptr, N, eps, BLOCK: tl.constexpr):
        """One program per row of x [D, N]."""
        dt = out_ptr.dtype.element_ty
        row = tl.program_id(0).to(tl.int64)
        x_ptr += row * N
        out_ptr += row * N
        offs = tl.arange(0, BLOCK)
        m = offs < N
        x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
        r = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
        y = (x * r).to(dt).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs, (w * y).to(dt), mask=m)

    @triton.jit
    def _rope_half(x1, x2, c, s):
        return x1 * c - x2 * s, x2 * c + x1 * s

    @triton.jit
    def _qkv_prologue_kernel(qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, pos_ptr, q_ptr, kc_ptr, vc_ptr,
                             S, eps, clip, NH: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr,
                             BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr, HAS_CLIP: tl.constexpr):
        """One program per head and position: programs [0, NH) write q, [NH, NH + NKV) k, the rest v, for the
        position pos + program_id(1) (row program_id(1) of qkv and q)."""
        p = tl.program_id(0)
        row = tl.program_id(1).to(tl.int64)
        qkv_ptr += row * (NH + 2 * NKV) * HD
        q_ptr += row * NH * HD
        dt = q_ptr.dtype.element_ty
        half = HD // 2
        d = tl.arange(0, HD // 2)
        pos = tl.load(pos_ptr).to(tl.int64) + row
        c = tl.load(cos_ptr + pos * half + d).to(dt).to(tl.float32)
        s = tl.load(sin_ptr + pos * half + d).to(dt).to(tl.float32)
        if p < NH:
            offs = tl.arange(0, BLOCK_Q)
            allq = tl.load(qkv_ptr + offs, mask=offs < NH * HD, other=0.0).to(tl.float32)
            r = tl.rsqrt(tl.sum(allq * allq, axis=0) / (NH * HD) + eps)
            x1 = tl.load(qkv_ptr + p * HD + d).to(tl.float32)
            x2 = tl.load(qkv_ptr + p * HD + half + d).to(tl.float32)
            w1 = tl.load(qw_ptr + p * HD + d).to(tl.float32)
            w2 = tl.load(qw_ptr + p * HD + half + d).to(tl.float32)
            y1 = ((x1 * r).to(dt).to(tl.float32) * w1).to(dt).to(tl.float32)
            y2 = ((x2 * r).to(dt).to(tl.float32) * w2).to(dt).to(tl.float32)
            if HAS_CLIP:
                y1 = tl.minimum(tl.maximum(y1, -clip), clip)
                y2 = tl.minimum(tl.maximum(y2, -clip), clip)
            o1, o2 = _rope_half(y1, y2, c, s)
            tl.store(q_ptr + p * HD + d, o1.to(dt))
            tl.store(q_ptr + p * HD + half + d, o2.to(dt))
        elif p < NH + NKV:
            h = p - NH
            kbase = qkv_ptr + NH * HD
            offs = tl.arange(0, BLOCK_KV)
            allk = tl.load(kbase + offs, mask=offs < NKV * HD, other=0.0).to(tl.float32)
            r = tl.rsqrt(tl.sum(allk * allk, axis=0) / (NKV * HD) + eps)
            x1 = tl.load(kbase + h * HD + d).to(tl.float32)
            x2 = tl.load(kbase + h * HD + half + d).to(tl.float32)
            w1 = tl.load(kw_ptr + h * HD + d).to(tl.float32)
            w2 = tl.load(kw_ptr + h * HD + half + d).to(tl.float32)
            y1 = ((x1 * r).to(dt).to(tl.float32) * w1).to(dt).to(tl.float32)
            y2 = ((x2 * r).to(dt).to(tl.float32) * w2).to(dt).to(tl.float32)
            if HAS_CLIP:
                y1 = tl.minimum(tl.maximum(y1, -clip), clip)
                y2 = tl.minimum(tl.maximum(y2, -clip), clip)
            o1, o2 = _rope_half(y1, y2, c, s)
            dst = kc_ptr + h * S * HD + pos * HD
            tl.store(dst + d, o1.to(dt))
            tl.store(dst + half + d, o2.to(dt))
        else:
            h = p - NH - NKV
            e = tl.arange(0, HD)
            v = tl.load(qkv_ptr + (NH + NKV) * HD + h * HD + e).to(tl.float32)
            if HAS_CLIP:
                v = tl.minimum(tl.maximum(v, -clip), clip)
            tl.store(vc_ptr + h * S * HD + pos * HD + e, v.to(dt))


def rmsnorm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> torch.Tensor:
    """`rmsnorm_torch` over the rows of a contiguous x [..., N], written into out."""
    n = x.shape[-1]
    _rmsnorm_kernel[(x.numel() // n,)](x, weight, out, n, eps, BLOCK=triton.next_power_of_2(n), num_warps=8)
    return out


def qkv_prologue_triton(qkv, q_norm, k_norm, cos, sin, pos, q_out, k_cache, v_cache, eps, clip) -> None:
    """`qkv_prologue_torch` in one launch (contiguous qkv [D, W] and q_out [D, NH, HD])."""
    num_pos, num_heads, head_dim = q_out.shape
    num_kv, max_seq, _ = k_cache.shape
    if head_dim & (head_dim - 1):
        raise ValueError(f"the Triton attention prologue needs a power-of-two head dim, got {head_dim}")
    grid = (num_heads + 2 * num_kv, num_pos)
    _qkv_prologue_kernel[grid](qkv, q_norm, k_norm, cos, sin, pos, q_out, k_cache, v_cache, max_seq, eps,
                               0.0 if clip is None else float(clip), NH=num_heads, NKV=num_kv, HD=head_dim,
                               BLOCK_Q=triton.next_power_of_2(num_heads * head_dim),
                               BLOCK_KV=triton.next_power_of_2(num_kv * head_dim), HAS_CLIP=clip is not None,
                               num_warps=4)
