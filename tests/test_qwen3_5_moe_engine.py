"""The engine on Qwen3.5-MoE's own cases (CPU, float32, the tiny seeded model): speculative decoding with exact
selection equals AR greedy through the Gated DeltaNet state's rollbacks (the tiny model with a synthetic drafter; the
family's trained member with its AR and DFlash drafters), and an engine read from the shipped
image-text layout equals the text model. The cases every architecture shares: test_architectures_engine.py."""

import numpy as np
import pytest
import torch

from specmoe.engines import EngineConfig, build_engine, build_engine_from_checkpoint
from specmoe.routing import Calibration, preset

from test_architectures_engine import SEQ, make_engine, tiny_engine_model


@pytest.fixture(scope="module")
def tiny():
    return tiny_engine_model("qwen3.5-moe-tiny")


@pytest.fixture(scope="module")
def tokens(tiny):
    return np.random.default_rng(3).integers(0, tiny[1].vocab_size, 24)


@pytest.mark.parametrize("mode", ["history", "recompute"])
def test_speculative_exact_selection_equals_ar_greedy_through_rollbacks(tiny, mode):
    # rejected drafts pass through the Gated DeltaNet state: the engine rolls it back after every block, from the
    # kept per-position states or by recomputing the committed positions (EngineConfig.state_rollback)
    from specmoe.drafters import DrafterConfig, build_drafter
    from specmoe.offload import ExpertResidency
    from specmoe.speculation import SpeculativeConfig
    from specmoe.verifiers import selector_preset

    model, adapter, store = tiny
    calibration = Calibration.uniform(adapter.num_moe_layers, adapter.num_experts, adapter.vocab_size)
    prompt = np.random.default_rng(5).integers(0, adapter.vocab_size, 10).tolist()
    expected = make_engine(tiny, "exact_lru", adapter.num_experts).generate(prompt, 12).generated
    drafter = build_drafter(DrafterConfig("synthetic", acceptance=0.6), model)
    config = SpeculativeConfig(selector_preset("exact"), k=4, pool_size=adapter.num_experts // 2, max_new_tokens=12)
    engine = build_engine(model, None, calibration, EngineConfig(max_seq_len=SEQ, state_rollback=mode),
                          speculative=config, residency=ExpertResidency(store, adapter.num_experts, "cpu"))
    assert engine.kernels["state_rollback"] == mode and engine.decoder.gdn_rollback == mode
    result = engine.generate(prompt, 12, drafter=drafter)
    assert result.tokens == expected
    assert 0 < sum(result.accepted) < 4 * len(result.accepted)  # some drafts accepted, some rejected


def test_an_engine_read_from_an_image_text_checkpoint_equals_the_text_model(tiny, tokens, tmp_path):
    # the shipped layout (model_type qwen3_5_moe, tensors under model.language_model.)
    from _architecture_checks import image_text_qwen

    model, adapter, _ = tiny
    image_text_qwen(model).save_pretrained(tmp_path)
    calibration = Calibration.uniform(adapter.num_moe_layers, adapter.num_experts, adapter.vocab_size)
    policy = preset("exact_lru", adapter.num_experts, adapter.top_k)
    read = build_engine_from_checkpoint(tmp_path, policy, calibration, EngineConfig(max_seq_len=SEQ),
                                        dtype=torch.float32)
    with torch.no_grad():
        ref = model(torch.as_tensor(tokens)[None]).logits[0].float().numpy()
    result = read.teacher_forced(tokens, prompt_len=10, return_logits=True)
    assert np.abs(result.logits - ref).max() <= 1e-4 * np.abs(ref).max()


@pytest.mark.parametrize("drafter_name", ["ar", "dflash"])
def test_the_trained_member_decodes_speculatively_as_greedy_with_each_drafter(drafter_name):
    """The family's Qwen3.5-MoE member in the engine with the family's AR drafter and its own DFlash drafter (real
    checkpoints, real acceptance): exact selection commits exactly the AR greedy tokens, through rollbacks."""
    from specmoe.drafters import DrafterConfig, build_drafter
    from specmoe.models import load_model
    from specmoe.offload import ExpertResidency, ExpertStore
    from specmoe.speculation import SpeculativeConfig
    from specmoe.verifiers import selector_preset

    model, adapter = load_model("family/qwen3_5_moe")
    store = ExpertStore.from_model(model, adapter)
    calibration = Calibration.uniform(adapter.num_moe_layers, adapter.num_experts, adapter.vocab_size)
    prompt = np.random.default_rng(7).integers(4, adapter.vocab_size, 24).tolist()
    residency = ExpertResidency(store, adapter.num_experts, "cpu")
    config = EngineConfig(max_seq_len=SEQ)
    expected = build_engine(model, preset("exact_lru", adapter.num_experts, adapter.top_k), calibration, config,
                            residency=residency).generate(prompt, 24).generated
    drafter = build_drafter(DrafterConfig(drafter_name), model)
    speculative = SpeculativeConfig(selector_preset("exact"), k=8, pool_size=64, union_slots=64, max_new_tokens=24)
    engine = build_engine(model, None, calibration, config, speculative=speculative, residency=residency)
    result = engine.generate(prompt, 24, drafter=drafter)
    assert result.generated == expected
    assert 0 < sum(result.accepted) < 8 * len(result.accepted)  # drafts accepted and rejected: rollbacks happened


def test_state_rollback_is_checked_against_the_decoder():
    # a bad value names the field; a mode other than "auto" on a decoder without recurrent state is refused
    with pytest.raises(ValueError, match="state_rollback must be one of"):
        EngineConfig(state_rollback="never")
    model, adapter, store = tiny_engine_model("olmoe-micro")
    with pytest.raises(ValueError, match="state_rollback='recompute'.*no recurrent state"):
        build_engine(model, preset("exact_lru", adapter.num_experts, adapter.top_k),
                     Calibration.uniform(adapter.num_moe_layers, adapter.num_experts, adapter.vocab_size),
                     EngineConfig(max_seq_len=SEQ, state_rollback="recompute"), store=store)
