"""The gated delta rule kernels (`specmoe.kernels.gdn`): our Triton kernel in Triton's interpreter on the CPU and
on a CUDA device, fla's kernels on the device (skipped without fla), each against the torch reference, for D = 1
(autoregressive step) and verification blocks (D = 9, 16, 17; the interpreter also at other small D), the state
after every position included; the reference against a step-by-step recomputation from a fresh state. (That a
change to the kernel keeps its bits is `scripts/bench_gdn_kernels.py --compare --module old=FILE`'s question, on
a GPU.)"""

from __future__ import annotations

import pytest
import torch
from _interpreter import run_in_interpreter

from specmoe.kernels.gdn import (FLA_CHUNK_FROM, gdn_recurrence, gdn_recurrence_torch, load_fla,
                                 random_gdn_inputs, triton as _triton)

FULL = (16, 32, 128, 128)  # Qwen3.6-35B-A3B: 16 key heads, 32 value heads, d_k = d_v = 128


def test_reference_history_is_the_state_of_each_prefix():
    q, k, v, decay, beta, state = random_gdn_inputs(5, 2, 4, 16, 8, "cpu")
    start = state.clone()
    history = torch.empty(5, *state.shape)
    out = gdn_recurrence_torch(q, k, v, decay, beta, state, history)
    assert torch.equal(history[-1], state)
    for n in range(1, 6):  # a fresh run over the first n positions ends in history[n - 1], same outputs
        fresh = start.clone()
        o = gdn_recurrence(q[:n], k[:n], v[:n], decay[:n], beta[:n], fresh)
        assert torch.allclose(fresh, history[n - 1], atol=1e-6)
        assert torch.allclose(o, out[:n], atol=1e-6)


_INTERPRETER_CHECK = r"""
import torch
from specmoe.kernels.gdn import gdn_recurrence, random_gdn_inputs
for d, nk, nv, dk, dv in ((1, 2, 4, 16, 16), (6, 2, 4, 16, 24), (3, 1, 1, 8, 8), (9, 2, 4, 16, 16), (17, 1, 2, 16, 8)):
    q, k, v, decay, beta, state = random_gdn_inputs(d, nk, nv, dk, dv, "cpu", seed=d)
    outs = []
    for kernel in ("torch", "triton"):
        s, hist = state.clone(), torch.zeros(d, nv, dk, dv)
        o = gdn_recurrence(q, k, v, decay, beta, s, hist, kernel=kernel)
        s2 = state.clone()  # without history: the same outputs and final state
        o2 = gdn_recurrence(q, k, v, decay, beta, s2, None, kernel=kernel)
        outs.append((o, s, hist, o2, s2))
    for a, b in zip(*outs):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), (d, float((a - b).abs().max()))
print("gdn ok")
"""


@pytest.mark.skipif(_triton is None, reason="Triton is not installed")
def test_triton_kernel_in_the_interpreter_matches_torch():
    done = run_in_interpreter(_INTERPRETER_CHECK)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "gdn ok" in done.stdout


_FLA_INTERPRETER_CHECK = r"""
import torch
from specmoe.kernels.gdn import gdn_recurrence, random_gdn_inputs
for d, history in ((1, False), (5, False), (3, True)):
    q, k, v, decay, beta, state = random_gdn_inputs(d, 2, 4, 16, 16, "cpu", seed=d)
    outs = []
    for kernel in ("torch", "fla"):
        s, hist = state.clone(), (torch.zeros(d, 4, 16, 16) if history else None)
        outs.append((gdn_recurrence(q, k, v, decay, beta, s, hist, kernel=kernel), s) + ((hist,) if history else ()))
    for a, b in zip(*outs):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), (d, float((a - b).abs().max()))
print("fla ok")
"""


@pytest.mark.skipif(_triton is None or load_fla() is None, reason="Triton or fla is not installed")
def test_fla_recurrent_kernel_in_the_interpreter_matches_torch():
    """fla's fused recurrent kernel runs in the interpreter (its chunked kernel autotunes, which needs a GPU)."""
    done = run_in_interpreter(_FLA_INTERPRETER_CHECK)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "fla ok" in done.stdout


