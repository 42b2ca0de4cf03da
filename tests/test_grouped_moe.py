"""The grouped slot-indexed MoE (`specmoe.kernels.grouped_moe`): its torch reference against the per-token one,
the Triton kernels in the interpreter on the CPU (small shapes, D in {1, 5, 17}, fp32 and bf16, positions
sharing slots, every position on the same slots, a slot repeated within a position, more pairs than slots
and fewer), OLMoE's decoder choosing it for steps of D > 1 (interpreter), and, marked gpu, the kernels at
OLMoE-1B-7B's size against the reference, inside a captured CUDA graph whose routes change between replays,
and against the per-token kernel."""

import importlib.util
import os

import pytest
import torch
from _interpreter import ROUTED_DECODE, run_in_interpreter

from specmoe.kernels.grouped_moe import (default_block_m, grouped_moe_bytes, grouped_params, make_grouped_workspace,
                                         slot_moe_grouped, slot_moe_grouped_torch, zipf_routes)
from specmoe.kernels.moe import slot_moe_torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAS_TRITON = importlib.util.find_spec("triton") is not None


def make_case(num_positions, top_k, hidden, inter, num_slots, dtype=torch.float32, device="cpu", seed=0,
              exponent=1.2):
    g = torch.Generator().manual_seed(seed)
    buf = (torch.randn(num_slots, 3 * hidden * inter, generator=g) * hidden ** -0.5).to(device=device, dtype=dtype)
    x = torch.randn(num_positions, hidden, generator=g).to(device=device, dtype=dtype)
    res = torch.randn(num_positions, hidden, generator=g).to(device=device, dtype=dtype)
    route = zipf_routes(1, num_positions, top_k, num_slots, exponent, g, device)[0]
    return buf, x, res, route


def test_reference_is_the_per_token_reference_at_every_position():
    d, k, h, i, c = 5, 4, 16, 8, 7
    buf, x, res, route = make_case(d, k, h, i, c)
    route[2, :k] = route[1, :k].flip(0)  # positions sharing all their slots
    out = slot_moe_grouped_torch(x, res, buf, route, torch.empty_like(x), h, i)
    for pos in range(d):
        one = torch.empty(h)
        slot_moe_torch(x[pos], res[pos], buf, route[pos], torch.empty(k, i), one, h, i)
        assert torch.equal(out[pos], one)
    ws = make_grouped_workspace(d, k, h, i, torch.float32, "cpu")
    alias = res.clone()  # out may alias the residual, as in the decoder
    assert slot_moe_grouped_torch(x, alias, buf, route, alias, h, i, ws) is alias
    assert torch.equal(alias, out)
    # the definition, in float64: out_i = res_i + sum_j w_ij * down(silu(gate x_i) * up x_i)
    expect = res.double().clone()
    for pos in range(d):
        for j in range(k):
            row = buf[route[pos, j]].double()
            gate, up, down = row[: i * h].view(i, h), row[i * h: 2 * i * h].view(i, h), row[2 * i * h:].view(h, i)
            w = route[pos, k + j].view(torch.float32).double()
            expect[pos] += w * down @ (torch.nn.functional.silu(gate @ x[pos].double()) * (up @ x[pos].double()))
    torch.testing.assert_close(out.double(), expect, rtol=1e-5, atol=1e-5)


