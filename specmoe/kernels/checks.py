"""Self-checks of the kernels on the device they will run on: each compares a fast kernel with its torch
reference on random inputs of a decoder's shapes (its `specmoe.geometry.Geometry`, in its dtype on its
device), and raises RuntimeError if they disagree (relative L2 error above 2e-2). A decoder runs them when it
chooses its kernels (`Decoder.use_kernels`, through `specmoe.models.decoder.verified`); one that fails is not
used, and the decoder's notes say why."""

from __future__ import annotations

import contextlib
import re

import numpy as np
import torch

from specmoe.geometry import Geometry

TOLERANCE = 2e-2


def relative_error(ref: torch.Tensor, out: torch.Tensor) -> float:
    """|out - ref| / |ref| (L2, float32)."""
    ref = ref.float()
    return float((out.float() - ref).norm() / ref.norm().clamp_min(1e-12))


def _agree(name: str, ref: torch.Tensor, out: torch.Tensor) -> None:
    if ref.is_cuda:
        torch.cuda.synchronize()
    err = relative_error(ref, out)
    if not err < TOLERANCE:
        raise RuntimeError(f"{name} differs from the torch path: relative error {err:.3g}")


def _random_route(s: Geometry, num_slots: int, g: torch.Generator, device: torch.device) -> torch.Tensor:
    """A route row [2K] int32: K distinct random slots, then softmax weights as float32 bit patterns."""
    route = torch.zeros(2 * s.top_k, dtype=torch.int32, device=device)
    route[: s.top_k] = torch.randperm(num_slots, device=device, generator=g)[: s.top_k].int()
    route[s.top_k:].view(torch.float32)[:] = torch.softmax(torch.randn(s.top_k, device=device, generator=g), 0)
    return route


def _random_routes(s: Geometry, num_slots: int, num_positions: int, g: torch.Generator,
                   device: torch.device) -> torch.Tensor:
    """Routes [D, 2K] int32 of a verification block: K distinct slots per position drawn from a skewed
    popularity over the slots (1 / rank, random ranking), so that positions share slots; softmax weights."""
    popularity = 1.0 / torch.arange(1, num_slots + 1, device=device, dtype=torch.float32)
    popularity = popularity[torch.randperm(num_slots, device=device, generator=g)]
    route = torch.zeros(num_positions, 2 * s.top_k, dtype=torch.int32, device=device)
    route[:, : s.top_k] = torch.multinomial(popularity.expand(num_positions, num_slots), s.top_k,
                                            replacement=False, generator=g).int()
    route[:, s.top_k:].view(torch.float32)[:] = torch.softmax(
        torch.randn(num_positions, s.top_k, device=device, generator=g), -1)
    return route


def check_slot_moe(s: Geometry, slot_buf: torch.Tensor, moe_params: dict | None, dtype: torch.dtype,
                   device: torch.device) -> torch.Generator:
    """The per-token Triton slot MoE kernel against its torch version on random input and K random slots of the
    slot buffer (rows of the store's [gate | up | down] layout, `s.hidden` x `s.inter`); returns the generator
    for further checks."""
    from . import moe as kmoe

    if slot_buf.dim() != 2 or slot_buf.shape[1] < 3 * s.hidden * s.inter:
        raise RuntimeError(f"slot buffer rows of {tuple(slot_buf.shape)[1:]} values cannot hold an expert of "
                           f"[gate | up | down] with H={s.hidden}, I={s.inter}")
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(s.hidden, device=device, generator=g).to(dtype)
    res = torch.zeros(s.hidden, device=device, dtype=dtype)  # compare the MoE output alone
    route = _random_route(s, slot_buf.shape[0], g, device)
    act = torch.empty(s.top_k, s.inter, device=device, dtype=dtype)
    ref, out = torch.empty_like(res), torch.empty_like(res)
    kmoe.slot_moe_torch(x, res, slot_buf, route, act, ref, s.hidden, s.inter)
    kmoe.slot_moe_triton(x, res, slot_buf, route, act, out, s.hidden, s.inter, moe_params)
    _agree("slot MoE kernel", ref, out)
    if kmoe.is_fp8_rows(slot_buf):
        check_fp8_equals_dequantised(s, moe_params, dtype, device, x, route)
    return g


def check_fp8_equals_dequantised(s: Geometry, moe_params: dict | None, dtype: torch.dtype, device: torch.device,
                                 x: torch.Tensor, route: torch.Tensor) -> None:
    """The per-token kernel over FP8 rows of random experts and over the same rows dequantised to `dtype`:
    bitwise equal (the FP8 store decodes as the bf16 store of the dequantised weights; `moe.row_sums` fixes the
    reduction order that the two row formats' tile layouts would otherwise change)."""
    from . import moe as kmoe
    from .fp8 import fp8_rows_of, unpack_fp8_rows

    g, k = torch.Generator().manual_seed(5), s.top_k
    route = route.clone()
    route[:k] = torch.arange(k, device=device, dtype=torch.int32)  # K random experts in slots 0 .. K - 1
    rows = fp8_rows_of(torch.randn(k, 2 * s.inter, s.hidden, generator=g) * s.hidden ** -0.5,
                       torch.randn(k, s.hidden, s.inter, generator=g) * s.inter ** -0.5)
    deq = torch.cat([t.flatten(1) for t in unpack_fp8_rows(rows, s.hidden, s.inter, dtype)], dim=1)
    res = torch.randn(s.hidden, generator=g).to(device, dtype)
    act = torch.empty(s.top_k, s.inter, device=device, dtype=dtype)
    outs = []
    for buf in (rows.to(device), deq.to(device)):
        outs.append(torch.empty_like(res))
        kmoe.slot_moe_triton(x, res, buf, route, act, outs[-1], s.hidden, s.inter, moe_params)
    if not torch.equal(*outs):
        raise RuntimeError(f"slot MoE kernel over FP8 rows differs from it over the dequantised rows in "
                           f"{int((outs[0] != outs[1]).sum())} of {s.hidden} outputs")


