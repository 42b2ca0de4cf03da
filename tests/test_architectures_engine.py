"""The engine on the architectures beyond OLMoE (CPU, float32, tiny seeded configs): DeepSeek-V3 (a random nonzero
selection bias; one group and group-limited choice; a dense first layer, MLA) and Qwen3.5-MoE (3 Gated DeltaNet
layers and 1 gated attention layer, gated shared expert). For each: all-resident exact decoding equals
transformers (forward and greedy generate; a second run starts a fresh sequence), PSR's selections and tokens do
not depend on copy timing, the prompt chunks execute the experts the policy chose (a one-position run that follows
the recorded logits computes the same outputs), and an engine read from a checkpoint directory equals one built
from the model. Qwen3.5-MoE's own cases (speculative rollbacks, the image-text layout): test_qwen3_5_moe_engine.py."""

import numpy as np
import pytest
import torch

from specmoe.engines import EngineConfig, LogitFeed, build_engine, build_engine_from_checkpoint
from specmoe.models import load_model
from specmoe.offload import ExpertStore
from specmoe.routing import Calibration, preset

SEQ = 64
FIRST_LAYER = {"deepseek-v3-tiny": ("attention", "dense_mlp"), "deepseek-v3-tiny-groups": ("attention", "dense_mlp"),
               "qwen3.5-moe-tiny": ("linear_attention", "moe")}


def tiny_engine_model(name: str):
    """(model, adapter, store) of a tiny named config, experts pinned to transformers' eager loop."""
    model, adapter = load_model(name, seed=0)
    model.set_experts_implementation("eager")
    return model, adapter, ExpertStore.from_model(model, adapter)


@pytest.fixture(scope="module", params=list(FIRST_LAYER))
def tiny(request):
    return (*tiny_engine_model(request.param), request.param)


@pytest.fixture(scope="module")
def tokens(tiny):
    return np.random.default_rng(3).integers(0, tiny[1].vocab_size, 24)


def make_engine(tiny, name, capacity, **config):
    model, adapter, store = tiny[:3]
    calibration = Calibration.uniform(adapter.num_moe_layers, adapter.num_experts, adapter.vocab_size)
    return build_engine(model, preset(name, capacity, adapter.top_k), calibration,
                        EngineConfig(max_seq_len=SEQ, **config), store=store)


def test_all_resident_exact_decoding_equals_transformers(tiny, tokens):
    model, adapter, _, name = tiny
    engine = make_engine(tiny, "exact_lru", adapter.num_experts)
    assert engine.decoder.layer_kinds[0] == FIRST_LAYER[name]
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


def test_psr_decisions_do_not_depend_on_copy_timing_and_chunks_execute_them(tiny, tokens):
    model, adapter = tiny[:2]
    engine = make_engine(tiny, "psr", adapter.num_experts // 2, prefill_chunk=4)
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
    model, adapter = tiny[:2]
    model.save_pretrained(tmp_path)
    calibration = Calibration.uniform(adapter.num_moe_layers, adapter.num_experts, adapter.vocab_size)
    policy = preset("psr", adapter.num_experts // 2, adapter.top_k)
    read = build_engine_from_checkpoint(tmp_path, policy, calibration, EngineConfig(max_seq_len=SEQ),
                                        dtype=torch.float32)
    built = make_engine(tiny, "psr", adapter.num_experts // 2)
    assert read.fingerprint == built.fingerprint == adapter.fingerprint(model)
    a, b = read.teacher_forced(tokens, return_logits=True), built.teacher_forced(tokens, return_logits=True)
    np.testing.assert_array_equal(a.selected, b.selected)
    np.testing.assert_allclose(a.logits, b.logits, rtol=1e-5, atol=1e-5)


def test_an_engine_over_a_model_whose_experts_were_freed_decodes_the_same(tiny, tokens):
    """`free_routed_experts` (benchmarks of full-size models): once the store holds the experts, the model's own
    copies go, and an engine built after that decodes exactly as one built before."""
    from specmoe.engines.helpers import free_routed_experts

    name = tiny[3]
    before = make_engine(tiny, "psr", 6).teacher_forced(tokens, prompt_len=4, return_logits=True)
    model, adapter, store = tiny_engine_model(name)
    assert free_routed_experts(model) == store.num_layers * store.num_experts * store.expert_bytes
    after = make_engine((model, adapter, store), "psr", 6).teacher_forced(tokens, prompt_len=4, return_logits=True)
    np.testing.assert_array_equal(after.logits, before.logits)
    np.testing.assert_array_equal(after.selected, before.selected)


def test_resident_model_on_device_holds_every_expert_in_the_store_and_the_unit():
    """`resident_model_on_device` (the profile scripts' target): the store holds every expert of the seeded random
    model, the model's own copies are freed, and the unit keeps all E of every layer resident on the device."""
    from specmoe.engines.helpers import random_model_on_device, resident_model_on_device
    from specmoe.offload import ExpertStore

    model, adapter, store, unit = resident_model_on_device("olmoe-micro", 3, torch.float32, "cpu")
    reference, _ = random_model_on_device("olmoe-micro", 3, torch.float32, "cpu")
    again = ExpertStore.from_model(reference, adapter)
    assert (store.num_layers, store.num_experts) == (adapter.num_moe_layers, adapter.num_experts)
    assert all(torch.equal(a, b) for a, b in zip(store.layers, again.layers))
    assert all(p.numel() == 0 for n, p in model.named_parameters() if ".experts." in n)
    assert unit.slots.capacity == adapter.num_experts and unit.store is store