def test_cpu_call_without_the_interpreter_computes_the_reference(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    d, k, h, i, c = 3, 2, 16, 8, 5
    buf, x, res, route = make_case(d, k, h, i, c, dtype=torch.bfloat16)
    ws = make_grouped_workspace(d, k, h, i, torch.bfloat16, "cpu")
    out = slot_moe_grouped(x, res, buf, route, torch.empty_like(x), h, i, ws, backend="triton")
    assert torch.equal(out, slot_moe_grouped_torch(x, res, buf, route, torch.empty_like(x), h, i))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_kernels_compile_for_the_gpu_with_and_without_late_slots():
    """Triton's interpreter skips the compiler's type rules: the grouped MoE's launches (bf16 and float32, with and
    without late slots) go through Triton's front end for an H200 here (`compile_launches`: nothing is computed)."""
    from specmoe.kernels.compiled import compile_launches
    from specmoe.kernels.grouped_moe import slot_moe_grouped_triton

    h, inter, k, slots = 64, 32, 2, 8
    waits = []
    with compile_launches() as compiled:
        for dtype in (torch.bfloat16, torch.float32):
            for d in (9, 17):
                x = torch.zeros(d, h, dtype=dtype)
                route = torch.zeros(d, 2 * k, dtype=torch.int32)
                buf = torch.zeros(slots, 3 * h * inter, dtype=dtype)
                ws = make_grouped_workspace(d, k, h, inter, dtype, "cpu")
                for late in (None, (3, lambda: waits.append(1))):
                    slot_moe_grouped_triton(x, x, buf, route, torch.empty_like(x), h, inter, ws, late=late)
    assert {name for name, _ in compiled} == {"_group_slots_kernel", "_grouped_gate_up_kernel",
                                              "_grouped_down_kernel", "_combine_kernel"}
    assert len(waits) == 4  # the late phase waited once per call


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_every_tuning_candidate_compiles_for_the_gpu():
    """Each of GATE_UP_CANDIDATES and DOWN_CANDIDATES (the tuner's choices, `tune_grouped_moe`) goes through
    Triton's front end for an H200 at D = 17 in bf16 (a candidate that did not would only be skipped by the tuner,
    silently); each launch carries its kernel's own warps and stages."""
    from specmoe.kernels import grouped_moe as gm
    from specmoe.kernels.compiled import compile_launches

    h, inter, k, slots, d = 256, 128, 2, 8, 17
    x = torch.zeros(d, h, dtype=torch.bfloat16)
    route = torch.zeros(d, 2 * k, dtype=torch.int32)
    buf = torch.zeros(slots, 3 * h * inter, dtype=torch.bfloat16)
    ws = make_grouped_workspace(d, k, h, inter, torch.bfloat16, "cpu")
    with compile_launches() as compiled:
        for cand in gm.GATE_UP_CANDIDATES:
            gm._launch_gate_up(x, buf, route, ws, 0, slots, grouped_params(d, cand))
        for cand in gm.DOWN_CANDIDATES:
            gm._launch_down(buf, route, ws, 0, slots, grouped_params(d, cand))
    tiles = [(name, c["BLOCK_N"] if "BLOCK_N" in c else c["BLOCK_H"], c["BLOCK_K"]) for name, c in compiled]
    assert tiles == [("_grouped_gate_up_kernel", c["block_n"], c["block_k"]) for c in gm.GATE_UP_CANDIDATES] + \
        [("_grouped_down_kernel", c["block_h"], c["block_k2"]) for c in gm.DOWN_CANDIDATES]


def test_tuner_picks_gate_up_and_down_apart(monkeypatch):
    """`tune_grouped_moe` times each weight kernel alone over its own candidates, each timing a CUDA graph's worth
    of launches over TUNE_ROUTES routes of TUNE_ZIPF (stand-ins for the launches and for `fastest`'s timings): the
    choice joins the fastest of each, is one of GROUPED_CANDIDATES (what the tuning cache accepts), and the times
    name the kernel and candidate, per call."""
    from specmoe.kernels import grouped_moe as gm

    launched, drawn, benches = [], [], []
    monkeypatch.setattr(gm, "_launch_grouping", lambda route, ws, c: launched.append(("grouping", c)))
    monkeypatch.setattr(gm, "_launch_gate_up", lambda x, buf, route, ws, lo, hi, p: launched.append(("up", p)))
    monkeypatch.setattr(gm, "_launch_down", lambda buf, route, ws, lo, hi, p: launched.append(("down", p)))
    plain_routes = gm.zipf_routes
    monkeypatch.setattr(gm, "zipf_routes", lambda *a: drawn.append((a[0], a[4])) or plain_routes(*a))
    fast_up = {**gm.GATE_UP_CANDIDATES[0], "block_n": 32, "block_k": 128, "warps": 2, "stages": 3}
    fast_down = {**gm.DOWN_CANDIDATES[0], "block_h": 16, "block_k2": 256, "warps2": 4, "stages2": 3}

    def fastest(candidates, run, what, bench=None, launches=1):  # ms per launch, as `fastest` reports them
        benches.append(bench)
        times = {}
        for i, cand in enumerate(candidates):
            run(cand)
            times[i] = (0.4 if cand in (fast_up, fast_down) else 2.0) / launches
        best = min(times, key=times.get)
        return dict(candidates[best]), times

    monkeypatch.setattr(gm, "fastest", fastest)
    buf = torch.zeros(64, 3 * 16 * 8, dtype=torch.bfloat16)
    params, times = gm.tune_grouped_moe(buf, 17, 8, 16, 8)
    assert params == {**fast_up, **fast_down} and params in gm.GROUPED_CANDIDATES
    n = gm.TUNE_ROUTES
    assert drawn == [(n, gm.TUNE_ZIPF)] and benches == [None, None]  # `fastest`'s own timer: CUDA graphs
    assert launched[:n] == [("grouping", 64)] * n
    ups = [p for kind, p in launched if kind == "up"]
    downs = [p for kind, p in launched if kind == "down"]
    assert len(ups) == n * len(gm.GATE_UP_CANDIDATES) and len(downs) == n * len(gm.DOWN_CANDIDATES)
    assert [{key: p[key] for key in cand} for p, cand in zip(ups[::n], gm.GATE_UP_CANDIDATES)] == \
        list(gm.GATE_UP_CANDIDATES)
    assert [{key: p[key] for key in cand} for p, cand in zip(downs[::n], gm.DOWN_CANDIDATES)] == \
        list(gm.DOWN_CANDIDATES)
    assert all(p["block_m"] == 32 for p in ups + downs)  # D = 17's tile of positions
    assert sorted(times) == sorted([f"gate_up {i}" for i in range(len(gm.GATE_UP_CANDIDATES))] +
                                   [f"down {i}" for i in range(len(gm.DOWN_CANDIDATES))])
    assert times[f"gate_up {gm.GATE_UP_CANDIDATES.index(fast_up)}"] == 0.4 / n  # per call of the graph's n


def test_input_checks_and_launch_parameters():
    d, k, h, i, c = 3, 2, 16, 8, 5
    buf, x, res, route = make_case(d, k, h, i, c)
    ws = make_grouped_workspace(d, k, h, i, torch.float32, "cpu")

    def call(**kw):
        a = dict(x=x, residual=res, slot_buf=buf, route=route, out=torch.empty_like(x), hidden=h, inter=i,
                 workspace=ws)
        a.update(kw)
        return slot_moe_grouped_torch(**a)

    with pytest.raises(ValueError, match="x must be"):
        call(x=x[0])
    with pytest.raises(ValueError, match="residual must be"):
        call(residual=res[:2])
    with pytest.raises(ValueError, match="out must be"):
        call(out=torch.empty(d, h, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="route must be int32"):
        call(route=route.long())
    with pytest.raises(ValueError, match="route must be int32"):
        call(route=route[:, :3])
    with pytest.raises(ValueError, match="slot buffer must be"):
        call(slot_buf=buf[:, :100])
    with pytest.raises(ValueError, match="contiguous"):
        call(x=torch.randn(h, d).t())
    with pytest.raises(ValueError, match="workspace is for"):
        call(workspace=make_grouped_workspace(d + 1, k, h, i, torch.float32, "cpu"))
    with pytest.raises(ValueError, match="workspace holds"):
        call(workspace=make_grouped_workspace(d, k, h, i, torch.bfloat16, "cpu"))
    with pytest.raises(ValueError, match="must be positive"):
        make_grouped_workspace(0, k, h, i, torch.float32, "cpu")
    assert ws.groups.shape == (d * k,) and ws.act.shape == (d, k, i) and ws.y.shape == (d, k, h)
    assert [default_block_m(n) for n in (1, 9, 16, 17, 33, 100)] == [16, 16, 16, 32, 64, 64]
    assert grouped_params(17)["block_m"] == 32 and grouped_params(17, dict(block_m=16))["block_m"] == 16
    with pytest.raises(ValueError, match="unknown grouped MoE options"):
        grouped_params(5, dict(block_q=16))
    with pytest.raises(ValueError, match="power of two >= 16"):
        grouped_params(5, dict(block_n=8))
    with pytest.raises(ValueError, match="swap2 must be 0 or 1, got 2"):
        grouped_params(5, dict(swap2=2))


def test_zipf_routes_share_slots_across_positions():
    g = torch.Generator().manual_seed(0)
    routes = zipf_routes(20, 17, 8, 64, 1.2, g)
    assert routes.shape == (20, 17, 16) and routes.dtype == torch.int32
    slots = routes[..., :8]
    assert all(len(set(r.tolist())) == 8 for r in slots.reshape(-1, 8))  # distinct within a position
    weights = routes[..., 8:].view(torch.float32)
    torch.testing.assert_close(weights.sum(-1), torch.ones(20, 17))
    distinct = [torch.unique(r).numel() for r in slots]
    uniform = [torch.unique(r).numel() for r in zipf_routes(20, 17, 8, 64, 0.0, g)[..., :8]]
    assert 8 <= min(distinct) and sum(distinct) < sum(uniform) <= 20 * 64
    assert grouped_moe_bytes(routes[0], 4, 2, 2) == distinct[0] * 3 * 4 * 2 * 2


# -- the Triton kernels in the interpreter (CPU, where Triton is installed; tests/_interpreter.py) --------
_KERNEL_CHECK = r"""
import torch
from specmoe.kernels.grouped_moe import (make_grouped_workspace, slot_moe_grouped_torch, slot_moe_grouped_triton,
                                         zipf_routes)
from specmoe.kernels.moe import slot_moe_triton

H, I, K = 64, 32, 4
# per position, relative L2; the torch path's bf16 products round differently from Triton's (the per-token
# kernel is as far from it, e.g. 1.8e-2 at one position of these cases)
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def rel(ref, out):
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def per_token(x, res, buf, route):
    out = torch.empty_like(x)
    for i in range(x.shape[0]):
        slot_moe_triton(x[i], res[i], buf, route[i], torch.empty(K, I, dtype=x.dtype), out[i], H, I)
    return out


def routes(kind, d, c, g):
    route = zipf_routes(1, d, K, c, 1.2, g)[0]
    if kind == "same":  # every position on the same K slots, in different orders
        for i in range(d):
            route[i, :K] = route[0, :K][torch.randperm(K, generator=g)]
    elif kind == "repeat":  # a slot twice within a position (the pairs share one activation)
        route[:, 1] = route[:, 0]
    elif kind == "one":  # every position uses slot c - 1, the other slots distinct
        for i in range(d):
            route[i, :K] = torch.cat([torch.tensor([c - 1]), torch.randperm(c - 1, generator=g)[: K - 1]])
    return route


def one_hot_buffer(c, dtype, g):
    # each row of gate, up and down has one entry in {-1, 1}: every dot product is exact in float32, so any
    # summation order gives the same sums and the kernels must agree bit for bit (the combine order included)
    buf = torch.zeros(c, 3 * H * I)
    for s in range(c):
        for part, (rows, cols) in enumerate(((I, H), (I, H), (H, I))):
            m = torch.zeros(rows, cols)
            m[torch.arange(rows), torch.randint(0, cols, (rows,), generator=g)] = torch.randint(0, 2, (rows,), generator=g) * 2.0 - 1
            buf[s, part * I * H: (part + 1) * I * H] = m.flatten()
    return buf.to(dtype)


CASES = [  # D, slots C, routes, launch parameters (None: the defaults), compare with the per-token kernel
    (1, 12, "zipf", None, True), (5, 12, "zipf", None, False), (17, 12, "zipf", None, False),
    (17, 80, "zipf", None, False),  # more slots than pairs: G = D * K programs
    (5, 9, "same", None, True), (17, 9, "one", None, False), (5, 12, "repeat", None, True),
    (17, 12, "zipf", dict(block_m=16, block_k=32, block_k2=16), False),  # two chunks of positions
    (5, 6, "zipf", dict(block_n=64, block_h=16, block_k=16, block_c=32), False),
    # the down kernel's own warps and stages (apart from gate/up's)
    (9, 12, "zipf", dict(block_n=16, block_k=32, warps=2, stages=4, block_h=32, block_k2=16, warps2=8, stages2=2),
     False),
    # swapped products (the weight rows as the tile product's M), each kernel alone and both, two chunks
    (17, 12, "zipf", dict(swap=1, block_n=32, block_k=32), False), (9, 12, "zipf", dict(swap2=1, block_h=64), False),
    (17, 12, "repeat", dict(swap=1, swap2=1, block_m=16, block_k2=16), False)]
g = torch.Generator().manual_seed(0)
for dtype in (torch.float32, torch.bfloat16):
    for d, c, kind, params, compare in CASES if dtype == torch.float32 else [c for c in CASES if c[3] is None]:
        buf = (torch.randn(c, 3 * H * I, generator=g) * H ** -0.5).to(dtype)
        x, res = (torch.randn(d, H, generator=g).to(dtype) for _ in range(2))
        route = routes(kind, d, c, g)
        ws = make_grouped_workspace(d, K, H, I, dtype, "cpu")
        ws.act.fill_(float("nan")), ws.y.fill_(float("nan"))  # stale scratch must never be read
        out = slot_moe_grouped_triton(x, res, buf, route, torch.full_like(x, float("nan")), H, I, ws, params)
        ref = slot_moe_grouped_torch(x, res, buf, route, torch.empty_like(x), H, I)
        used = sorted(set(route[:, :K].flatten().tolist()))
        assert ws.groups.tolist()[: min(d * K, c)] == (used + [-1] * d * K)[: min(d * K, c)], (ws.groups, used)
        for i in range(d):
            assert rel(ref[i], out[i]) < TOL[dtype], (dtype, d, c, kind, params, i, rel(ref[i], out[i]))
        if compare:
            assert rel(per_token(x, res, buf, route), out) < TOL[dtype] / 10, (dtype, d, c, kind, params)
        if kind == "zipf" and d == 5:
            # a second call with other routes on the same workspace (as graph replays do), out aliasing residual
            route2 = routes("zipf", d, c, g)
            h = res.clone()
            slot_moe_grouped_triton(x, h, buf, route2, h, H, I, ws, params)
            assert rel(slot_moe_grouped_torch(x, res, buf, route2, torch.empty_like(x), H, I), h) < TOL[dtype]
for dtype, d, params in ((torch.bfloat16, 1, None), (torch.bfloat16, 17, None), (torch.float32, 5, None),
                         (torch.bfloat16, 17, dict(swap=1, swap2=1)), (torch.float32, 9, dict(swap=1, swap2=1))):
    buf = one_hot_buffer(10, dtype, g)
    x = torch.randint(-3, 4, (d, H), generator=g).to(dtype) * 0.5
    res = torch.randn(d, H, generator=g).to(dtype)
    route = routes("zipf", d, 10, g)
    ws = make_grouped_workspace(d, K, H, I, dtype, "cpu")
    out = slot_moe_grouped_triton(x, res, buf, route, torch.empty_like(x), H, I, ws, params)
    assert torch.equal(out, per_token(x, res, buf, route)), (dtype, d, params)
# late slots (the speculative engine's demand copies in flight): the rows from `first` on hold NaN until wait()
# writes them, as a copy landing; the output is the one pass's, bit for bit, and wait() runs once
for dtype, d, first, params in ((torch.bfloat16, 17, 6, None), (torch.float32, 5, 0, None),
                                (torch.float32, 9, 12, None), (torch.float32, 9, 5, dict(swap=1, swap2=1))):
    buf = (torch.randn(12, 3 * H * I, generator=g) * H ** -0.5).to(dtype)
    x, res = (torch.randn(d, H, generator=g).to(dtype) for _ in range(2))
    route = routes("zipf", d, 12, g)
    ws = make_grouped_workspace(d, K, H, I, dtype, "cpu")
    whole = slot_moe_grouped_triton(x, res, buf, route, torch.empty_like(x), H, I, ws, params)
    landing = buf.clone()
    landing[first:] = float("nan")
    waited = []

    def wait():
        waited.append(torch.isnan(landing).any().item())
        landing[first:] = buf[first:]

    out = slot_moe_grouped_triton(x, res, landing, route, torch.empty_like(x), H, I, ws, params, late=(first, wait))
    assert waited == [first < 12] and torch.equal(out, whole), (dtype, d, first, params, waited)
try:
    slot_moe_grouped_triton(x, res, buf, route, torch.empty_like(x), H, I, ws, late=(13, wait))
    raise AssertionError("late past the slots accepted")
except ValueError as e:
    assert "late must be" in str(e)
print("grouped ok")
"""


def run_interpreted(script: str, marker: str, timeout: int = 600) -> None:
    done = run_in_interpreter(script, timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    assert marker in done.stdout


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
def test_triton_kernels_match_the_reference_in_the_interpreter():
    run_interpreted(_KERNEL_CHECK, "grouped ok")


_DECODER_CHECK = ROUTED_DECODE + r"""
import numpy as np
import torch
from transformers import OlmoeConfig
from specmoe.models.olmoe import OLMOE_CONFIGS, build_random_olmoe
from specmoe.models.olmoe_decode import OlmoeDecoder

SEQ, C = 8, 16
# olmoe-micro (H = 32, I = 16, E = 64, K = 8) cut to two layers: every kernel runs in the interpreter
model = build_random_olmoe(OlmoeConfig(**{**OLMOE_CONFIGS["olmoe-micro"], "num_hidden_layers": 2}), 0, torch.float32,
                           "cpu")
decoder = OlmoeDecoder.from_model(model, SEQ)
c = decoder.geometry
k, num_layers = c.top_k, c.num_layers
g = torch.Generator().manual_seed(0)
slot_bufs = [torch.randn(C, 3 * c.hidden * c.inter, generator=g) * 0.2 for _ in range(num_layers)]
rng = np.random.default_rng(4)
routes = random_routes(5, num_layers, k, C, rng)
ids = rng.integers(0, c.vocab_size, 5)


def run(decoder, d):
    return run_routed(decoder, slot_bufs, ids, routes, SEQ, d)


assert decoder.use_kernels("triton", "sdpa", "slot", slot_bufs[0], tune=False)["backend"] == "triton", decoder.notes
assert decoder.grouped_moe, decoder.notes
assert any("grouped slot MoE kernel (steps of D > 1 positions) checked" in n for n in decoder.notes), decoder.notes
calls = []
import specmoe.models.decoder as od  # every decoder's MoE step (routed_moe) calls the kernel from here
kernel = od.slot_moe_grouped_triton
od.slot_moe_grouped_triton = lambda *a, **kw: calls.append(1) or kernel(*a, **kw)
single, block = run(decoder, 1), run(decoder, 5)
assert len(calls) == num_layers  # the block's layers, not the single steps
torch.testing.assert_close(block, single, rtol=1e-5, atol=1e-5)
od.slot_moe_grouped_triton = kernel

# a grouped kernel that disagrees with the torch path is not used: the per-position loop runs instead
import specmoe.kernels.grouped_moe as gm
good = gm.slot_moe_grouped_triton
gm.slot_moe_grouped_triton = lambda x, res, buf, route, out, *a, **kw: out.zero_()
fallback = OlmoeDecoder.from_model(model, SEQ)
fallback.use_kernels("triton", "sdpa", "slot", slot_bufs[0], tune=False)
gm.slot_moe_grouped_triton = good
assert fallback.backend == "triton" and not fallback.grouped_moe
assert any("grouped slot MoE kernel (steps of D > 1 positions) unusable (RuntimeError: grouped slot MoE kernel "
           "(position 0 of 17) differs" in n and "the slot MoE kernel once per position used" in n
           for n in fallback.notes), fallback.notes
torch.testing.assert_close(run(fallback, 5), single, rtol=1e-5, atol=1e-5)
print("decoder ok")
"""


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
def test_decoder_uses_the_grouped_kernel_for_blocks_in_the_interpreter():
    """OLMoE's decoder with backend "triton" (the interpreter, float32 olmoe-tiny): the self-check passes, a step
    of D = 5 positions runs the grouped kernel once per layer and equals five single steps (per-token kernel);
    a grouped kernel that fails its check is not used, and the block then loops the per-token kernel."""
    run_interpreted(_DECODER_CHECK, "decoder ok")


# -- on a CUDA device, at OLMoE-1B-7B's size ----------------------------------------------------------------------
H, I, E, K = 2048, 1024, 64, 8
GPU_TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-4}


def _rel(ref, out):
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def _per_token(x, res, buf, route):
    from specmoe.kernels.moe import slot_moe_triton

    out = torch.empty_like(x)
    act = torch.empty(K, I, dtype=x.dtype, device=x.device)
    for i in range(x.shape[0]):
        slot_moe_triton(x[i], res[i], buf, route[i], act, out[i], H, I)
    return out


@pytest.fixture(scope="module")
def gpu_buffers():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    g = torch.Generator(device="cuda").manual_seed(0)
    return {dtype: (torch.randn(E, 3 * H * I, device="cuda", generator=g) * 0.02).to(dtype)
            for dtype in (torch.bfloat16, torch.float32)}


@pytest.mark.gpu
@pytest.mark.parametrize("d", [9, 17])
def test_late_slots_written_by_a_delayed_copy_on_another_stream_on_gpu(gpu_buffers, d):
    """The late slots' rows arrive by a copy on another stream behind a 2 ms sleep, joined by wait(); eagerly and
    in a captured graph, the output equals the one-pass output bit for bit (a read of a late slot before the join
    would read the stale rows, zeros)."""
    from specmoe.kernels.grouped_moe import slot_moe_grouped_triton

    buf = gpu_buffers[torch.bfloat16]
    first = E // 2
    g = torch.Generator().manual_seed(7)
    route = zipf_routes(1, d, K, E, 0.5, g, "cuda")[0]
    assert (route[:, :K] >= first).any() and (route[:, :K] < first).any()
    x, res = (torch.randn(d, H, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
    ws = make_grouped_workspace(d, K, H, I, torch.bfloat16, "cuda")
    whole = slot_moe_grouped_triton(x, res, buf, route, torch.empty_like(x), H, I, ws)
    host = buf[first:].cpu().pin_memory()
    landing, out = buf.clone(), torch.empty_like(x)
    main, copier = torch.cuda.current_stream(), torch.cuda.Stream(priority=-1)

    def run():
        copier.wait_stream(main)
        with torch.cuda.stream(copier):
            torch.cuda._sleep(2_000_000)  # about 2 ms of cycles: the copy lands well after the early phase
            landing[first:].copy_(host, non_blocking=True)
        slot_moe_grouped_triton(x, res, landing, route, out, H, I, ws, late=(first, lambda: main.wait_stream(copier)))

    landing[first:].zero_()
    run()
    torch.cuda.synchronize()
    assert torch.equal(out, whole)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(main)
    with torch.cuda.stream(side):
        landing[first:].zero_()
        main = side
        with torch.cuda.graph(graph, stream=side):
            run()
    main = torch.cuda.current_stream()
    for _ in range(2):
        landing[first:].zero_()
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, whole)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("d", [1, 9, 17])
def test_kernel_matches_the_reference_and_the_per_token_kernel_on_gpu(gpu_buffers, d, dtype):
    from specmoe.kernels.grouped_moe import slot_moe_grouped_triton

    buf = gpu_buffers[dtype]
    g = torch.Generator().manual_seed(d)
    ws = make_grouped_workspace(d, K, H, I, dtype, "cuda")
    for exponent in (0.0, 1.2, 3.0):
        route = zipf_routes(1, d, K, E, exponent, g, "cuda")[0]
        x = torch.randn(d, H, generator=g).to("cuda", dtype)
        res = torch.randn(d, H, generator=g).to("cuda", dtype)
        out = slot_moe_grouped_triton(x, res, buf, route, torch.empty_like(x), H, I, ws)
        ref = slot_moe_grouped_torch(x, res, buf, route, torch.empty_like(x), H, I)
        moe_ref = ref.float() - res.float()
        for i in range(d):  # the MoE part of each position, not hidden by the residual
            assert _rel(moe_ref[i], out[i].float() - res[i].float()) < GPU_TOL[dtype] * 2, (exponent, i)
        pt = _per_token(x, res, buf, route)
        assert _rel(pt, out) < GPU_TOL[dtype] / 2, exponent
        used = torch.unique(route[:, :K]).tolist()
        torch.cuda.synchronize()
        assert ws.groups.tolist()[: min(d * K, E)] == (used + [-1] * d * K)[: min(d * K, E)]


def _exact_case(d, dtype):
    """Expert rows with one entry of +-1 per row (16 slots) and inputs on a half-integer grid: every dot product is
    exact in float32 whatever the summation order. Returns (buf, x, res, route) on the GPU."""
    g = torch.Generator(device="cuda").manual_seed(1)
    buf = torch.zeros(16, 3 * H * I, device="cuda")
    for part, (rows, cols) in enumerate(((I, H), (I, H), (H, I))):
        view = buf[:, part * I * H: (part + 1) * I * H].view(16, rows, cols)
        col = torch.randint(0, cols, (16, rows, 1), device="cuda", generator=g)
        sign = torch.randint(0, 2, (16, rows, 1), device="cuda", generator=g) * 2.0 - 1
        view.scatter_(2, col, sign)
    x = (torch.randint(-3, 4, (d, H), device="cuda", generator=g) * 0.5).to(dtype)
    res = torch.randn(d, H, device="cuda", generator=g).to(dtype)
    route = zipf_routes(1, d, K, 16, 1.2, torch.Generator().manual_seed(d), "cuda")[0]
    return buf.to(dtype), x, res, route


@pytest.mark.gpu
@pytest.mark.parametrize("swap", [0, 1], ids=["plain", "swapped"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("d", [1, 9, 17])
def test_exact_sums_equal_the_per_token_kernel_bit_for_bit_on_gpu(d, dtype, swap):
    """On exact dot products (`_exact_case`) the grouped kernels (tensor-core tiles, the positions or, swapped, the
    weight rows as the product's M) and the per-token kernel must agree bit for bit; what is left to differ is the
    rounding points and the order of the float32 combine over experts."""
    from specmoe.kernels.grouped_moe import slot_moe_grouped_triton

    buf, x, res, route = _exact_case(d, dtype)
    ws = make_grouped_workspace(d, K, H, I, dtype, "cuda")
    out = slot_moe_grouped_triton(x, res, buf, route, torch.empty_like(x), H, I, ws, dict(swap=swap, swap2=swap))
    assert torch.equal(out, _per_token(x, res, buf, route))


@pytest.mark.gpu
@pytest.mark.parametrize("d", [9, 17])
def test_every_tuning_candidate_computes_the_exact_sums_on_gpu(d):
    """Each of GATE_UP_CANDIDATES and DOWN_CANDIDATES (what the tuner may choose on a device), the other kernel at
    its defaults: the per-token kernel's bits on exact dot products (bf16), and the reference's values to the
    tolerance on random experts."""
    from specmoe.kernels import grouped_moe as gm

    buf, x, res, route = _exact_case(d, torch.bfloat16)
    expected = _per_token(x, res, buf, route)
    ws = make_grouped_workspace(d, K, H, I, torch.bfloat16, "cuda")
    for cand in gm.GATE_UP_CANDIDATES + gm.DOWN_CANDIDATES:
        out = gm.slot_moe_grouped_triton(x, res, buf, route, torch.empty_like(x), H, I, ws, cand)
        assert torch.equal(out, expected), cand


@pytest.mark.gpu
@pytest.mark.parametrize("d", [9, 17])
def test_one_captured_graph_serves_every_route(gpu_buffers, d):
    """Captured once, replayed with routes of 8 to min(D * K, E) distinct slots written into the same device
    tensor: every replay computes that route's result (the grouping happens on the device)."""
    from specmoe.kernels.grouped_moe import slot_moe_grouped_triton

    dtype = torch.bfloat16
    buf = gpu_buffers[dtype]
    g = torch.Generator().manual_seed(10 + d)
    x = torch.randn(d, H, generator=g).to("cuda", dtype)
    res = torch.randn(d, H, generator=g).to("cuda", dtype)
    out = torch.empty_like(x)
    ws = make_grouped_workspace(d, K, H, I, dtype, "cuda")
    route = torch.zeros(d, 2 * K, dtype=torch.int32, device="cuda")
    route[:, :K] = torch.arange(K, dtype=torch.int32)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm up outside the capture
        slot_moe_grouped_triton(x, res, buf, route, out, H, I, ws)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        slot_moe_grouped_triton(x, res, buf, route, out, H, I, ws)
    same = zipf_routes(1, 1, K, E, 1.0, g)[0].expand(d, 2 * K).contiguous()  # one set of K slots for all
    cases = [zipf_routes(1, d, K, E, a, g)[0] for a in (0.0, 1.2, 3.0)] + [same, zipf_routes(1, d, K, E, 0.0, g)[0]]
    for new in cases:
        route.copy_(new)
        out.fill_(float("nan"))
        graph.replay()
        ref = slot_moe_grouped_torch(x, res, buf, route, torch.empty_like(x), H, I)
        assert _rel(ref, out) < GPU_TOL[dtype], torch.unique(new[:, :K]).numel()
        assert _rel(_per_token(x, res, buf, route), out) < GPU_TOL[dtype] / 2


@pytest.mark.gpu
def test_decoder_self_check_passes_at_full_size(gpu_buffers):
    from specmoe.geometry import Geometry
    from specmoe.kernels import checks

    # the grouped MoE check reads K, H and I
    geometry = Geometry(num_layers=1, num_experts=64, top_k=K, vocab_size=0, hidden=H, inter=I, max_seq_len=256,
                        num_heads=16, num_kv_heads=16, head_dim=128)
    checks.check_grouped_moe(geometry, gpu_buffers[torch.bfloat16], torch.bfloat16, torch.device("cuda"))