def check_gdn(kernel: str, heads: tuple[int, int, int, int], device: torch.device, fla=None,
              positions=(1, 16)) -> None:
    """A gated delta rule kernel ("triton" or "fla", `specmoe.kernels.gdn`) against the torch recurrence at the
    layer's heads (NK, NV, dk, dv), for each number of positions: outputs, final state and the state after every
    position (relative L2 error above TOLERANCE fails; the recurrent kernels agree to about 1e-6 in float32,
    fla's chunked one, D >= 64, computes its products in lower precision)."""
    from .gdn import gdn_recurrence, random_gdn_inputs

    nk, nv, dk, dv = heads
    for d in positions:
        q, k, v, decay, beta, state = random_gdn_inputs(d, nk, nv, dk, dv, device, seed=d)
        for history in (False, True):
            results = []
            for name in ("torch", kernel):
                st, hist = state.clone(), (torch.zeros(d, nv, dk, dv, device=device) if history else None)
                out = gdn_recurrence(q, k, v, decay, beta, st, hist, kernel=name, fla=fla)
                results.append((out, st) + ((hist,) if history else ()))
            for ref, out in zip(*results):
                if ref.is_cuda:
                    torch.cuda.synchronize()
                err = relative_error(ref, out)
                if not err < TOLERANCE:
                    raise RuntimeError(f"the {kernel} gated delta rule differs from torch at D = {d}: relative "
                                       f"error {err:.3g}")


def check_gdn_prologue(heads: tuple[int, int, int, int], width: int, dtype: torch.dtype, device: torch.device,
                       positions=(1, 16)) -> None:
    """The Gated DeltaNet prologue kernel (`gdn.gdn_prologue_triton`) against its torch version at the layer's
    heads (NK, NV, dk, dv) and convolution width, for each number of positions: every output and the new
    convolution state (`_agree`)."""
    from .gdn import gdn_prologue_torch, gdn_prologue_triton, prologue_outputs, random_prologue_inputs

    for d in positions:
        inputs = random_prologue_inputs(d, heads, width, dtype, device, seed=d)
        results = []
        for prologue in (gdn_prologue_torch, gdn_prologue_triton):
            proj, weight, A, dt_bias, state = (t.clone() for t in inputs)
            outs = prologue_outputs(d, heads, width, dtype, device)
            prologue(proj, weight, A, dt_bias, state, *outs)
            results.append((state,) + outs)
        for name, ref, out in zip(("state", "conv_in", "q", "k", "v", "decay", "beta"), *results):
            _agree(f"Gated DeltaNet prologue kernel ({name}, D = {d})", ref, out)


def check_gated_rmsnorm(heads: tuple[int, int, int, int], eps: float, dtype: torch.dtype, device: torch.device,
                        num_positions: int = 16) -> None:
    """The gated RMSNorm kernel (`gdn.gated_rmsnorm_triton`) against `gdn.gated_rmsnorm` on a float32 input
    rounded to `dtype` and a gate that is a strided view, as in the decoder."""
    from .gdn import gated_rmsnorm, gated_rmsnorm_triton

    _, nv, _, dv = heads
    g = torch.Generator(device=device).manual_seed(5)
    x = torch.randn(num_positions, nv, dv, device=device, generator=g)
    gate = torch.randn(num_positions, 2 * nv * dv + 1, device=device, generator=g).to(dtype)
    gate = gate[:, 1:1 + nv * dv].view(num_positions, nv, dv)
    weight = torch.randn(dv, device=device, generator=g).to(dtype)
    _agree("gated RMSNorm kernel", gated_rmsnorm(x.to(dtype), gate, weight, eps),
           gated_rmsnorm_triton(x, gate, weight, eps))


def _check_norm(x: torch.Tensor, res: torch.Tensor, w: torch.Tensor, eps: float, style: str = "olmoe") -> None:
    """The RMSNorm kernel of `style` on rows x against `rmsnorm_torch`, alone and after the residual add of res
    (the sum too)."""
    from . import norm_rope as knr

    _agree(f"{style} RMSNorm kernel", knr.rmsnorm_torch(x, w, eps, style=style),
           knr.rmsnorm_triton(x, w, eps, torch.empty_like(x), style=style))
    res_out = res.clone()
    out = knr.rmsnorm_triton(x, w, eps, torch.empty_like(x), style=style, residual=res_out)
    _agree("residual add of the RMSNorm kernel", res + x, res_out)
    _agree(f"{style} RMSNorm kernel after the residual add", knr.rmsnorm_torch(res + x, w, eps, style=style), out)


def check_triton(s: Geometry, slot_buf: torch.Tensor, moe_params: dict | None, eps: float, clip_qkv: float | None,
                 dtype: torch.dtype, device: torch.device) -> None:
    """Our Triton kernels (slot MoE, RMSNorm alone and after the residual add, attention prologue) against their
    torch versions."""
    from . import norm_rope as knr

    g = check_slot_moe(s, slot_buf, moe_params, dtype, device)
    x = torch.randn(s.hidden, device=device, generator=g).to(dtype)
    w = torch.randn(s.hidden, device=device, generator=g).to(dtype)
    _agree("RMSNorm kernel", knr.rmsnorm_torch(x, w, eps), knr.rmsnorm_triton(x, w, eps, torch.empty_like(x)))
    _check_norm(*(torch.randn(3, s.hidden, device=device, generator=g).to(dtype) for _ in range(2)), w, eps)
    width = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
    num_pos = 3
    qkv = torch.randn(num_pos, width, device=device, generator=g).to(dtype)
    q_norm = torch.randn(s.num_heads * s.head_dim, device=device, generator=g).to(dtype)
    k_norm = torch.randn(s.num_kv_heads * s.head_dim, device=device, generator=g).to(dtype)
    inv = 1.0 / (10000.0 ** (torch.arange(0, s.head_dim, 2, device=device).float() / s.head_dim))
    freqs = torch.arange(8, device=device).float()[:, None] * inv[None]
    pos = torch.tensor([3], device=device)
    outs = []
    for fn in (knr.qkv_prologue_torch, knr.qkv_prologue_triton):
        q = torch.zeros(num_pos, s.num_heads, s.head_dim, device=device, dtype=dtype)
        kc = torch.zeros(s.num_kv_heads, 8, s.head_dim, device=device, dtype=dtype)
        vc = torch.zeros_like(kc)
        fn(qkv, q_norm, k_norm, freqs.cos(), freqs.sin(), pos, q, kc, vc, eps, clip_qkv)
        outs.append(torch.cat([q.flatten(), kc.flatten(), vc.flatten()]))
    _agree("attention prologue kernel", *outs)