# -- on a CUDA device --------------------------------------------------------------------------------------------
def _compare(kernel: str, d: int, history: bool):
    nk, nv, dk, dv = FULL
    q, k, v, decay, beta, state = random_gdn_inputs(d, nk, nv, dk, dv, "cuda", seed=d)
    results = []
    for name in ("torch", kernel):
        s = state.clone()
        hist = torch.zeros(d, nv, dk, dv, device="cuda") if history else None
        o = gdn_recurrence(q, k, v, decay, beta, s, hist, kernel=name)
        results.append((o, s) + ((hist,) if history else ()))
    for ref, out in zip(*results):
        err = float((out - ref).norm() / ref.norm())
        chunked = kernel == "fla" and d >= FLA_CHUNK_FROM and not history  # products in lower precision
        assert err < (1e-2 if chunked else 1e-4), (kernel, d, history, err)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [1, 9, 16, 17])
@pytest.mark.parametrize("history", [False, True])
def test_gpu_triton_kernel_matches_torch(d, history):
    _compare("triton", d, history)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [1, 16, 64])
@pytest.mark.parametrize("history", [False, True])
def test_gpu_fla_kernels_match_torch(d, history):
    if load_fla() is None:
        pytest.skip("flash-linear-attention (fla) is not installed")
    if history and d == 64:
        pytest.skip("history runs fla's recurrent kernel per position: D = 16 covers it")
    _compare("fla", d, history)


_DECODER_CHECK = r"""
import sys
import torch
sys.path.insert(0, "tests")
from test_qwen3_5_moe_decode import run_step
from specmoe.kernels.gdn import load_fla
from specmoe.models import load_model
from specmoe.models.qwen3_5_moe_decode import Qwen35MoeDecoder
from specmoe.offload.store import ExpertStore

model, adapter = load_model("qwen3.5-moe-tiny", seed=0)
store = ExpertStore.from_model(model, adapter, pin=False)
rows = [store.layers[layer] for layer in range(store.num_layers)]
tokens = torch.randint(0, model.config.vocab_size, (16,), generator=torch.Generator().manual_seed(3)).tolist()
reference = Qwen35MoeDecoder.from_model(model, 40)  # the torch recurrence (= transformers: test_qwen3_5_moe_decode)
expected = torch.cat([run_step(reference, rows, tokens[:8], 0)[1], run_step(reference, rows, tokens[8:16], 8)[1]])
kernels = ["triton"] + (["fla"] if load_fla() is not None else [])
for kernel in kernels:
    for mode in ("history", "recompute"):
        # a 6-position block of which 2 are committed, rolled back, then the rest: the torch path's logits
        dec = Qwen35MoeDecoder.from_model(model, 40)
        dec.set_gdn(rollback=mode)
        dec.gdn_kernel, dec.fla = kernel, load_fla()
        _, first = run_step(dec, rows, tokens[:8], 0)
        step, _ = run_step(dec, rows, tokens[8:10] + [(t + 5) % 512 for t in tokens[10:14]], 8)
        dec.rollback(step, 2)
        _, rest = run_step(dec, rows, tokens[10:16], 10)
        torch.testing.assert_close(first, expected[:8], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(rest, expected[10:16], atol=1e-4, rtol=1e-4)
        print("decoder ok", kernel, mode)
"""


@pytest.mark.skipif(_triton is None, reason="Triton is not installed")
def test_decoder_with_the_triton_recurrence_in_the_interpreter_gives_the_torch_logits():
    """The decoder's wiring of the kernels (buffers, history, recompute rollback) on the tiny model: our Triton
    recurrence (and fla's, where installed) in Triton's interpreter, both rollback modes."""
    done = run_in_interpreter(_DECODER_CHECK)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("decoder ok") >= 2, done.stdout
