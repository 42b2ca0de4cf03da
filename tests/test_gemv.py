"""The linear kernels of one row and of a few rows (`specmoe.kernels.gemv`): every launch candidate against the
exact product in Triton's interpreter on the CPU (float32 and bfloat16, ragged shapes and row counts, the float32
copy), compiled for an H200 on the CPU, their refusals, the dispatch (`linear`, `Linears`: a launch per shape and
row block, cuBLAS off CUDA and above ROWS_MAX rows); on a GPU (`gpu`) every candidate at OLMoE's shapes, the tuned
choices and their cache entries."""

import importlib.util
import json

import pytest
import torch
import torch.nn.functional as F

from _interpreter import run_in_interpreter

from specmoe.kernels.checks import check_gemv
from specmoe.kernels.gemv import CUBLAS, GEMV_CANDIDATES, ROWS_CANDIDATES, ROWS_MAX, Linears, linear, row_block

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")

_INTERPRETED = r"""
import torch, torch.nn.functional as F
from specmoe.kernels import checks
from specmoe.kernels.gemv import GEMV_CANDIDATES, gemv_triton
torch.manual_seed(0)
for n, k in ((5, 48), (64, 256), (33, 1100)):
    for dtype in (torch.float32, torch.bfloat16):
        w, x = torch.randn(n, k).to(dtype), torch.randn(1, k).to(dtype)
        exact = (w.double() @ x.double().T).T  # [1, n]
        for p in GEMV_CANDIDATES[1:]:
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
print("OK")
"""


@needs_triton
def test_every_candidate_against_the_exact_product_in_the_interpreter():
    """Ragged shapes (rows not a multiple of the row block, columns not of the column block), float32 and bf16:
    the bf16 result within one rounding of the exact product; the float32 copy holds the same values; the
    device self-check passes."""
    res = run_in_interpreter(_INTERPRETED)
    assert res.returncode == 0 and "OK" in res.stdout, res.stderr[-3000:]


@needs_triton
def test_every_candidate_compiles_for_the_gpu():
    """Each launch candidate, bf16 with and without the float32 copy, through Triton's front end for an H200."""
    from specmoe.kernels.checks import compile_launches
    from specmoe.kernels.gemv import gemv_triton

    w, x = torch.zeros(128, 2048, dtype=torch.bfloat16), torch.zeros(1, 2048, dtype=torch.bfloat16)
    with compile_launches() as compiled:
        for p in GEMV_CANDIDATES[1:]:
            gemv_triton(x, w, p, out=torch.zeros(1, 128, dtype=torch.bfloat16))
            gemv_triton(x, w, p, out32=torch.zeros(128))
    assert {name for name, _ in compiled} == {"_gemv_kernel"}
    assert len(compiled) == 2 * (len(GEMV_CANDIDATES) - 1)


@needs_triton
def test_refusals_name_the_problem():
    from specmoe.kernels.gemv import gemv_triton

    w = torch.zeros(8, 16)
    p = GEMV_CANDIDATES[1]
    with pytest.raises(ValueError, match="one contiguous row of 16 values"):
        gemv_triton(torch.zeros(2, 16), w, p)
    with pytest.raises(ValueError, match="one contiguous row"):
        gemv_triton(torch.zeros(1, 16, dtype=torch.bfloat16), w, p)
    with pytest.raises(ValueError, match="out32 must be 8 contiguous torch.float32"):
        gemv_triton(torch.zeros(1, 16), w, p, out32=torch.zeros(8, dtype=torch.float64))


