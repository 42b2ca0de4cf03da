"""MLA's split-KV decode attention over a latent cache (`specmoe.kernels.split_kv.split_kv_latent_attention`)
against its torch reference `specmoe.kernels.mla.mla_decode_attention`: the CPU path and the input checks; the
Triton kernel in Triton's interpreter at small sizes (several D, positions, bf16 and float32); on a CUDA device at
Moonlight's sizes (R = 512, P = 64, 16 heads, S = 4096), and inside a CUDA graph whose position changes between
replays (marked gpu). The attention prologue (`mla_prologue_triton` against `mla_prologue_torch`) in the
interpreter and through Triton's compiler for the GPU."""

import importlib.util

import pytest
import torch

from _interpreter import run_in_interpreter

from specmoe.kernels import causal_step_mask
from specmoe.kernels.mla import mla_decode_attention
from specmoe.kernels.split_kv import make_split_kv_workspace, split_kv_latent_attention


def reference(q, cache, first, rank, scale):
    """mla_decode_attention in float32 with the causal mask of a step at position `first`."""
    positions = torch.arange(cache.shape[0], device=q.device)
    mask = causal_step_mask(positions, torch.tensor([first], device=q.device),
                            torch.empty(q.shape[0], cache.shape[0], device=q.device))
    return mla_decode_attention(q.float(), cache.float(), mask, scale, rank)


