"""The gated delta rule of a Gated DeltaNet layer (Qwen3.5-MoE's linear attention) for the D positions of one
decode step, over a recurrent state [NV, dk, dv] (float32) kept in a static buffer and updated in place.

One interface, three implementations (`gdn_recurrence(..., kernel=)`):
- "torch": the reference, position by position in float32 (CPU, and CUDA without Triton);
- "triton": our recurrent kernel, one launch for the D positions, grid (NV, dv / BV): each program keeps its
  [dk, BV] block of the state in registers, updates it position by position and writes it back in place; with
  `history` it also stores the block after every position (the state a verification block's rollback resumes
  from), in the same launch. Each iteration first loads the next position's q, k, v, decay and beta, then does
  this position's math, so those loads are in flight while the math runs rather than after it (the arithmetic is
  the per-position loop's, bit for bit);
- "fla": flash-linear-attention's Triton kernels (optional dependency `fla`, version 0.6.0):
  `fused_recurrent_gated_delta_rule` from the live state for up to FLA_CHUNK_FROM - 1 positions,
  `chunk_gated_delta_rule` for longer prompt chunks; each returns a fresh final state, copied into the live one.
  With `history`, fla's recurrent kernel runs once per position (it returns only its final state).

Inputs (the decoder prepares them the same way for every implementation): q, k [D, NK, dk] float32, L2-normed,
q scaled by dk^-1/2; v [D, NV, dv] float32; decay [D, NV] (log of the per-position decay) and beta [D, NV]
float32. Value head h reads key head h // (NV / NK) (grouped value heads). Per position: S <- exp(decay) S;
S <- S + k (beta (v - k S)); output q S.

Around the recurrence, a Gated DeltaNet step has a prologue and an epilogue, each as torch (the CPU path and the
reference) and as one Triton launch:
- `gdn_prologue_*`: from the in_proj output [D, C + NV dv + 2 NV] ([qkv | z | b | a], C = 2 NK dk + NV dv) and
  the layer's convolution state [C, K - 1]: the convolution input [C, K - 1 + D] (the state, then the D inputs;
  kept for rollback), the new state (its last K - 1 columns), and the recurrence's inputs above: the short
  causal depthwise convolution (width K, float32 sums rounded to the model dtype), silu (rounded), q and k
  L2-normed in float32 (q times dk^-1/2), v; decay = A softplus(a + dt_bias) and beta = sigmoid(b) (rounded to
  the model dtype, then float32). The kernel's grid is one program per head of q, k and v (2 NK + NV), each
  taking the D positions of its channels as 2-D tiles [positions, channels] (up to PROLOGUE_BLOCK_T positions a
  tile), so that a tile's loads do not wait for one another position by position: a channel's convolution state
  is read and then rewritten in the same launch, so one program owns it (a barrier orders its reads before its
  writes);
- `gated_rmsnorm*`: the output norm, per (position, value head): w * rmsnorm(x) (rounded to the model dtype)
  times silu(z) in float32, rounded. The kernel rounds the recurrence's float32 output to the model dtype first,
  as the torch path does before calling it.
The kernels follow the torch code's rounding points; float32 sums in another order (the convolution, the norms)
and the device's exp / rsqrt make them agree to about 1e-6 relative in float32, bitwise in bfloat16 but for a
rare element one bfloat16 step away (`checks.check_gdn_prologue`, tests/test_gdn_prologue.py). Each element's
operations are those of the kernels' former loop over positions, in the same order, but for the sum of squares of
the q / k L2 norm: it is now a row reduction of a [positions, channels] tile, whose association on the GPU
follows the tile's layout, so for D > 1 q and k can differ from the former kernel's in the last bit or two of
float32 (in the interpreter, and at D = 1 on the GPU, they are the same bits).

Graph capture: every launch has static shapes and reads no host value, so a step captures into a CUDA graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import pdl

try:  # Triton is optional: CPU machines run the torch reference
    import triton
    import triton.language as tl

    from .pdl import enter
except ImportError:  # pragma: no cover - depends on the environment
    triton = None

GDN_KERNELS = ("torch", "triton", "fla")
L2NORM_EPS = 1e-6  # the reference's l2norm of q and k in the gated delta rule
SOFTPLUS_THRESHOLD = 20.0  # torch's softplus: x itself above it
FLA_CHUNK_FROM = 64  # fla's chunked kernel from this many positions (one chunk), its fused recurrent one below
PROLOGUE_BLOCK_T = 32  # the prologue kernel's positions per tile: a verification block's D <= 32 in one tile
FLA_NOTE = ("flash-linear-attention (`fla`, the optional extra specmoe[fla]) cannot be imported: the Gated "
            "DeltaNet runs on our Triton kernel (or torch)")


def load_fla():
    """fla's (fused_recurrent_gated_delta_rule, chunk_gated_delta_rule), or None where it cannot be imported
    (`fla_missing()` says why: fla itself, or one of its imports such as einops)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except ImportError as exc:
        _FLA_ERROR[:] = [f"{type(exc).__name__}: {exc}"]
        return None
    return fused_recurrent_gated_delta_rule, chunk_gated_delta_rule


