"""Programmatic dependent launch (`specmoe.kernels.pdl`): off on the CPU and when SPECMOE_PDL=0; every kernel that
takes it compiles for an H200 with it (Triton's front end on the CPU); the GEMV's first tile loaded ahead gives its
sums bit for bit (interpreter); on a GPU (`gpu`) the probe passes and the engines (all resident and offloaded on the
device policy) and the static AR drafter give the same tokens, selections and logits, bit for bit, with it on and
off."""

import importlib.util

import numpy as np
import pytest
import torch

from _interpreter import run_in_interpreter

from specmoe.kernels import pdl

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
ON = {"PDL": True, "launch_pdl": True}
PDL_KERNELS = {"_gemv_kernel", "_rmsnorm_kernel", "_qkv_prologue_kernel", "_gate_mul_kernel",
               "_split_kv_partial_kernel", "_split_kv_reduce_kernel", "_greedy_partial_kernel",
               "_greedy_combine_kernel", "_route_resident_kernel", "_route_sigmoid_kernel", "_gate_up_act_kernel",
               "_down_combine_kernel"}


def test_off_on_the_cpu_and_when_the_environment_says_so(monkeypatch):
    on, why = pdl.status("cpu")
    assert not on and "not on this device" in why
    assert pdl.options(torch.zeros(1)) == {}
    monkeypatch.setenv(pdl.ENV, "0")
    assert pdl.status("cuda") == (False, f"programmatic dependent launch off ({pdl.ENV}=0)")  # before any CUDA call


@needs_triton
def test_every_pdl_kernel_compiles_for_hopper_with_it(monkeypatch):
    """Each launcher passes PDL (and Triton's launch_pdl) where pdl.options says so, and each kernel compiles with
    it for an H200 (the GDC calls are Hopper instructions)."""
    from types import SimpleNamespace

    from specmoe.kernels import greedy, moe, norm_rope, resident_routing, split_kv
    from specmoe.kernels.compiled import compile_launches
    from specmoe.kernels.gemv import GEMV_CANDIDATES, gemv_triton

    monkeypatch.setattr(pdl, "options", lambda t: dict(ON))
    bf, i32, i64 = torch.bfloat16, torch.int32, torch.int64
    hidden, inter, heads, hd, seq = 256, 128, 4, 64, 128
    x = torch.zeros(1, hidden, dtype=bf)
    with compile_launches() as compiled:
        gemv_triton(x, torch.zeros(512, hidden, dtype=bf), GEMV_CANDIDATES[3])
        norm_rope.rmsnorm_triton(x, torch.zeros(hidden, dtype=bf), 1e-5, torch.zeros_like(x),
                                 residual=torch.zeros_like(x))
        cos = sin = torch.zeros(seq, hd // 2)
        q = torch.zeros(1, heads, hd, dtype=bf)
        cache = torch.zeros(heads, seq, hd, dtype=bf)
        norm_rope.qkv_prologue_triton(torch.zeros(1, 3 * heads * hd, dtype=bf), None, None, cos, sin,
                                      torch.zeros(1, dtype=i64), q, cache, cache, 1e-5, None)
        norm_rope.gate_mul_triton(torch.zeros(1, inter, dtype=bf), torch.zeros(1, inter, dtype=bf),
                                  torch.zeros(1, inter, dtype=bf), "silu")
        ws = split_kv.make_split_kv_workspace(1, heads, hd, seq, "cpu")
        split_kv._launch(q, cache, cache, torch.ones(1, dtype=i64), 0.125, torch.zeros(1, heads * hd, dtype=bf), ws,
                         heads, hd, 0)
        greedy.greedy_triton(torch.zeros(1, 8192), torch.zeros(1, dtype=i64), torch.zeros(1))
        z, slot_of = torch.zeros(1, 64), torch.zeros(64, dtype=i32)
        experts, route = torch.zeros(1, 8, dtype=i64), torch.zeros(1, 16, dtype=i32)
        resident_routing.route_resident_triton(z, 8, True, 1.0, slot_of, experts, route)
        scoring = SimpleNamespace(n_group=8, topk_group=4, scale=2.5, renormalise=True)
        resident_routing.route_sigmoid_triton(z, 8, scoring, torch.zeros(64, dtype=torch.float64), slot_of, experts,
                                              route)
        moe.slot_moe_triton(x, x, torch.zeros(4, 3 * hidden * inter, dtype=bf), torch.zeros(16, dtype=i32),
                            torch.zeros(8, inter, dtype=bf), torch.zeros_like(x), hidden, inter)
    assert {name for name, _ in compiled} == PDL_KERNELS
    assert all(constants["PDL"] for _, constants in compiled)
    assert next(c for name, c in compiled if name == "_gemv_kernel")["FIRST_TILE"]


def test_every_kernel_waits_first_and_every_launch_asks_for_pdl():
    """Across specmoe/kernels: each Triton kernel takes PDL and its first statement (after the docstring) is
    enter(PDL), but the GEMV's, which computes its addresses and loads its first weight tile first under FIRST_TILE
    (no other memory access before); each kernel launch passes
    **pdl.options(a device tensor of the launch). A kernel added without them would still be correct, only not
    overlapped; this keeps the rule whole."""
    import ast
    from pathlib import Path

    import specmoe.kernels

    kernels, launches = [], []
    for path in Path(specmoe.kernels.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel") and node.name.startswith("_"):
                kernels.append(node.name)
                assert "PDL" in [a.arg for a in node.args.args], (path.name, node.name)
                body = [b for b in node.body if not (isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant))]
                first = ast.unparse(body[0])
                if node.name == "_gemv_kernel":  # address arithmetic, then the first weight tile under FIRST_TILE
                    at = next(i for i, b in enumerate(body)
                              if isinstance(b, ast.If) and "FIRST_TILE" in ast.unparse(b.test))
                    before = " ".join(ast.unparse(b) for b in body[:at])
                    assert "tl.load" not in before and "tl.store" not in before, before
                else:
                    assert first == "enter(PDL)", (path.name, node.name, first)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript) \
                    and ast.unparse(node.func.value).endswith("_kernel"):
                launches.append(ast.unparse(node.func.value))
                spread = [ast.unparse(k.value) for k in node.keywords if k.arg is None]
                assert any(v.startswith("pdl.options(") for v in spread) or "PDL=True" in ast.unparse(node) \
                    or (path.name == "gemv.py" and "overlap" in spread), (path.name, ast.unparse(node.func.value))
    assert PDL_KERNELS <= set(kernels) and len(kernels) >= 26 and len(launches) >= len(kernels) - 1