def inputs(num_q, heads, rank, rope, seq, dtype, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(num_q, heads, rank + rope, generator=g, device=device).to(dtype)
    cache = torch.randn(seq, rank + rope, generator=g, device=device).to(dtype)
    return q, cache


def test_cpu_call_is_the_reference(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, cache = inputs(3, 4, 32, 16, 40, torch.float32)
    ws = make_split_kv_workspace(3, 4, 32, 40, "cpu", num_kv_heads=1, rope_dim=16)
    out = torch.full((3, 4, 32), float("nan"))
    assert split_kv_latent_attention(q, cache, torch.tensor([20]), 0.2, out, ws) is out
    torch.testing.assert_close(out, reference(q, cache, 17, 32, 0.2))
    before = out.clone()
    cache[20:] = 1e3  # positions past seq_len never matter
    split_kv_latent_attention(q, cache, torch.tensor([20], dtype=torch.int32), 0.2, out, ws)
    torch.testing.assert_close(out, before)


def test_input_checks():
    q, cache = inputs(2, 4, 32, 16, 40, torch.float32)
    ws = make_split_kv_workspace(2, 4, 32, 40, "cpu", num_kv_heads=1, rope_dim=16)
    n, out = torch.tensor([5]), torch.empty(2, 4, 32)
    with pytest.raises(ValueError, match="workspace is for"):
        split_kv_latent_attention(q[:, :, :40].contiguous(), cache, n, 0.2, out, ws)
    with pytest.raises(ValueError, match="out must be"):
        split_kv_latent_attention(q, cache, n, 0.2, torch.empty(2, 128), ws)
    with pytest.raises(ValueError, match="share a dtype"):
        split_kv_latent_attention(q.bfloat16(), cache, n, 0.2, out, ws)
    with pytest.raises(ValueError, match="seq_len"):
        split_kv_latent_attention(q, cache, torch.tensor(5), 0.2, out, ws)
    with pytest.raises(ValueError, match="rope_dim > 0"):
        split_kv_latent_attention(q, cache, n, 0.2, out, make_split_kv_workspace(2, 4, 32, 40, "cpu"))
    with pytest.raises(ValueError, match="rope dim"):
        make_split_kv_workspace(2, 4, 32, 40, "cpu", num_kv_heads=1, rope_dim=12)
    with pytest.raises(ValueError, match="rope dim"):
        make_split_kv_workspace(2, 4, 32, 40, "cpu", rope_dim=16)  # one KV head


_INTERPRETED = r"""
import torch
from specmoe.kernels import causal_step_mask
from specmoe.kernels.mla import mla_decode_attention
from specmoe.kernels.split_kv import make_split_kv_workspace, split_kv_latent_attention
R, P, NH, S = 32, 16, 4, 72
for dtype in (torch.float32, torch.bfloat16):
    for D in (1, 3, 5):
        for n in sorted({D, D + 2, 37, S}):
            for splits in (1, 3):
                g = torch.Generator().manual_seed(D * 100 + n)
                q = torch.randn(D, NH, R + P, generator=g).to(dtype)
                cache = torch.randn(S, R + P, generator=g).to(dtype)
                cache[n:] = float("nan")  # never read
                ws = make_split_kv_workspace(D, NH, R, S, "cpu", num_kv_heads=1, rope_dim=P, num_splits=splits,
                                             block_n=16)
                out = torch.full((D, NH, R), float("nan"), dtype=dtype)
                split_kv_latent_attention(q, cache, torch.tensor([n], dtype=torch.int32), 0.15, out, ws)
                clean = torch.nan_to_num(cache.float(), nan=0.0)
                mask = causal_step_mask(torch.arange(S), torch.tensor([n - D]), torch.empty(D, S))
                ref = mla_decode_attention(q.float(), clean, mask, 0.15, R)
                tol = 1e-5 if dtype == torch.float32 else 2e-2
                assert out.dtype == dtype
                torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol), (dtype, D, n, splits)
print("latent split-KV ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_kernel_matches_the_reference_in_the_interpreter():
    done = run_in_interpreter(_INTERPRETED)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "latent split-KV ok" in done.stdout


MOONLIGHT = dict(rank=512, rope=64, heads=16, seq=4096)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_q", [1, 17])
def test_gpu_kernel_matches_the_reference_at_moonlight_sizes(dtype, num_q):
    m = MOONLIGHT
    q, cache = inputs(num_q, m["heads"], m["rank"], m["rope"], m["seq"], dtype, "cuda")
    ws = make_split_kv_workspace(num_q, m["heads"], m["rank"], m["seq"], "cuda", num_kv_heads=1, rope_dim=m["rope"])
    out = torch.empty(num_q, m["heads"], m["rank"], dtype=dtype, device="cuda")
    scale = 192 ** -0.5
    for n in (num_q, 100, 1000, 2049, m["seq"]):
        split_kv_latent_attention(q, cache, torch.tensor([n], device="cuda"), scale, out, ws)
        ref = reference(q, cache, n - num_q, m["rank"], scale)
        tol = 2e-3 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)


@pytest.mark.gpu
def test_gpu_kernel_in_a_cuda_graph_follows_the_position():
    m = MOONLIGHT
    q, cache = inputs(1, m["heads"], m["rank"], m["rope"], m["seq"], torch.bfloat16, "cuda", seed=1)
    ws = make_split_kv_workspace(1, m["heads"], m["rank"], m["seq"], "cuda", num_kv_heads=1, rope_dim=m["rope"])
    out = torch.empty(1, m["heads"], m["rank"], dtype=torch.bfloat16, device="cuda")
    seq_len = torch.tensor([10], dtype=torch.int32, device="cuda")
    split_kv_latent_attention(q, cache, seq_len, 0.1, out, ws)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        split_kv_latent_attention(q, cache, seq_len, 0.1, out, ws)
    for n in (10, 333, 4096, 7):
        seq_len.fill_(n)
        graph.replay()
        torch.testing.assert_close(out.float(), reference(q, cache, n - 1, m["rank"], 0.1), rtol=2e-2, atol=2e-2)


_PROLOGUE = r"""
import torch
from specmoe.kernels.mla import mla_prologue_torch, mla_prologue_triton
from specmoe.kernels.norm_rope import rope_tables
S = 24
for R, P, NH, nope in ((32, 16, 4, 8), (24, 12, 3, 8)):  # powers of two, and neither (masked lanes)
    cos, sin = rope_tables(P, 10000.0, S, "cpu")
    for dtype in (torch.float32, torch.bfloat16):
        for interleaved in (True, False):
            for D in (1, 3):
                g = torch.Generator().manual_seed(R + D)
                kv = torch.randn(D, R + P, generator=g).to(dtype)
                q = torch.randn(D, NH, nope + P, generator=g).to(dtype)
                q_lat = torch.randn(NH, D, R, generator=g).to(dtype)
                w = torch.randn(R, generator=g).to(dtype)
                first = torch.tensor([S - D - 2])
                outs = []
                for fn in (mla_prologue_torch, mla_prologue_triton):
                    cache = torch.full((S, R + P), 7.0, dtype=dtype)
                    query = torch.full((D, NH, R + P), 7.0, dtype=dtype)
                    assert fn(kv, q[..., nope:], q_lat, w, 1e-6, cos, sin, first, cache, query, interleaved) is query
                    outs.append((cache, query))
                (c0, q0), (c1, q1) = outs
                rows = slice(S - D - 2, S - 2)
                assert torch.equal(c0[:rows.start], c1[:rows.start]) and torch.equal(c0[rows.stop:], c1[rows.stop:])
                assert (c1[:rows.start] == 7).all() and (c1[rows.stop:] == 7).all()  # only the step's rows written
                # no reduction in the rotation or the query's copy: the same bits; the norm's sum may round otherwise
                assert torch.equal(q0, q1), (dtype, interleaved, D)
                assert torch.equal(c0[rows, R:], c1[rows, R:])
                tol = 1e-6 if dtype == torch.float32 else 1e-2
                torch.testing.assert_close(c1[rows, :R].float(), c0[rows, :R].float(), rtol=tol, atol=tol)
print("MLA prologue ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_prologue_kernel_matches_the_torch_version_in_the_interpreter():
    """Cache rows (normed latent, rotated k_pe) and queries (q_lat, rotated q_pe) of the step's positions, both rope
    layouts, float32 and bf16, shapes with and without padded lanes; the rows outside the step stay untouched."""
    done = run_in_interpreter(_PROLOGUE)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "MLA prologue ok" in done.stdout


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_prologue_kernel_compiles_for_the_gpu():
    """Triton's interpreter skips the compiler's type rules (the kernel's branch assigns pointers of two tensors):
    its launches at Moonlight's shapes, bf16 and float32, both layouts, go through the front end for an H200."""
    from specmoe.kernels.compiled import compile_launches
    from specmoe.kernels.mla import mla_prologue_triton
    from specmoe.kernels.norm_rope import rope_tables

    r, p, nh, nope, s = 512, 64, 16, 128, 64
    cos, sin = rope_tables(p, 10000.0, s, "cpu")
    with compile_launches() as compiled:
        for dtype in (torch.bfloat16, torch.float32):
            for interleaved in (True, False):
                q = torch.zeros(3, nh, nope + p, dtype=dtype)
                mla_prologue_triton(torch.zeros(3, r + p, dtype=dtype), q[..., nope:],
                                    torch.zeros(nh, 3, r, dtype=dtype), torch.ones(r, dtype=dtype), 1e-6, cos, sin,
                                    torch.tensor([0]),
                                    torch.zeros(s, r + p, dtype=dtype), torch.zeros(3, nh, r + p, dtype=dtype),
                                    interleaved)
    assert {name for name, _ in compiled} == {"_mla_prologue_kernel"} and len(compiled) == 4


def test_prologue_refuses_strided_outputs():
    from specmoe.kernels.mla import mla_prologue_triton

    with pytest.raises(ValueError, match="contiguous cache, query"):
        mla_prologue_triton(torch.zeros(1, 48), torch.zeros(1, 4, 16), torch.zeros(4, 1, 32), torch.ones(32), 1e-6,
                            torch.zeros(8, 8), torch.zeros(8, 8), torch.tensor([0]), torch.zeros(8, 48),
                            torch.zeros(1, 4, 96)[..., :48], False)
