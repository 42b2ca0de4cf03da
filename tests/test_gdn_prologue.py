"""The Gated DeltaNet's prologue and gated RMSNorm kernels (`specmoe.kernels.gdn`) against their torch versions:
in Triton's interpreter on the CPU at small shapes with Qwen3.5's structure (NK < NV, convolution width 4) for
D = 1, 2 (fewer positions than the convolution state's columns), 9, 16, 17 and 40 (more positions than the prologue
kernel's tile of 32), in float32 and bfloat16, the prologue also in tiles of one position (the order of the
kernel's former loop over positions) and of four, which must give the same bits; the decoder's whole Gated
DeltaNet mixer (`_linear_attention`) with and without the kernels on the tiny model; and the same on a CUDA device
(full Qwen3.6 head shapes, the decoder's choice and a CUDA-graph replay).

Tolerances: the copies (convolution input and state) are bitwise. The kernel rounds where the torch code rounds
(the convolution's float32 sum and silu to the model dtype, beta to the model dtype, the gated norm's two
roundings), so in bfloat16 v, beta and the gated norm are bitwise equal here; the float32 sums in another order
(the convolution's four terms, the L2 and RMS norms) and exp / log differ in the last float32 bits: float32
results within rtol 1e-5 (a few float32 ulp after a norm; decay's log1p by Kahan's formula is within a few ulp)."""

from __future__ import annotations

import pytest
import torch
from _interpreter import run_in_interpreter

from specmoe.kernels.gdn import triton as _triton

NAMES = ("state", "conv_in", "q", "k", "v", "decay", "beta")
FULL = (16, 32, 128, 128)  # Qwen3.6-35B-A3B: 16 key heads, 32 value heads, d_k = d_v = 128

_KERNEL_CHECK = r"""
import torch
from specmoe.kernels.gdn import (gated_rmsnorm, gated_rmsnorm_triton, gdn_prologue_torch, gdn_prologue_triton,
                                 prologue_outputs, random_prologue_inputs)
names = ("state", "conv_in", "q", "k", "v", "decay", "beta")
exact = {torch.float32: ("state", "conv_in"), torch.bfloat16: ("state", "conv_in", "v", "beta")}
cases = ((1, (2, 4, 16, 16)), (2, (2, 4, 32, 16)), (9, (2, 4, 16, 16)), (16, (2, 4, 16, 32)), (17, (2, 4, 32, 16)),
         (40, (1, 2, 16, 16)))  # D = 40: a tile of 32 positions and one of 8
for dtype in (torch.float32, torch.bfloat16):
    for d, heads in cases:
        inputs = random_prologue_inputs(d, heads, 4, dtype, "cpu", seed=d)
        results = []
        for prologue in (gdn_prologue_torch, gdn_prologue_triton, lambda *a: gdn_prologue_triton(*a, block_t=1),
                         lambda *a: gdn_prologue_triton(*a, block_t=4)):
            proj, weight, A, dt_bias, state = (t.clone() for t in inputs)
            outs = prologue_outputs(d, heads, 4, dtype, "cpu")
            prologue(proj, weight, A, dt_bias, state, *outs)
            results.append((state,) + outs)
        for name, ref, out, *tiled in zip(names, *results):
            if name in exact[dtype]:
                assert torch.equal(ref, out), (dtype, d, name)
            else:
                torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6, msg=f"{dtype} {d} {name}")
            # one position per tile (the per-position order) and tiles of 4: the same bits as one tile of D
            assert all(torch.equal(out, other) for other in tiled), (dtype, d, name)
        nv, dv = heads[1], heads[3]
        x = torch.randn(d, nv, dv, generator=torch.Generator().manual_seed(d))
        gate = torch.randn(d, 2 * nv * dv + 3, generator=torch.Generator().manual_seed(d + 1)).to(dtype)
        gate = gate[:, 3:3 + nv * dv].view(d, nv, dv)  # a strided view, as the decoder's slice of in_proj's output
        weight = torch.randn(dv).to(dtype)
        ref, out = gated_rmsnorm(x.to(dtype), gate, weight, 1e-6), gated_rmsnorm_triton(x, gate, weight, 1e-6)
        if dtype == torch.bfloat16:
            assert torch.equal(ref, out), d
        else:
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
print("kernels ok")
"""


