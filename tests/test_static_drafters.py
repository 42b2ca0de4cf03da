"""The static-cache drafters (`specmoe.drafters.static_ar`, `static_dflash`) on the CPU, where they run the
step functions their CUDA graphs capture, eagerly: drafts and confidences equal the transformers drafters'
(float32), rollback leaves the state of a fresh drafter on the committed prefix, the target decoder's
feature capture equals the harness's hidden states, and the speculative engine hands a DFlash drafter its
features so that its tokens equal the harness loop's. Also the runtime choice, the synthetic drafter's cost
modes and bad input. The shipped family's target and drafters, float32."""

import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from specmoe.drafters import (DFlashDrafter, DrafterConfig, DrafterError, HFAutoregressiveDrafter, StaticARDrafter,
                              StaticDFlashDrafter, SyntheticDrafter, build_drafter)
from specmoe.drafters.base import check_drafter_fits
from specmoe.drafters.dflash_model import extract_context_feature
from specmoe.engines import EngineConfig, build_engine
from specmoe.harness import exact_routing, speculative_generate
from specmoe.geometry import Geometry
from specmoe.offload import ExpertResidency, ExpertStore
from specmoe.routing import Calibration
from specmoe.speculation import SpeculativeConfig
from specmoe.verifiers import selector_preset

SEQ = 96


@pytest.fixture(scope="module")
def target(family):
    return family[0]


@pytest.fixture(scope="module")
def prompt(family_text):
    return family_text[:24]


def _steps(seed: int, count: int, max_k: int):
    """(k, accepted, bonus) of `count` verifications: random k, accepted lengths 0..k (full acceptance
    included), random bonus tokens."""
    rng = np.random.default_rng(seed)
    out = [(max_k, max_k, 5), (3, 0, 7)]  # a fully accepted block (two tokens to feed next) and a rejection
    for _ in range(count - 2):
        k = int(rng.integers(1, max_k + 1))
        out.append((k, int(rng.integers(0, k + 1)), int(rng.integers(0, 8192))))
    return out


def _same_proposals(a, b, k):
    drafts_a, conf_a = a.propose(k)
    drafts_b, conf_b = b.propose(k)
    assert drafts_a.tolist() == drafts_b.tolist()
    np.testing.assert_allclose(conf_a, conf_b, rtol=1e-4, atol=1e-6)
    return drafts_a.tolist()


# -- AR --------------------------------------------------------------------------------------------------
def test_static_ar_drafts_what_the_transformers_drafter_drafts(target, prompt):
    hf = build_drafter(DrafterConfig("ar", runtime="hf"), target)
    static = build_drafter(DrafterConfig("ar", runtime="static", max_seq_len=SEQ), target)
    assert isinstance(hf, HFAutoregressiveDrafter) and isinstance(static, StaticARDrafter)
    assert static.attention.kind == "sdpa" and static._step.graph is None  # the CPU: eager steps
    for d in (hf, static):
        d.reset(torch.tensor(prompt))
    for k, accepted, bonus in _steps(0, 8, 6):
        _same_proposals(hf, static, k)
        hf.commit(accepted, bonus)
        static.commit(accepted, bonus)
        assert static.tokens == hf.tokens and static.cached == hf.cache.get_seq_length()


def test_static_ar_after_a_verification_equals_a_fresh_one_on_the_committed_prefix(target, prompt):
    config = DrafterConfig("ar", runtime="static", max_seq_len=SEQ)
    drafter = build_drafter(config, target)
    drafter.reset(torch.tensor(prompt))
    for k, accepted, bonus in [(6, 6, 11), (5, 2, 13)]:  # full acceptance, then a rejection
        drafter.propose(k)
        drafter.commit(accepted, bonus)
        fresh = build_drafter(config, target)
        fresh.reset(torch.tensor(drafter.tokens))
        rows = drafter.cached
        for name in ("k_cache", "v_cache"):
            torch.testing.assert_close(getattr(drafter.decoder, name)[:, :, :rows],
                                       getattr(fresh.decoder, name)[:, :, :rows], atol=1e-5, rtol=1e-5)
        _same_proposals(drafter, fresh, 6)
        drafter.commit(0, bonus)  # back on the committed sequence (the fresh drafter is discarded)
    with pytest.raises(DrafterError, match="static cache"):
        drafter.propose(SEQ)


def test_static_ar_runs_olmo2_with_grouped_query_attention(target, prompt, tmp_path):
    from transformers import Olmo2Config, Olmo2ForCausalLM

    torch.manual_seed(0)
    config = Olmo2Config(vocab_size=8192, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                         pad_token_id=1, bos_token_id=0, eos_token_id=0)
    Olmo2ForCausalLM(config).save_pretrained(tmp_path)
    hf = build_drafter(DrafterConfig("ar", path=str(tmp_path), runtime="hf"), target)
    static = build_drafter(DrafterConfig("ar", path=str(tmp_path), runtime="static", max_seq_len=SEQ), target)
    assert static.decoder.kind == "olmo2"
    for d in (hf, static):
        d.reset(torch.tensor(prompt))
    for k, accepted, bonus in _steps(1, 4, 5):
        _same_proposals(hf, static, k)
        hf.commit(accepted, bonus)
        static.commit(accepted, bonus)


