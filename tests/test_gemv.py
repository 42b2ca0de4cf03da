"""The one-row linear kernel (`specmoe.kernels.gemv`): every launch candidate against F.linear in Triton's
interpreter on the CPU (float32 and bfloat16, ragged shapes, the float32 copy), compiled for an H200 on the CPU,
its refusals, the dispatch (`linear`, `Linears`: cuBLAS off CUDA and for several rows); on a GPU (`gpu`) every
candidate at OLMoE's shapes, the tuned choice and its cache entry."""

import importlib.util
import json

import pytest
import torch
import torch.nn.functional as F

from _interpreter import run_in_interpreter

from specmoe.kernels.checks import check_gemv
from specmoe.kernels.gemv import CUBLAS, GEMV_CANDIDATES, Linears, linear, padded_rows

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")

_INTERPRETED = r"""
import torch, torch.nn.functional as F
from specmoe.kernels import checks
from specmoe.kernels.gemv import GEMV_CANDIDATES, gemv_triton, linear
torch.manual_seed(0)
for n, k in ((5, 48), (64, 256), (33, 1100)):
    for dtype in (torch.float32, torch.bfloat16):
        w, x = torch.randn(n, k).to(dtype), torch.randn(1, k).to(dtype)
        exact = (w.double() @ x.double().T).T  # [1, n]
        for p in GEMV_CANDIDATES:
            out = gemv_triton(x, w, p)
            assert out.shape == (1, n) and out.dtype == dtype, (out.shape, out.dtype)
            if dtype == torch.float32:
                torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-4)
            else:  # float32 sums of the exact bf16 products, one rounding: within a bf16 ulp of the exact value
                ulp = exact.abs().clamp_min(1e-3) * 2.0 ** -7
                assert bool(((out.double() - exact).abs() <= ulp).all()), (n, k, p)
            out32 = torch.full((n,), float("nan"))
            assert gemv_triton(x, w, p, out32=out32) is None
            assert torch.equal(out32, out.float()[0]), (n, k, p)  # the same values, as float32
            both = torch.zeros(n, dtype=dtype)
            out32.fill_(float("nan"))
            gemv_triton(x[0], w, p, out=both, out32=out32)
            assert torch.equal(both, out[0]) and torch.equal(out32, out.float()[0])
        checks.check_gemv(n, k, GEMV_CANDIDATES[3], dtype, torch.device("cpu"))
        # several rows in one launch: each row's values those of its own one-row launch, bit for bit; `linear`
        # takes them for a float32 copy of a small weight's product (a router's logits)
        xs = torch.randn(3, k).to(dtype)
        for p in (GEMV_CANDIDATES[0], GEMV_CANDIDATES[-1]):
            alone = torch.stack([gemv_triton(xs[i:i + 1], w, p)[0] for i in range(3)])
            out, out32 = torch.zeros(3, n, dtype=dtype), torch.full((3, n), float("nan"))
            assert gemv_triton(xs, w, p, out=out, out32=out32) is out
            assert torch.equal(out, alone) and torch.equal(out32, alone.float()), (n, k, p)
            out32.fill_(float("nan"))
            assert linear(xs, w, p, out32) is None and torch.equal(out32, alone.float())
print("OK")
"""


@needs_triton
def test_every_candidate_against_the_exact_product_in_the_interpreter():
    """Ragged shapes (rows not a multiple of the row block, columns not of the column block), float32 and bf16:
    the bf16 result within one rounding of the exact product; the float32 copy holds the same values; the
    device self-check passes."""
    res = run_in_interpreter(_INTERPRETED)
    assert res.returncode == 0 and "OK" in res.stdout, res.stderr[-3000:]


_TUNER = r"""
import torch
import specmoe.kernels.gemv as gemv
from specmoe.kernels.gemv import GEMV_CANDIDATES, tune_gemv
ran, timed_on = [], []
plain = gemv.linear
gemv.linear = lambda x, w, *a: timed_on.append(w) or plain(x, w, *a)
def every(candidates, run, what, launches=1):  # `fastest` without its timer: each candidate once, on the tuner's own inputs
    for i, cand in enumerate(candidates):
        run(cand)
        ran.append(i)
    return dict(candidates[0]), {i: 1.0 for i in ran}
gemv.fastest = every
for dtype in (torch.bfloat16, torch.float32):
    for weight in (None, torch.randn(40, 96).to(dtype)):  # a random weight, or the layer's own
        ran.clear(), timed_on.clear()
        tune_gemv(40, 96, dtype, "cpu", weight)
        assert ran == list(range(len(GEMV_CANDIDATES))), ran
        assert all(w is weight for w in timed_on) if weight is not None else timed_on[0].shape == (40, 96)
print("OK")
"""


