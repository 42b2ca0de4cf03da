"""RMSNorm, the attention prologue of the D positions of one decode step (QK-norm, rotary embedding, KV-cache
write) and the small gates around the projections: D = 1 for autoregressive decoding, k + 1 for a verification
block.

Each comes as a single Triton launch for the device and as plain torch for the CPU (and as the reference in
tests). Fusing them matters at batch 1: transformers' eager versions are 6 to 10 kernels per RMSNorm and about
20 for the prologue, each only a few microseconds of work, which inside a CUDA graph still costs launch gaps.
Four norm styles (`NORM_STYLES`), with their rounding points: OLMoE's and Qwen3's "olmoe" (normalise in float32,
round to the model dtype, multiply by the weight), Qwen3.5-MoE's "zero_centred" (normalise and scale by 1 + w in
float32, round once; also `zero_centred=True`), OLMo-2's "olmo2" (normalise and scale by w in float32, round once)
and OLMo-1's "layer" (LayerNorm without weight or bias: centre, normalise in float32, round once). A norm can
follow a residual add (`residual`: residual += x, then the sum is normed: a pre-norm layer) or be added to the
residual (`add_to`: residual += norm(x), OLMo-2's post-norms). The prologue's QK-norm takes the same styles
(none for OLMo-1), and its rotary embedding rounds as transformers' OLMoE / Qwen modules (tables rounded to the
model dtype, each product rounded) or, `rope_f32`, as OLMo's and OLMo-2's (float32 tables, rounded once). The prologue also takes Qwen3.5-MoE's gated attention (`head_norm`, `gated`: per-head
zero-centred norms, q rows interleaved with the output gate, rotary embedding on the first rotary dims of each
head). `gate_mul` is out = [residual +] act(g) * x, act silu or sigmoid: the SwiGLU product, the output gate of
the gated attention and the sigmoid-gated shared expert. The first position comes from a device tensor, so the
same captured graph serves every step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import pdl

try:
    import triton
    import triton.language as tl

    from .pdl import enter
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


NORM_STYLES = ("olmoe", "zero_centred", "olmo2", "layer")  # module docstring; index = the kernels' STYLE


def norm_style(zero_centred: bool, style: str) -> str:
    """The style a call names (zero_centred=True is "zero_centred"); ValueError for an unknown one."""
    style = "zero_centred" if zero_centred else style
    if style not in NORM_STYLES:
        raise ValueError(f"norm style must be one of {NORM_STYLES}, got {style!r}")
    return style


def rmsnorm_torch(x: torch.Tensor, weight: torch.Tensor | None, eps: float, zero_centred: bool = False,
                  style: str = "olmoe") -> torch.Tensor:
    """The norm of `style` over the last dimension of x [..., N]: "olmoe" transformers' OlmoeRMSNorm (also
    Qwen3's), "zero_centred" Qwen3_5MoeRMSNorm (normalised in float32, scaled by 1 + w, then rounded to x's
    dtype), "olmo2" Olmo2RMSNorm (scaled by w in float32, then rounded), "layer" OLMo's LayerNorm without
    weight or bias (weight unused)."""
    style = norm_style(zero_centred, style)
    h = x.float()
    if style == "layer":
        return F.layer_norm(h, (x.shape[-1],), None, None, eps=eps).to(x.dtype)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if style == "zero_centred":
        return (h * (1.0 + weight.float())).to(x.dtype)
    if style == "olmo2":
        return (weight * h).to(x.dtype)
    return weight * h.to(x.dtype)


def rmsnorm(fused: bool, x: torch.Tensor, weight: torch.Tensor | None, eps: float, style: str = "olmoe",
            residual: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The norm of `style` of x's rows (contiguous) into out (a new tensor if None); with a residual (x's shape,
    contiguous): residual += x first, in place and rounded as torch's add_, and the sum is normed. One launch where
    fused (`rmsnorm_triton`), else the torch ops (`rmsnorm_torch`): the decoders' and drafters' one dispatch."""
    if fused:
        return rmsnorm_triton(x, weight, eps, torch.empty_like(x) if out is None else out, style=style,
                              residual=residual)
    if residual is not None:
        x = residual.add_(x)
    y = rmsnorm_torch(x, weight, eps, style=style)
    return y if out is None else out.copy_(y)