@pytest.mark.skipif(_triton is None, reason="Triton is not installed")
def test_prologue_and_gated_norm_kernels_in_the_interpreter_match_torch():
    done = run_in_interpreter(_KERNEL_CHECK)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "kernels ok" in done.stdout


def compare_mixers(device: str, dtype: torch.dtype, kernel: str, fused: dict, tol: float) -> None:
    """Layer 0's `_linear_attention` of the tiny model over a verification block of 16 positions and then one
    position, from the same random state: the torch path against the recurrence `kernel` and the fused kernels
    (`fused`: the decoder's `gdn_fused`); outputs, states and the step's buffers agree (relative L2 error below
    tol; the copies bitwise)."""
    from specmoe.models import load_model
    from specmoe.models.qwen3_5_moe_decode import Qwen35MoeDecoder

    model, _ = load_model("qwen3.5-moe-tiny", seed=0)
    model = model.to(device=device, dtype=dtype)
    decoders = [Qwen35MoeDecoder.from_model(model, 40) for _ in range(2)]
    torch_path, fast = decoders
    fast.gdn_kernel, fast.gdn_fused = kernel, fused
    g = torch.Generator(device=device).manual_seed(1)
    for d in (16, 1):
        x = torch.randn(d, model.config.hidden_size, device=device, generator=g).to(dtype)
        results = []
        for dec in decoders:
            dec.randomize_cache(d)
            step = dec.step(d)
            with torch.no_grad():
                out = dec._linear_attention(step, 0, x)
            w = step.work
            results.append([out, dec.recurrent_state[0], w["gdn_q"][0], w["gdn_k"][0], w["gdn_v"][0],
                            w["gdn_decay"][0], w["gdn_beta"][0], dec.conv_state[0], w["conv_in"][0]])
        for n, (ref, got) in enumerate(zip(*results)):
            if n >= 7:
                assert torch.equal(ref, got), (d, n)
            else:
                err = float((got.float() - ref.float()).norm() / ref.float().norm())
                assert err < tol, (d, n, err)


_DECODER_CHECK = r"""
import sys
import torch
sys.path.insert(0, "tests")
from test_gdn_prologue import compare_mixers
compare_mixers("cpu", torch.float32, "triton", {"prologue": True, "norm": True}, 1e-5)
print("mixer ok")
"""


@pytest.mark.skipif(_triton is None, reason="Triton is not installed")
def test_decoder_mixer_with_the_kernels_in_the_interpreter_matches_torch():
    """The whole Gated DeltaNet mixer with the prologue, our recurrence and the gated norm as Triton kernels (in the
    interpreter) against the torch path, float32 (a few float32 ulp apart: relative error below 1e-5)."""
    done = run_in_interpreter(_DECODER_CHECK)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "mixer ok" in done.stdout