_INTERPRETED = r"""
import torch, triton
from specmoe.kernels.gemv import GEMV_CANDIDATES, _gemv_kernel
torch.manual_seed(0)
for n, k in ((5, 48), (64, 1100), (33, 2048)):
    w, x = torch.randn(n, k).to(torch.bfloat16), torch.randn(1, k).to(torch.bfloat16)
    for p in GEMV_CANDIDATES:
        outs = []
        for first_tile in (False, True):
            out = torch.zeros(1, n, dtype=torch.bfloat16)
            out32 = torch.zeros(n)
            _gemv_kernel[(triton.cdiv(n, p["block_n"]),)](x, w, out, out32, n, K=k, BLOCK_N=p["block_n"],
                                                          BLOCK_K=p["block_k"], STAGES=p["num_stages"], WRITE=True,
                                                          WRITE32=True, FIRST_TILE=first_tile)
            outs.append((out, out32))
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1]), (n, k, p)
print("OK")
"""


@needs_triton
def test_the_gemv_first_tile_ahead_gives_the_same_sums_in_the_interpreter():
    """What the GEMV does under PDL (its first tile of weights loaded before the wait, the loop from the second)
    sums exactly as the plain loop, for every launch candidate, K a multiple of the tile or not."""
    res = run_in_interpreter(_INTERPRETED)
    assert res.returncode == 0 and "OK" in res.stdout, res.stderr[-3000:]


@pytest.mark.gpu
def test_gpu_pdl_on_and_off_decode_the_same(monkeypatch, family_text):
    """The family's target in bf16: all resident (one graph per token) and offloaded at C = 16 on the device
    policy (PSR), and the static AR drafter: with PDL on (the default on Hopper) and off, the same tokens,
    selections and logits, bit for bit."""
    from specmoe.assets import family_path
    from specmoe.drafters import DrafterConfig, build_drafter
    from specmoe.engines import EngineConfig, build_engine
    from specmoe.engines.helpers import calibration_from_engine
    from specmoe.models import load_model
    from specmoe.offload import ExpertStore
    from specmoe.routing import Calibration, preset

    assert pdl.status("cuda")[0], pdl.status("cuda")
    model, adapter = load_model(str(family_path("target")), dtype=torch.bfloat16, device="cuda")
    store = ExpertStore.from_model(model, adapter)
    uniform = Calibration.uniform(adapter.num_moe_layers, adapter.num_experts, adapter.vocab_size)
    prompt = np.asarray(family_text[:40])
    runs, drafts = {}, {}
    for flag in ("1", "0"):
        monkeypatch.setenv(pdl.ENV, flag)
        resident = build_engine(model, preset("exact_lru", adapter.num_experts, adapter.top_k), uniform,
                                EngineConfig(max_seq_len=256), store=store)
        cal = calibration_from_engine(resident, [np.asarray(family_text[40:104])], {"model": "family"})
        psr = build_engine(model, preset("psr", 16, adapter.top_k), cal,
                           EngineConfig(max_seq_len=256, policy_device="on"), store=store)
        assert resident.kernels["pdl"] is (flag == "1") and psr.kernels["pdl"] is (flag == "1")
        runs[flag] = [engine.generate(prompt, 24, return_logits=True) for engine in (resident, psr)]
        assert runs[flag][1].info["routing"] == "device_policy", runs[flag][1].info
        drafter = build_drafter(DrafterConfig("ar", max_seq_len=256), model)
        assert drafter.decoder.fused and drafter._step.graph is not None, drafter.notes
        drafter.reset(torch.as_tensor(prompt))
        drafts[flag] = []
        for block in range(6):
            tokens, conf = drafter.propose(8)
            drafts[flag].append((tokens.tolist(), conf))
            drafter.commit(block % 9, int(tokens[-1]))
    for on, off in zip(runs["1"], runs["0"]):
        assert on.generated == off.generated
        np.testing.assert_array_equal(on.selected, off.selected)
        np.testing.assert_array_equal(on.logits, off.logits)
    for (a, ca), (b, cb) in zip(drafts["1"], drafts["0"]):
        assert a == b
        np.testing.assert_array_equal(ca, cb)
