"""The gated delta rule of a Gated DeltaNet layer (Qwen3.5-MoE's linear attention) for the D positions of one
decode step, over a recurrent state [NV, dk, dv] (float32) kept in a static buffer and updated in place.

One interface, three implementations (`gdn_recurrence(..., kernel=)`):
- "torch": the reference, position by position in float32 (CPU, and CUDA without Triton);
- "triton": our recurrent kernel, one launch for the D positions, grid (NV, dv / BV): each program keeps its
  [dk, BV] block of the state in registers, updates it position by position and writes it back in place; with
  `history` it also stores the block after every position (the state a verification block's rollback resumes
  from), in the same launch;
- "fla": flash-linear-attention's Triton kernels (optional dependency `fla`, version 0.6.0):
  `fused_recurrent_gated_delta_rule` from the live state for up to FLA_CHUNK_FROM - 1 positions,
  `chunk_gated_delta_rule` for longer prompt chunks; each returns a fresh final state, copied into the live one.
  With `history`, fla's recurrent kernel runs once per position (it returns only its final state).

Inputs (the decoder prepares them the same way for every implementation): q, k [D, NK, dk] float32, L2-normed,
q scaled by dk^-1/2; v [D, NV, dv] float32; decay [D, NV] (log of the per-position decay) and beta [D, NV]
float32. Value head h reads key head h // (NV / NK) (grouped value heads). Per position: S <- exp(decay) S;
S <- S + k (beta (v - k S)); output q S.

Graph capture: every launch has static shapes and reads no host value, so a step captures into a CUDA graph.
"""

from __future__ import annotations

import torch

try:  # Triton is optional: CPU machines run the torch reference
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None

GDN_KERNELS = ("torch", "triton", "fla")
FLA_CHUNK_FROM = 64  # fla's chunked kernel from this many positions (one chunk), its fused recurrent one below
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
    def _gdn_kernel(q_ptr, k_ptr, v_ptr, decay_ptr, beta_ptr, state_ptr, hist_ptr, out_ptr, T,
                    NK: tl.constexpr, NV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr,
                    BV: tl.constexpr, STORE_HISTORY: tl.constexpr):
        """Program (value head h, value block j): the state block S[h, :, j*BV:(j+1)*BV] through T positions."""
        h = tl.program_id(0)
        j = tl.program_id(1)
        kh = h // (NV // NK)
        o_k = tl.arange(0, BK)
        o_v = j * BV + tl.arange(0, BV)
        mk, mv = o_k < DK, o_v < DV
        mask = mk[:, None] & mv[None, :]
        s_off = h * DK * DV + o_k[:, None] * DV + o_v[None, :]
        s = tl.load(state_ptr + s_off, mask=mask, other=0.0)
        for t in range(T):
            b_q = tl.load(q_ptr + (t * NK + kh) * DK + o_k, mask=mk, other=0.0)
            b_k = tl.load(k_ptr + (t * NK + kh) * DK + o_k, mask=mk, other=0.0)
            b_v = tl.load(v_ptr + (t * NV + h) * DV + o_v, mask=mv, other=0.0)
            b_g = tl.load(decay_ptr + t * NV + h)
            b_b = tl.load(beta_ptr + t * NV + h)
            s = s * tl.exp(b_g)
            delta = (b_v - tl.sum(s * b_k[:, None], axis=0)) * b_b
            s = s + b_k[:, None] * delta[None, :]
            tl.store(out_ptr + (t * NV + h) * DV + o_v, tl.sum(s * b_q[:, None], axis=0), mask=mv)
            if STORE_HISTORY:
                tl.store(hist_ptr + t * NV * DK * DV + s_off, s, mask=mask)
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
                                           STORE_HISTORY=history is not None, num_warps=num_warps)
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