def check_mla_kernels(num_heads: int, kv_lora_rank: int, rope_dim: int, nope_dim: int, hidden: int, inter: int,
                      eps: float, latent_eps: float, interleaved: bool, dtype: torch.dtype,
                      device: torch.device) -> None:
    """DeepSeek-V3's fused dense kernels against their torch versions at the decoder's shapes, for one position and
    a block of three: the RMSNorm alone and after the residual add (the sum too), the MLA prologue
    (`mla.mla_prologue_triton`: cache rows and queries; q_pe a strided view of the query projection, as the decoder
    passes it) and the SwiGLU product of a dense MLP (`norm_rope.gate_mul_triton`)."""
    from . import norm_rope as knr
    from .mla import mla_prologue_torch, mla_prologue_triton

    g = torch.Generator(device=device).manual_seed(8)
    rand = lambda *shape: torch.randn(*shape, device=device, generator=g).to(dtype)  # noqa: E731
    r, p, seq = kv_lora_rank, rope_dim, 8
    cos, sin = knr.rope_tables(p, 10000.0, seq, device)
    w, kv_w = rand(hidden), rand(r)
    for d in (1, 3):
        _check_norm(rand(d, hidden), rand(d, hidden), w, eps)
        kv, q = rand(d, r + p), rand(d, num_heads, nope_dim + p)
        q_lat = rand(num_heads, d, r)
        first = torch.tensor([seq - d - 1], device=device)
        outs = []
        for fn in (mla_prologue_torch, mla_prologue_triton):
            cache = torch.zeros(seq, r + p, device=device, dtype=dtype)
            query = torch.zeros(d, num_heads, r + p, device=device, dtype=dtype)
            fn(kv, q[..., nope_dim:], q_lat, kv_w, latent_eps, cos, sin, first, cache, query, interleaved)
            outs.append(torch.cat([cache.flatten(), query.flatten()]))
        _agree("MLA prologue kernel", *outs)
        gu = rand(d, 2 * inter)
        ref = knr.gate_mul_torch(gu[:, :inter], gu[:, inter:], torch.empty(d, inter, device=device, dtype=dtype),
                                 "silu")
        _agree("SwiGLU product kernel", ref, knr.gate_mul_triton(gu[:, :inter], gu[:, inter:], torch.empty_like(ref),
                                                                 "silu"))


def check_zero_centred_kernels(s: Geometry, rotary_dim: int, shared_inter: int, eps: float, dtype: torch.dtype,
                               device: torch.device) -> None:
    """Qwen3.5-MoE's fused kernels (`norm_rope`) against their torch versions at the decoder's shapes, for one
    position and a block of three: the zero-centred RMSNorm alone and with the residual add (the sum too), the
    gated attention's prologue (per-head zero-centred q/k norms, rotary on the first `rotary_dim` dims of each
    head, q and the KV rows written), and gate_mul as the decoder calls it (the output gate beside q, the shared
    expert's SwiGLU product, its sigmoid-gated residual add)."""
    from . import norm_rope as knr

    g = torch.Generator(device=device).manual_seed(6)
    rand = lambda *shape: torch.randn(*shape, device=device, generator=g).to(dtype)  # noqa: E731
    nh, nkv, hd, seq = s.num_heads, s.num_kv_heads, s.head_dim, 8
    cos, sin = knr.rope_tables(rotary_dim, 10000.0, seq, device)
    for d in (1, 3):
        x, res, w = rand(d, s.hidden), rand(d, s.hidden), rand(s.hidden) * 0.1
        _check_norm(x, res, w, eps, "zero_centred")
        qkv, qn, kn = rand(d, (2 * nh + 2 * nkv) * hd), rand(hd) * 0.1, rand(hd) * 0.1
        outs = []
        for fn in (knr.qkv_prologue_torch, knr.qkv_prologue_triton):
            q = torch.zeros(d, nh, hd, device=device, dtype=dtype)
            kc, vc = (torch.zeros(nkv, seq, hd, device=device, dtype=dtype) for _ in range(2))
            fn(qkv, qn, kn, cos, sin, torch.tensor([seq - d], device=device), q, kc, vc, eps, None,
               zero_centred=True, head_norm=True, gated=True)
            outs.append(torch.cat([q.flatten(), kc.flatten(), vc.flatten()]))
        _agree("gated attention prologue kernel", *outs)
        gate = qkv[:, :2 * nh * hd].view(d, nh, 2 * hd)[..., hd:]
        gate_up, y = rand(d, 2 * shared_inter + 1), rand(d, s.hidden)
        for name, args in (("output gate", (gate, rand(d, nh * hd), "sigmoid")),
                           ("SwiGLU product", (gate_up[:, :shared_inter], gate_up[:, shared_inter:-1], "silu")),
                           ("sigmoid-gated residual add", (gate_up[:, -1:], y, "sigmoid", res))):
            width = args[1].shape[1]
            _agree(f"{name} kernel", knr.gate_mul_torch(args[0], args[1], torch.empty(d, width, device=device,
                                                                                       dtype=dtype), *args[2:]),
                   knr.gate_mul_triton(args[0], args[1], torch.empty(d, width, device=device, dtype=dtype), *args[2:]))


def check_drafter_kernels(hidden: int, inter: int, heads: tuple[int, int, int], vocab: int, eps: float, style: str,
                          prologue: dict, clip: float | None, dtype: torch.dtype, device: torch.device,
                          positions=(1, 3), post_norm: bool = False, kv_only: bool = False,
                          qk_norm: bool = True) -> None:
    """The fused kernels of a static drafter's layers against their torch versions at its shapes, for each
    number of positions: the norm of its `style` alone and after the residual add (the sum too), added to the
    residual where it post-norms (`post_norm`, OLMo-2); the attention prologue with its flags (`prologue`:
    style, head_norm, rope_f32; qk_norm False: none, OLMo-1) and heads (NH, NKV, HD), also for keys and values
    alone (`kv_only`, DFlash's context rows); the SwiGLU product; the greedy head over `vocab` logits (the same
    tokens, probabilities within TOLERANCE)."""
    from . import norm_rope as knr

    nh, nkv, hd = heads
    g = torch.Generator(device=device).manual_seed(7)
    rand = lambda *shape: torch.randn(*shape, device=device, generator=g).to(dtype)  # noqa: E731
    seq = max(positions) + 5
    cos, sin = knr.rope_tables(hd, 10000.0, seq, device)
    head_norm = prologue.get("head_norm", False)
    for d in positions:
        x, res, w = rand(d, hidden), rand(d, hidden), rand(hidden)
        _check_norm(x, res, w, eps, style)
        if post_norm:
            _agree(f"{style} post-norm kernel's residual add", res + knr.rmsnorm_torch(x, w, eps, style=style),
                   knr.rmsnorm_triton(x, w, eps, None, style=style, add_to=res.clone()))
        for q_heads in (nh, 0) if kv_only else (nh,):
            qkv = rand(d, (q_heads + 2 * nkv) * hd)
            qn, kn = (rand(hd), rand(hd)) if head_norm else (rand(nh * hd), rand(nkv * hd))
            outs = []
            for fn in (knr.qkv_prologue_torch, knr.qkv_prologue_triton):
                q = torch.zeros(d, q_heads, hd, device=device, dtype=dtype)
                kc, vc = (torch.zeros(nkv, seq, hd, device=device, dtype=dtype) for _ in range(2))
                fn(qkv, qn if qk_norm else None, kn if qk_norm else None, cos, sin,
                   torch.tensor([seq - d], device=device), q, kc, vc, eps, clip, **prologue)
                outs.append(torch.cat([q.flatten(), kc.flatten(), vc.flatten()]))
            _agree(f"attention prologue kernel ({q_heads} query heads)", *outs)
        gate_up = rand(d, 2 * inter)
        gate, up = gate_up.chunk(2, dim=-1)
        _agree("SwiGLU product kernel", knr.gate_mul_torch(gate, up, torch.empty_like(up), "silu"),
               knr.gate_mul_triton(gate, up, torch.empty_like(up), "silu"))
        check_greedy((torch.randn(d, vocab, device=device, generator=g) * 4).to(dtype))