@needs_triton
def test_the_tuner_runs_every_candidate_on_its_inputs():
    """`tune_gemv` times each candidate on inputs it makes itself; each must run on them (a candidate that raised
    there was skipped by the tuner without a word: the earlier cuBLAS candidate, whose float32 output had the wrong
    shape, never ran on the GPU). Given the layer's weight it times on that weight, not on a new random one."""
    res = run_in_interpreter(_TUNER)
    assert res.returncode == 0 and "OK" in res.stdout, res.stderr[-3000:]


@needs_triton
def test_every_candidate_compiles_for_the_gpu():
    """Each launch candidate, bf16 with and without the float32 copy, through Triton's front end for an H200."""
    from specmoe.kernels.compiled import compile_launches
    from specmoe.kernels.gemv import gemv_triton

    w, x = torch.zeros(128, 2048, dtype=torch.bfloat16), torch.zeros(1, 2048, dtype=torch.bfloat16)
    with compile_launches() as compiled:
        for p in GEMV_CANDIDATES:
            gemv_triton(x, w, p, out=torch.zeros(1, 128, dtype=torch.bfloat16))
            gemv_triton(x, w, p, out32=torch.zeros(128))
    assert {name for name, _ in compiled} == {"_gemv_kernel"}
    assert len(compiled) == 2 * len(GEMV_CANDIDATES)


@needs_triton
def test_refusals_name_the_problem():
    from specmoe.kernels.gemv import gemv_triton

    w = torch.zeros(8, 16)
    p = GEMV_CANDIDATES[1]
    with pytest.raises(ValueError, match="contiguous rows of 16 values"):
        gemv_triton(torch.zeros(2, 15), w, p)
    with pytest.raises(ValueError, match="contiguous rows"):
        gemv_triton(torch.zeros(1, 16, dtype=torch.bfloat16), w, p)
    with pytest.raises(ValueError, match="contiguous rows"):
        gemv_triton(torch.zeros(2, 32)[:, ::2], w, p)
    with pytest.raises(ValueError, match="out32 must be 1 x 8 contiguous torch.float32"):
        gemv_triton(torch.zeros(1, 16), w, p, out32=torch.zeros(8, dtype=torch.float64))
    with pytest.raises(ValueError, match="out must be 3 x 8 contiguous"):
        gemv_triton(torch.zeros(3, 16), w, p, out=torch.zeros(1, 8))


def test_dispatch_runs_f_linear_off_the_kernel(monkeypatch):
    """`linear` is F.linear, bit for bit, for cuBLAS's launch, no launch, and more than one row but where it takes
    the GEMV's rows (a float32 copy of a small weight's product; the float32 rows: written by the GEMM itself for
    float32 inputs, the rounded values copied for bf16); `Linears` off CUDA chooses cuBLAS for every shape and
    records it; a bias: F.linear."""
    import specmoe.kernels.gemv as gemv

    g = torch.Generator().manual_seed(3)
    w = torch.randn(12, 40, generator=g)
    small = gemv.ROWS_MAX_WEIGHT_BYTES
    monkeypatch.setattr(gemv, "ROWS_MAX_WEIGHT_BYTES", w.numel() * 2 - 1)  # w "large" (bf16 too): F.linear's rows
    for x in (torch.randn(1, 40, generator=g), torch.randn(3, 40, generator=g),
              torch.randn(gemv.ROWS_MAX + 1, 40, generator=g)):
        for params in (None, CUBLAS, GEMV_CANDIDATES[1] if x.shape[0] > 1 else None):
            if x.shape[0] > gemv.ROWS_MAX:
                monkeypatch.setattr(gemv, "ROWS_MAX_WEIGHT_BYTES", small)  # small, but too many rows: F.linear
            out32 = torch.zeros(x.shape[0], 12)
            y = linear(x, w, params, out32)
            assert y is out32 and torch.equal(out32, F.linear(x, w))  # float32: the GEMM wrote the rows, no copy
            bf = torch.zeros(x.shape[0], 12)
            y = linear(x.bfloat16(), w.bfloat16(), params, bf)  # bf16: rounded first, then its float32 values
            assert y.dtype == torch.bfloat16 and torch.equal(bf, F.linear(x.bfloat16(), w.bfloat16()).float())
        x3 = torch.randn(3, 40, generator=g)  # several rows without a float32 copy: F.linear, whatever the weight
        assert torch.equal(linear(x3, w, GEMV_CANDIDATES[1]), F.linear(x3, w))
    # a launch given, but a strided row or weight, which the kernel does not take: F.linear
    x = torch.randn(1, 80, generator=g)[:, ::2]
    for xx, ww in ((x, w), (x.contiguous(), torch.randn(40, 12, generator=g).T)):
        assert torch.equal(linear(xx, ww, GEMV_CANDIDATES[1]), F.linear(xx, ww))
    lin, notes, launch = Linears(), [], {}
    lin.choose([w, torch.zeros(12, 40), torch.zeros(7, 40)], "auto", notes, launch, check_gemv)
    assert lin.params == {(12, 40, torch.float32): CUBLAS, (7, 40, torch.float32): CUBLAS}
    assert launch == {"gemv 12x40": {"params": CUBLAS, "source": "defaults"},
                      "gemv 7x40": {"params": CUBLAS, "source": "defaults"}}
    x = torch.randn(1, 40, generator=g)
    assert torch.equal(lin(x, w), F.linear(x, w))
    bias = torch.randn(12, generator=g)
    lin.params[(12, 40, torch.float32)] = GEMV_CANDIDATES[1]  # a projection with a bias: F.linear, whatever the launch
    assert torch.equal(lin(x, w, bias=bias), F.linear(x, w, bias))
    with pytest.raises(ValueError, match="a bias and out32"):
        lin(x, w, torch.zeros(1, 12), bias=bias)
    with pytest.raises(ValueError, match="tune must be"):
        lin.choose([w], "sometimes", notes, launch, check_gemv)


