"""The fused norm, prologue and gate kernels of Qwen3.5-MoE's decoder (specmoe.kernels.norm_rope): each Triton
kernel against its torch version in Triton's interpreter on the CPU (float32, D = 1 and 16, Qwen-structured
shapes: q interleaved with its output gate, per-head zero-centred norms, partial rotary), and the decoder's
attention_router / head with the kernels against its torch path; on a CUDA device (marked gpu) the same in bf16
at Qwen3.6-35B-A3B's attention shapes, the decoder's self-check, and the tiny decoder with and without them."""

import importlib.util

import pytest
import torch

from _interpreter import run_in_interpreter

from specmoe.kernels import norm_rope as nr

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")

# The kernels against torch: exact where the arithmetic is the same; else within TOL. In float32 the kernels sum
# the norm's squares in another order than torch's mean and compute exp (silu, sigmoid) with another routine, so
# results differ in the last float32 bits (measured up to ~5e-7 absolute at these magnitudes).
_KERNELS = r"""
import torch
from specmoe.kernels import norm_rope as nr
TOL = dict(rtol=1e-5, atol=2e-6)
torch.manual_seed(0)
H, NH, NKV, HD, RD, S, I = 64, 4, 2, 16, 4, 40, 32  # Qwen-structured: GQA, partial rotary (RD < HD)
cos, sin = nr.rope_tables(RD, 10000.0, S, "cpu")
for D in (1, 16):
    x, h, w = torch.randn(D, H), torch.randn(D, H), torch.randn(H) * 0.1
    for zero_centred in (False, True):
        torch.testing.assert_close(nr.rmsnorm_triton(x, w, 1e-6, torch.empty_like(x), zero_centred),
                                   nr.rmsnorm_torch(x, w, 1e-6, zero_centred), **TOL)
        res = h.clone()
        out = nr.rmsnorm_triton(x, w, 1e-6, torch.empty_like(x), zero_centred, residual=res)
        assert torch.equal(res, h + x)  # the residual add is exact
        torch.testing.assert_close(out, nr.rmsnorm_torch(h + x, w, 1e-6, zero_centred), **TOL)
    # Qwen's gated prologue (positions 20 .. 20 + D - 1), and OLMoE's (full rotary, norms over all heads) with clip
    for rd, flags, clip in ((RD, dict(zero_centred=True, head_norm=True, gated=True), None), (HD, {}, 1.5)):
        c, s = nr.rope_tables(rd, 10000.0, S, "cpu")
        gated, per_head = flags.get("gated", False), flags.get("head_norm", False)
        qkv = torch.randn(D, ((1 + gated) * NH + 2 * NKV) * HD)
        qn, kn = torch.randn(HD if per_head else NH * HD) * 0.1, torch.randn(HD if per_head else NKV * HD) * 0.1
        outs = []
        for fn in (nr.qkv_prologue_torch, nr.qkv_prologue_triton):
            q, kc, vc = torch.zeros(D, NH, HD), torch.full((NKV, S, HD), 7.0), torch.full((NKV, S, HD), 7.0)
            fn(qkv, qn, kn, c, s, torch.tensor([20]), q, kc, vc, 1e-6, clip, **flags)
            outs.append((q, kc, vc))
        (q0, k0, v0), (q1, k1, v1) = outs
        torch.testing.assert_close(q1, q0, **TOL)
        torch.testing.assert_close(k1, k0, **TOL)
        assert torch.equal(v1, v0)  # a copy (and clip)
        if gated:  # the dims past the rotary ones are the normed values, untouched
            assert torch.equal(k1[:, :20], k0[:, :20]) and torch.equal(k1[:, 20 + D:], k0[:, 20 + D:])
    gate_up, y, att = torch.randn(D, 2 * I + 1), torch.randn(D, H), torch.randn(D, NH * HD)
    gate = torch.randn(D, 2 * NH * HD).view(D, NH, 2 * HD)[..., HD:]
    for g, xs, act, res in ((gate, att, "sigmoid", None), (gate_up[:, :I], gate_up[:, I:2 * I], "silu", None),
                            (gate_up[:, 2 * I:], y, "sigmoid", h)):
        want = nr.gate_mul_torch(g, xs, torch.empty(D, xs.shape[1]), act, res)
        got = nr.gate_mul_triton(g, xs, torch.empty(D, xs.shape[1]), act, None if res is None else res.clone())
        torch.testing.assert_close(got, want, **TOL)
    inplace = att.clone()  # out aliasing x, as the decoder's output gate
    nr.gate_mul_triton(gate, inplace, inplace, "sigmoid")
    torch.testing.assert_close(inplace, nr.gate_mul_torch(gate, att, torch.empty_like(att), "sigmoid"), **TOL)
print("kernels ok")
"""