def check_greedy(logits: torch.Tensor) -> None:
    """The greedy head kernel (`specmoe.kernels.greedy`) against its torch version on `logits` [D, V] (written
    from row 1 on): the same tokens, probabilities within TOLERANCE."""
    from .greedy import greedy_torch, greedy_triton

    d, device = logits.shape[0], logits.device
    outs = []
    for fn in (greedy_torch, greedy_triton):
        tokens = torch.zeros(d + 1, dtype=torch.int64, device=device)
        probs = torch.zeros(d + 1, dtype=torch.float32, device=device)
        fn(logits, tokens, probs, torch.ones(1, dtype=torch.int64, device=device))
        outs.append((tokens, probs))
    if not torch.equal(outs[0][0], outs[1][0]):
        raise RuntimeError("the greedy head kernel's tokens differ from the torch path's")
    _agree("greedy head kernel's probabilities", outs[0][1], outs[1][1])


def check_gemv(n: int, k: int, params: dict, dtype: torch.dtype, device: torch.device) -> None:
    """The one-row linear kernel (`specmoe.kernels.gemv`) with launch `params` against F.linear for a weight
    [n, k]: its output in the model dtype and its float32 copy (the same values)."""
    from .gemv import gemv_triton

    g = torch.Generator(device=device).manual_seed(11)
    w = torch.randn(n, k, device=device, generator=g).to(dtype) / k ** 0.5
    x = torch.randn(1, k, device=device, generator=g).to(dtype)
    ref = torch.nn.functional.linear(x, w)
    out32 = torch.full((n,), float("nan"), device=device)
    out = gemv_triton(x, w, params)
    gemv_triton(x, w, params, out32=out32)
    _agree(f"GEMV kernel [{n}, {k}]", ref, out)
    if not torch.equal(out.float().flatten(), out32):
        raise RuntimeError(f"GEMV kernel [{n}, {k}]: its float32 output is not its {dtype} output's values")


def check_grouped_moe(s: Geometry, slot_buf: torch.Tensor, dtype: torch.dtype, device: torch.device,
                      params: dict | None = None, num_positions: int = 17) -> None:
    """The grouped slot MoE kernel (D positions, each distinct slot read once) against the torch path, one
    position at a time: random inputs, a block of D positions sharing slots (`_random_routes`)."""
    from .grouped_moe import make_grouped_workspace, slot_moe_grouped_torch, slot_moe_grouped_triton

    g = torch.Generator(device=device).manual_seed(3)
    d = num_positions
    x = torch.randn(d, s.hidden, device=device, generator=g).to(dtype)
    res = torch.zeros(d, s.hidden, device=device, dtype=dtype)  # compare the MoE output alone
    route = _random_routes(s, slot_buf.shape[0], d, g, device)
    ws = make_grouped_workspace(d, s.top_k, s.hidden, s.inter, dtype, device)
    ref = slot_moe_grouped_torch(x, res, slot_buf, route, torch.empty_like(res), s.hidden, s.inter, ws)
    out = slot_moe_grouped_triton(x, res, slot_buf, route, torch.empty_like(res), s.hidden, s.inter, ws, params)
    for i in range(d):
        _agree(f"grouped slot MoE kernel (position {i} of {d})", ref[i], out[i])


def check_attention(s: Geometry, name: str, attend, dtype: torch.dtype, device: torch.device) -> None:
    """An attention over the written positions, attend(q, k_cache, v_cache, seq_len, scale) -> [D, NH * HD]
    (split-KV, flash-attn), against SDPA over the masked cache: random queries and caches of the decoder's
    shapes, the first two thirds of the positions written, one query and a causal block of three."""
    from .attention import causal_step_mask, decode_attention

    g = torch.Generator(device=device).manual_seed(1)
    k_cache, v_cache = (torch.randn(s.num_kv_heads, s.max_seq_len, s.head_dim, device=device,
                                    generator=g).to(dtype) for _ in range(2))
    written = 2 * s.max_seq_len // 3 + 1
    positions = torch.arange(s.max_seq_len, device=device)
    for num_pos in (1, 3):
        if num_pos > written:
            continue
        q = torch.randn(num_pos, s.num_heads, s.head_dim, device=device, generator=g).to(dtype)
        first = torch.tensor([written - num_pos], device=device)
        mask = causal_step_mask(positions, first, torch.empty(num_pos, s.max_seq_len, device=device,
                                                              dtype=dtype))
        seq_len = torch.full((1,), written, dtype=torch.int32, device=device)
        scale = s.head_dim ** -0.5
        _agree(name, decode_attention(q, k_cache, v_cache, mask, scale), attend(q, k_cache, v_cache, seq_len, scale))


def check_fused_experts(s: Geometry, slot_buf: torch.Tensor, fused_experts, dtype: torch.dtype,
                        device: torch.device) -> None:
    """vLLM's fused_experts against the torch slot MoE: random input, K random slots of the buffer."""
    from .moe import slot_moe_torch, slot_moe_vllm

    g = torch.Generator(device=device).manual_seed(2)
    x = torch.randn(s.hidden, device=device, generator=g).to(dtype)
    res = torch.zeros(s.hidden, device=device, dtype=dtype)  # compare the MoE output alone
    route = _random_route(s, slot_buf.shape[0], g, device)
    ref, out = torch.empty_like(res), torch.empty_like(res)
    act = torch.empty(s.top_k, s.inter, device=device, dtype=dtype)
    slot_moe_torch(x, res, slot_buf, route, act, ref, s.hidden, s.inter)
    slot_moe_vllm(x, res, slot_buf, route, out, s.hidden, s.inter, fused_experts)
    _agree("fused_experts", ref, out)