@pytest.mark.gpu
def test_candidates_tuning_and_cache_on_the_gpu(tmp_path, monkeypatch):
    """At OLMoE's and OLMo-1B's one-row shapes in bf16: every candidate within one rounding of the float32
    product of the same bf16 inputs and its float32 copy equal; `Linears.choose` tunes, writes the cache (every
    candidate timed), and a second choice reads it; the chosen launch reproduces its outputs."""
    monkeypatch.setenv("SPECMOE_TUNING_CACHE", str(tmp_path / "tuning.json"))
    from specmoe.kernels.gemv import gemv_triton

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    shapes = [(6144, 2048), (2048, 2048), (128, 2048), (2048, 8192), (50304, 2048)]
    weights = [torch.randn(n, k, device=dev, generator=g).to(torch.bfloat16) / k ** 0.5 for n, k in shapes]
    for w in weights:
        x = torch.randn(1, w.shape[1], device=dev, generator=g).to(torch.bfloat16)
        exact = (w.double() @ x.double().T).T
        for p in GEMV_CANDIDATES:
            out32 = torch.empty(w.shape[0], device=dev)
            out = gemv_triton(x, w, p)
            gemv_triton(x, w, p, out32=out32)
            assert torch.equal(out.float()[0], out32)
            ulp = exact.abs().clamp_min(1e-3) * 2.0 ** -7
            assert bool(((out.double() - exact).abs() <= ulp).all()), (w.shape, p)
    lin, notes, launch = Linears(), [], {}
    lin.choose(weights, "auto", notes, launch, check_gemv)
    assert {key: v["source"] for key, v in launch.items()} == {f"gemv {n}x{k}": "tuned" for n, k in shapes}
    entries = json.loads((tmp_path / "tuning.json").read_text())["entries"]
    assert len([key for key in entries if '"kernel":"gemv"' in key]) == len(shapes)
    for entry in entries.values():  # every candidate timed: none skipped
        assert set(entry["times_ms"]) == {str(i) for i in range(len(GEMV_CANDIDATES))}, entry
    again, notes2, launch2 = Linears(), [], {}
    again.choose(weights, "auto", notes2, launch2, check_gemv)
    assert again.params == lin.params and {v["source"] for v in launch2.values()} == {"cache"}
    x = torch.randn(1, 2048, device=dev, generator=g).to(torch.bfloat16)
    assert torch.equal(lin(x, weights[1]), again(x, weights[1]))
    print({key: v["params"] for key, v in launch.items()})