def compare_decoders(plain, fused, rows, tokens, tol):
    """Run the tiny decoder's torch path and its fused path side by side (routing both by the torch path's router
    logits, so that last-bit differences cannot change an expert): a prompt step of 16 positions, then single
    positions; every layer's MoE input, router logits and residual, the final logits and greedy tokens, the KV
    cache."""
    from test_qwen3_5_moe_decode import exact_route

    top_k, seq = plain.geometry.top_k, plain.geometry.max_seq_len
    for position in [0] + list(range(16, len(tokens))):
        chunk = tokens[position:16] if position == 0 else tokens[position:position + 1]
        steps = [dec.step(len(chunk)) for dec in (plain, fused)]
        for step in steps:
            step.set_input(chunk, position, seq)
        for layer in range(plain.geometry.num_layers):
            for dec, step in zip((plain, fused), steps):
                dec.attention_router(step, layer, copy_out=False)
            a, b = steps
            for name in ("moe_in", "h"):
                torch.testing.assert_close(b.work[name], a.work[name], **tol)
            torch.testing.assert_close(b.logits_dev[layer], a.logits_dev[layer], **tol)
            selected, weights = exact_route(a.logits_dev[layer, :, :plain.geometry.num_experts].cpu(), top_k)
            for dec, step in zip((plain, fused), steps):
                step.slots_np[layer], step.weights_np[layer] = selected.numpy(), weights.numpy()
                dec.moe(step, layer, rows[layer])
        for dec, step in zip((plain, fused), steps):
            dec.head(step, copy_out=False)
        torch.testing.assert_close(steps[1].out_logits, steps[0].out_logits, **tol)
        assert torch.equal(steps[1].next_dev, steps[0].next_dev)
        torch.testing.assert_close(fused.k_cache, plain.k_cache, **tol)
        torch.testing.assert_close(fused.v_cache, plain.v_cache, **tol)


# The tiny decoder (float32) with the kernels against its torch path (the kernels' last-bit differences, above,
# through 4 layers).
_DECODER = r"""
import sys
import torch
sys.path.insert(0, "tests")
from specmoe.models import load_model
from specmoe.models.qwen3_5_moe_decode import Qwen35MoeDecoder
from specmoe.offload.store import ExpertStore
from test_norm_rope import compare_decoders
model, adapter = load_model("qwen3.5-moe-tiny", seed=0)
rows = ExpertStore.from_model(model, adapter, pin=False).layers
tokens = torch.randint(0, model.config.vocab_size, (17,), generator=torch.Generator().manual_seed(3)).tolist()
plain, fused = Qwen35MoeDecoder.from_model(model, 40), Qwen35MoeDecoder.from_model(model, 40)
fused.fused = True
# and every projection on a GEMV launch at one position (forced: on the CPU the choice is cuBLAS's F.linear)
import specmoe.kernels.gemv as gemv
fused.linears.params = {(*w.shape, w.dtype): gemv.GEMV_CANDIDATES[4] for w in fused.dense_weights()}
called, kernel = set(), gemv.gemv_triton
gemv.gemv_triton = lambda x, w, *a, **k: called.add(tuple(w.shape)) or kernel(x, w, *a, **k)
compare_decoders(plain, fused, rows, tokens, dict(rtol=1e-4, atol=1e-5))
assert called == {tuple(w.shape) for w in fused.dense_weights()} and len(called) >= 7, called
print("decoder ok")
"""


@needs_triton
@pytest.mark.parametrize("script,done", [(_KERNELS, "kernels ok"), (_DECODER, "decoder ok")],
                         ids=["kernels", "decoder"])
def test_in_the_interpreter(script, done):
    result = run_in_interpreter(script)
    assert result.returncode == 0, result.stderr[-3000:]
    assert done in result.stdout


