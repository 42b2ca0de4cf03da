"""Speculative decoding on the DeepSeek-V3 architecture (CPU, float32, tiny configs with a random nonzero
selection bias, one group and group-limited choice): the engine's exact selection reproduces its AR greedy
output under exact routing, and with block selectors the engine agrees with the harness loop (tokens,
accepted lengths, selections, copies, moves) under the sigmoid router's block-selection rule."""

import numpy as np
import pytest
import torch

from specmoe.drafters import DrafterConfig, build_drafter
from specmoe.engines import EngineConfig, build_engine
from specmoe.harness import speculative_generate
from specmoe.models import load_model
from specmoe.offload import ExpertResidency, ExpertStore
from specmoe.routing import Calibration, preset
from specmoe.speculation import SpeculativeConfig
from specmoe.verifiers import selector_preset

SEQ, NEW, K_DRAFTS = 64, 12, 4


@pytest.fixture(scope="module", params=["deepseek-v3-tiny", "deepseek-v3-tiny-groups"])
def tiny(request):
    model, adapter = load_model(request.param, seed=0)
    model.set_experts_implementation("eager")
    store = ExpertStore.from_model(model, adapter)
    calibration = Calibration.uniform(adapter.num_moe_layers, adapter.num_experts, adapter.vocab_size)
    drafter = build_drafter(DrafterConfig("synthetic", acceptance=0.7), model)
    prompt = np.random.default_rng(5).integers(0, adapter.vocab_size, 10).tolist()
    return model, adapter, store, calibration, drafter, prompt


def _spec(tiny, selector, pool_size):
    model, adapter, store, calibration, drafter, _ = tiny
    config = SpeculativeConfig(selector_preset(selector), k=K_DRAFTS, pool_size=pool_size, max_new_tokens=NEW)
    engine = build_engine(model, None, calibration, EngineConfig(max_seq_len=SEQ), speculative=config,
                          residency=ExpertResidency(store, adapter.num_experts, "cpu"))
    engine.drafter = drafter
    return engine, config


