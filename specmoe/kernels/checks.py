"""Self-checks of the kernels on the device they will run on: each compares a fast kernel with its torch
reference on random inputs of a decoder's shapes (its `specmoe.geometry.Geometry`, in its dtype on its
device), and raises RuntimeError if they disagree (relative L2 error above 2e-2). A decoder runs them when it
chooses its kernels (`Decoder.use_kernels`, through `specmoe.models.decoder.verified`); one that fails is not
used, and the decoder's notes say why."""

from __future__ import annotations

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