_DECODER = r"""
import numpy as np
import torch
from transformers import OlmoeConfig
from specmoe.kernels.gemv import CUBLAS, GEMV_CANDIDATES
from specmoe.models.olmoe import OLMOE_CONFIGS, build_random_olmoe
from specmoe.models.olmoe_decode import OlmoeDecoder

SEQ, C = 8, 16
model = build_random_olmoe(OlmoeConfig(**{**OLMOE_CONFIGS["olmoe-micro"], "num_hidden_layers": 2}), 0, torch.float32,
                           "cpu")
g = torch.Generator().manual_seed(0)
rng = np.random.default_rng(4)
ids = rng.integers(0, 128, 5)

def run(params):
    decoder = OlmoeDecoder.from_model(model, SEQ)
    c = decoder.geometry
    bufs = [torch.randn(C, 3 * c.hidden * c.inter, generator=torch.Generator().manual_seed(i)) * 0.2
            for i in range(c.num_layers)]
    assert decoder.use_kernels("triton", "sdpa", "slot", bufs[0], tune=False)["backend"] == "triton", decoder.notes
    assert decoder.greedy_fused, decoder.notes
    assert all(v == CUBLAS for v in decoder.linears.params.values()), decoder.linears.params  # CPU: cuBLAS's path
    if params is not None:
        decoder.linears.params = {shape: params for shape in decoder.linears.params}
    routes = random_routes(5, c.num_layers, c.top_k, C, np.random.default_rng(4))
    step = decoder.step(1)
    logits, router, tokens, probs = [], [], [], []
    with torch.no_grad():
        for t in range(5):
            step.set_input(ids[t:t + 1], t, SEQ)
            for layer in range(c.num_layers):
                decoder.attention_router(step, layer)
                step.route_np[layer] = routes[t:t + 1, layer]
                decoder.moe(step, layer, bufs[layer])
            decoder.head(step)
            logits.append(step.out_logits.clone()); router.append(step.logits_dev.clone())
            tokens.append(step.next_dev.clone()); probs.append(step.next_prob.clone())
    return torch.cat(logits), torch.cat(router), torch.cat(tokens), torch.cat(probs)

ref = run(None)
assert torch.equal(ref[2], ref[0].argmax(-1))  # the greedy head kernel's tokens
torch.testing.assert_close(ref[3], torch.softmax(ref[0], -1).max(-1).values, rtol=1e-5, atol=1e-7)
for params in (GEMV_CANDIDATES[1], GEMV_CANDIDATES[6]):
    out = run(params)
    torch.testing.assert_close(out[0], ref[0], rtol=1e-5, atol=1e-5)  # head logits
    torch.testing.assert_close(out[1], ref[1], rtol=1e-5, atol=1e-5)  # router and pre-gate logits, float32
    assert torch.equal(out[2], ref[2])
print("decoder ok")
""".replace("import numpy as np\n", "import numpy as np\n" + __import__("_interpreter").ROUTED_DECODE, 1)


@needs_triton
def test_olmoe_decoder_on_the_gemv_kernel_in_the_interpreter():
    """OLMoE's decoder (olmoe-micro, two layers, float32, Triton backend in the interpreter): its one-row GEMMs
    on two GEMV launches (forced: on the CPU the choice is cuBLAS's F.linear) give the head and router logits of
    F.linear within float32 noise and the same greedy tokens; the greedy head kernel's tokens are the argmax of
    the logits and its probabilities their softmax maximum."""
    res = run_in_interpreter(_DECODER)
    assert res.returncode == 0 and "decoder ok" in res.stdout, res.stderr[-3000:]


def test_a_launch_that_fails_its_check_falls_back_to_cublas(monkeypatch):
    """`Linears.choose` with a tuned kernel launch whose check fails: that shape on cuBLAS, the reason noted; a
    passing shape keeps its launch."""
    import specmoe.kernels.gemv as gemv
    from specmoe.kernels.tuning import LaunchChoice

    monkeypatch.setattr(gemv, "gemv_launch_params", lambda tune, n, k, dtype, device, weight: LaunchChoice(
        dict(GEMV_CANDIDATES[2]), "tuned", (f"gemv [{n}, {k}] tuned",)))

    def check(n, k, params, dtype, device):
        if n == 7:
            raise RuntimeError("GEMV kernel [7, 40] differs from the torch path: relative error 1")

    lin, notes, launch = Linears(), [], {}
    lin.choose([torch.zeros(12, 40), torch.zeros(7, 40)], "auto", notes, launch, check)
    assert lin.params == {(12, 40, torch.float32): GEMV_CANDIDATES[2], (7, 40, torch.float32): CUBLAS}
    assert launch["gemv 7x40"]["source"] == "defaults" and launch["gemv 12x40"]["source"] == "tuned"
    assert any("GEMV kernel for [7, 40] unusable (RuntimeError: GEMV kernel [7, 40] differs" in n and "cuBLAS used" in n
               for n in notes), notes


def test_padded_rows_appends_zero_rows_to_the_multiple():
    w = torch.randn(1025, 16)
    padded = padded_rows(w, 8)
    assert padded.shape == (1032, 16) and torch.equal(padded[:1025], w) and not padded[1025:].any()
    assert padded_rows(padded, 8) is padded and padded_rows(w, 1) is w
    x = torch.randn(3, 16)
    out = F.linear(x, padded)  # the padding's outputs are zeros; the rows' own agree (a library may tile them otherwise)
    assert not out[:, 1025:].any()
    torch.testing.assert_close(out[:, :1025], F.linear(x, w), rtol=1e-6, atol=1e-6)