def test_torch_versions_follow_transformers_rounding():
    """The zero-centred norm rounds once, after the 1 + w scale; OLMoE's rounds the normed value first; the
    gated prologue's q skips the gate rows and leaves the dims past the rotary ones as normed."""
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    w = torch.randn(8, dtype=torch.bfloat16)
    h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    assert torch.equal(nr.rmsnorm_torch(x, w, 1e-6, zero_centred=True), (h * (1 + w.float())).bfloat16())
    assert torch.equal(nr.rmsnorm_torch(x, w, 1e-6), w * h.bfloat16())
    nh, nkv, hd, rd = 2, 1, 8, 4
    cos, sin = nr.rope_tables(rd, 10000.0, 4, "cpu")
    qkv = torch.randn(1, (2 * nh + 2 * nkv) * hd)
    q, kc, vc = torch.zeros(1, nh, hd), torch.zeros(nkv, 4, hd), torch.zeros(nkv, 4, hd)
    ones = torch.zeros(hd)
    nr.qkv_prologue_torch(qkv, ones, ones, cos, sin, torch.tensor([2]), q, kc, vc, 1e-6, None, zero_centred=True,
                          head_norm=True, gated=True)
    heads = qkv[:, :2 * nh * hd].view(1, nh, 2 * hd)[..., :hd]
    normed = nr.rmsnorm_torch(heads, ones, 1e-6, zero_centred=True)
    assert torch.equal(q[..., rd:], normed[..., rd:])
    assert torch.equal(vc[:, 2], qkv[:, -nkv * hd:].view(nkv, hd))


def test_cpu_decoder_notes_the_kernels_unusable():
    from specmoe.models import load_model
    from specmoe.models.qwen3_5_moe_decode import Qwen35MoeDecoder
    from specmoe.offload.store import ExpertStore

    model, adapter = load_model("qwen3.5-moe-tiny", seed=0)
    rows = ExpertStore.from_model(model, adapter, pin=False).layers[0]
    decoder = Qwen35MoeDecoder.from_model(model, 16)
    decoder.use_kernels("auto", "auto", "slot", rows)
    assert not decoder.fused and not any("zero-centred" in n for n in decoder.notes)  # not asked for on the CPU
    decoder.use_kernels("triton", "sdpa", "slot", rows)
    assert not decoder.fused and not decoder.linears.params  # every projection on F.linear / torch.mm
    assert any(n.startswith("Triton zero-centred norm") and "unusable" in n for n in decoder.notes)


# -- on a CUDA device -------------------------------------------------------------------------------------------
def _bf16_close(got, want, what, equal_at_least: float = 0.97, tol: float = 2 ** -7):
    """bf16 kernels against torch: most elements equal; the rest one rounding apart (torch's and Triton's exp
    and rsqrt, and the norm's summation order, can move a value across a bf16 rounding boundary)."""
    torch.cuda.synchronize()
    equal = (got == want).float().mean().item()
    assert equal > equal_at_least, f"{what}: only {equal:.3f} of the elements equal torch's"
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


