"""The engine on the Qwen3.5-MoE architecture (CPU, float32, the tiny seeded model: 3 Gated DeltaNet layers and 1
gated attention layer, 16 experts, top-4, gated shared expert): all-resident exact decoding equals transformers
(forward and greedy generate), PSR's selections and tokens do not depend on copy timing, and an engine read from a
checkpoint directory equals one built from the model."""

import numpy as np
import pytest
import torch

from specmoe.engines import EngineConfig, LogitFeed, build_engine, build_engine_from_checkpoint
from specmoe.models import load_model
from specmoe.offload import ExpertStore
from specmoe.routing import Calibration, preset

SEQ = 64


@pytest.fixture(scope="module")
def tiny():
    model, adapter = load_model("qwen3.5-moe-tiny", seed=0)
    return model, adapter, ExpertStore.from_model(model, adapter)


@pytest.fixture(scope="module")
def tokens(tiny):
    return np.random.default_rng(3).integers(0, tiny[1].vocab_size, 24)


def _engine(tiny, name, capacity, **config):
    model, adapter, store = tiny
    calibration = Calibration.uniform(adapter.num_moe_layers, adapter.num_experts, adapter.vocab_size)
    return build_engine(model, preset(name, capacity, adapter.top_k), calibration,
                        EngineConfig(max_seq_len=SEQ, **config), store=store)


def test_all_resident_exact_decoding_equals_transformers(tiny, tokens):
    model, adapter, _ = tiny
    engine = _engine(tiny, "exact_lru", adapter.num_experts)
    assert engine.decoder.layer_kinds[0] == ("linear_attention", "moe")
    with torch.no_grad():
        ref = model(torch.as_tensor(tokens)[None]).logits[0].float().numpy()
    result = engine.teacher_forced(tokens, prompt_len=10, return_logits=True)
    assert np.abs(result.logits - ref).max() <= 1e-4 * np.abs(ref).max()
    again = engine.teacher_forced(tokens, prompt_len=10, return_logits=True)  # a new sequence: the state is reset
    np.testing.assert_allclose(again.logits, result.logits, rtol=1e-6, atol=1e-6)
    prompt = tokens[:6]
    with torch.no_grad():
        hf = model.generate(torch.as_tensor(prompt)[None], max_new_tokens=10, min_new_tokens=10, do_sample=False)
    assert engine.generate(prompt, 10).generated == hf[0, len(prompt):].tolist()


def test_psr_decisions_do_not_depend_on_copy_timing(tiny, tokens):
    model, adapter, _ = tiny
    engine = _engine(tiny, "psr", adapter.num_experts // 2, prefill_chunk=4)
    base = engine.teacher_forced(tokens, prompt_len=12, return_logits=True)
    assert base.copy_totals()["issued"] > 0
    for in_flight in (1, 4):
        engine.configure(copy_delay=(0.0, 0.001), max_in_flight=in_flight, delay_seed=in_flight)
        run = engine.teacher_forced(tokens, prompt_len=12, return_logits=True)
        np.testing.assert_array_equal(run.selected, base.selected)
        np.testing.assert_array_equal(run.output_tokens, base.output_tokens)
    engine.configure(copy_delay=None, max_in_flight=2)
    followed = engine.teacher_forced(tokens, prompt_len=12, return_logits=True, feed=LogitFeed.of(base))
    np.testing.assert_array_equal(followed.selected, base.selected)
    np.testing.assert_allclose(followed.logits, base.logits, rtol=1e-4, atol=1e-4)


def test_an_engine_read_from_a_checkpoint_equals_one_built_from_the_model(tiny, tokens, tmp_path):
    model, adapter, _ = tiny
    model.save_pretrained(tmp_path)
    calibration = Calibration.uniform(adapter.num_moe_layers, adapter.num_experts, adapter.vocab_size)
    policy = preset("psr", adapter.num_experts // 2, adapter.top_k)
    read = build_engine_from_checkpoint(tmp_path, policy, calibration, EngineConfig(max_seq_len=SEQ),
                                        dtype=torch.float32)
    built = _engine(tiny, "psr", adapter.num_experts // 2)
    assert read.fingerprint == built.fingerprint == adapter.fingerprint(model)
    a, b = read.teacher_forced(tokens, return_logits=True), built.teacher_forced(tokens, return_logits=True)
    np.testing.assert_array_equal(a.selected, b.selected)
    np.testing.assert_allclose(a.logits, b.logits, rtol=1e-5, atol=1e-5)


def test_speculative_exact_selection_equals_ar_greedy_through_rollbacks(tiny):
    # rejected drafts pass through the Gated DeltaNet state: the engine rolls it back after every block
    from specmoe.drafters import DrafterConfig, build_drafter
    from specmoe.offload import ExpertResidency
    from specmoe.speculation import SpeculativeConfig
    from specmoe.verifiers import selector_preset

    model, adapter, store = tiny
    calibration = Calibration.uniform(adapter.num_moe_layers, adapter.num_experts, adapter.vocab_size)
    prompt = np.random.default_rng(5).integers(0, adapter.vocab_size, 10).tolist()
    expected = _engine(tiny, "exact_lru", adapter.num_experts).generate(prompt, 12).generated
    drafter = build_drafter(DrafterConfig("synthetic", acceptance=0.6), model)
    config = SpeculativeConfig(selector_preset("exact"), k=4, pool_size=adapter.num_experts // 2, max_new_tokens=12)
    engine = build_engine(model, None, calibration, EngineConfig(max_seq_len=SEQ), speculative=config,
                          residency=ExpertResidency(store, adapter.num_experts, "cpu"))
    result = engine.generate(prompt, 12, drafter=drafter)
    assert result.tokens == expected
    assert 0 < sum(result.accepted) < 4 * len(result.accepted)  # some drafts accepted, some rejected


def test_an_engine_read_from_an_image_text_checkpoint_equals_the_text_model(tiny, tokens, tmp_path):
    # the shipped layout (model_type qwen3_5_moe, tensors under model.language_model.)
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    model, adapter, _ = tiny
    config = Qwen3_5MoeConfig(text_config=model.config.to_dict(),
                              vision_config=dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2,
                                                 out_hidden_size=64))
    full = Qwen3_5MoeForConditionalGeneration(config).eval()
    full.model.language_model.load_state_dict(model.model.state_dict())
    full.lm_head.load_state_dict(model.lm_head.state_dict())
    full.save_pretrained(tmp_path)
    calibration = Calibration.uniform(adapter.num_moe_layers, adapter.num_experts, adapter.vocab_size)
    policy = preset("exact_lru", adapter.num_experts, adapter.top_k)
    read = build_engine_from_checkpoint(tmp_path, policy, calibration, EngineConfig(max_seq_len=SEQ),
                                        dtype=torch.float32)
    with torch.no_grad():
        ref = model(torch.as_tensor(tokens)[None]).logits[0].float().numpy()
    result = read.teacher_forced(tokens, prompt_len=10, return_logits=True)
    assert np.abs(result.logits - ref).max() <= 1e-4 * np.abs(ref).max()