# -- DFlash ----------------------------------------------------------------------------------------------
def _features(target, tokens, layer_ids):
    """The harness's features of every position of `tokens` (exact routing)."""
    with torch.no_grad(), exact_routing(target):
        out = target(input_ids=torch.tensor([tokens]), output_hidden_states=True)
    return extract_context_feature(out.hidden_states, list(layer_ids))[0]


@pytest.mark.parametrize("attention", ["sdpa", "split_kv"])  # split_kv: the block-as-one-query layout
def test_static_dflash_drafts_what_the_transformers_drafter_drafts(target, prompt, attention):
    hf = build_drafter(DrafterConfig("dflash", runtime="hf"), target)
    static = build_drafter(DrafterConfig("dflash", runtime="static", max_seq_len=SEQ, attention=attention), target)
    assert isinstance(hf, DFlashDrafter) and isinstance(static, StaticDFlashDrafter)
    assert static.attention.kind == attention and static.target_layer_ids == hf.target_layer_ids
    tokens = list(prompt)
    every = _features(target, tokens, hf.target_layer_ids)
    for d in (hf, static):
        d.reset(torch.tensor(tokens), every[:-1])
    for k, accepted, bonus in _steps(2, 5, 16):
        drafts = _same_proposals(hf, static, k)
        root = len(tokens) - 1
        tokens += drafts[:accepted] + [bonus]
        rows = _features(target, tokens, hf.target_layer_ids)[root:root + accepted + 1]
        hf.commit(accepted, bonus, rows)
        static.commit(accepted, bonus, rows)


def test_static_dflash_after_a_verification_equals_a_fresh_one_on_the_committed_prefix(target, prompt):
    config = DrafterConfig("dflash", runtime="static", max_seq_len=SEQ)
    drafter = build_drafter(config, target)
    ids = drafter.target_layer_ids
    tokens = list(prompt)
    drafter.reset(torch.tensor(tokens), _features(target, tokens, ids)[:-1])
    drafts, _ = drafter.propose(8)
    with pytest.raises(ValueError, match="features"):
        drafter.commit(3, 5, None)
    committed = tokens + drafts[:3].tolist() + [int(drafts[3]) ^ 1]
    every = _features(target, committed, ids)
    drafter.commit(3, committed[-1], every[len(tokens) - 1:-1])  # the root and the 3 accepted drafts
    fresh = build_drafter(config, target)
    fresh.reset(torch.tensor(committed), every[:-1])
    _same_proposals(drafter, fresh, 8)
    rows = len(committed) - 1  # the committed context; the block's rows above it are overwritten next time
    for name in ("k_cache", "v_cache"):
        torch.testing.assert_close(getattr(drafter, name)[:, :, :rows], getattr(fresh, name)[:, :, :rows],
                                   atol=1e-5, rtol=1e-5)
    with pytest.raises(DrafterError, match="1..16"):
        drafter.propose(17)


def test_the_decoder_captures_the_harness_features(family, prompt):
    """The engine's decoder writes, inside its steps, the hidden states the harness hands a DFlash drafter:
    transformers' hidden_states[l + 1] for layer l, the last layer's after the final norm."""
    model, adapter = family
    from specmoe.models import decoder_for

    layer_ids = [0, 7, adapter.num_moe_layers - 1, 7]
    tokens = prompt[:10]
    decoder = decoder_for(model.config).from_model(model, 32)
    decoder.capture_features(layer_ids)
    store = ExpertStore.from_model(model, adapter)
    step = decoder.step(len(tokens))
    step.set_input(tokens, 0, 32)
    for layer in range(adapter.num_moe_layers):  # exact routing over every expert (slot = expert)
        decoder.attention_router(step, layer)
        z = torch.from_numpy(step.router_logits(layer).copy())
        selected = torch.topk(z, adapter.top_k, dim=-1).indices
        step.slots_np[layer] = selected.numpy()
        step.weights_np[layer] = adapter.execution_weights(z, selected).numpy()
        decoder.moe(step, layer, store.layers[layer])
    decoder.head(step)
    expected = _features(model, tokens, layer_ids)
    torch.testing.assert_close(step.work["features"], expected, atol=1e-4, rtol=1e-4)
    assert decoder.features(step) is step.work["features"]
    decoder.capture_features([1])  # other layers: the steps made so far are dropped (their graphs would not write)
    again = decoder.step(len(tokens))
    assert again is not step and decoder.features(again).shape == (len(tokens), model.config.hidden_size)
    with pytest.raises(ValueError, match="outside"):
        decoder_for(model.config).from_model(model, 32).capture_features([adapter.num_moe_layers])


