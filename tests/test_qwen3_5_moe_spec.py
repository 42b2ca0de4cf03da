"""The harness's speculative loop on Qwen3.5-MoE (Gated DeltaNet) targets (CPU): the loop rolls the linear-attention
layers' convolution and recurrent states back itself (`specmoe.harness.recurrent`), so exact selection commits
exactly the AR greedy tokens through rejected drafts, the state after a rollback equals a fresh run's over the
committed prefix, the engine agrees with the loop on the trained member, and the recorded blocks replay."""

import numpy as np
import pytest
import torch

from specmoe.drafters import DrafterConfig, build_drafter
from specmoe.harness import speculative_generate
from specmoe.harness.patch import exact_routing
from specmoe.harness.recurrent import MixerStates, recurrent_mixers
from specmoe.harness.speculative import greedy_decode
from specmoe.models import adapter_for, load_model
from specmoe.routing import Calibration
from specmoe.speculation import SpeculativeConfig, crop_cache
from specmoe.verifiers import selector_preset

NEW, K_DRAFTS = 16, 6


@pytest.fixture(scope="module")
def member():
    return load_model("family/qwen3_5_moe")


@pytest.fixture(scope="module")
def tiny():
    return load_model("qwen3.5-moe-tiny", seed=0)


def _prompt(adapter, n=20, seed=7):
    return np.random.default_rng(seed).integers(4, adapter.vocab_size, n).tolist()


def _greedy(model, prompt, n=NEW):
    with exact_routing(model):
        return greedy_decode(model, torch.tensor(prompt), n)[0].tolist()


def _exact(adapter, k=K_DRAFTS):
    return SpeculativeConfig(selector_preset("exact"), k=k, pool_size=adapter.num_experts // 2, max_new_tokens=NEW)


def _check_rollbacks(result, k=K_DRAFTS):
    assert 0 < sum(result.accepted) < k * len(result.accepted)  # drafts accepted and rejected: rollbacks happened


def test_the_loop_finds_the_gated_deltanet_mixers_only_where_they_are(tiny):
    model, adapter = tiny
    """The rollback hooks only the linear-attention layers' token mixers, and nothing on other models."""
    assert sorted(recurrent_mixers(model)) == [i for i, t in enumerate(adapter.layer_types) if t == "linear_attention"]
    assert not recurrent_mixers(load_model("olmoe-tiny", seed=0)[0])


def test_exact_selection_equals_greedy_on_the_tiny_config(tiny):
    model, adapter = tiny
    prompt = _prompt(adapter, 12)
    drafter = build_drafter(DrafterConfig("synthetic", acceptance=0.6), model)
    result = speculative_generate(model, adapter, drafter, torch.tensor(prompt), _exact(adapter, 4),
                                  divergence=False)
    _check_rollbacks(result, 4)
    assert result.tokens.tolist() == _greedy(model, prompt)


@pytest.mark.parametrize("drafter_name", ["ar", "dflash"])
def test_the_trained_member_decodes_speculatively_as_greedy_and_as_the_engine(member, drafter_name):
    from specmoe.engines import EngineConfig, build_engine
    from specmoe.offload import ExpertResidency, ExpertStore

    model, adapter = member
    prompt = _prompt(adapter, 24)
    drafter = build_drafter(DrafterConfig(drafter_name), model)
    config = _exact(adapter)
    result = speculative_generate(model, adapter, drafter, torch.tensor(prompt), config)
    _check_rollbacks(result)
    assert result.tokens.tolist() == _greedy(model, prompt)
    assert result.divergence["kl"] < 1e-5  # every committed position as exact routing's

    calibration = Calibration.uniform(adapter.num_moe_layers, adapter.num_experts, adapter.vocab_size)
    store = ExpertStore.from_model(model, adapter)
    engine = build_engine(model, None, calibration, EngineConfig(max_seq_len=64), speculative=config,
                          residency=ExpertResidency(store, adapter.num_experts, "cpu"))
    assert engine.generate(prompt, NEW, drafter=drafter).generated == result.tokens.tolist()


@pytest.mark.parametrize("name", ["tiny", "member"])
def test_states_after_a_rollback_equal_a_fresh_run_over_the_committed_prefix(request, name):
    from transformers import DynamicCache

    model, adapter = request.getfixturevalue(name)
    prompt, block = _prompt(adapter, 10), _prompt(adapter, 6, seed=3)
    committed = 2

    def run(ids, cache):
        return model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True).logits[0, -1]

    with torch.no_grad():  # transformers' own routing (exact)
        cache = DynamicCache(config=model.config)
        run(prompt, cache)
        with MixerStates(model, cache) as states:
            states.snapshot()
            run(block, cache)
            states.rollback(committed)
        crop_cache(cache, len(prompt) + committed)
        fresh = DynamicCache(config=model.config)
        run(prompt, fresh)
        for token in block[:committed]:  # one token a step, as greedy decoding
            run([token], fresh)
        assert cache.get_seq_length() == fresh.get_seq_length() == len(prompt) + committed
        for index in recurrent_mixers(model):
            mine, theirs = cache.layers[index], fresh.layers[index]
            for field in ("conv_states", "recurrent_states"):
                torch.testing.assert_close(getattr(mine, field)[0], getattr(theirs, field)[0], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(run(block[committed:committed + 1], cache), run(block[committed:committed + 1], fresh),
                                   atol=1e-4, rtol=1e-4)


def test_the_member_s_recorded_blocks_replay(member):
    from specmoe.records import BlockRecords, blocks_from_records
    from specmoe.replay import replay_block_selection

    model, adapter = member
    selector = selector_preset("acceptmoe")
    config = SpeculativeConfig(selector, k=K_DRAFTS, pool_size=adapter.num_experts // 4, max_new_tokens=NEW)
    calibration = Calibration.uniform(adapter.num_moe_layers, adapter.num_experts, adapter.vocab_size)
    result = speculative_generate(model, adapter, build_drafter(DrafterConfig("ar"), model),
                                  torch.tensor(_prompt(adapter, 24)), config, calibration=calibration, record=True,
                                  divergence=False)
    _check_rollbacks(result)
    records = BlockRecords.from_requests([result.blocks], top_k=adapter.top_k, vocab_size=adapter.vocab_size)
    replayed = replay_block_selection(selector, blocks_from_records(records), calibration, config.pool_size,
                                      keep_selected=True)
    # the replay starts from the calibration's pool (the loop's from the prompt's experts): same blocks, own copies
    assert replayed.blocks == result.verifications and replayed.committed == sum(a + 1 for a in result.accepted)
    assert replayed.copies > 0 and replayed.selected.shape == (replayed.committed, adapter.num_moe_layers, adapter.top_k)


def test_the_member_s_loop_and_teacher_forced_walk_agree():
    """The family's tau cross-check (`tau_crosscheck`: the loop against the teacher-forced walk) now runs on the Qwen
    member, with the family's AR drafter and the member's DFlash drafter."""
    from _architecture_checks import assert_loop_agrees_with_the_walk

    from specmoe.assets import family_path
    from specmoe_train.family import load_family
    from specmoe_train.members import load_member

    root = family_path("qwen3_5_moe").parent
    target, dflash = load_member(root, "qwen3_5_moe")
    ar = load_family(root)[1]
    prompt = torch.tensor(_prompt(adapter_for(target.config), 24))
    assert_loop_agrees_with_the_walk(target, ar, dflash, prompt, new=24, k=8)