def test_dispatch_runs_f_linear_off_the_kernel():
    """`linear` is F.linear, bit for bit, for cuBLAS's launch, no launch, and several rows with a launch the few-row
    kernel does not take (the float32 rows too: written by the GEMM itself for float32 inputs, the rounded values
    copied for bf16); `Linears` off CUDA chooses cuBLAS for every shape and row block and records it."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(12, 40, generator=g)
    for x in (torch.randn(1, 40, generator=g), torch.randn(3, 40, generator=g)):
        for params in (None, CUBLAS, GEMV_CANDIDATES[1] if x.shape[0] > 1 else None):
            out32 = torch.zeros(x.shape[0], 12)
            y = linear(x, w, params, out32)
            assert y is out32 and torch.equal(out32, F.linear(x, w))  # float32: the GEMM wrote the rows, no copy
            bf = torch.zeros(x.shape[0], 12)
            y = linear(x.bfloat16(), w.bfloat16(), params, bf)  # bf16: rounded first, then its float32 values
            assert y.dtype == torch.bfloat16 and torch.equal(bf, F.linear(x.bfloat16(), w.bfloat16()).float())
    # a launch given, but a strided row or weight, which the kernel does not take: F.linear
    x = torch.randn(1, 80, generator=g)[:, ::2]
    for xx, ww in ((x, w), (x.contiguous(), torch.randn(40, 12, generator=g).T)):
        assert torch.equal(linear(xx, ww, GEMV_CANDIDATES[1]), F.linear(xx, ww))
    lin, notes, launch = Linears(), [], {}
    lin.choose_rows(9, notes, launch)  # nothing chosen yet: nothing to do
    assert lin.params == {} and launch == {}
    lin.choose([w, torch.zeros(12, 40), torch.zeros(7, 40)], "auto", notes, launch, check_gemv)
    assert lin.params == {(12, 40, torch.float32, 1): CUBLAS, (7, 40, torch.float32, 1): CUBLAS}
    assert launch == {"gemv 12x40": {"params": CUBLAS, "source": "defaults"},
                      "gemv 7x40": {"params": CUBLAS, "source": "defaults"}}
    for rows in (1, 9, 16, 40):  # one row: chosen already; 9 and 16: one row block; above ROWS_MAX: F.linear
        lin.choose_rows(rows, notes, launch)
    assert lin.params == {(n, 40, torch.float32, b): CUBLAS for n in (12, 7) for b in (1, 16)}
    assert launch["gemv 7x40 D<=16"] == {"params": CUBLAS, "source": "defaults"} and len(launch) == 4
    for rows in (1, 5, 17, 40):
        x = torch.randn(rows, 40, generator=g)
        assert torch.equal(lin(x, w), F.linear(x, w))
    lin.clear()
    lin.choose_rows(17, notes, launch)
    assert lin.params == {} and len(launch) == 4
    assert [row_block(d) for d in (1, 2, 16, 17, ROWS_MAX, ROWS_MAX + 1)] == [1, 16, 16, 32, 32, 0]
    with pytest.raises(ValueError, match="tune must be"):
        lin.choose([w], "sometimes", notes, launch, check_gemv)


@pytest.mark.gpu
def test_candidates_tuning_and_cache_on_the_gpu(tmp_path, monkeypatch):
    """At OLMoE's and OLMo-1B's shapes in bf16: every one-row candidate, and every few-row candidate at 2, 9, 17
    and 32 rows, within one rounding of the product of the same bf16 inputs, its float32 copy equal;
    `Linears.choose` and `choose_rows` tune (cuBLAS among the candidates), write the cache, and a second choice
    reads it; the chosen launches reproduce their outputs."""
    monkeypatch.setenv("SPECMOE_TUNING_CACHE", str(tmp_path / "tuning.json"))
    from specmoe.kernels.gemv import gemm_rows_triton, gemv_triton

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    shapes = [(6144, 2048), (2048, 2048), (128, 2048), (2048, 8192), (50304, 2048)]
    weights = [torch.randn(n, k, device=dev, generator=g).to(torch.bfloat16) / k ** 0.5 for n, k in shapes]
    for w in weights:
        x = torch.randn(1, w.shape[1], device=dev, generator=g).to(torch.bfloat16)
        exact = (w.double() @ x.double().T).T
        for p in GEMV_CANDIDATES[1:]:
            out32 = torch.empty(w.shape[0], device=dev)
            out = gemv_triton(x, w, p)
            gemv_triton(x, w, p, out32=out32)
            assert torch.equal(out.float()[0], out32)
            ulp = exact.abs().clamp_min(1e-3) * 2.0 ** -7
            assert bool(((out.double() - exact).abs() <= ulp).all()), (w.shape, p)
        for rows in (2, 9, 17, ROWS_MAX):
            x = torch.randn(rows, w.shape[1], device=dev, generator=g).to(torch.bfloat16)
            exact = x.double() @ w.double().T
            for p in ROWS_CANDIDATES[1:]:
                out32 = torch.empty(rows, w.shape[0], device=dev)
                out = gemm_rows_triton(x, w, p)
                gemm_rows_triton(x, w, p, out32=out32)
                assert torch.equal(out.float(), out32)
                ulp = exact.abs().clamp_min(1e-3) * 2.0 ** -7
                assert bool(((out.double() - exact).abs() <= ulp).all()), (w.shape, rows, p)
    lin, notes, launch = Linears(), [], {}
    lin.choose(weights, "auto", notes, launch, check_gemv)
    for rows in (9, 17):
        lin.choose_rows(rows, notes, launch)
    assert {key: v["source"] for key, v in launch.items()} == {
        f"gemv {n}x{k}{rows}": "tuned" for n, k in shapes for rows in ("", " D<=16", " D<=32")}
    entries = json.loads((tmp_path / "tuning.json").read_text())["entries"]
    assert len([key for key in entries if '"kernel":"gemv"' in key]) == len(shapes)
    assert len([key for key in entries if '"kernel":"gemm_rows"' in key]) == 2 * len(shapes)
    again, notes2, launch2 = Linears(), [], {}
    again.choose(weights, "auto", notes2, launch2, check_gemv)
    for rows in (16, 32):
        again.choose_rows(rows, notes2, launch2)
    assert again.params == lin.params and {v["source"] for v in launch2.values()} == {"cache"}
    for rows in (1, 9, 17):
        x = torch.randn(rows, 2048, device=dev, generator=g).to(torch.bfloat16)
        assert torch.equal(lin(x, weights[1]), again(x, weights[1]))
    for key, entry in entries.items():  # the chosen launches and every candidate's time, as tuned
        print(json.loads(key)["kernel"], json.loads(key)["shape"], entry["params"], entry["times_ms"])


_DECODER = r"""
import numpy as np
import torch
from transformers import OlmoeConfig
from specmoe.kernels.gemv import CUBLAS, GEMV_CANDIDATES, ROWS_CANDIDATES
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

