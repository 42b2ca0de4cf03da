"""The static drafters' fused kernels (`specmoe.kernels.norm_rope`'s norm styles, post-norm residual add and
prologue variants; `specmoe.kernels.greedy`) against their torch references in Triton's interpreter on the CPU
(float32), the drafters' build-time check (`checks.check_drafter_kernels`), and the drafters on the fused
kernels (backend "triton", split-KV attention) against the same drafters on the torch ops (backend "torch",
SDPA): the same drafts, probabilities within float32 tolerance, for the family's AR drafter (OLMo-1), a tiny
OLMo-2 with grouped-query attention, and the family's DFlash drafter. The backend choice on the CPU."""

import importlib.util

import pytest

from _interpreter import run_in_interpreter

from specmoe.drafters import DrafterConfig, DrafterError, build_drafter

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")

_KERNELS = r"""
import torch
from specmoe.kernels import checks, norm_rope as nr
from specmoe.kernels.greedy import greedy_torch, greedy_triton
TOL = dict(rtol=1e-5, atol=2e-6)
torch.manual_seed(0)
H, NH, NKV, HD, S = 64, 4, 2, 16, 40
cos, sin = nr.rope_tables(HD, 10000.0, S, "cpu")
for D in (1, 5):
    x, h, w = torch.randn(D, H), torch.randn(D, H), torch.randn(H) * 0.1
    for style in nr.NORM_STYLES:
        torch.testing.assert_close(nr.rmsnorm_triton(x, w, 1e-5, torch.empty_like(x), style=style),
                                   nr.rmsnorm_torch(x, w, 1e-5, style=style), **TOL)
        res = h.clone()
        out = nr.rmsnorm_triton(x, w, 1e-5, torch.empty_like(x), style=style, residual=res)
        assert torch.equal(res, h + x)
        torch.testing.assert_close(out, nr.rmsnorm_torch(h + x, w, 1e-5, style=style), **TOL)
        res = h.clone()
        assert nr.rmsnorm_triton(x, w, 1e-5, None, style=style, add_to=res) is res  # a post-norm's residual add
        torch.testing.assert_close(res, h + nr.rmsnorm_torch(x, w, 1e-5, style=style), **TOL)
    # OLMo-1 (no QK-norm, clip), OLMo-2 (olmo2 norms over all heads), both with float32 rotary; keys and values
    # alone (no query heads: DFlash's context rows) with per-head norms and rounded tables
    for nh, qk, flags, clip in ((NH, False, dict(rope_f32=True), 1.5), (NH, True, dict(style="olmo2", rope_f32=True), None),
                                (0, True, dict(head_norm=True), None)):
        qkv = torch.randn(D, (nh + 2 * NKV) * HD)
        per_head = flags.get("head_norm", False)
        qn, kn = (torch.randn(HD if per_head else NH * HD), torch.randn(HD if per_head else NKV * HD)) if qk else (None, None)
        outs = []
        for fn in (nr.qkv_prologue_torch, nr.qkv_prologue_triton):
            q, kc, vc = torch.zeros(D, nh, HD), torch.full((NKV, S, HD), 7.0), torch.full((NKV, S, HD), 7.0)
            fn(qkv, qn, kn, cos, sin, torch.tensor([20]), q, kc, vc, 1e-5, clip, **flags)
            outs.append((q, kc, vc))
        for a, b in zip(*outs):
            torch.testing.assert_close(b, a, **TOL)
for V in (1000, 8192):
    logits = torch.randn(4, V) * 4
    logits[2, 17] = logits[2, V - 3] = logits[2].max() + 1  # a tie: the first index
    outs = []
    for fn in (greedy_torch, greedy_triton):
        tokens, probs = torch.zeros(7, dtype=torch.int64), torch.zeros(7)
        fn(logits, tokens, probs, torch.tensor([2]))
        outs.append((tokens, probs))
    assert torch.equal(outs[0][0], outs[1][0]) and outs[1][0][4] == 17, outs
    torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1e-5, atol=1e-7)
checks.check_drafter_kernels(H, 48, (NH, NKV, HD), 1000, 1e-5, "layer", dict(rope_f32=True), 2.0, torch.float32,
                             torch.device("cpu"), qk_norm=False)
checks.check_drafter_kernels(H, 48, (NH, NKV, HD), 1000, 1e-6, "olmo2", dict(style="olmo2", rope_f32=True), None,
                             torch.bfloat16, torch.device("cpu"), post_norm=True)
checks.check_drafter_kernels(H, 48, (NH, NKV, HD), 1000, 1e-6, "olmoe", dict(head_norm=True), None, torch.bfloat16,
                             torch.device("cpu"), positions=(1, 7), kv_only=True)
print("ok")
"""