_FLA_ERROR: list[str] = []


def fla_missing() -> str:
    """The note for a run without fla: what the last `load_fla` could not import, and what runs instead."""
    return f"{FLA_NOTE} ({_FLA_ERROR[0] if _FLA_ERROR else 'not imported'})"


def gdn_recurrence_torch(q, k, v, decay, beta, state, history=None, out=None) -> torch.Tensor:
    """The reference (see the module docstring): `state` updated in place, copied into history[i] after position
    i where given; returns the outputs [D, NV, dv] float32 (into `out` where given)."""
    repeat = v.shape[1] // q.shape[1]
    q, k = q.repeat_interleave(repeat, dim=1), k.repeat_interleave(repeat, dim=1)
    out = torch.empty_like(v) if out is None else out
    for i in range(q.shape[0]):
        state.mul_(decay[i].exp()[:, None, None])
        remembered = (state * k[i][:, :, None]).sum(dim=-2)  # [NV, dv]
        delta = (v[i] - remembered) * beta[i][:, None]
        state.add_(k[i][:, :, None] * delta[:, None, :])
        out[i] = (state * q[i][:, :, None]).sum(dim=-2)
        if history is not None:
            history[i].copy_(state)
    return out


if triton is not None:

    @triton.jit
    def _position_inputs(q_ptr, k_ptr, v_ptr, decay_ptr, beta_ptr, t, T, kh, h, o_k, o_v, mk, mv,
                         NK: tl.constexpr, NV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr):
        """Position t's q and k (key head kh), v, decay and beta (value head h) of `_gdn_kernel`'s program; zeros
        past the T positions."""
        live = t < T
        b_q = tl.load(q_ptr + (t * NK + kh) * DK + o_k, mask=mk & live, other=0.0)
        b_k = tl.load(k_ptr + (t * NK + kh) * DK + o_k, mask=mk & live, other=0.0)
        b_v = tl.load(v_ptr + (t * NV + h) * DV + o_v, mask=mv & live, other=0.0)
        b_g = tl.load(decay_ptr + t * NV + h, mask=live, other=0.0)
        b_b = tl.load(beta_ptr + t * NV + h, mask=live, other=0.0)
        return b_q, b_k, b_v, b_g, b_b

    @triton.jit
    def _gdn_kernel(q_ptr, k_ptr, v_ptr, decay_ptr, beta_ptr, state_ptr, hist_ptr, out_ptr, T,
                    NK: tl.constexpr, NV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr,
                    BV: tl.constexpr, STORE_HISTORY: tl.constexpr, PDL: tl.constexpr = False):
        """Program (value head h, value block j): the state block S[h, :, j*BV:(j+1)*BV] through T positions. The
        loads of position t + 1's inputs come before position t's math, which they do not depend on, so they are
        in flight while it runs (a software prefetch by hand; the math is unchanged)."""
        enter(PDL)
        h = tl.program_id(0)
        j = tl.program_id(1)
        kh = h // (NV // NK)
        o_k = tl.arange(0, BK)
        o_v = j * BV + tl.arange(0, BV)
        mk, mv = o_k < DK, o_v < DV
        mask = mk[:, None] & mv[None, :]
        s_off = h * DK * DV + o_k[:, None] * DV + o_v[None, :]
        s = tl.load(state_ptr + s_off, mask=mask, other=0.0)
        # position 0's inputs; then each iteration loads position t + 1's before position t's math
        b_q, b_k, b_v, b_g, b_b = _position_inputs(q_ptr, k_ptr, v_ptr, decay_ptr, beta_ptr, 0, T, kh, h, o_k, o_v,
                                                   mk, mv, NK, NV, DK, DV)
        for t in range(T):
            n_q, n_k, n_v, n_g, n_b = _position_inputs(q_ptr, k_ptr, v_ptr, decay_ptr, beta_ptr, t + 1, T, kh, h,
                                                       o_k, o_v, mk, mv, NK, NV, DK, DV)
            s = s * tl.exp(b_g)
            delta = (b_v - tl.sum(s * b_k[:, None], axis=0)) * b_b
            s = s + b_k[:, None] * delta[None, :]
            tl.store(out_ptr + (t * NV + h) * DV + o_v, tl.sum(s * b_q[:, None], axis=0), mask=mv)
            if STORE_HISTORY:
                tl.store(hist_ptr + t * NV * DK * DV + s_off, s, mask=mask)
            b_q, b_k, b_v, b_g, b_b = n_q, n_k, n_v, n_g, n_b
        tl.store(state_ptr + s_off, s, mask=mask)


