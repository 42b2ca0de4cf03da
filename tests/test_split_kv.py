"""Split-KV decode attention (specmoe.kernels.split_kv): the torch reference against a per-query loop and the
input checks (CPU); the Triton kernel against the reference in Triton's interpreter (where Triton is
installed); on a CUDA device, the kernel against the reference and SDPA at several lengths, D = 1 and 17,
bf16 and fp32, and inside a CUDA graph whose seq_len changes between replays (marked gpu)."""

import importlib.util
import os

import pytest
import torch

from _interpreter import run_in_interpreter

from specmoe.kernels import decode_attention
from specmoe.kernels.split_kv import (make_split_kv_workspace, split_kv_attention, split_kv_attention_reference,
                                      split_kv_bytes, split_kv_config)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def loop_attention(q, k_cache, v_cache, n, scale):
    """Query i, head h: softmax over positions 0 .. n - D + i of KV head h // G, one at a time in float64."""
    num_q, num_heads, head_dim = q.shape
    group = num_heads // k_cache.shape[0]
    out = torch.empty(num_q, num_heads, head_dim, dtype=torch.float64)
    for i in range(num_q):
        last = n - num_q + i
        for h in range(num_heads):
            k = k_cache[h // group, : last + 1].double()
            v = v_cache[h // group, : last + 1].double()
            w = torch.softmax(k @ q[i, h].double() * scale, dim=0)
            out[i, h] = w @ v
    return out.reshape(num_q, num_heads * head_dim)


def make_inputs(num_q, num_heads, num_kv, head_dim, max_seq, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(num_q, num_heads, head_dim, generator=g, device=device).to(dtype)
    k = torch.randn(num_kv, max_seq, head_dim, generator=g, device=device).to(dtype)
    v = torch.randn(num_kv, max_seq, head_dim, generator=g, device=device).to(dtype)
    return q, k, v


@pytest.mark.parametrize("num_heads,num_kv,num_q", [(4, 4, 1), (4, 2, 1), (4, 2, 5), (8, 2, 17), (2, 1, 3)])
def test_reference_matches_a_per_query_loop(num_heads, num_kv, num_q):
    head_dim, max_seq = 16, 40
    q, k, v = make_inputs(num_q, num_heads, num_kv, head_dim, max_seq)
    for n in sorted({num_q, num_q + 1, 23, max_seq}):
        ref = split_kv_attention_reference(q, k, v, torch.tensor([n]), 0.3)
        assert ref.shape == (num_q, num_heads * head_dim) and ref.dtype == q.dtype
        torch.testing.assert_close(ref.double(), loop_attention(q, k, v, n, 0.3), rtol=1e-5, atol=1e-5)
    # positions past seq_len never matter
    k2, v2 = k.clone(), v.clone()
    k2[:, 23:], v2[:, 23:] = float("nan"), float("nan")
    n = torch.tensor([23], dtype=torch.int32)
    torch.testing.assert_close(split_kv_attention_reference(q, k2, v2, n, 0.3),
                               split_kv_attention_reference(q, k, v, n, 0.3))


def test_reference_in_bf16_rounds_once():
    q, k, v = make_inputs(3, 4, 2, 16, 32, dtype=torch.bfloat16)
    ref = split_kv_attention_reference(q, k, v, torch.tensor([20]), 0.25)
    assert ref.dtype == torch.bfloat16
    exact = loop_attention(q, k, v, 20, 0.25)
    # float32 throughout and one rounding at the end: within one bf16 rounding (2^-9 relative) of the exact value
    torch.testing.assert_close(ref.double(), exact, rtol=2 ** -8, atol=1e-5)


def test_cpu_call_computes_the_reference(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v = make_inputs(5, 4, 2, 16, 32)
    ws = make_split_kv_workspace(5, 4, 16, 32, "cpu", num_kv_heads=2)
    out = torch.full((5, 64), float("nan"))
    n = torch.tensor([9], dtype=torch.int64)
    assert split_kv_attention(q, k, v, n, 0.25, out, ws) is out
    torch.testing.assert_close(out, split_kv_attention_reference(q, k, v, n, 0.25))


def test_input_checks():
    q, k, v = make_inputs(2, 4, 2, 16, 32)
    ws = make_split_kv_workspace(2, 4, 16, 32, "cpu", num_kv_heads=2)
    out = torch.empty(2, 64)
    n = torch.tensor([5], dtype=torch.int32)

    def call(**kw):
        a = dict(q=q, k_cache=k, v_cache=v, seq_len=n, scale=0.25, out=out, workspace=ws)
        a.update(kw)
        return split_kv_attention(**a)

    with pytest.raises(ValueError, match=r"q must be \[D, NH, HD\]"):
        call(q=q[0])
    with pytest.raises(ValueError, match="must both be"):
        call(v_cache=v[:, :16])
    with pytest.raises(ValueError, match="multiple of the KV heads"):
        call(q=torch.randn(2, 3, 16), k_cache=k, v_cache=v)
    with pytest.raises(ValueError, match="head dim of q"):
        call(q=torch.randn(2, 4, 32))
    with pytest.raises(ValueError, match="share a dtype"):
        call(q=q.to(torch.bfloat16))
    with pytest.raises(ValueError, match="shape"):
        call(seq_len=torch.tensor(5))
    with pytest.raises(ValueError, match="int32 or int64"):
        call(seq_len=torch.tensor([5.0]))
    with pytest.raises(ValueError, match="out must be"):
        call(out=torch.empty(2, 63))
    with pytest.raises(ValueError, match="out must be"):
        call(out=torch.empty(2, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous"):
        call(q=torch.randn(2, 16, 4).transpose(1, 2))
    with pytest.raises(ValueError, match="workspace is for"):
        call(workspace=make_split_kv_workspace(3, 4, 16, 32, "cpu", num_kv_heads=2))
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="on q's device"):
            call(seq_len=n.cuda())
    meta = torch.tensor([5], dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match="on q's device"):
        call(seq_len=meta)
    with pytest.raises(ValueError, match="between the number of queries"):
        split_kv_attention_reference(q, k, v, torch.tensor([1]), 0.25)
    with pytest.raises(ValueError, match="between the number of queries"):
        split_kv_attention_reference(q, k, v, torch.tensor([33]), 0.25)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        make_split_kv_workspace(1, 6, 16, 32, "cpu", num_kv_heads=4)
    with pytest.raises(ValueError, match="power of two from 16 to 256"):
        make_split_kv_workspace(1, 4, 96, 32, "cpu")
    with pytest.raises(ValueError, match="power of two from 16 to 256"):
        make_split_kv_workspace(1, 4, 512, 32, "cpu")
    with pytest.raises(ValueError, match="do not fit"):
        make_split_kv_workspace(33, 4, 16, 32, "cpu")
    with pytest.raises(ValueError, match="unknown split-KV options"):
        make_split_kv_workspace(1, 4, 16, 32, "cpu", block_k=16)
    with pytest.raises(ValueError, match="one query row per KV head"):
        make_split_kv_workspace(2, 4, 16, 32, "cpu", block_m=1)
    with pytest.raises(ValueError, match="block_n"):
        make_split_kv_workspace(1, 4, 16, 32, "cpu", block_n=24)
    with pytest.raises(ValueError, match="bad split-KV options"):
        make_split_kv_workspace(1, 4, 16, 32, "cpu", num_splits=0)


def test_launch_depends_on_static_shapes_and_fills_the_gpu():
    olmoe = split_kv_config(1, 16, 16, 128, 4096)
    assert olmoe["block_m"] == 16 and olmoe["num_stages"] == 1 and 16 * olmoe["num_splits"] >= 4 * 132
    # a verification block: one wave of at most one program per SM (OLMoE: 8 splits of 16 heads, 128 programs)
    for d in (9, 17):
        block = split_kv_config(d, 16, 16, 128, 4096)
        assert block["block_m"] == (16 if d == 9 else 32) and block["num_splits"] == 8
    qwen = split_kv_config(17, 16, 2, 256, 4096)  # 136 rows per KV head: 5 blocks of 32, 2 KV heads
    assert qwen["block_m"] == 32 and 2 * 5 * qwen["num_splits"] <= 132 < 2 * 5 * (qwen["num_splits"] + 1)
    assert split_kv_config(17, 16, 16, 128, 4096, num_sms=8)["num_splits"] == 1  # fewer SMs than programs
    gqa = split_kv_config(1, 16, 2, 256, 4096)  # one query's rows of a GQA group: two programs per SM
    assert gqa["block_m"] == 16 and gqa["num_splits"] <= 4096 // gqa["block_n"]
    assert gqa["num_splits"] == min(4096 // gqa["block_n"], 2 * 132 // 2)  # at most one split per key block
    tiny = split_kv_config(1, 4, 4, 16, 8)
    assert tiny["num_splits"] >= 1
    ws = make_split_kv_workspace(17, 16, 128, 4096, "cpu")
    assert ws.partial_out.shape == (17 * 16, ws.num_splits, 128) and ws.partial_out.dtype == torch.float32
    assert ws.partial_lse.shape == (17 * 16, ws.num_splits)
    assert split_kv_bytes(1, 16, 16, 128, 4000, 2) == (2 * 16 * 4000 + 2 * 16) * 128 * 2


# -- the Triton kernel in the interpreter (CPU, where Triton is installed) --------------------------------------
_INTERPRETER_CHECK = r"""
import torch
from specmoe.kernels.split_kv import make_split_kv_workspace, split_kv_attention, split_kv_attention_reference
torch.manual_seed(0)
S, HD = 64, 16
cases = [(4, 2, 1, dict(block_n=16, num_splits=3)), (4, 2, 5, dict(block_n=16, num_splits=3)),
         (2, 2, 1, dict(block_n=16, num_splits=5)), (4, 2, 5, {})]
for NH, NKV, D, opts in cases:
    ws = make_split_kv_workspace(D, NH, HD, S, "cpu", num_kv_heads=NKV, **opts)
    q, k, v = torch.randn(D, NH, HD), torch.randn(NKV, S, HD), torch.randn(NKV, S, HD)
    for n in sorted({1, D, 7, 17, 33, S}):
        if n < D:
            continue
        k[:, n:], v[:, n:] = float("nan"), float("nan")  # unwritten positions must never be read
        for dtype in (torch.int32, torch.int64):
            seq_len = torch.tensor([n], dtype=dtype)
            out = torch.full((D, NH * HD), float("nan"))
            split_kv_attention(q, k, v, seq_len, 0.3, out, ws)
            ref = split_kv_attention_reference(q, k, v, seq_len, 0.3)
            err = (out - ref).abs().max().item()
            assert err < 1e-5, (NH, NKV, D, opts, n, err)
        k.normal_(), v.normal_()
print("split-kv ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_triton_kernel_matches_reference_in_the_interpreter():
    done = run_in_interpreter(_INTERPRETER_CHECK)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "split-kv ok" in done.stdout


# -- on a CUDA device --------------------------------------------------------------------------------------------
GPU_SHAPES = [(16, 16, 128), (16, 2, 256)]  # OLMoE (NH = NKV = 16, HD = 128); GQA as Qwen3.5-MoE-like models
MAX_SEQ = 4096
TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-4}


def gpu_lengths(num_q):
    """1, 7, 128, 1000, S; for D = 17 the shortest valid lengths are D and D + 7 (the block alone, and 7 more)."""
    return sorted({max(n, num_q) for n in (1, 7, 128, 1000, MAX_SEQ)} | ({num_q + 7} if num_q > 1 else set()))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("num_q", [1, 17])
@pytest.mark.parametrize("num_heads,num_kv,head_dim", GPU_SHAPES, ids=["olmoe", "gqa"])
def test_kernel_matches_reference_on_gpu(num_heads, num_kv, head_dim, num_q, dtype):
    q, k, v = make_inputs(num_q, num_heads, num_kv, head_dim, MAX_SEQ, dtype, "cuda")
    ws = make_split_kv_workspace(num_q, num_heads, head_dim, MAX_SEQ, "cuda", num_kv_heads=num_kv)
    out = torch.empty(num_q, num_heads * head_dim, dtype=dtype, device="cuda")
    seq_len = torch.zeros(1, dtype=torch.int32, device="cuda")
    scale = head_dim ** -0.5
    for n in gpu_lengths(num_q):
        kn, vn = k.clone(), v.clone()
        kn[:, n:], vn[:, n:] = float("nan"), float("nan")  # unwritten positions must never be read
        seq_len.fill_(n)
        out.fill_(float("nan"))
        split_kv_attention(q, kn, vn, seq_len, scale, out, ws)
        ref = split_kv_attention_reference(q, kn, vn, seq_len, scale)
        torch.testing.assert_close(out.float(), ref.float(), rtol=TOL[dtype], atol=TOL[dtype],
                                   msg=lambda m: f"seq_len {n}: {m}")


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads,num_kv,head_dim", GPU_SHAPES, ids=["olmoe", "gqa"])
def test_one_query_matches_the_engines_sdpa_path(num_heads, num_kv, head_dim):
    q, k, v = make_inputs(1, num_heads, num_kv, head_dim, MAX_SEQ, torch.bfloat16, "cuda", seed=1)
    ws = make_split_kv_workspace(1, num_heads, head_dim, MAX_SEQ, "cuda", num_kv_heads=num_kv)
    out = torch.empty(1, num_heads * head_dim, dtype=torch.bfloat16, device="cuda")
    scale = head_dim ** -0.5
    for n in (1, 7, 128, 1000, MAX_SEQ):
        mask = torch.full((1, MAX_SEQ), torch.finfo(torch.bfloat16).min, dtype=torch.bfloat16, device="cuda")
        mask[:, :n] = 0
        sdpa = decode_attention(q, k, v, mask, scale)[0]
        split_kv_attention(q, k, v, torch.tensor([n], device="cuda"), scale, out, ws)
        torch.testing.assert_close(out[0].float(), sdpa.float(), rtol=2e-2, atol=2e-2,
                                   msg=lambda m: f"seq_len {n}: {m}")


@pytest.mark.gpu
@pytest.mark.parametrize("num_q,first", [(1, 10), (17, 20)])
@pytest.mark.parametrize("num_heads,num_kv,head_dim", GPU_SHAPES, ids=["olmoe", "gqa"])
def test_one_captured_graph_serves_every_length(num_heads, num_kv, head_dim, num_q, first):
    dtype = torch.bfloat16
    q, k, v = make_inputs(num_q, num_heads, num_kv, head_dim, MAX_SEQ, dtype, "cuda", seed=2)
    ws = make_split_kv_workspace(num_q, num_heads, head_dim, MAX_SEQ, "cuda", num_kv_heads=num_kv)
    out = torch.empty(num_q, num_heads * head_dim, dtype=dtype, device="cuda")
    seq_len = torch.full((1,), first, dtype=torch.int32, device="cuda")
    scale = head_dim ** -0.5
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm up outside the capture
        split_kv_attention(q, k, v, seq_len, scale, out, ws)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        split_kv_attention(q, k, v, seq_len, scale, out, ws)
    for n in (first, 3000, first, MAX_SEQ, 3000):
        seq_len.fill_(n)
        out.fill_(float("nan"))
        graph.replay()
        ref = split_kv_attention_reference(q, k, v, seq_len, scale)
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2,
                                   msg=lambda m: f"replay at seq_len {n}: {m}")


@pytest.mark.gpu
@pytest.mark.parametrize("opts", [dict(block_m=1), dict(block_n=32), dict(block_n=32, num_stages=3),
                                  dict(block_n=128, num_warps=8), dict(num_splits=16), dict(num_splits=66),
                                  dict(num_stages=3)])
def test_benchmark_variants_are_correct(opts):
    """The launch variants that scripts/bench_attention.py times, at OLMoE shapes (D = 1)."""
    q, k, v = make_inputs(1, 16, 16, 128, MAX_SEQ, torch.bfloat16, "cuda", seed=3)
    ws = make_split_kv_workspace(1, 16, 128, MAX_SEQ, "cuda", **opts)
    out = torch.empty(1, 16 * 128, dtype=torch.bfloat16, device="cuda")
    for n in (1, 100, 1000, 4000):
        seq_len = torch.tensor([n], device="cuda")
        split_kv_attention(q, k, v, seq_len, 128 ** -0.5, out, ws)
        ref = split_kv_attention_reference(q, k, v, seq_len, 128 ** -0.5)
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