def check_resident_routing(num_positions: int, num_experts: int, top_k: int, scoring, device) -> None:
    """The one-launch resident routing kernel against its torch version on bf16-rounded logits with ties:
    the same experts and slots, weights within 1e-6 relative (RuntimeError otherwise). A sigmoid router is
    checked with its last layer's selection bias (zeros without one) and its groups."""
    from .device_routing import route_resident

    gen = torch.Generator(device="cpu").manual_seed(0)
    bias = None
    if scoring.kind == "sigmoid":
        rows = scoring.bias if scoring.bias is not None else torch.zeros(1, num_experts, dtype=torch.float64)
        bias = torch.as_tensor(rows[-1], dtype=torch.float64).to(device)
    z = (torch.randn(num_positions, num_experts, generator=gen) * 4).round() / 4
    z[:, : min(top_k, num_experts)] = 0.0  # ties at the cut
    z = z.to(torch.bfloat16).float().to(device)
    slot_of = torch.randperm(num_experts, generator=gen).to(torch.int32).to(device)
    outs = []
    for kernel in ("torch", "triton"):
        experts = torch.zeros(num_positions, top_k, dtype=torch.int64, device=device)
        route = torch.zeros(num_positions, 2 * top_k, dtype=torch.int32, device=device)
        route_resident(z, top_k, scoring, slot_of, experts, route, kernel=kernel, bias=bias)
        outs.append((experts.cpu(), route.cpu()))
    (e0, r0), (e1, r1) = outs
    w0, w1 = r0[:, top_k:].view(torch.float32), r1[:, top_k:].view(torch.float32)
    if not (torch.equal(e0, e1) and torch.equal(r0[:, :top_k], r1[:, :top_k])
            and torch.allclose(w0, w1, rtol=1e-6, atol=0)):
        raise RuntimeError("the resident routing kernel disagrees with its torch version")


def check_latent_attention(s: Geometry, kv_lora_rank: int, name: str, attend, dtype: torch.dtype,
                           device: torch.device) -> None:
    """An MLA attention over the written positions of a latent cache, attend(q [D, NH, R + P], cache [S, R + P],
    seq_len, scale) -> [D, NH, R] (split-KV), against `mla.mla_decode_attention` over the masked cache: random
    queries and a random cache of the decoder's shapes (head_dim = R + P), the first two thirds of the positions
    written, one query and a causal block of three."""
    from .attention import causal_step_mask
    from .mla import mla_decode_attention

    g = torch.Generator(device=device).manual_seed(4)
    cache = torch.randn(s.max_seq_len, s.head_dim, device=device, generator=g).to(dtype)
    written = 2 * s.max_seq_len // 3 + 1
    positions = torch.arange(s.max_seq_len, device=device)
    scale = s.head_dim ** -0.5
    for num_pos in (1, 3):
        if num_pos > written:
            continue
        q = torch.randn(num_pos, s.num_heads, s.head_dim, device=device, generator=g).to(dtype)
        first = torch.tensor([written - num_pos], device=device)
        mask = causal_step_mask(positions, first, torch.empty(num_pos, s.max_seq_len, device=device, dtype=dtype))
        seq_len = torch.full((1,), written, dtype=torch.int32, device=device)
        _agree(name, mla_decode_attention(q, cache, mask, scale, kv_lora_rank), attend(q, cache, seq_len, scale))


def check_device_cache(policy, scoring, calibration, router_logits: np.ndarray, pregate_logits: np.ndarray,
                       tokens: np.ndarray, device, sequences: int = 1) -> dict:
    """The device cache (`device_cache.DeviceCache`) against the host `LogicalCache`, step by step: router_logits
    and pregate_logits float32 [T, L, E], tokens [T]; the T positions are cut into `sequences` sequences (a
    reset between them). At every (position, layer) the selections, slots, execution weights (float32 bits),
    demand and prefetch lists must be equal, and after every step the whole state (integer and float64 arrays,
    counters) bit for bit; the displaced mass within 1e-12 relative. Raises AssertionError at the first
    difference; returns the host's `totals()` and two counts of the host's events that the device reaches by
    other paths than the host's loops: "protected_victims", demand insertions whose victim was protected
    (every resident outside S was), and "window_victims", part 1's insertions whose victim was an expert of the
    window not visited yet."""
    from specmoe.routing import EngineScoring, LogicalCache
    from specmoe.routing import kernels as K

    from .device_cache import DeviceCache

    num_positions, num_layers, num_experts = router_logits.shape
    k = policy.top_k
    host = LogicalCache(policy, calibration, num_layers, num_experts, groups=scoring.groups)
    engine_scoring = EngineScoring.of(scoring, num_layers, num_experts)
    dev = DeviceCache(host, scoring, device)
    z_dev = torch.as_tensor(router_logits, dtype=torch.float32).to(device)
    g_dev = torch.as_tensor(pregate_logits, dtype=torch.float32).to(device)
    tok_dev = torch.as_tensor(np.asarray(tokens, dtype=np.int64)).to(device)
    selected, slots = np.empty(k, np.int64), np.empty(k, np.int64)
    weights, logged = np.empty(k, np.float32), np.empty(num_experts, np.float32)
    cut = {round(i * num_positions / sequences) for i in range(1, sequences)}
    events = {"protected_victims": 0, "window_victims": 0}
    slot_row, prot_row, pred_row, pos = K.EXPERT_SLOT, K.PROTECTED, K.PREDICTED, K.POS
    for t in range(num_positions):
        if t in cut:
            host.reset()
            dev.reset()
        token = int(tokens[t])
        for layer in range(num_layers):
            where = f"position {t}, layer {layer}"
            step_t = host.iscalar[layer, pos]
            d = host.route(layer, router_logits[t, layer], token, engine_scoring, logged, selected, slots, weights)
            # a protected victim: protected at this step, not resident after it (part 1 never evicts one)
            events["protected_victims"] += int(np.sum((host.istate[layer, prot_row] == step_t)
                                                      & (host.istate[layer, slot_row] < 0)))
            inserted = np.zeros(0, np.int64)
            nxt = layer + 1 < num_layers
            if nxt and policy.insert_budget > 0:
                g = pregate_logits[t, layer + 1]
                g = g.astype(np.float64) if scoring.kind == "softmax" else scoring.selection_scores(g, layer + 1)
                before = host.istate[layer + 1, slot_row].copy()
                inserted = host.insert_predicted(layer + 1, g, token).copy()
                # a window expert resident before part 1 and evicted by it (left out, or inserted again later)
                window = host.istate[layer + 1, pred_row, :min(policy.window, num_experts)]
                after = host.istate[layer + 1, slot_row, window]
                moved = (after < 0) | (after != before[window])
                events["window_victims"] += int(np.sum((before[window] >= 0) & moved))
            dev.step(tok_dev[t:t + 1], layer, z_dev[t, layer], g_dev[t, layer + 1] if nxt else None)
            experts, route = dev.experts.cpu().numpy(), dev.route.cpu().numpy()
            demand, prefetch = dev.demand.cpu().numpy(), dev.prefetch.cpu().numpy()
            assert np.array_equal(experts, selected), (where, "selected", experts, selected)
            assert np.array_equal(route[:k], slots), (where, "slots", route[:k], slots)
            assert np.array_equal(route[k:], weights.view(np.int32)), (where, "weights", route[k:].view(np.float32),
                                                                        weights)
            assert demand[0] == d and np.array_equal(demand[1:1 + d], host.demand[:d]) \
                and np.array_equal(demand[1 + k:1 + k + d], host.demand_slots[:d]), (where, "demand", demand, d)
            n = len(inserted)
            if nxt and policy.insert_budget > 0:
                m = dev.max_inserted
                assert prefetch[0] == n and np.array_equal(prefetch[1:1 + n], inserted) and np.array_equal(
                    prefetch[1 + m:1 + m + n], host.slot_of(layer + 1, inserted)), (where, "prefetch", prefetch,
                                                                                    inserted)
            state = dev.state()
            for name in ("istate", "iscalar", "fstate", "fscalar", "counters"):
                a, b = state[name], getattr(host, name)
                assert np.array_equal(a.view(np.int64), b.view(np.int64)), (where, name, np.argwhere(a != b)[:5])
            np.testing.assert_allclose(state["displaced_mass"], host.displaced_mass, rtol=1e-12, atol=1e-300)
    return {**host.totals(), **events}


