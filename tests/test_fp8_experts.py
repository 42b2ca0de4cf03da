"""FP8 experts (`specmoe.kernels.fp8`): the block quantiser against transformers' convention, the FP8 row, the
torch slot MoE paths over FP8 rows against the same paths over the dequantised weights (bitwise), the Triton
per-token and grouped kernels over FP8 rows in the interpreter (several 128 x 128 blocks and a partial one),
an OLMoE decoder running FP8 slot buffers through the Triton kernels (interpreter), and, marked gpu, the kernels at
Qwen3.6-35B-A3B's expert size (H 2048, I 512, 256 experts, top-8) and the OLMoE-1B-7B engine over an FP8 store."""

import collections
import importlib.util
import re

import numpy as np
import pytest
import torch
from _interpreter import ROUTED_DECODE, run_in_interpreter

from specmoe.kernels.fp8 import (FP8_BLOCK, dequantize_fp8, fp8_row_layout, fp8_rows_of, quantize_fp8,
                                 unpack_fp8_rows)
from specmoe.kernels.grouped_moe import slot_moe_grouped_torch, zipf_routes
from specmoe.kernels.moe import slot_moe_torch

HAS_TRITON = importlib.util.find_spec("triton") is not None


def experts(n, hidden, inter, seed=0):
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(n, 2 * inter, hidden, generator=g) * hidden ** -0.5
    down = torch.randn(n, hidden, inter, generator=g) * inter ** -0.5
    gate_up[0, :3, :5] *= 40.0  # one block with an outlier: its own scale
    return gate_up, down


def bf16_rows(fp8_rows, hidden, inter, dtype):
    """The dequantised rows in the model dtype: the bf16 reference's slot buffer."""
    gate_up, down = unpack_fp8_rows(fp8_rows, hidden, inter, dtype)
    return torch.cat([gate_up.flatten(1), down.flatten(1)], dim=1)


def test_quantiser_is_transformers_convention_and_round_trips():
    w = torch.randn(3, 300, 200) * 0.05
    w[1, 130:140, 10:20] = 0.0
    q, s = quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (3, 3, 2)
    # the convention: w ~ q.float() * scale_inv broadcast over each 128 x 128 block
    expand = s.repeat_interleave(FP8_BLOCK, 1).repeat_interleave(FP8_BLOCK, 2)[:, :300, :200]
    deq = dequantize_fp8(q, s)
    assert torch.equal(deq, q.float() * expand)
    torch.testing.assert_close(deq, w, rtol=0.07, atol=1e-3)
    assert torch.all(torch.log2(s) == torch.round(torch.log2(s)))  # power-of-two inverse scales
    assert q.float().abs().amax() <= 448
    # dequantised weights are exact in bf16, and quantising them again gives the same weights
    deq_bf16 = dequantize_fp8(q, s, torch.bfloat16)
    assert torch.equal(deq_bf16.float(), deq)
    q2, s2 = quantize_fp8(deq_bf16)
    assert torch.equal(dequantize_fp8(q2, s2), deq)


def test_row_layout_and_torch_paths_equal_the_dequantised_reference():
    h, i, c, k = 256, 160, 6, 4
    lay = fp8_row_layout(h, i)
    assert lay.gate_blocks == (2, 2) and lay.num_scales == 12 and lay.scale_offset % 16 == 0
    assert fp8_row_layout(2048, 512).width == 3 * 512 * 2048 + 192 * 4  # Qwen3.6: 3 MiB + 768 bytes of scales
    gate_up, down = experts(c, h, i)
    rows = fp8_rows_of(gate_up, down)
    assert rows.dtype == torch.uint8 and rows.shape == (c, lay.width)
    for dtype in (torch.float32, torch.bfloat16):
        ref_buf = bf16_rows(rows, h, i, dtype)
        gu, dn = unpack_fp8_rows(rows, h, i, dtype)
        torch.testing.assert_close(gu.float(), gate_up, rtol=0.07, atol=2e-3)
        torch.testing.assert_close(dn.float(), down, rtol=0.07, atol=2e-3)
        g = torch.Generator().manual_seed(1)
        route = zipf_routes(1, 5, k, c, 1.0, g)[0]
        x = torch.randn(5, h, generator=g).to(dtype)
        res = torch.randn(5, h, generator=g).to(dtype)
        out = slot_moe_grouped_torch(x, res, rows, route, torch.empty_like(x), h, i)
        ref = slot_moe_grouped_torch(x, res, ref_buf, route, torch.empty_like(x), h, i)
        assert torch.equal(out, ref)
        one = torch.empty(h, dtype=dtype)
        slot_moe_torch(x[0], res[0], rows, route[0], torch.empty(k, i, dtype=dtype), one, h, i)
        assert torch.equal(one, ref[0])