# -- on a CUDA device --------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("d", [1, 9, 16, 17, 40])
def test_gpu_prologue_and_gated_norm_match_torch_at_full_shapes(d):
    """bfloat16 at Qwen3.6's heads: the copies bitwise; the rest within float32 noise and the device's exp / rsqrt
    (relative L2 error below 1e-3; a convolution sum one float32 ulp apart can round to the neighbouring bfloat16,
    so not bitwise)."""
    from specmoe.kernels import checks
    from specmoe.kernels.gdn import (gated_rmsnorm, gated_rmsnorm_triton, gdn_prologue_torch, gdn_prologue_triton,
                                     prologue_outputs, random_prologue_inputs)

    inputs = random_prologue_inputs(d, FULL, 4, torch.bfloat16, "cuda", seed=d)
    results = []
    for prologue in (gdn_prologue_torch, gdn_prologue_triton):
        proj, weight, A, dt_bias, state = (t.clone() for t in inputs)
        outs = prologue_outputs(d, FULL, 4, torch.bfloat16, "cuda")
        prologue(proj, weight, A, dt_bias, state, *outs)
        results.append((state,) + outs)
    torch.cuda.synchronize()
    for name, ref, out in zip(NAMES, *results):
        if name in ("state", "conv_in"):
            assert torch.equal(ref, out), name
        else:
            assert checks.relative_error(ref, out) < 1e-3, (name, checks.relative_error(ref, out))
    nv, dv = FULL[1], FULL[3]
    proj = inputs[0]
    gate = proj[:, 2 * FULL[0] * FULL[2] + nv * dv:][:, :nv * dv].view(d, nv, dv)
    x = torch.randn(d, nv, dv, device="cuda")
    weight = torch.randn(dv, device="cuda").bfloat16()
    ref, out = gated_rmsnorm(x.bfloat16(), gate, weight, 1e-6), gated_rmsnorm_triton(x, gate, weight, 1e-6)
    assert checks.relative_error(ref, out) < 1e-3


@pytest.mark.gpu
def test_gpu_decoder_chooses_the_kernels_and_its_mixer_matches_torch():
    """The tiny model in bfloat16 on CUDA: `use_kernels` checks and chooses the fused kernels (and a Triton or fla
    recurrence); layer 0's mixer then matches the torch path's."""
    from specmoe.models import load_model
    from specmoe.models.qwen3_5_moe_decode import Qwen35MoeDecoder
    from specmoe.offload.store import ExpertStore

    model, adapter = load_model("qwen3.5-moe-tiny", seed=0)
    slot_buf = ExpertStore.from_model(model, adapter, pin=False).layers[0].to("cuda", torch.bfloat16)
    dec = Qwen35MoeDecoder.from_model(model.to("cuda", torch.bfloat16), 40)
    kernels = dec.use_kernels("auto", "auto", "slot", slot_buf, tune=False)
    print(dec.notes)
    assert dec.gdn_fused == {"prologue": True, "norm": True}, dec.notes
    assert kernels["gdn"] in ("triton", "fla"), dec.notes
    compare_mixers("cuda", torch.bfloat16, kernels["gdn"], dec.gdn_fused, 2e-2)


@pytest.mark.gpu
def test_gpu_mixer_with_the_kernels_replays_in_a_cuda_graph():
    """The mixer's launches (in_proj, prologue, recurrence, gated norm, out_proj) captured once and replayed from
    the same state give the eager run's output and state."""
    from specmoe.models import load_model
    from specmoe.models.qwen3_5_moe_decode import Qwen35MoeDecoder

    model, _ = load_model("qwen3.5-moe-tiny", seed=0)
    dec = Qwen35MoeDecoder.from_model(model.to("cuda", torch.bfloat16), 40)
    dec.gdn_kernel, dec.gdn_fused = "triton", {"prologue": True, "norm": True}
    step = dec.step(16)
    x = torch.randn(16, model.config.hidden_size, device="cuda").bfloat16()
    with torch.no_grad():
        dec.randomize_cache(0)
        want = dec._linear_attention(step, 0, x).clone()
        state = dec.recurrent_state[0].clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the graph, then capture
            dec._linear_attention(step, 0, x)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = dec._linear_attention(step, 0, x)
        dec.randomize_cache(0)
        start = dec.recurrent_state[0].clone()
        graph.replay()
    torch.cuda.synchronize()
    assert not torch.equal(dec.recurrent_state[0], start)  # the replay advanced the state
    for ref, got in ((want, out), (state, dec.recurrent_state[0])):  # (cuBLAS may pick another algorithm inside)
        err = float((got.float() - ref.float()).norm() / ref.float().norm())
        assert err < 1e-2, err