def gdn_recurrence_triton(q, k, v, decay, beta, state, history=None, out=None, block_v: int = 16,
                          num_warps: int = 2) -> torch.Tensor:
    """Our Triton kernel (see the module docstring); the same contract as `gdn_recurrence_torch`. Every tensor
    must be contiguous float32."""
    d, nk, dk = q.shape
    nv, dv = v.shape[1], v.shape[2]
    out = torch.empty_like(v) if out is None else out
    bv = min(block_v, triton.next_power_of_2(dv))
    _gdn_kernel[(nv, triton.cdiv(dv, bv))](q, k, v, decay, beta, state, state if history is None else history, out,
                                           d, NK=nk, NV=nv, DK=dk, DV=dv, BK=triton.next_power_of_2(dk), BV=bv,
                                           STORE_HISTORY=history is not None, num_warps=num_warps, **pdl.options(q))
    return out


def gdn_recurrence_fla(q, k, v, decay, beta, state, history=None, out=None, fla=None) -> torch.Tensor:
    """fla's kernels (see the module docstring; `fla` = `load_fla()`); the same contract as
    `gdn_recurrence_torch`."""
    recurrent, chunk = fla if fla is not None else load_fla()
    out = torch.empty_like(v) if out is None else out
    d = q.shape[0]
    if history is not None:  # fla's kernels return the final state only: one launch per position
        for i in range(d):
            o, final = recurrent(q[None, i:i + 1], k[None, i:i + 1], v[None, i:i + 1], g=decay[None, i:i + 1],
                                 beta=beta[None, i:i + 1], scale=1.0, initial_state=state[None],
                                 output_final_state=True)
            out[i].copy_(o[0, 0])
            state.copy_(final[0])
            history[i].copy_(state)
        return out
    kernel = chunk if d >= FLA_CHUNK_FROM else recurrent
    o, final = kernel(q[None], k[None], v[None], g=decay[None], beta=beta[None], scale=1.0,
                      initial_state=state[None], output_final_state=True)
    out.copy_(o[0])
    state.copy_(final[0])
    return out


def gdn_recurrence(q, k, v, decay, beta, state, history=None, out=None, kernel: str = "torch",
                   fla=None) -> torch.Tensor:
    """The gated delta rule of D positions with `kernel` ("torch", "triton" or "fla"; see the module
    docstring): `state` [NV, dk, dv] updated in place, history [D, NV, dk, dv] (or None) the state after each
    position; returns the outputs [D, NV, dv] float32."""
    if kernel == "triton":
        return gdn_recurrence_triton(q, k, v, decay, beta, state, history, out)
    if kernel == "fla":
        return gdn_recurrence_fla(q, k, v, decay, beta, state, history, out, fla)
    if kernel != "torch":
        raise ValueError(f"the Gated DeltaNet kernel must be one of {GDN_KERNELS}, got {kernel!r}")
    return gdn_recurrence_torch(q, k, v, decay, beta, state, history, out)


def random_gdn_inputs(num_positions: int, nk: int, nv: int, dk: int, dv: int, device, seed: int = 0):
    """Random inputs of the contract (normed q and k, decays in (-1, 0), beta in (0, 1)) and a random state:
    (q, k, v, decay, beta, state), for the self-checks, tests and benchmarks."""
    g = torch.Generator(device=device).manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, device=device, generator=g)  # noqa: E731
    q, k = (torch.nn.functional.normalize(rand(num_positions, nk, dk), dim=-1) for _ in range(2))
    decay = -torch.rand(num_positions, nv, device=device, generator=g)
    beta = torch.rand(num_positions, nv, device=device, generator=g)
    return q * dk ** -0.5, k, rand(num_positions, nv, dv), decay, beta, rand(nv, dk, dv) * dk ** -0.5