def test_exact_selection_equals_ar_engine_greedy(tiny):
    model, adapter, store, calibration, drafter, prompt = tiny
    ar = build_engine(model, preset("exact_lru", adapter.num_experts, adapter.top_k), calibration,
                      EngineConfig(max_seq_len=SEQ), store=store)
    expected = ar.generate(prompt, NEW).generated
    engine, config = _spec(tiny, "exact", adapter.num_experts // 2)
    result = engine.generate(prompt, NEW, drafter=drafter)
    assert result.tokens == expected
    assert len(result.accepted) >= 1 and 0 < sum(result.accepted)


@pytest.mark.parametrize("selector", ["acceptmoe", "confidence_top1"])
def test_agrees_with_the_harness_loop(tiny, selector):
    model, adapter, store, calibration, drafter, prompt = tiny
    engine, config = _spec(tiny, selector, adapter.num_experts // 4)
    harness = speculative_generate(model, adapter, drafter, torch.tensor(prompt), config, calibration=calibration,
                                   record=True, divergence=False)
    result = engine.generate(prompt, NEW, drafter=drafter, record=True)
    assert harness.copies > 0 and 0 < sum(harness.accepted) < K_DRAFTS * len(harness.accepted)  # not trivial
    assert result.tokens == harness.tokens.tolist()
    assert list(result.accepted) == harness.accepted and list(result.roots) == harness.roots
    # the link's copies less the unused block prefetches: the pool's copies, one per missing expert
    logical = result.counts()["copies"] - result.copy_totals()["prefetch_unused"]
    assert (logical, result.moves) == (harness.copies, harness.moves)
    for mine, theirs in zip(result.block_selected, harness.blocks, strict=True):
        np.testing.assert_array_equal(mine, theirs["selected"])
    assert result.displaced == pytest.approx(harness.displaced, rel=1e-4)


def test_drafter_layers_are_decoder_layers_dense_ones_included(tiny):
    # a DFlash drafter names decoder layers (transformers' hidden_states): the tiny model has one dense layer
    # before its MoE layers, so its last decoder layer is a valid feature layer although the MoE layers are fewer
    from types import SimpleNamespace

    from specmoe.drafters import DrafterError, check_drafter_fits
    model, adapter, store, calibration, drafter, prompt = tiny
    engine, _ = _spec(tiny, "exact", adapter.num_experts // 2)
    decoder_layers = len(engine.decoder.layer_kinds)
    assert decoder_layers == engine.geometry.num_layers + 1
    last = decoder_layers - 1
    stub = SimpleNamespace(name="dflash", target_layer_ids=(0, last), max_drafts=16, hidden_size=adapter.hidden_size,
                           vocab_size=adapter.vocab_size)
    check_drafter_fits(stub, engine.geometry, decoder_layers)
    with pytest.raises(DrafterError, match=rf"target layers \[{last}\], the target has layers 0\.\.{last - 1}"):
        check_drafter_fits(stub, engine.geometry)  # counted as MoE layers (OLMoE's default) it would not fit
    too_far = SimpleNamespace(**{**vars(stub), "target_layer_ids": (decoder_layers,)})
    with pytest.raises(DrafterError, match=rf"target layers \[{decoder_layers}\], the target has layers 0\.\.{last}"):
        engine._use_drafter(too_far)
    engine._use_drafter(stub)
    assert engine.decoder.feature_layers == (0, last)


@pytest.mark.parametrize("name", ["exact_lru", "psr"])
def test_recorded_trace_carries_the_rule_and_replays_the_harness(tiny, name, tmp_path):
    # a trace holds the raw logits and the router's rule; replayed through the stored rule it makes the
    # harness's decisions, and the engine following it as a logit feed makes them too
    from specmoe.engines import LogitFeed
    from specmoe.files import read_safetensors, write_safetensors
    from specmoe.harness import record_trace
    from specmoe.harness.patch import model_scoring, patch_model, unpatch
    from specmoe.records import AcceptanceProfile, Trace, synthetic_blocks
    from specmoe.routing import replay

    model, adapter, store, calibration, drafter, prompt = tiny
    rng = np.random.default_rng(11)
    sequences = [torch.as_tensor(rng.integers(0, adapter.vocab_size, n)) for n in (14, 9)]
    trace = record_trace(model, sequences, "tiny")
    rule = model_scoring(model, adapter)
    assert trace.groups == adapter.groups and trace.scoring.kind == "sigmoid"
    path = trace.save(tmp_path / "trace.safetensors")
    loaded = Trace.load(path)
    assert (loaded.scoring.kind, loaded.scoring.renormalise, loaded.scoring.scale, loaded.scoring.groups) == \
        (rule.kind, rule.renormalise, rule.scale, rule.groups)
    np.testing.assert_array_equal(loaded.scoring.bias, rule.bias)
    np.testing.assert_array_equal(loaded.router_logits, trace.router_logits)
    meta, arrays = read_safetensors(path, ValueError, "trace")  # a file written before traces carried groups
    del meta["groups"], meta["scoring"], arrays["selection_bias"]
    write_safetensors(tmp_path / "old.safetensors", arrays, meta)
    old = Trace.load(tmp_path / "old.safetensors")
    assert old.groups == (1, 1) and old.scoring.kind == "softmax" and old.scoring.bias is None
    blocks = synthetic_blocks(trace, 3, AcceptanceProfile.geometric(0.7))
    assert blocks.groups == adapter.groups and blocks.scoring is trace.scoring

    policy = preset(name, adapter.num_experts // 2, adapter.top_k)
    harness = []
    context = patch_model(model, adapter, policy, calibration, record=True)
    try:
        for seq in sequences:
            with torch.no_grad():
                model(input_ids=seq[None])
            z, g, _, selected = context.recorded(0)
            np.testing.assert_array_equal(z, trace.router_logits[len(np.concatenate(harness or [z[:0]])):][:len(z)])
            harness.append(selected)
    finally:
        unpatch(model)
    harness = np.concatenate(harness)
    ours = replay(policy, loaded.router_logits, loaded.pregate_logits, loaded.token_ids, calibration,
                  sequence_starts=loaded.sequence_starts, scoring=loaded.scoring)
    np.testing.assert_array_equal(ours.selected, harness)
    # ranked as softmax logits (no rule), the same logits make another router's choices
    assert not np.array_equal(replay(policy, trace.router_logits, trace.pregate_logits, trace.token_ids, calibration,
                                     sequence_starts=trace.sequence_starts, groups=trace.groups).selected, harness)

    engine = build_engine(model, policy, calibration, EngineConfig(max_seq_len=SEQ), store=store)
    for (lo, hi), seq in zip(loaded.sequences(), sequences, strict=True):
        feed = LogitFeed.of_trace(loaded)
        piece = LogitFeed(feed.router_logits[lo:hi], feed.pregate_logits[lo:hi], feed.tokens[lo:hi],
                          feed.fingerprint, feed.scoring)
        followed = engine.follow(piece)
        np.testing.assert_array_equal(followed.selected, harness[lo:hi])
        np.testing.assert_array_equal(followed.router_logits, loaded.router_logits[lo:hi])  # raw, as recorded


def test_block_records_replay_as_the_engine_follows_them(tiny, tmp_path):
    # block records hold raw logits and the rule: the CPU replay of block selection (acceptmoe) and the engine
    # following the records make the same selections and copies, the harness's
    from specmoe.harness.patch import model_scoring
    from specmoe.records import BlockRecords, blocks_from_records
    from specmoe.replay import replay_block_selection

    model, adapter, store, calibration, drafter, prompt = tiny
    pool = adapter.num_experts // 4
    config = SpeculativeConfig(selector_preset("acceptmoe"), k=K_DRAFTS, pool_size=pool, max_new_tokens=NEW)
    runs = [speculative_generate(model, adapter, drafter, torch.tensor(p), config, calibration=calibration,
                                 record=True, divergence=False) for p in (prompt, prompt[2:9])]
    records = BlockRecords.from_requests([r.blocks for r in runs], top_k=adapter.top_k, vocab_size=adapter.vocab_size,
                                         groups=adapter.groups, scoring=model_scoring(model, adapter))
    records = BlockRecords.load(records.save(tmp_path / "blocks.safetensors"))
    assert records.scoring.kind == "sigmoid" and records.groups == adapter.groups
    blocks = blocks_from_records(records)
    expected = replay_block_selection(config.selector, blocks, calibration, pool, keep_selected=True)
    harness = np.concatenate([np.concatenate([b["selected"][: b["accepted"] + 1] for b in r.blocks]) for r in runs])
    np.testing.assert_array_equal(expected.selected, harness)  # the replay makes the harness's selections
    # the rule matters: ranked as softmax logits (a file without the rule) the same logits select otherwise
    from dataclasses import replace
    as_softmax = replay_block_selection(config.selector, replace(blocks, scoring=None, groups=(1, 1)), calibration,
                                        pool, keep_selected=True)
    assert not np.array_equal(as_softmax.selected, expected.selected)
    engine, _ = _spec(tiny, "acceptmoe", pool)
    results = engine.follow(blocks, first_position=len(prompt), record=True)
    assert sum(r.counts()["copies"] - r.copy_totals()["prefetch_unused"] for r in results) == expected.copies > 0
    committed = np.concatenate([np.concatenate([s[: a + 1] for s, a in zip(r.block_selected, r.accepted)])
                                for r in results])
    np.testing.assert_array_equal(committed, expected.selected)


def test_block_replays_route_with_the_recorded_groups(tiny):
    # replay_ar and the rollback cache rank under the blocks' group rule: every selection lies in topk_group
    # groups, and replay_ar is the AR replay of the committed rows with those groups
    from specmoe.harness import record_trace
    from specmoe.records import AcceptanceProfile, synthetic_blocks
    from specmoe.replay import replay_ar, replay_rollback
    from specmoe.routing import replay

    model, adapter, store, calibration, drafter, prompt = tiny
    seq = torch.as_tensor(np.random.default_rng(12).integers(0, adapter.vocab_size, 24))
    blocks = synthetic_blocks(record_trace(model, [seq]), 3, AcceptanceProfile.geometric(0.6))
    policy = preset("psr", adapter.num_experts // 2, adapter.top_k)
    rows, starts = blocks.committed_rows()
    expected = replay(policy, blocks.router_logits[rows], blocks.pregate_logits[rows], blocks.tokens[rows],
                      calibration, sequence_starts=starts, scoring=blocks.scoring).selected
    np.testing.assert_array_equal(replay_ar(policy, blocks, calibration, keep_selected=True).selected, expected)
    rolled = replay_rollback(policy, blocks, calibration, keep_selected=True).selected
    size = adapter.num_experts // adapter.n_group
    assert (np.array([[len(set(s // size)) for s in step] for step in rolled]) <= adapter.topk_group).all()