def device_cache_case(num_layers: int, num_experts: int, num_positions: int, seed: int = 0, vocab: int = 20,
                      prior_density: float = 0.1):
    """Inputs for `check_device_cache`: a calibration with a random warm ranking, a sparse token prior (a
    `prior_density` share of its (layer, token, expert) entries set) on a coarse grid (ties of the A priority) and
    random deltas; router and pre-gate logits [T, L, E] float32 that
    recur over positions (a layer prefers some experts, so the cache hits and misses), rounded to bfloat16 on a
    grid of 1/4 (many exact ties, +-0 included); tokens [T] (some outside the prior's vocabulary)."""
    from specmoe.routing import Calibration
    from specmoe.routing.calibration import TokenPrior

    rng = np.random.default_rng(seed)
    shape = (num_layers, vocab, num_experts)
    dense = np.where(rng.random(shape) < prior_density, np.round(rng.random(shape) * 4) / 4, 0.0)
    calibration = Calibration(np.stack([rng.permutation(num_experts) for _ in range(num_layers)]),
                              TokenPrior.from_dense(dense), rng.uniform(2.0, 4.0, num_layers))
    base = rng.normal(0.0, 1.5, (num_layers, num_experts))

    def logits():
        x = np.round((base + rng.normal(0.0, 1.5, (num_positions, num_layers, num_experts))) * 4) / 4
        x[::7, :, :6] = 0.0
        x[3::7, :, 2:9] = -0.0
        return torch.tensor(x, dtype=torch.float32).to(torch.bfloat16).float().numpy()

    tokens = rng.integers(0, vocab + 3, num_positions)
    return calibration, logits(), logits(), tokens