# -- the step's prologue (convolution, norms, decay and beta) and epilogue (gated RMSNorm) --------------------------
def l2_normalise(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def gdn_prologue_torch(proj, conv_weight, A, dt_bias, conv_state, conv_in, q, k, v, decay, beta) -> None:
    """The prologue in torch (see the module docstring): from proj [D, C + NV dv + 2 NV] (in_proj's output),
    conv_weight [C, 1, K], A [NV] float32 (-exp(A_log)), dt_bias [NV] and the convolution state [C, K - 1] (updated
    in place), writes conv_in [C, K - 1 + D] and the recurrence's inputs q, k [D, NK, dk], v [D, NV, dv], decay and
    beta [D, NV] (float32)."""
    d, (nk, dk), (nv, dv) = proj.shape[0], q.shape[1:], v.shape[1:]
    conv_dim, width = conv_in.shape[0], conv_weight.shape[-1]
    b, a = proj[:, proj.shape[1] - 2 * nv:].split([nv, nv], dim=-1)
    conv_in[:, :width - 1].copy_(conv_state)
    conv_in[:, width - 1:].copy_(proj[:, :conv_dim].t())
    conv_state.copy_(conv_in[:, d:])
    mixed = F.silu(F.conv1d(conv_in[None], conv_weight, groups=conv_dim))[0].t()  # [D, C]
    mq, mk, mv = mixed.split([nk * dk, nk * dk, nv * dv], dim=-1)
    q.copy_(l2_normalise(mq.reshape(d, nk, dk).float()) * dk ** -0.5)
    k.copy_(l2_normalise(mk.reshape(d, nk, dk).float()))
    v.copy_(mv.reshape(d, nv, dv))
    decay.copy_(A * F.softplus(a.float() + dt_bias, threshold=SOFTPLUS_THRESHOLD))
    beta.copy_(b.sigmoid())


def gated_rmsnorm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Gated DeltaNet's output norm over the last dimension: w * norm(x) (rounded to x's dtype first), times
    silu(gate) in float32, rounded to x's dtype."""
    h = x.float()
    h = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (h * F.silu(gate.float())).to(x.dtype)