_DRAFTERS = r"""
import numpy as np
import torch
from transformers import Olmo2Config, Olmo2ForCausalLM
from specmoe.assets import family_path
from specmoe.drafters import DrafterConfig, build_drafter
from specmoe.models import load_model

model, _ = load_model(str(family_path("target")))
SEQ = 64
STEPS = [(4, 4, 5), (2, 0, 7), (3, 1, 11)]  # (k, accepted, bonus): all, none and some drafts accepted

def pair(name, **kw):
    torch_ops = build_drafter(DrafterConfig(name, runtime="static", max_seq_len=SEQ, backend="torch",
                                            attention="sdpa", **kw), model)
    fused = build_drafter(DrafterConfig(name, runtime="static", max_seq_len=SEQ, backend="triton",
                                        attention="split_kv", **kw), model)
    assert not torch_ops.notes[-1].startswith("fused") and "fused Triton kernels of the layers checked" in \
        " ".join(fused.notes), fused.notes
    return torch_ops, fused

def walk(drafters, width=0):
    g = torch.Generator().manual_seed(1)
    features = lambda n: torch.randn(n, width, generator=g) if width else None
    prompt = list(range(3, 23))
    for d in drafters:
        d.reset(torch.tensor(prompt), features(len(prompt) - 1) if width else None)
        g.manual_seed(1)
    g.manual_seed(2)
    for k, accepted, bonus in STEPS:
        out = [d.propose(k) for d in drafters]
        assert out[0][0].tolist() == out[1][0].tolist(), (out[0][0], out[1][0])
        np.testing.assert_allclose(out[1][1], out[0][1], rtol=1e-4, atol=1e-6)
        rows = features(accepted + 1)
        for d in drafters:
            d.commit(accepted, bonus, rows)

# the AR drafter with its layers' one-row GEMMs on the GEMV kernel, as on a GPU (on the CPU the choice is F.linear;
# forced here; the head's vocabulary-wide GEMV is left out for the interpreter's time, test_gemv runs it in OLMoE's
# decoder; the OLMo-2 drafter below keeps F.linear): same drafts
from specmoe.kernels.gemv import GEMV_CANDIDATES
torch_ops, fused = pair("ar")
dec = fused.decoder
for w in (dec.layers[0]["wqkv"], dec.layers[0]["wo"], dec.layers[0]["gate_up"], dec.layers[0]["down"]):
    dec.linears.params[(*w.shape, w.dtype)] = GEMV_CANDIDATES[-1]
walk((torch_ops, fused))
torch.manual_seed(0)
config = Olmo2Config(vocab_size=8192, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                     pad_token_id=1, bos_token_id=0, eos_token_id=0)
Olmo2ForCausalLM(config).save_pretrained(OLMO2_DIR)
olmo2 = pair("ar", path=OLMO2_DIR)
assert olmo2[0].decoder.kind == "olmo2"
walk(olmo2)
dflash = pair("dflash")
walk(dflash, dflash[0].feature_width)
print("ok")
"""


@needs_triton
def test_drafter_kernels_equal_their_torch_references_in_the_interpreter():
    result = run_in_interpreter(_KERNELS)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-4000:]


@needs_triton
def test_fused_drafters_draft_what_the_torch_drafters_draft_in_the_interpreter(tmp_path):
    script = _DRAFTERS.replace("OLMO2_DIR", repr(str(tmp_path)))
    result = run_in_interpreter(script, timeout=1200)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-4000:]


def test_backend_choice_on_the_cpu(family):
    model = family[0]
    drafter = build_drafter(DrafterConfig("ar", runtime="static", max_seq_len=32), model)  # "auto": torch on the CPU
    assert not drafter.decoder.fused and any(n.startswith("layers: torch ops") for n in drafter.notes)
    dflash = build_drafter(DrafterConfig("dflash", runtime="static", max_seq_len=32, backend="torch"), model)
    assert not dflash.fused
    with pytest.raises(DrafterError, match="backend"):
        DrafterConfig("ar", backend="cuda")