def run_block(params):  # the five positions as one step of D = 5 rows
    decoder = OlmoeDecoder.from_model(model, SEQ)
    c = decoder.geometry
    bufs = [torch.randn(C, 3 * c.hidden * c.inter, generator=torch.Generator().manual_seed(i)) * 0.2
            for i in range(c.num_layers)]
    decoder.use_kernels("triton", "sdpa", "slot", bufs[0], tune=False)
    if params is not None:  # before the step is made: its row block's launches are then kept
        decoder.linears.params.update({(*key[:3], 16): params for key in list(decoder.linears.params)})
    out = run_routed(decoder, bufs, ids, random_routes(5, c.num_layers, c.top_k, C, np.random.default_rng(4)),
                     SEQ, 5)
    return out, decoder

block, decoder = run_block(None)
one_row = [k for k in decoder.launch if k.startswith("gemv ") and "D<=" not in k]
assert len(one_row) == 3 and {k: v["params"] for k, v in decoder.launch.items() if "D<=" in k} == {
    f"{k} D<=16": CUBLAS for k in one_row}, decoder.launch  # made with the step (head and router: one shape)
torch.testing.assert_close(block, ref[0], rtol=1e-5, atol=1e-5)  # the block's rows are the one-row steps' logits
for params in (ROWS_CANDIDATES[1], ROWS_CANDIDATES[7]):
    out, decoder = run_block(params)
    torch.testing.assert_close(out, block, rtol=1e-5, atol=1e-5)