if triton is not None:

    @triton.jit
    def _prologue_kernel(proj_ptr, conv_w_ptr, a_ptr, dt_bias_ptr, state_ptr, conv_in_ptr, q_ptr, k_ptr, v_ptr,
                         decay_ptr, beta_ptr, T, row_stride, b_col, q_scale, eps, threshold,
                         NK: tl.constexpr, NV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                         WIDTH: tl.constexpr, BD: tl.constexpr, BLOCK_T: tl.constexpr, BW: tl.constexpr,
                         PDL: tl.constexpr = False):
        """Program p: q head p (p < NK), k head p - NK (p < 2 NK) or v head p - 2 NK, i.e. its channels of the
        convolution, through T positions in tiles [BLOCK_T positions, BD channels] (every load of a tile
        independent of the tile's math, so a tile's loads are in flight together); a v head's program also writes
        that head's decay and beta, a vector per tile. BW: the convolution state's columns (WIDTH - 1) rounded up
        to a power of two."""
        enter(PDL)
        p = tl.program_id(0)
        W: tl.constexpr = WIDTH - 1
        dt = conv_in_ptr.dtype.element_ty
        c0 = tl.where(p < 2 * NK, p * DK, 2 * NK * DK + (p - 2 * NK) * DV)  # its first channel, its channels
        n = tl.where(p < 2 * NK, DK, DV)
        h = p - 2 * NK  # its value head (v programs)
        o = tl.arange(0, BD)
        m = o < n
        c = c0 + o
        cols = W + T  # the convolution input's row length
        for t0 in range(0, T, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            mt = t < T
            mask = mt[:, None] & m[None, :]
            acc = tl.zeros([BLOCK_T, BD], dtype=tl.float32)
            for j in tl.static_range(WIDTH):  # input column t + j: position t + j - W, else the old state's
                col = t + j
                x = tl.load(proj_ptr + tl.maximum(col - W, 0)[:, None] * row_stride + c[None, :],
                            mask=mask & (col >= W)[:, None], other=0.0)
                for i in tl.static_range(W - j):  # position i < W - j: the old state's column i + j
                    old = tl.load(state_ptr + c * W + i + j, mask=m & (t0 <= i) & (i < t0 + BLOCK_T), other=0.0)
                    x = tl.where((t == i)[:, None], old[None, :], x)
                acc += tl.load(conv_w_ptr + c * WIDTH + j, mask=m, other=0.0).to(tl.float32)[None, :] * x.to(tl.float32)
            tl.store(conv_in_ptr + c[None, :] * cols + W + t[:, None], x, mask=mask)  # j = W: position t itself
            y = acc.to(dt).to(tl.float32)
            y = (y / (1.0 + tl.exp(-y))).to(dt).to(tl.float32)  # silu, rounded
            if p < 2 * NK:
                normed = y * tl.rsqrt(tl.sum(y * y, axis=1) + eps)[:, None]  # each position's L2 norm
                if p < NK:
                    tl.store(q_ptr + (t[:, None] * NK + p) * DK + o[None, :], normed * q_scale, mask=mask)
                else:
                    tl.store(k_ptr + (t[:, None] * NK + p - NK) * DK + o[None, :], normed, mask=mask)
            else:
                tl.store(v_ptr + (t[:, None] * NV + h) * DV + o[None, :], y, mask=mask)
                # decay = A softplus(a + dt_bias), beta = sigmoid(b) rounded
                arg = tl.load(proj_ptr + t * row_stride + b_col + NV + h, mask=mt, other=0.0).to(tl.float32)
                arg = arg + tl.load(dt_bias_ptr + h).to(tl.float32)
                u = tl.exp(tl.minimum(arg, threshold))
                one_u = 1.0 + u
                log1p = tl.where(one_u == 1.0, u, tl.log(one_u) * (u / (one_u - 1.0)))  # log1p(u) to a few ulp
                tl.store(decay_ptr + t * NV + h, tl.load(a_ptr + h) * tl.where(arg > threshold, arg, log1p), mask=mt)
                b_in = tl.load(proj_ptr + t * row_stride + b_col + h, mask=mt, other=0.0).to(tl.float32)
                tl.store(beta_ptr + t * NV + h, (1.0 / (1.0 + tl.exp(-b_in))).to(dt).to(tl.float32), mask=mt)
        # the old state into the convolution input's first W columns; the new state is the input's last W columns
        # (column T + j: the old state's where T + j < W, else position T + j - W), read here, written after the
        # barrier: every read of the old state (above and here) is done before any of its columns is rewritten
        jw = tl.arange(0, BW)
        mw = (jw < W)[:, None] & m[None, :]
        w_off = c[None, :] * W + jw[:, None]
        tl.store(conv_in_ptr + c[None, :] * cols + jw[:, None], tl.load(state_ptr + w_off, mask=mw), mask=mw)
        col = T + jw
        keep = (col < W)[:, None]
        old = tl.load(state_ptr + c[None, :] * W + tl.minimum(col, W - 1)[:, None], mask=mw & keep)
        new = tl.load(proj_ptr + tl.maximum(col - W, 0)[:, None] * row_stride + c[None, :],
                      mask=mw & (col >= W)[:, None])
        tl.debug_barrier()
        tl.store(state_ptr + w_off, tl.where(keep, old, new), mask=mw)

    @triton.jit
    def _gated_rmsnorm_kernel(x_ptr, gate_ptr, w_ptr, out_ptr, gate_row, gate_head, eps, NV: tl.constexpr,
                              DV: tl.constexpr, BV: tl.constexpr, PDL: tl.constexpr = False):
        """Program (position t, value head h)."""
        enter(PDL)
        t = tl.program_id(0)
        h = tl.program_id(1)
        dt = out_ptr.dtype.element_ty
        o = tl.arange(0, BV)
        m = o < DV
        x = tl.load(x_ptr + (t * NV + h) * DV + o, mask=m, other=0.0).to(dt).to(tl.float32)
        normed = (x * tl.rsqrt(tl.sum(x * x, axis=0) / DV + eps)).to(dt).to(tl.float32)
        y = (tl.load(w_ptr + o, mask=m, other=0.0).to(tl.float32) * normed).to(dt).to(tl.float32)
        g = tl.load(gate_ptr + t * gate_row + h * gate_head + o, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + (t * NV + h) * DV + o, (y * (g / (1.0 + tl.exp(-g)))).to(dt), mask=m)


def gdn_prologue_triton(proj, conv_weight, A, dt_bias, conv_state, conv_in, q, k, v, decay, beta,
                        num_warps: int | None = None, block_t: int = PROLOGUE_BLOCK_T) -> None:
    """The prologue in one launch; the same contract as `gdn_prologue_torch`. proj's rows must have unit column
    stride, every other tensor must be contiguous. The kernel takes the D positions in tiles of block_t (D itself
    rounded up to a power of two where smaller), on 8 warps for tiles of 32 positions or more, else 4."""
    d, (nk, dk), (nv, dv) = proj.shape[0], q.shape[1:], v.shape[1:]
    width = conv_weight.shape[-1]
    if proj.stride(1) != 1:
        raise ValueError("the prologue kernel needs in_proj's output with unit column stride")
    b_col = proj.shape[1] - 2 * nv
    block = min(triton.next_power_of_2(max(d, 1)), block_t)
    _prologue_kernel[(2 * nk + nv,)](proj, conv_weight, A, dt_bias, conv_state, conv_in, q, k, v, decay, beta, d,
                                     proj.stride(0), b_col, dk ** -0.5, L2NORM_EPS, SOFTPLUS_THRESHOLD, NK=nk, NV=nv,
                                     DK=dk, DV=dv, WIDTH=width, BD=triton.next_power_of_2(max(dk, dv)),
                                     BLOCK_T=block, BW=triton.next_power_of_2(max(width - 1, 1)),
                                     num_warps=num_warps or (8 if block >= 32 else 4), **pdl.options(proj))


def gated_rmsnorm_triton(x, gate, weight, eps: float, out=None) -> torch.Tensor:
    """`gated_rmsnorm(x.to(gate.dtype), gate, weight, eps)` in one launch: x [D, NV, dv] contiguous (the
    recurrence's float32 output, or already in the model dtype), gate [D, NV, dv] with unit last stride (a view of
    in_proj's output); returns [D, NV, dv] in gate's dtype (into `out` where given)."""
    d, nv, dv = x.shape
    if gate.stride(2) != 1:
        raise ValueError("the gated RMSNorm kernel needs the gate with unit last stride")
    out = torch.empty(d, nv, dv, dtype=gate.dtype, device=x.device) if out is None else out
    _gated_rmsnorm_kernel[(d, nv)](x, gate, weight, out, gate.stride(0), gate.stride(1), eps, NV=nv, DV=dv,
                                   BV=triton.next_power_of_2(dv), num_warps=1 if dv <= 128 else 4, **pdl.options(x))
    return out


def random_prologue_inputs(num_positions: int, heads: tuple[int, int, int, int], width: int, dtype, device,
                           seed: int = 0):
    """Random prologue inputs of the contract (`gdn_prologue_torch`) at heads (NK, NV, dk, dv) and convolution
    width: (proj, conv_weight, A, dt_bias, conv_state), for the self-checks and tests; a and dt_bias spread
    softplus's argument over about (-10, 22), both sides of the threshold."""
    nk, nv, dk, dv = heads
    g = torch.Generator(device=device).manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, device=device, generator=g)  # noqa: E731
    conv_dim = 2 * nk * dk + nv * dv
    proj = rand(num_positions, conv_dim + nv * dv + 2 * nv)
    proj[:, -nv:] *= 8.0
    weight = rand(conv_dim, 1, width) * width ** -0.5
    A = -torch.rand(nv, device=device, generator=g).mul(4.0).exp()
    dt_bias = rand(nv) * 4.0 + 4.0
    return proj.to(dtype), weight.to(dtype), A, dt_bias.to(dtype), rand(conv_dim, width - 1).to(dtype)


def prologue_outputs(num_positions: int, heads: tuple[int, int, int, int], width: int, dtype, device):
    """Zeroed prologue outputs (conv_in, q, k, v, decay, beta) of the contract."""
    nk, nv, dk, dv = heads
    f32, d = dict(dtype=torch.float32, device=device), num_positions
    return (torch.zeros(2 * nk * dk + nv * dv, width - 1 + d, dtype=dtype, device=device),
            torch.zeros(d, nk, dk, **f32), torch.zeros(d, nk, dk, **f32), torch.zeros(d, nv, dv, **f32),
            torch.zeros(d, nv, **f32), torch.zeros(d, nv, **f32))