@pytest.mark.gpu
@pytest.mark.parametrize("num_pos", [1, 16])
def test_kernels_on_gpu_at_qwen36_shapes(num_pos):
    """bf16, Qwen3.6-35B-A3B: H 2048, 16 query and 2 KV heads of 256 dims, rotary on the first 64, shared expert
    width 512; plus the decoder's own self-check at these shapes."""
    from specmoe.geometry import Geometry
    from specmoe.kernels import checks

    dev, bf, d = "cuda", torch.bfloat16, num_pos
    H, NH, NKV, HD, RD, S, I = 2048, 16, 2, 256, 64, 4096, 512
    g = torch.Generator(device=dev).manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, device=dev, generator=g).to(bf)  # noqa: E731
    x, h, w = rand(d, H), rand(d, H), rand(H) * 0.1
    _bf16_close(nr.rmsnorm_triton(x, w, 1e-6, torch.empty_like(x), True), nr.rmsnorm_torch(x, w, 1e-6, True), "norm")
    res = h.clone()
    out = nr.rmsnorm_triton(x, w, 1e-6, torch.empty_like(x), True, residual=res)
    assert torch.equal(res, h + x)
    _bf16_close(out, nr.rmsnorm_torch(h + x, w, 1e-6, True), "residual norm")
    cos, sin = nr.rope_tables(RD, 1e7, S, dev)
    qkv, qn, kn = rand(d, (2 * NH + 2 * NKV) * HD), rand(HD) * 0.1, rand(HD) * 0.1
    outs = []
    for fn in (nr.qkv_prologue_torch, nr.qkv_prologue_triton):
        q = torch.zeros(d, NH, HD, device=dev, dtype=bf)
        kc, vc = (torch.zeros(NKV, S, HD, device=dev, dtype=bf) for _ in range(2))
        fn(qkv, qn, kn, cos, sin, torch.tensor([3000], device=dev), q, kc, vc, 1e-6, None, zero_centred=True,
           head_norm=True, gated=True)
        outs.append((q, kc[:, 3000:3000 + d], vc))
    # q and k: the reference rounds the rotary's two products and their sum to bf16 one by one, the kernel keeps
    # them in float32 until the store; on the H200 about 4% of q's elements (all in the rotated quarter of each
    # head) land one bf16 rounding apart, so the equal share is checked at 90% and the closeness at 2^-7 below
    for what, a, b in zip(("q", "k rows", "v cache"), *outs):
        _bf16_close(b, a, what, equal_at_least=0.9 if what != "v cache" else 0.97)
    gate = qkv[:, :2 * NH * HD].view(d, NH, 2 * HD)[..., HD:]
    gate_up, y, att = rand(d, 2 * I + 1), rand(d, H), rand(d, NH * HD)
    for what, (gt, xs, act, r) in (("output gate", (gate, att, "sigmoid", None)),
                                   ("SwiGLU", (gate_up[:, :I], gate_up[:, I:2 * I], "silu", None)),
                                   ("gated add", (gate_up[:, 2 * I:], y, "sigmoid", h))):
        want = nr.gate_mul_torch(gt, xs, torch.empty(d, xs.shape[1], device=dev, dtype=bf), act, r)
        got = nr.gate_mul_triton(gt, xs, torch.empty(d, xs.shape[1], device=dev, dtype=bf), act,
                                 None if r is None else r.clone())
        if what == "gated add":
            # one gate per row: Triton's and torch's sigmoid can round the row's gate to neighbouring bf16 values,
            # which scales the whole row's product by 2^-8 (on the H200 78-83% of the elements stayed equal):
            # the equal share is not a criterion there; the closeness allows that scaling of |y| < 4
            _bf16_close(got, want, what, equal_at_least=0.5, tol=2 ** -5)
        else:
            _bf16_close(got, want, what)
    geometry = Geometry(40, 256, 8, 248320, H, 512, S, NH, NKV, HD, tuple(range(40)))
    checks.check_zero_centred_kernels(geometry, RD, I, 1e-6, bf, torch.device(dev))


@pytest.mark.gpu
def test_tiny_decoder_on_gpu_with_and_without_the_kernels():
    """The tiny decoder (float32, CUDA): use_kernels("triton") checks and takes the fused kernels (with split-KV
    attention), and gives the torch path's MoE inputs, router logits, KV rows and logits."""
    from specmoe.models import load_model
    from specmoe.models.qwen3_5_moe_decode import Qwen35MoeDecoder
    from specmoe.offload.store import ExpertStore

    model, adapter = load_model("qwen3.5-moe-tiny", seed=0)
    rows = [r.cuda() for r in ExpertStore.from_model(model, adapter, pin=False).layers]
    model = model.cuda()
    tokens = torch.randint(0, model.config.vocab_size, (17,), generator=torch.Generator().manual_seed(3)).tolist()
    fused, plain = Qwen35MoeDecoder.from_model(model, 40), Qwen35MoeDecoder.from_model(model, 40)
    fused.use_kernels("triton", "auto", "slot", rows[0])
    assert fused.fused and fused.attention == "split_kv", fused.notes
    assert "gemv {}x{}".format(*fused.router_pair[0].shape) in fused.launch, fused.launch  # the router's launch
    plain.use_kernels("torch", "sdpa", "slot", rows[0])
    assert not plain.fused and not plain.linears.params
    compare_decoders(plain, fused, rows, tokens, dict(rtol=1e-4, atol=1e-4))