print("decoder ok")
""".replace("import numpy as np\n", "import numpy as np\n" + __import__("_interpreter").ROUTED_DECODE, 1)


@needs_triton
def test_olmoe_decoder_on_the_gemv_kernel_in_the_interpreter():
    """OLMoE's decoder (olmoe-micro, two layers, float32, Triton backend in the interpreter): its one-row GEMMs
    on two GEMV launches (forced: on the CPU the choice is cuBLAS's F.linear) give the head and router logits of
    F.linear within float32 noise and the same greedy tokens; the greedy head kernel's tokens are the argmax of
    the logits and its probabilities their softmax maximum. The same five positions as one step of five rows
    (the row block's launches chosen when the step is made): the one-row steps' logits on F.linear, and the
    same on two forced few-row launches."""
    res = run_in_interpreter(_DECODER)
    assert res.returncode == 0 and "decoder ok" in res.stdout, res.stderr[-3000:]


def test_a_launch_that_fails_its_check_falls_back_to_cublas(monkeypatch):
    """`Linears.choose` / `choose_rows` with tuned kernel launches whose check fails for one shape: that shape
    (at that row block) on cuBLAS, the reason noted; a passing shape keeps its launch; the few-row launch is
    checked at a ragged row count of its block."""
    import specmoe.kernels.gemv as gemv
    from specmoe.kernels.tuning import LaunchChoice

    monkeypatch.setattr(gemv, "gemv_launch_params", lambda tune, n, k, dtype, device, rows: LaunchChoice(
        dict((GEMV_CANDIDATES if rows == 1 else ROWS_CANDIDATES)[2]), "tuned", (f"[{n}, {k}] tuned at {rows}",)))
    checked = []

    def check(n, k, params, dtype, device, rows):
        checked.append((n, rows))
        if n == 7 and rows == 1 or n == 12 and rows > 1:
            raise RuntimeError(f"kernel [{n}, {k}] differs from the torch path: relative error 1")

    lin, notes, launch = Linears(), [], {}
    lin.choose([torch.zeros(12, 40), torch.zeros(7, 40)], "auto", notes, launch, check)
    lin.choose_rows(20, notes, launch)
    assert lin.params == {(12, 40, torch.float32, 1): GEMV_CANDIDATES[2], (7, 40, torch.float32, 1): CUBLAS,
                          (12, 40, torch.float32, 32): CUBLAS, (7, 40, torch.float32, 32): ROWS_CANDIDATES[2]}
    assert checked == [(12, 1), (7, 1), (12, 17), (7, 17)]
    assert launch["gemv 7x40"]["source"] == "defaults" and launch["gemv 12x40"]["source"] == "tuned"
    assert launch["gemv 12x40 D<=32"]["source"] == "defaults" and launch["gemv 7x40 D<=32"]["source"] == "tuned"
    assert any("linear kernel for [7, 40] unusable (RuntimeError: kernel [7, 40] differs" in n and "cuBLAS used" in n
               for n in notes), notes
    assert any(n.startswith("linear kernel for [12, 40] at up to 32 rows unusable") for n in notes), notes


_ROWS_INTERPRETED = r"""
import torch, triton
from specmoe.kernels import checks
from specmoe.kernels.gemv import ROWS_CANDIDATES, _rows_kernel, gemm_rows_triton, row_block
torch.manual_seed(0)
for n, k in ((5, 48), (40, 300), (33, 1100)):
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.randn(n, k).to(dtype)
        for d in (2, 9, 17, 32):
            x = torch.randn(d, k).to(dtype)
            exact = x.double() @ w.double().T  # [d, n]
            for p in ROWS_CANDIDATES[1:]:
                out = gemm_rows_triton(x, w, p)
                assert out.shape == (d, n) and out.dtype == dtype, (out.shape, out.dtype)
                if dtype == torch.float32:
                    torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-4)
                else:  # float32 sums of the exact bf16 products, one rounding
                    ulp = exact.abs().clamp_min(1e-3) * 2.0 ** -7
                    assert bool(((out.double() - exact).abs() <= ulp).all()), (n, k, d, p)
                out32 = torch.full((d, n), float("nan"))
                assert gemm_rows_triton(x, w, p, out32=out32) is None
                assert torch.equal(out32, out.float()), (n, k, d, p)  # the same values, as float32
                if dtype == torch.bfloat16 and d in (9, 17):  # PDL's first tile ahead of the wait: the same sums
                    outs = []
                    for first_tile in (False, True):
                        o, o32 = torch.zeros(d, n, dtype=dtype), torch.zeros(d, n)
                        _rows_kernel[(triton.cdiv(n, p["block_n"]),)](
                            x, w, o, o32, d, n, K=k, BLOCK_D=row_block(d), BLOCK_N=p["block_n"],
                            BLOCK_K=p["block_k"], STAGES=p["num_stages"], WRITE=True, WRITE32=True,
                            FIRST_TILE=first_tile)
                        outs.append((o, o32))
                    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1]), (n, k, d, p)
                    assert torch.equal(outs[0][0], out), (n, k, d, p)
        checks.check_gemv(n, k, ROWS_CANDIDATES[4], dtype, torch.device("cpu"), rows=9)