# -- the speculative engine ------------------------------------------------------------------------------
@pytest.mark.parametrize("name,runtime", [("dflash", "hf"), ("dflash", "static"), ("ar", "static")])
def test_spec_engine_hands_features_and_agrees_with_the_harness_loop(family, prompt, name, runtime):
    model, adapter = family
    drafter = build_drafter(DrafterConfig(name, runtime=runtime, max_seq_len=SEQ), model)
    calibration = Calibration.uniform(adapter.num_moe_layers, adapter.num_experts, adapter.vocab_size)
    settings = dict(k=4, pool_size=32, max_new_tokens=10)
    harness = speculative_generate(model, adapter, drafter, torch.tensor(prompt[:12]),
                                   SpeculativeConfig(selector_preset("confidence_top1"), **settings),
                                   calibration=calibration, divergence=False)
    residency = ExpertResidency(ExpertStore.from_model(model, adapter), adapter.num_experts, "cpu")
    engine = build_engine(model, None, calibration, EngineConfig(max_seq_len=48),
                          speculative=SpeculativeConfig(selector_preset("confidence_top1"), **settings),
                          residency=residency)
    result = engine.generate(prompt[:12], settings["max_new_tokens"], drafter=drafter)
    assert sum(harness.accepted) > 0 and len(harness.accepted) > 1  # not trivial
    assert result.tokens == harness.tokens.tolist()
    assert list(result.accepted) == harness.accepted and (result.counts()["copies"]
                                                         - result.copy_totals()["prefetch_unused"]) == harness.copies


def test_spec_engine_refuses_a_drafter_that_does_not_fit_the_target():
    geometry = Geometry(num_layers=16, num_experts=64, top_k=8, vocab_size=8192, hidden=128, inter=32,
                        max_seq_len=64)
    stub = SimpleNamespace(name="dflash", target_layer_ids=(1, 16), max_drafts=16, hidden_size=256, vocab_size=8192)
    with pytest.raises(DrafterError, match=r"target layers \[16\].*0\.\.15.*hidden size 256 \(target 128\)"):
        check_drafter_fits(stub, geometry)
    with pytest.raises(DrafterError, match="vocabulary 100"):
        check_drafter_fits(SimpleNamespace(name="ar", target_layer_ids=(), vocab_size=100, hidden_size=None), geometry)
    # no target features read: the hidden size is not checked
    check_drafter_fits(SimpleNamespace(name="synthetic", target_layer_ids=(), vocab_size=8192, hidden_size=None),
                       geometry)


# -- runtimes, costs, bad input --------------------------------------------------------------------------
def test_runtime_choice_and_bad_input(target, tmp_path):
    assert isinstance(build_drafter(DrafterConfig("ar"), target), HFAutoregressiveDrafter)  # auto on the CPU
    assert isinstance(build_drafter(DrafterConfig("dflash"), target), DFlashDrafter)
    for bad in (dict(runtime="gpu"), dict(max_seq_len=1), dict(attention="flash"), dict(cost_mode="sleep")):
        with pytest.raises(DrafterError):
            DrafterConfig("ar", **bad)
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(vocab_size=8192, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2)).save_pretrained(tmp_path)
    with pytest.raises(DrafterError, match="model_type 'llama'"):
        build_drafter(DrafterConfig("ar", path=str(tmp_path), runtime="static"), target)
    assert isinstance(build_drafter(DrafterConfig("ar", path=str(tmp_path)), target), HFAutoregressiveDrafter)
    with pytest.raises(DrafterError, match="static cache"):
        build_drafter(DrafterConfig("ar", runtime="static", max_seq_len=8), target).reset(torch.arange(8))
    with pytest.raises(DrafterError, match="shorter than one block"):
        build_drafter(DrafterConfig("dflash", runtime="static", max_seq_len=8), target)


def _counting(prefix, n):
    return [(prefix[-1] + 1 + i) % 50 for i in range(n)]


def test_synthetic_cost_is_charged_or_spent():
    for mode, spent in (("charge", False), ("spin", True)):
        drafter = SyntheticDrafter(_counting, 50, acceptance=0.5, cost_s=0.05, cost_mode=mode)
        drafter.reset(torch.tensor([3]))
        started = time.perf_counter()
        drafter.propose(4)
        elapsed = time.perf_counter() - started
        assert drafter.fixed_cost_s == 0.05  # reported as the block's drafting time either way
        assert (elapsed >= 0.05) == spent
    with pytest.raises(DrafterError, match="cost_mode"):
        SyntheticDrafter(_counting, 50, cost_mode="sleep")