def device_select_case(num_blocks: int, num_layers: int, positions: int, num_experts: int, seed: int = 0):
    """Router logits float32 [B, L, D, E] on a bfloat16 grid with deliberate ties (duplicated expert columns,
    repeated rows, +-0) and position weights float64 [B, D] in [0, 1] with equal values, for `check_device_select`."""
    rng = np.random.default_rng(seed)
    z = torch.from_numpy(rng.normal(0.0, 1.5, (num_blocks, num_layers, positions, num_experts))).to(torch.bfloat16)
    z = z.float().numpy()
    z[..., 7] = z[..., 3]  # tied experts
    z[..., num_experts - 1] = z[..., 0]
    z[:, :, positions // 2] = z[:, :, 1]  # tied positions
    z[..., 5] = -0.0
    z[..., 6] = 0.0
    alpha = np.round(rng.uniform(0.0, 1.0, (num_blocks, positions)), 1)  # ties, and values at rescue thresholds
    alpha[:, 0] = 1.0
    return np.ascontiguousarray(z, dtype=np.float32), alpha


def check_device_select(selector, scoring, pool, router_logits: np.ndarray, alpha: np.ndarray, device,
                        max_positions: int | None = None, pregate_logits: np.ndarray | None = None,
                        prefetch: int = 0) -> dict:
    """Block selection and the pool on the device (`device_select.DevicePool`) against the host
    (`select_block_into` with float32 weights, `ExpertPool.use`, `end_block`), block by block and layer by layer:
    router_logits float32 [B, L, D, E], alpha [B, D]; `pool` a fresh host pool (it is advanced). The counts,
    eligible set, union, missing experts and slots, selections, route rows, the weights' float32 bits and the
    displaced mass to 1e-12 relative (float64 exp may differ in the last bit between numba, numpy and libdevice),
    and after each block the pool's slot table, members, recency and refill moves must be equal. max_positions:
    the device pool's (default the blocks' D; larger: blocks shorter than the pool's buffers).

    prefetch > 0 (with pregate_logits float32 [B, L, D, E]): the block prefetch of every layer >= 1 too, against
    `predict_prefetch` and `place_union` as `BlockRouter` uses them: the prefetch list, the demand list (the copies
    only, in their physical slots), the route rows' physical slots, the layer's counts (prefetched, hits, union
    slots written) and the refill moves' physical sources.

    Raises AssertionError at the first difference; returns the host pool's totals, and with prefetch the
    placement's totals: prefetch, hit, unused, demand, the peak union slots and `spilled` (demand copies that
    took an unused prefetch's slot, the rule's last resort)."""
    from specmoe.verifiers import PrefetchTally, SelectionBuffers, place_union, predict_prefetch, select_block_into

    from .device_select import DevicePool

    num_blocks, num_layers, positions, num_experts = router_logits.shape
    k, p, u = pool.top_k, pool.pool_size, pool.union_slots
    if prefetch and (pregate_logits is None or pregate_logits.shape != router_logits.shape):
        raise ValueError("a prefetch check needs pre-gate logits shaped as the router logits")
    dev = DevicePool(pool, selector, scoring, max_positions or positions, device, prefetch=prefetch)
    rows_of = slice(0, positions)
    buffers = SelectionBuffers(positions, num_experts, k)
    predicted = SelectionBuffers(positions, num_experts, k, np.float32)
    tally, spilled = PrefetchTally(), 0
    for block in range(num_blocks):
        a = np.ascontiguousarray(alpha[block], dtype=np.float64)
        a_dev = torch.tensor(a, device=device)
        physical = np.tile(np.arange(p, p + u), (num_layers, 1))
        for layer in range(num_layers):
            where = f"block {block} layer {layer}"
            prefetched = np.empty(0, np.int64)
            if prefetch and layer:
                g = np.ascontiguousarray(pregate_logits[block, layer])
                prefetched = predict_prefetch(selector, g, pool.resident(layer), a, k, scoring, predicted, prefetch, u,
                                              layer)
                dev.predict(layer, torch.tensor(g, device=device), a_dev)
                listing = dev.prefetches[layer].cpu().numpy()
                n = int(listing[0])
                assert np.array_equal(listing[1:1 + n], prefetched) and \
                    np.array_equal(listing[1 + num_experts:1 + num_experts + n], np.arange(p, p + n)), \
                    f"{where}: prefetch list\nhost   {prefetched}\ndevice {listing[1:1 + n]}"
            z = router_logits[block, layer]
            counts = select_block_into(selector, z, pool.resident(layer), a, k, scoring, buffers, layer=layer)
            missing, slots = pool.use(layer, buffers.selected[:positions])
            route = pool.slot_table(layer)[buffers.selected[:positions]]
            copies, copy_slots = missing, slots
            if prefetch:  # the physical slots, as `BlockRouter.route` places them
                placed, copy, used = place_union(missing, prefetched, p, u)
                physical[layer, slots - p] = placed
                slot_map = np.arange(p + u)
                slot_map[slots] = placed
                route = slot_map[route]
                copies, copy_slots = missing[copy], placed[copy]
                spilled += int((copy_slots < p + prefetched.size).sum())
                tally.count(prefetched, missing, p, u)
                placement = (prefetched.size, missing.size - int(copy.sum()), used)
            if layer % 2:  # as the engine calls it: logits rows of stride 2E, the step's route rows [D, 2K]
                rows = torch.zeros(positions, 2 * num_experts, dtype=torch.float32, device=device)
                rows[:, :num_experts] = torch.tensor(z, device=device)
                route_out = torch.zeros(positions, 2 * k, dtype=torch.int32, device=device)
                dev.select(layer, rows[:, :num_experts], a_dev, route_out)
                dev.route[rows_of].copy_(route_out[:, :k])
                assert np.array_equal(route_out[:, k:].cpu().numpy(), buffers.weights[:positions].view(np.int32)), \
                    f"{where}: the route rows' weights"
            else:
                dev.select(layer, torch.tensor(z, device=device), a_dev)
            got = dev.counts.cpu().numpy()
            assert tuple(got) == (*counts, 1), f"{where}: counts {got} != {counts}"
            got = tuple(int(x) for x in dev.layer_counts[layer].cpu().numpy())
            want = (missing.size, *placement) if prefetch else (missing.size, 0, 0, missing.size)
            assert got == want, f"{where}: layer counts (missing, prefetched, hits, union written) {got} != {want}"
            n_eligible, n_union, n_missing = counts
            n_copies = copies.size
            assert int(dev.demand[0]) == n_copies, f"{where}: the demand list's count"
            for name, host, device_value in (
                    ("eligible", buffers.eligible[:n_eligible], dev.eligible[:n_eligible]),
                    ("union", buffers.union[:n_union], dev.union[:n_union]),
                    ("missing", copies, dev.missing[:n_copies]),
                    ("missing slots", copy_slots, dev.missing_slots[:n_copies]),
                    ("selected", buffers.selected[:positions], dev.selected[rows_of]),
                    ("route", route, dev.route[rows_of]),
                    ("weights", buffers.weights[:positions].view(np.int32), dev.weights[rows_of].view(torch.int32))):
                device_value = device_value.cpu().numpy()
                assert np.array_equal(host, device_value), f"{where}: {name}\nhost   {host}\ndevice {device_value}"
            displaced = dev.displaced[rows_of].cpu().numpy()
            assert np.allclose(displaced, buffers.displaced[:positions], rtol=1e-12, atol=0.0), \
                f"{where}: displaced\nhost   {buffers.displaced[:positions]}\ndevice {displaced}"
        pool.end_block()
        dev.end_block()
        state = dev.state()
        for name in ("slot", "pool_mask", "recency"):
            assert np.array_equal(getattr(pool, name), state[name]), f"block {block}: pool {name} differs"
        assert state["block"] == pool.block
        moves, n_moves = dev.moves.cpu().numpy(), dev.n_moves.cpu().numpy()
        for layer in range(num_layers):
            src, dst = pool.refill_moves(layer)
            if prefetch:
                src = physical[layer, src - p]
            n = n_moves[layer]
            assert n == src.size and np.array_equal(moves[layer, 0, :n], src) and \
                np.array_equal(moves[layer, 1, :n], dst), f"block {block} layer {layer}: refill moves differ"
    totals = pool.totals()
    if prefetch:
        totals.update(tally.as_dict(), spilled=spilled)
    return totals


_POINTER_TYPES = {torch.int64: "*i64", torch.int32: "*i32", torch.float64: "*fp64", torch.float32: "*fp32",
                  torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.uint8: "*u8", torch.int8: "*i8"}


def _arg_type(arg) -> str:
    """A launch argument's type in a kernel signature: a tensor's pointer type, a Python int as i32 where it fits
    (as a launch types it), else i64."""
    if isinstance(arg, torch.Tensor):
        return _POINTER_TYPES[arg.dtype]
    return "i32" if -2 ** 31 <= int(arg) < 2 ** 31 else "i64"


def compile_for_gpu(kernel, args: tuple, constants: dict, num_warps: int, arch: int = 90, full: bool = False,
                    **options) -> dict | None:
    """Run a Triton kernel's front end for a CUDA GPU of compute capability `arch` (default 90: Hopper) without
    one: its Python source to Triton IR, where the language's type rules apply (a loop-carried variable that
    changes type, pointer arithmetic of mixed types), which Triton's interpreter on the CPU does not enforce; such
    a kernel raises here as its first launch would on the device. args: the launch's non-constexpr arguments in
    parameter order (tensors by dtype, Python ints as 32-bit integers where they fit, as a launch types them);
    constants: its constexprs by name. With `full`, the whole pipeline runs (layouts, PTX, and Triton's bundled
    ptxas on the PTX) and returns `ptxas_usage` of it, the launch's "warps" and the PTX's `mma_kind`: registers and
    spills, which only the machine code shows (a comparison tile too wide for the registers compiles, then runs
    several times slower); else None."""
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend

    names = [name for name in kernel.arg_names if name not in constants]
    if len(names) != len(args):
        raise ValueError(f"{len(args)} arguments for the kernel's {len(names)} non-constexpr parameters")
    signature = {name: "constexpr" for name in constants} | {name: _arg_type(arg) for name, arg in zip(names, args)}
    signature = {name: signature[name] for name in kernel.arg_names}
    constexprs = {(kernel.arg_names.index(name),): value for name, value in constants.items()}
    source = ASTSource(kernel, signature, constexprs)
    target = GPUTarget("cuda", arch, 32)
    if full:
        import triton

        ptx = triton.compile(source, target=target, options=dict(options, num_warps=num_warps)).asm["ptx"]
        return dict(ptxas_usage(ptx, arch), warps=num_warps, mma=mma_kind(ptx))
    backend = make_backend(target)
    parsed = backend.parse_options(dict(options, num_warps=num_warps))
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    source.make_ir(target, parsed, backend.get_codegen_implementation(parsed), backend.get_module_map(), context)
    return None


def mma_kind(ptx: str) -> str:
    """The tensor-core product a kernel's PTX uses: "wgmma" (Hopper's warpgroup product, operands from shared
    memory), "mma.sync" (the per-warp product, operands in registers) or "" (none)."""
    return "wgmma" if "wgmma.mma_async" in ptx else "mma.sync" if "mma.sync" in ptx else ""


def ptxas_usage(ptx: str, arch: int = 90) -> dict:
    """ptxas's report on one kernel's PTX, assembled for sm_{arch}a by the ptxas Triton ships: {"registers",
    "spill_stores", "spill_loads", "stack"} (the last three in bytes)."""
    import pathlib
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "kernel.ptx"
        path.write_text(ptx)
        done = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name=sm_{arch}a", str(path), "-o", str(path) + ".o"],
                              capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ptxas failed on the kernel's PTX: {done.stderr[-2000:]}")
    found = {key: re.search(pattern, done.stderr) for key, pattern in (
        ("registers", r"Used (\d+) registers"), ("spill_stores", r"(\d+) bytes spill stores"),
        ("spill_loads", r"(\d+) bytes spill loads"), ("stack", r"(\d+) bytes stack frame"))}
    if found["registers"] is None:
        raise RuntimeError(f"ptxas -v reported no register use: {done.stderr[-2000:]}")
    return {key: int(m.group(1)) if m else 0 for key, m in found.items()}


def launch_cache_step(cache, scoring, device="cpu"):
    """A `DeviceCache` over `cache` making one launch of each kind the engine makes per layer (layer 0's route from
    router logits, layer 1's part 1 from pre-gate logits; zero logits, token 0): inside `compile_launches`,
    every cache-step kernel of the policy compiles. Returns the DeviceCache."""
    from .device_cache import DeviceCache

    dev = DeviceCache(cache, scoring, device)
    token = torch.zeros(1, dtype=torch.int64, device=device)
    logits = torch.zeros(cache.num_experts, dtype=torch.float32, device=device)
    dev.step(token, 0, router_logits=logits)
    dev.step(token, 1, pregate_logits=logits)
    return dev


def launch_block_selection(pool, selector, scoring, positions: int, prefetch: int = 0, device="cpu"):
    """A `DevicePool` over `pool` making each launch form once for a block of `positions`: with a prefetch budget
    layer 1's block prefetch, layer 1's selection from logits rows of stride 2E into route rows (the engine's
    form), layer 0's plain selection, the refill; zero logits, unit weights. Inside `compile_launches`, every
    block-selection kernel of the selector compiles. Returns the DevicePool."""
    from .device_select import DevicePool

    dev = DevicePool(pool, selector, scoring, positions, device, prefetch=prefetch)
    e = pool.num_experts
    z = torch.zeros(positions, 2 * e, dtype=torch.float32, device=device)[:, :e]
    alpha = torch.ones(positions, dtype=torch.float64, device=device)
    if prefetch:
        dev.predict(1, z, alpha)
    dev.select(1, z, alpha, torch.zeros(positions, 2 * pool.top_k, dtype=torch.int32, device=device))
    dev.select(0, z, alpha)
    dev.end_block()
    return dev


@contextlib.contextmanager
def compile_launches(arch: int = 90, full: bool = False):
    """Within the block, every Triton launch (`kernel[grid](...)`) runs `compile_for_gpu` on its arguments instead
    of the kernel, once per kernel and specialisation (constexprs and argument types), and returns; nothing runs
    and no output is written, so only code whose host side reads no kernel output can run inside. Yields the list
    of (kernel name, constexprs) compiled; with `full`, (kernel name, constexprs, `ptxas_usage`) from the whole
    pipeline. Not under Triton's interpreter (its kernels are not compiled)."""
    import inspect

    from triton.runtime.jit import JITFunction

    original, compiled, seen = JITFunction.run, [], set()

    def run(self, *args, grid, warmup, **kwargs):
        bound = inspect.signature(self.fn).bind_partial(*args, **{k: v for k, v in kwargs.items()
                                                                   if k in self.arg_names})
        bound.apply_defaults()
        values = dict(bound.arguments)
        options = {k: v for k, v in kwargs.items() if k not in self.arg_names}
        constants = {p.name: values[p.name] for p in self.params if p.is_constexpr}
        launch = tuple(values[p.name] for p in self.params if not p.is_constexpr)
        key = (self.fn.__qualname__, tuple(sorted(constants.items())), tuple(sorted(options.items())),
               tuple(_arg_type(a) for a in launch))
        if key not in seen:
            seen.add(key)
            usage = compile_for_gpu(self, launch, constants, options.pop("num_warps", 4), arch, full, **options)
            compiled.append((self.fn.__name__, constants) + ((usage,) if full else ()))

    JITFunction.run = run
    try:
        yield compiled
    finally:
        JITFunction.run = original