def swiglu(fused: bool, gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gate_up [D, 2I] = [gate | up], a new [D, I] (`gate_mul_triton` where fused, else
    `gate_mul_torch`)."""
    gate, up = gate_up.chunk(2, dim=-1)
    out = gate_up.new_empty(up.shape)
    return (gate_mul_triton if fused else gate_mul_torch)(gate, up, out, "silu")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def qkv_prologue_torch(qkv: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, cos: torch.Tensor,
                       sin: torch.Tensor, pos: torch.Tensor, q_out: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, eps: float, clip: float | None, zero_centred: bool = False,
                       head_norm: bool = False, gated: bool = False, style: str = "olmoe",
                       rope_f32: bool = False) -> None:
    """For each of D positions pos, pos + 1, ..., pos + D - 1 (pos: [1] device tensor): split its row of
    qkv [D, (NH + 2 NKV) HD] (gated: [D, (2 NH + 2 NKV) HD], each head's q followed by its output gate, which is
    left for the caller), QK-norm (over all heads, as OLMoE does; head_norm: per head, weights [HD]; norm style
    `style` or zero_centred; q_norm None: none, OLMo-1), clip, rotary embedding on the first RD dims of each head
    (cos/sin tables [S, RD/2], float32; RD = HD for OLMoE; rope_f32: in float32, rounded once), write
    q_out [D, NH, HD] and the caches [NKV, S, HD] at the position. NH may be 0 (keys and values only)."""
    num_pos, num_heads, head_dim = q_out.shape
    num_kv = k_cache.shape[0]
    q, k, v = qkv.split([(1 + gated) * num_heads * head_dim, num_kv * head_dim, num_kv * head_dim], dim=-1)
    if gated:
        q = q.view(num_pos, num_heads, 2 * head_dim)[..., :head_dim]
    if head_norm:
        q, k = q.reshape(num_pos, num_heads, head_dim), k.reshape(num_pos, num_kv, head_dim)
    if q_norm is not None:
        style = norm_style(zero_centred, style)
        q, k = rmsnorm_torch(q, q_norm, eps, style=style), rmsnorm_torch(k, k_norm, eps, style=style)
    if clip is not None:
        q, k, v = q.clamp(-clip, clip), k.clamp(-clip, clip), v.clamp(-clip, clip)
    positions = pos + torch.arange(num_pos, device=pos.device)
    rd = 2 * cos.shape[1]
    c = cos.index_select(0, positions).repeat(1, 2)[:, None]  # [D, 1, RD], as transformers' cat((f, f))
    s = sin.index_select(0, positions).repeat(1, 2)[:, None]
    if rope_f32:
        rotate = lambda t: torch.cat([(t[..., :rd].float() * c + rotate_half(t[..., :rd].float()) * s).to(t.dtype),  # noqa: E731
                                      t[..., rd:]], dim=-1)
    else:
        c, s = c.to(q.dtype), s.to(q.dtype)
        rotate = lambda t: torch.cat([t[..., :rd] * c + rotate_half(t[..., :rd]) * s, t[..., rd:]], dim=-1)  # noqa: E731
    q_out.copy_(rotate(q.reshape(num_pos, num_heads, head_dim)))
    k_cache.index_copy_(1, positions, rotate(k.reshape(num_pos, num_kv, head_dim)).transpose(0, 1))
    v_cache.index_copy_(1, positions, v.reshape(num_pos, num_kv, head_dim).transpose(0, 1))


GATE_ACTS = {"silu": F.silu, "sigmoid": torch.sigmoid}


def gate_mul_torch(g: torch.Tensor, x: torch.Tensor, out: torch.Tensor, act: str,
                   residual: torch.Tensor | None = None) -> torch.Tensor:
    """out [D, N] = [residual +] act(g) * x (each rounded to the model dtype, as the torch ops): x [D, N]; g [D, N],
    [D, A, B] with A B = N (a strided view, e.g. the output gates beside q), or [D, 1] (one gate per row)."""
    y = GATE_ACTS[act](g).reshape(g.shape[0], -1) * x
    return out.copy_(y if residual is None else residual + y)


if triton is not None:

    @triton.jit
    def _scaled(x, w, r, dt: tl.constexpr, STYLE: tl.constexpr):
        """The normed x (rsqrt r; x centred for "layer") times its weight, rounded to dt as `rmsnorm_torch` for
        the style NORM_STYLES[STYLE]."""
        if STYLE == 1:
            return ((x * r) * (1.0 + w)).to(dt)
        if STYLE == 2:
            return (w * (x * r)).to(dt)
        if STYLE == 3:
            return (x * r).to(dt)
        return (w * (x * r).to(dt).to(tl.float32)).to(dt)

    @triton.jit
    def _rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, N, eps, BLOCK: tl.constexpr, STYLE: tl.constexpr,
                        HAS_RESIDUAL: tl.constexpr, ADD_TO: tl.constexpr, PDL: tl.constexpr = False):
        """One program per row of x [D, N] (HAS_RESIDUAL: residual += x first, and the sum is normed; ADD_TO:
        out += the norm, out being the residual)."""
        enter(PDL)
        dt = out_ptr.dtype.element_ty
        row = tl.program_id(0).to(tl.int64)
        x_ptr += row * N
        out_ptr += row * N
        offs = tl.arange(0, BLOCK)
        m = offs < N
        x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            res_ptr += row * N
            x = (tl.load(res_ptr + offs, mask=m, other=0.0).to(tl.float32) + x).to(dt)
            tl.store(res_ptr + offs, x, mask=m)
            x = x.to(tl.float32)
        if STYLE == 3:
            x = tl.where(m, x - tl.sum(x, axis=0) / N, 0.0)
            w = x  # no weight
        else:
            w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
        r = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
        y = _scaled(x, w, r, dt, STYLE)
        if ADD_TO:
            y = (tl.load(out_ptr + offs, mask=m, other=0.0).to(tl.float32) + y.to(tl.float32)).to(dt)
        tl.store(out_ptr + offs, y, mask=m)

    @triton.jit
    def _norm_rope_head(src, w_ptr, r, e, partner, sign, c, s, clip, dt: tl.constexpr, STYLE: tl.constexpr,
                        HAS_CLIP: tl.constexpr, HAS_NORM: tl.constexpr, ROPE_F32: tl.constexpr):
        """One head of q or k: normed (rsqrt r) and scaled (HAS_NORM), clipped, rotated (its partner in
        rotate_half at `partner` with `sign`; c = 1, s = 0 past the rotary dims), rounded as `qkv_prologue_torch`."""
        if HAS_NORM:
            y = _scaled(tl.load(src + e).to(tl.float32), tl.load(w_ptr + e).to(tl.float32), r, dt, STYLE)
            yp = _scaled(tl.load(src + partner).to(tl.float32), tl.load(w_ptr + partner).to(tl.float32), r, dt,
                         STYLE)
        else:
            y, yp = tl.load(src + e), tl.load(src + partner)
        y, yp = y.to(tl.float32), yp.to(tl.float32)
        if HAS_CLIP:
            y = tl.minimum(tl.maximum(y, -clip), clip)
            yp = tl.minimum(tl.maximum(yp, -clip), clip)
        if ROPE_F32:
            return (y * c + sign * yp * s).to(dt)
        return ((y * c).to(dt).to(tl.float32) + (sign * yp * s).to(dt).to(tl.float32)).to(dt)

    @triton.jit
    def _qkv_prologue_kernel(qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, pos_ptr, q_ptr, kc_ptr, vc_ptr,
                             S, eps, clip, NH: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr, RD: tl.constexpr,
                             QS: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr,
                             HAS_CLIP: tl.constexpr, STYLE: tl.constexpr, HEAD_NORM: tl.constexpr,
                             HAS_NORM: tl.constexpr, ROPE_F32: tl.constexpr, PDL: tl.constexpr = False):
        """One program per head and position: programs [0, NH) write q, [NH, NH + NKV) k, the rest v, for the
        position pos + program_id(1) (row program_id(1) of qkv and q). Head p's q starts at p QS in the row
        (QS = 2 HD where its output gate follows it)."""
        enter(PDL)
        p = tl.program_id(0)
        row = tl.program_id(1).to(tl.int64)
        qkv_ptr += row * (NH * QS + 2 * NKV * HD)
        q_ptr += row * NH * HD
        dt = q_ptr.dtype.element_ty
        half = RD // 2
        e = tl.arange(0, HD)
        rot = e < RD
        partner = tl.where(e < half, e + half, tl.where(rot, e - half, e))
        sign = tl.where(e < half, -1.0, 1.0)
        pos = tl.load(pos_ptr).to(tl.int64) + row
        ci = tl.where(e < half, e, e - half)
        c = tl.load(cos_ptr + pos * half + ci, mask=rot, other=1.0)
        s = tl.load(sin_ptr + pos * half + ci, mask=rot, other=0.0)
        if not ROPE_F32:
            c, s = c.to(dt).to(tl.float32), s.to(dt).to(tl.float32)
        if p < NH:
            src = qkv_ptr + p * QS
            if HEAD_NORM:
                x = tl.load(src + e).to(tl.float32)
                r = tl.rsqrt(tl.sum(x * x, axis=0) / HD + eps)
                w_ptr = qw_ptr
            else:  # over all heads (QS = HD: q is contiguous)
                offs = tl.arange(0, BLOCK_Q)
                allq = tl.load(qkv_ptr + offs, mask=offs < NH * HD, other=0.0).to(tl.float32)
                r = tl.rsqrt(tl.sum(allq * allq, axis=0) / (NH * HD) + eps)
                w_ptr = qw_ptr + p * HD
            out = _norm_rope_head(src, w_ptr, r, e, partner, sign, c, s, clip, dt, STYLE, HAS_CLIP, HAS_NORM,
                                  ROPE_F32)
            tl.store(q_ptr + p * HD + e, out)
        elif p < NH + NKV:
            h = p - NH
            kbase = qkv_ptr + NH * QS
            src = kbase + h * HD
            if HEAD_NORM:
                x = tl.load(src + e).to(tl.float32)
                r = tl.rsqrt(tl.sum(x * x, axis=0) / HD + eps)
                w_ptr = kw_ptr
            else:
                offs = tl.arange(0, BLOCK_KV)
                allk = tl.load(kbase + offs, mask=offs < NKV * HD, other=0.0).to(tl.float32)
                r = tl.rsqrt(tl.sum(allk * allk, axis=0) / (NKV * HD) + eps)
                w_ptr = kw_ptr + h * HD
            out = _norm_rope_head(src, w_ptr, r, e, partner, sign, c, s, clip, dt, STYLE, HAS_CLIP, HAS_NORM,
                                  ROPE_F32)
            tl.store(kc_ptr + h * S * HD + pos * HD + e, out)
        else:
            h = p - NH - NKV
            v = tl.load(qkv_ptr + NH * QS + NKV * HD + h * HD + e).to(tl.float32)
            if HAS_CLIP:
                v = tl.minimum(tl.maximum(v, -clip), clip)
            tl.store(vc_ptr + h * S * HD + pos * HD + e, v.to(dt))

    @triton.jit
    def _gate_mul_kernel(g_ptr, x_ptr, res_ptr, out_ptr, N, G_ROW, G_INNER, G_OUTER, G_STEP, X_ROW,
                         BLOCK: tl.constexpr, SILU: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                         PDL: tl.constexpr = False):
        """Program (i, row): columns [i BLOCK, (i + 1) BLOCK) of out[row] = [res +] act(g) * x; column n's gate at
        g + row G_ROW + (n // G_INNER) G_OUTER + (n % G_INNER) G_STEP."""
        enter(PDL)
        dt = out_ptr.dtype.element_ty
        row = tl.program_id(1).to(tl.int64)
        cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = cols < N
        g = tl.load(g_ptr + row * G_ROW + (cols // G_INNER) * G_OUTER + (cols % G_INNER) * G_STEP, mask=m,
                    other=0.0).to(tl.float32)
        if SILU:
            a = g / (1.0 + tl.exp(-g))
        else:
            a = 1.0 / (1.0 + tl.exp(-g))
        x = tl.load(x_ptr + row * X_ROW + cols, mask=m, other=0.0).to(tl.float32)
        y = (a.to(dt).to(tl.float32) * x).to(dt)
        if HAS_RESIDUAL:
            y = (tl.load(res_ptr + row * N + cols, mask=m, other=0.0).to(tl.float32) + y.to(tl.float32)).to(dt)
        tl.store(out_ptr + row * N + cols, y, mask=m)


def rmsnorm_triton(x: torch.Tensor, weight: torch.Tensor | None, eps: float, out: torch.Tensor | None,
                   zero_centred: bool = False, residual: torch.Tensor | None = None, style: str = "olmoe",
                   add_to: torch.Tensor | None = None) -> torch.Tensor:
    """`rmsnorm_torch` over the rows of a contiguous x [..., N], written into out; with a residual (contiguous,
    x's shape): residual += x (rounded to its dtype, as torch's add_), and out = the norm of the sum. With
    add_to instead of out (contiguous, x's shape): add_to += the norm (rounded as torch's add of the rounded
    norm; a post-norm's residual add), returned."""
    style = norm_style(zero_centred, style)
    if (out is None) == (add_to is None) or (add_to is not None and residual is not None):
        raise ValueError("rmsnorm_triton writes either out (after an optional residual add) or add_to")
    n = x.shape[-1]
    res = x if residual is None else residual
    out = add_to if out is None else out
    _rmsnorm_kernel[(x.numel() // n,)](x, res, x if weight is None else weight, out, n, eps,
                                       BLOCK=triton.next_power_of_2(n), STYLE=NORM_STYLES.index(style),
                                       HAS_RESIDUAL=residual is not None, ADD_TO=add_to is not None, num_warps=8, **pdl.options(x))
    return out


def qkv_prologue_triton(qkv, q_norm, k_norm, cos, sin, pos, q_out, k_cache, v_cache, eps, clip,
                        zero_centred: bool = False, head_norm: bool = False, gated: bool = False,
                        style: str = "olmoe", rope_f32: bool = False) -> None:
    """`qkv_prologue_torch` in one launch (contiguous qkv [D, W] and q_out [D, NH, HD])."""
    style = norm_style(zero_centred, style)
    if style == "layer":
        raise ValueError("the attention prologue's QK-norm cannot be a LayerNorm")
    num_pos, num_heads, head_dim = q_out.shape
    num_kv, max_seq, _ = k_cache.shape
    if head_dim & (head_dim - 1):
        raise ValueError(f"the Triton attention prologue needs a power-of-two head dim, got {head_dim}")
    if gated and not head_norm:
        raise ValueError("the Triton attention prologue norms a gated q per head only (head_norm=True)")
    grid = (num_heads + 2 * num_kv, num_pos)
    has_norm = q_norm is not None
    _qkv_prologue_kernel[grid](qkv, q_norm if has_norm else qkv, k_norm if has_norm else qkv, cos, sin, pos,
                               q_out, k_cache, v_cache, max_seq, eps, 0.0 if clip is None else float(clip),
                               NH=num_heads, NKV=num_kv, HD=head_dim, RD=2 * cos.shape[1], QS=(1 + gated) * head_dim,
                               BLOCK_Q=max(16, triton.next_power_of_2(num_heads * head_dim)),
                               BLOCK_KV=triton.next_power_of_2(num_kv * head_dim), HAS_CLIP=clip is not None,
                               STYLE=NORM_STYLES.index(style), HEAD_NORM=head_norm or not has_norm, HAS_NORM=has_norm,
                               ROPE_F32=rope_f32, num_warps=4, **pdl.options(qkv))


def gate_mul_triton(g: torch.Tensor, x: torch.Tensor, out: torch.Tensor, act: str,
                    residual: torch.Tensor | None = None) -> torch.Tensor:
    """`gate_mul_torch` in one launch (out and residual contiguous [D, N], x's rows unit-stride; out may alias x
    or the residual)."""
    d, n = out.shape
    g3 = g.unsqueeze(1) if g.dim() == 2 else g
    if g3.shape[1] * g3.shape[2] == 1:  # one gate per row
        inner, outer, step = n, 0, 0
    elif g3.shape[1] * g3.shape[2] == n:
        inner, outer, step = g3.shape[2], g3.stride(1), g3.stride(2)
    else:
        raise ValueError(f"gates of shape {tuple(g.shape)} do not fit rows of {n}")
    if x.stride(-1) != 1:
        raise ValueError("gate_mul needs unit-stride rows of x")
    block = min(1024, triton.next_power_of_2(n))
    _gate_mul_kernel[(triton.cdiv(n, block), d)](g, x, out if residual is None else residual, out, n, g3.stride(0),
                                                 inner, outer, step, x.stride(0), BLOCK=block, SILU=act == "silu",
                                                 HAS_RESIDUAL=residual is not None, num_warps=4, **pdl.options(out))
    return out