print("OK")
"""


@needs_triton
def test_every_few_row_candidate_against_the_exact_product_in_the_interpreter():
    """Ragged shapes and row counts (2, 9, 17, 32 rows: both row blocks, padded rows masked), float32 and bf16:
    within one rounding of the exact product (float32 in IEEE precision, not TF32); the float32 copy holds the same
    values; the first tile loaded ahead of the wait (PDL) sums the same bits; the device self-check passes."""
    res = run_in_interpreter(_ROWS_INTERPRETED)
    assert res.returncode == 0 and "OK" in res.stdout, res.stderr[-3000:]


@needs_triton
def test_every_few_row_candidate_compiles_for_the_gpu():
    """Each few-row launch candidate at both row blocks, bf16 with and without the float32 copy, through Triton's
    front end for an H200."""
    from specmoe.kernels.checks import compile_launches
    from specmoe.kernels.gemv import gemm_rows_triton

    w = torch.zeros(128, 2048, dtype=torch.bfloat16)
    with compile_launches() as compiled:
        for d in (9, 17):
            x = torch.zeros(d, 2048, dtype=torch.bfloat16)
            for p in ROWS_CANDIDATES[1:]:
                gemm_rows_triton(x, w, p, out=torch.zeros(d, 128, dtype=torch.bfloat16))
                gemm_rows_triton(x, w, p, out32=torch.zeros(d, 128))
    assert {name for name, _ in compiled} == {"_rows_kernel"}
    assert len(compiled) == 2 * 2 * (len(ROWS_CANDIDATES) - 1)
    assert {c["BLOCK_D"] for _, c in compiled} == {16, 32}


@needs_triton
def test_few_row_refusals_name_the_problem():
    from specmoe.kernels.gemv import gemm_rows_triton

    w = torch.zeros(8, 16)
    p = ROWS_CANDIDATES[1]
    for x in (torch.zeros(1, 16), torch.zeros(ROWS_MAX + 1, 16), torch.zeros(3, 12), torch.zeros(3, 16).T):
        with pytest.raises(ValueError, match=f"2 to {ROWS_MAX} contiguous rows of 16 values"):
            gemm_rows_triton(x, w, p)
    with pytest.raises(ValueError, match="tiles of at least 16 columns"):
        gemm_rows_triton(torch.zeros(3, 16), w, GEMV_CANDIDATES[1])
    with pytest.raises(ValueError, match="out must be 24 contiguous torch.float32"):
        gemm_rows_triton(torch.zeros(3, 16), w, p, out=torch.zeros(8))