_KERNEL_CHECK = r"""
import torch
from specmoe.kernels.fp8 import fp8_rows_of, unpack_fp8_rows
from specmoe.kernels.grouped_moe import make_grouped_workspace, slot_moe_grouped_torch, slot_moe_grouped_triton, zipf_routes
from specmoe.kernels.moe import slot_moe_torch, slot_moe_triton

h, i, c, k = 256, 160, 6, 4  # gate/up: 2 x 2 blocks (the second row block partial), down: 2 x 2
g = torch.Generator().manual_seed(0)
gate_up = torch.randn(c, 2 * i, h, generator=g) * h ** -0.5
down = torch.randn(c, h, i, generator=g) * i ** -0.5
gate_up[2, 150:, 200:] *= 4.0  # a block of its own scale
rows = fp8_rows_of(gate_up, down)
for dtype in (torch.float32, torch.bfloat16):
    gu, dn = unpack_fp8_rows(rows, h, i, dtype)
    ref_buf = torch.cat([gu.flatten(1), dn.flatten(1)], dim=1)
    route = zipf_routes(1, 5, k, c, 1.0, g)[0]
    x = torch.randn(5, h, generator=g).to(dtype)
    res = torch.randn(5, h, generator=g).to(dtype)
    for pos in range(2):
        ref, out = torch.empty(h, dtype=dtype), torch.empty(h, dtype=dtype)
        slot_moe_torch(x[pos], res[pos], ref_buf, route[pos], torch.empty(k, i, dtype=dtype), ref, h, i)
        slot_moe_triton(x[pos], res[pos], rows, route[pos], torch.empty(k, i, dtype=dtype), out, h, i,
                        dict(block_n=16, block_k=64, block_h=32, block_k2=256, warps1=4, warps2=4))
        # the per-token kernel over FP8 rows is the same kernel over the dequantised rows
        same = torch.empty(h, dtype=dtype)
        slot_moe_triton(x[pos], res[pos], ref_buf, route[pos], torch.empty(k, i, dtype=dtype), same, h, i,
                        dict(block_n=16, block_k=64, block_h=32, block_k2=256, warps1=4, warps2=4))
        assert torch.equal(out, same), (dtype, pos)
        torch.testing.assert_close(out.float(), ref.float(), rtol=3e-2 if dtype == torch.bfloat16 else 1e-5,
                                   atol=3e-2 if dtype == torch.bfloat16 else 1e-5)
    ws = make_grouped_workspace(5, k, h, i, dtype, "cpu")
    ref = slot_moe_grouped_torch(x, res, ref_buf, route, torch.empty_like(x), h, i)
    out = slot_moe_grouped_triton(x, res, rows, route, torch.empty_like(x), h, i, ws,
                                  dict(block_n=32, block_k=64, block_h=32, block_k2=64))
    same = slot_moe_grouped_triton(x, res, ref_buf, route, torch.empty_like(x), h, i, ws,
                                   dict(block_n=32, block_k=64, block_h=32, block_k2=64))
    assert torch.equal(out, same), dtype
    wide = dict(block_n=128, block_k=256, block_h=128, block_k2=256)  # tiles of a whole block, K across blocks
    swapped = dict(block_n=64, block_k=64, block_h=128, block_k2=64, swap=1, swap2=1)  # weight rows as the M
    for params in (wide, swapped):
        assert torch.equal(slot_moe_grouped_triton(x, res, rows, route, torch.empty_like(x), h, i, ws, params),
                           slot_moe_grouped_triton(x, res, ref_buf, route, torch.empty_like(x), h, i, ws, params)), \
            (dtype, params)
    try:
        slot_moe_grouped_triton(x, res, rows, route, torch.empty_like(x), h, i, ws, dict(block_n=256))
        raise AssertionError("a tile of 256 rows over FP8 rows was accepted")
    except ValueError as exc:
        assert "at most 128 rows" in str(exc)
    torch.testing.assert_close(out.float(), ref.float(), rtol=3e-2 if dtype == torch.bfloat16 else 1e-5,
                               atol=3e-2 if dtype == torch.bfloat16 else 1e-5)
print("fp8 kernels ok")
"""


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
def test_triton_kernels_dequantise_fp8_rows_in_the_interpreter():
    done = run_in_interpreter(_KERNEL_CHECK, 900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "fp8 kernels ok" in done.stdout


_DECODER_CHECK = ROUTED_DECODE + r"""
import numpy as np
import torch
from transformers import OlmoeConfig
from specmoe.kernels.fp8 import fp8_rows_of, unpack_fp8_rows
from specmoe.models.olmoe import OLMOE_CONFIGS, build_random_olmoe
from specmoe.models.olmoe_decode import OlmoeDecoder

SEQ, C = 8, 16
model = build_random_olmoe(OlmoeConfig(**{**OLMOE_CONFIGS["olmoe-micro"], "num_hidden_layers": 2}), 0, torch.float32,
                           "cpu")
c = OlmoeDecoder.from_model(model, SEQ).geometry
k, num_layers = c.top_k, c.num_layers
g = torch.Generator().manual_seed(0)
fp8_bufs = [fp8_rows_of(torch.randn(C, 2 * c.inter, c.hidden, generator=g) * 0.3,
                        torch.randn(C, c.hidden, c.inter, generator=g) * 0.3) for _ in range(num_layers)]
deq_bufs = [torch.cat([t.flatten(1) for t in unpack_fp8_rows(b, c.hidden, c.inter, torch.float32)], 1)
            for b in fp8_bufs]
rng = np.random.default_rng(4)
routes = random_routes(5, num_layers, k, C, rng)
ids = rng.integers(0, c.vocab_size, 5)


def run(decoder, bufs, d):
    return run_routed(decoder, bufs, ids, routes, SEQ, d)


kernels = OlmoeDecoder.from_model(model, SEQ)
assert kernels.use_kernels("triton", "sdpa", "slot", fp8_bufs[0], tune=False)["backend"] == "triton", kernels.notes
assert kernels.grouped_moe, kernels.notes
reference = OlmoeDecoder.from_model(model, SEQ)
reference.use_kernels("torch", "sdpa", "slot", deq_bufs[0], tune=False)
ref = run(reference, deq_bufs, 1)
torch.testing.assert_close(run(kernels, fp8_bufs, 1), ref, rtol=1e-5, atol=1e-5)
torch.testing.assert_close(run(kernels, fp8_bufs, 5), ref, rtol=1e-5, atol=1e-5)
print("decoder ok")
"""


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
def test_a_decoder_runs_fp8_slot_buffers_through_the_triton_kernels_in_the_interpreter():
    """OLMoE's decoder (float32 olmoe-micro, two layers) on FP8 slot buffers with backend "triton": its kernel
    self-checks pass on FP8 rows, and single steps (per-token kernel) and a 5-position step (grouped kernel) give
    the torch decoder's logits over the dequantised rows."""
    done = run_in_interpreter(_DECODER_CHECK, 900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "decoder ok" in done.stdout


_REDUCE = re.compile(r'"tt\.reduce"\(%[\w.]+\) <\{axis = (\d+) : i32\}>.*?\}\) : \(tensor<([\dx]+)x(f32|bf16)', re.S)


def compiled_reductions(fn, args: dict, consts: dict, num_warps: int) -> list[tuple[int, int]]:
    """(axis extent, number of reduce ops of that extent) of a Triton kernel compiled for the H200 (sm_90) on
    this machine: no GPU needed, Triton's CUDA backend and its ptxas suffice."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {**args, **{k: "constexpr" for k in consts}}
    attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k, v in args.items() if v.startswith("*")}
    kernel = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=num_warps))
    extents = [int(shape.split("x")[int(axis)]) for axis, shape, _ in _REDUCE.findall(kernel.asm["ttgir"])]
    assert extents, "no reduction found in the compiled kernel"
    return sorted(collections.Counter(extents).items())


def _cuda_backend() -> bool:
    try:
        from triton.backends import backends
        return HAS_TRITON and "nvidia" in backends
    except ImportError:
        return False


@pytest.mark.skipif(not _cuda_backend(), reason="Triton's CUDA backend is not installed")
@pytest.mark.parametrize("inter", [1024, 512])  # OLMoE-1B-7B's and Qwen3.6-35B-A3B's expert widths (H 2048)
def test_per_token_kernels_reduce_in_an_order_that_no_layout_changes(inter):
    """Compiled for sm_90 (on the CPU), the per-token slot MoE kernels over FP8 rows and over bf16 rows sum the
    same products, but the compiler lays their weight tiles out differently (the uint8 load's 16 bytes per
    thread, the scales): a tl.sum over a tile's 256 columns then adds in another order, the float32 sums differ
    in a third of the rows, and about one layer step in six on OLMoE's shapes rounds an output to another bf16
    value, enough to flip near-tied experts downstream. The kernels must therefore reduce only pairs
    (`moe.row_sums`: a fixed tree whose every sum of two is the same either way round), for both row formats,
    with the default and every candidate launch parameters."""
    from specmoe.kernels.fp8 import FP8_BLOCK
    from specmoe.kernels.moe import MOE_CANDIDATES, MOE_DEFAULTS, _down_combine_kernel, _gate_up_act_kernel

    hidden, top_k = 2048, 8
    lay = fp8_row_layout(hidden, inter)
    formats = {"bf16": ("*bf16", 3 * hidden * inter, dict(FP8=False, SOFF=0, NI=1, NH=1, B=FP8_BLOCK)),
               "fp8": ("*u8", lay.width, dict(FP8=True, SOFF=lay.scale_offset, NI=lay.gate_blocks[0],
                                               NH=lay.gate_blocks[1], B=FP8_BLOCK))}
    for p in (MOE_DEFAULTS, MOE_CANDIDATES[5]):
        for name, (buf, width, fp8) in formats.items():
            gate_up = compiled_reductions(
                _gate_up_act_kernel, dict(x_ptr="*bf16", buf_ptr=buf, route_ptr="*i32", act_ptr="*bf16"),
                dict(H=hidden, I=inter, W=width, BLOCK_N=p["block_n"], BLOCK_K=p["block_k"], **fp8), p["warps1"])
            down = compiled_reductions(
                _down_combine_kernel,
                dict(act_ptr="*bf16", buf_ptr=buf, route_ptr="*i32", res_ptr="*bf16", out_ptr="*bf16"),
                dict(H=hidden, I=inter, W=width, TOP_K=top_k, BLOCK_H=p["block_h"], BLOCK_K=p["block_k2"], **fp8),
                p["warps2"])
            assert [e for e, _ in gate_up] == [2] and [e for e, _ in down] == [2], (name, p, gate_up, down)


# -- on a CUDA device, at Qwen3.6-35B-A3B's expert size ------------------------------------------------------------
H, I, E, K = 2048, 512, 256, 8


@pytest.fixture(scope="module")
def gpu_rows():
    gate_up, down = experts(E, H, I, seed=3)
    rows = fp8_rows_of(gate_up, down)
    return rows.cuda(), bf16_rows(rows, H, I, torch.bfloat16).cuda()


@pytest.mark.gpu
def test_per_token_kernel_on_fp8_rows_equals_the_dequantised_reference_on_gpu(gpu_rows):
    from specmoe.kernels.moe import slot_moe_triton

    rows, ref_buf = gpu_rows
    g = torch.Generator().manual_seed(5)
    for trial in range(4):
        route = zipf_routes(1, 1, K, E, 0.0, g, "cuda")[0, 0]
        x = torch.randn(H, generator=g).to("cuda", torch.bfloat16)
        res = torch.randn(H, generator=g).to("cuda", torch.bfloat16)
        act = torch.empty(K, I, device="cuda", dtype=torch.bfloat16)
        ref, out, same = (torch.empty_like(x) for _ in range(3))
        slot_moe_torch(x, res, ref_buf, route, act, ref, H, I)
        slot_moe_torch(x, res, rows, route, act, same, H, I)
        assert torch.equal(same, ref)  # the torch path dequantises exactly as the reference buffer holds
        slot_moe_triton(x, res, rows, route, act, out, H, I)
        bf16 = torch.empty_like(x)
        slot_moe_triton(x, res, ref_buf, route, act, bf16, H, I)
        assert torch.equal(out, bf16), trial  # same kernel, same dequantised weights: bitwise
        torch.testing.assert_close(out.float(), ref.float(), rtol=3e-2, atol=3e-2)  # a unit or two in bf16's last place


@pytest.mark.gpu
@pytest.mark.parametrize("swap", [0, 1], ids=["plain", "swapped"])
@pytest.mark.parametrize("d", [1, 9, 16])
def test_grouped_kernel_on_fp8_rows_equals_the_dequantised_reference_on_gpu(gpu_rows, d, swap):
    from specmoe.kernels.grouped_moe import make_grouped_workspace, slot_moe_grouped_triton

    rows, ref_buf = gpu_rows
    g = torch.Generator().manual_seed(d)
    route = zipf_routes(1, d, K, E, 1.2, g, "cuda")[0]
    x = torch.randn(d, H, generator=g).to("cuda", torch.bfloat16)
    res = torch.randn(d, H, generator=g).to("cuda", torch.bfloat16)
    ws = make_grouped_workspace(d, K, H, I, torch.bfloat16, "cuda")
    ref = slot_moe_grouped_torch(x, res, ref_buf, route, torch.empty_like(x), H, I)
    params = dict(swap=swap, swap2=swap)  # the tile product's form (`grouped_moe._tile_dot`): the tuner picks either
    out = slot_moe_grouped_triton(x, res, rows, route, torch.empty_like(x), H, I, ws, params).clone()
    bf16 = slot_moe_grouped_triton(x, res, ref_buf, route, torch.empty_like(x), H, I, ws, params)
    # not bitwise on the H200 (relative error about 7e-5, compiled tile order of the FP8 path), unlike the
    # per-token kernel and the interpreter
    assert float((out.float() - bf16.float()).norm() / bf16.float().norm()) < 1e-3
    torch.testing.assert_close(out.float(), ref.float(), rtol=3e-2, atol=3e-2)  # a unit or two in bf16's last place


@pytest.mark.gpu
def test_engine_over_an_fp8_store_decodes_as_over_the_dequantised_bf16_store_on_gpu():
    """OLMoE-1B-7B (the decoder with the GPU path: CUDA graphs, Triton kernels, cuda-python copies), random bf16
    experts rounded to FP8: PSR at C = 16 over the FP8 store (copies of FP8 rows) selects and decodes as over the
    bf16 store of the same weights, logits bitwise equal (both with the default launch parameters: the same
    per-token kernel over the same dequantised weights, whose row sums `moe.row_sums` fixes; prompt_len 8 is
    below the prompt chunk of 16, so every step is D = 1 and the grouped kernel never runs), and each slot holds
    its expert's FP8 row."""
    from specmoe.engines import EngineConfig, build_engine
    from specmoe.engines.helpers import random_model_on_device
    from specmoe.models.checkpoint import round_experts_to_fp8
    from specmoe.offload import ExpertStore
    from specmoe.routing import Calibration, preset

    model, adapter = random_model_on_device("olmoe-1b-7b", seed=0, dtype=torch.bfloat16, device="cuda")
    round_experts_to_fp8(model, adapter)
    stores = {"fp8": ExpertStore.from_model(model, adapter, fp8=True),
              "bf16": ExpertStore.from_model(model, adapter, fp8=False)}
    assert stores["fp8"].expert_bytes < 0.51 * stores["bf16"].expert_bytes
    cal = Calibration.uniform(adapter.num_moe_layers, adapter.num_experts, adapter.vocab_size)
    tokens = np.random.default_rng(2).integers(0, adapter.vocab_size, 32)
    runs = {}
    for name, store in stores.items():
        engine = build_engine(model, preset("psr", 16, adapter.top_k), cal, EngineConfig(max_seq_len=128, tune=False),
                              store=store)
        print(name, "engine notes:", engine.notes)
        runs[name] = engine.teacher_forced(tokens, prompt_len=8, return_logits=True)
        if name == "fp8":
            assert engine.residency.slots.data.dtype == torch.uint8
            copies = engine.residency.copies
            copies.synchronize()
            for layer in (0, 15):
                for slot in range(16):
                    expert = int(copies.content[layer, slot])
                    if expert >= 0:
                        assert torch.equal(engine.residency.slots.data[layer, slot].cpu(), store.expert(layer, expert))
        del engine
    np.testing.assert_array_equal(runs["fp8"].selected, runs["bf16"].selected)
    np.testing.assert_array_equal(runs["fp8"].output_tokens, runs["bf16"].output_tokens)
    np.testing.assert_array_equal(runs["fp8"].logits, runs["bf16"].logits)
    assert runs["fp8"].copy_totals()["issued"] > 0
