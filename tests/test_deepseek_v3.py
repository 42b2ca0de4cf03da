"""DeepSeek-V3 (Moonlight) in the harness: adapter, group-limited choice, exact routing = transformers, harness
and replay decision for decision, calibration, checkpoint directories. Tiny models with a random nonzero
selection bias, written by save_pretrained and loaded back."""

import numpy as np
import pytest
import torch

from _architecture_checks import (GEN, check_exact_routing_changes_nothing, left_padded, random_tokens,
                                 tiny_checkpoint)
from specmoe.harness.patch import exact_routing, patch_model, unpatch
from specmoe.models import DeepseekV3Adapter, ModelSourceError, adapter_for, named_config
from specmoe.routing import Calibration, EngineScoring, LogicalCache, PolicyConfig, RouterScoring, preset, replay
from specmoe.routing.calibration import CalibrationBuilder

NAMES = ["deepseek-v3-tiny", "deepseek-v3-tiny-groups"]
C = 6  # of 16 experts: the policies diverge from exact routing


@pytest.fixture(scope="module", params=NAMES)
def tiny(request, tmp_path_factory):
    """`tiny_checkpoint` of the config."""
    loaded = tiny_checkpoint(request.param, tmp_path_factory)
    yield loaded
    unpatch(loaded[0])


def test_checkpoint_directory_loads_the_same_model(tiny):
    model, adapter, path, _, built = tiny
    assert isinstance(adapter, DeepseekV3Adapter) and adapter == adapter_for(named_config(path.name))
    assert adapter.moe_layer_ids == (1, 2, 3) and adapter.num_moe_layers == 3
    assert adapter.routed_scaling_factor == pytest.approx(2.446) and adapter.norm_topk_prob
    for (name, a), (_, b) in zip(built.state_dict().items(), model.state_dict().items()):
        assert torch.equal(a, b), name
    biases = [router.e_score_correction_bias for router in adapter.routers(model)]
    assert all(b.abs().min() > 0 and b.std() > 0.03 for b in biases)  # random and nonzero
    assert adapter.fingerprint(model) == adapter.fingerprint(built)
    from specmoe.models import CheckpointReader
    assert adapter.checkpoint_fingerprint(CheckpointReader(path)) == adapter.fingerprint(model)
    gate, down = adapter.experts(model, 0)
    assert gate.shape == (16, 64, 64) and down.shape == (16, 64, 32)
    assert adapter.shared_experts(model, 0).gate_proj.out_features == 32 * named_config(path.name).n_shared_experts


def test_fingerprint_covers_the_selection_bias(tiny):
    model, adapter, *_ = tiny
    before = adapter.fingerprint(model)
    bias = adapter.routers(model)[1].e_score_correction_bias
    saved = bias.clone()
    bias.add_(0.5)
    try:
        assert adapter.fingerprint(model) != before
    finally:
        bias.copy_(saved)


def test_exact_routing_leaves_forward_and_generate_unchanged(tiny):
    model, adapter, *_ = tiny
    check_exact_routing_changes_nothing(model, adapter)


def test_execution_weights_and_scores_are_the_routers(tiny):
    """The adapter's arithmetic against the router's own output, and the bias changes the choice."""
    model, adapter, *_ = tiny
    router = adapter.routers(model)[0]
    hidden = torch.randn(40, adapter.hidden_size, generator=torch.Generator().manual_seed(3))
    logits, weights, selected = router(hidden)
    assert torch.equal(adapter.router_logits(router, hidden), logits)
    scores = adapter.selection_scores(logits, 0, router)
    assert torch.equal(scores, logits.sigmoid() + router.e_score_correction_bias)
    mine = adapter.execution_weights(logits, selected)
    torch.testing.assert_close(mine, weights, rtol=1e-6, atol=0)
    torch.testing.assert_close(mine.sum(-1), torch.full((40,), adapter.routed_scaling_factor), rtol=1e-6, atol=0)
    unbiased = logits.sigmoid().topk(adapter.top_k).indices.sort(-1).values
    assert not torch.equal(unbiased, selected.sort(-1).values)  # the bias steers the choice
    with pytest.raises(ValueError, match="router"):
        adapter.selection_scores(logits, 0)


@pytest.mark.parametrize("name", ["exact_lru", "cache_prior", "psr", "spec_exec"])
def test_harness_and_replay_agree_decision_for_decision(tiny, name):
    model, adapter, _, calibration, _ = tiny
    policy = preset(name, C, adapter.top_k)
    prompts = [random_tokens(adapter.vocab_size, n, 30 + i) for i, n in enumerate((7, 12))]
    ids, mask = left_padded(prompts)
    ctx = patch_model(model, adapter, policy, calibration, record=True)
    try:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=6, **GEN)
    finally:
        unpatch(model)
    diverged = 0
    for row, prompt in enumerate(prompts):
        z, g, tokens, selected = ctx.recorded(row)
        assert np.array_equal(tokens[len(prompt):], out.sequences[row, ids.shape[1]:-1].numpy())
        # the recordings are raw logits: the replay routes them through the model's rule, as the harness did
        trace = replay(policy, z, g if policy.insert_budget else None, tokens, calibration, scoring=ctx.scoring)
        assert np.array_equal(trace.selected, selected)
        exact = replay(preset("exact_lru", adapter.num_experts, adapter.top_k), z, None, tokens, calibration,
                       scoring=ctx.scoring)
        diverged += int((np.sort(exact.selected, -1) != np.sort(selected, -1)).any(-1).sum())
        if adapter.groups[0] > 1:  # every selection lies in topk_group groups
            size = adapter.num_experts // adapter.n_group
            assert (np.array([[len(set(s // size)) for s in step] for step in selected]) <= adapter.topk_group).all()
    if name != "exact_lru":
        assert diverged > 0  # the policy is not exact routing in disguise


def test_calibration_counts_the_group_limited_choice(tiny):
    model, adapter, _, calibration, _ = tiny
    assert calibration.provenance["fingerprint"] == adapter.fingerprint(model)
    windows = [random_tokens(adapter.vocab_size, 30, 300 + i) for i in range(2)]
    builder = CalibrationBuilder(adapter.num_moe_layers, adapter.num_experts, adapter.vocab_size, adapter.top_k,
                                 adapter.groups)
    counts = np.zeros((adapter.num_moe_layers, adapter.num_experts), dtype=np.int64)
    with torch.no_grad(), exact_routing(model, adapter, record=True) as context:
        for window in windows:
            model(input_ids=window[None])
            z, _, tokens, selected = context.recorded(0)
            builder.add(context.scoring.selection_scores(z), tokens)  # the raw logits through the rule
            for layer in range(adapter.num_moe_layers):
                np.add.at(counts[layer], selected[:, layer].ravel(), 1)
    assert np.array_equal(builder.selection_counts, counts)


def _grouped_case():
    """8 experts in 4 groups of 2, 2 groups kept, top-2; selection scores (sigmoid + bias) of one token."""
    z = np.array([0.30, 0.20, 0.60, 0.45, 0.70, 0.10, 0.65, 0.05])
    return z, (4, 2)


def test_group_limited_choice_by_hand():
    """Group sums (best two): g0 .50, g1 1.05, g2 .80, g3 .70: groups 1 and 2 are kept, so the top-2 is
    {4, 2}, where the plain top-2 would be {4, 6}."""
    z, groups = _grouped_case()
    calibration = Calibration.uniform(1, 8, 16, delta=1.0)
    for kind in ("exact", "group-free"):
        cache = LogicalCache(PolicyConfig(kind="exact", capacity=8, top_k=2, priority="lru"), calibration, 1, 8,
                             groups if kind == "exact" else (1, 1))
        selected = cache.run_span(0, z[None], None, np.array([3]))
        assert selected[0].tolist() == ([4, 2] if kind == "exact" else [4, 6])
    assert replay(PolicyConfig(kind="exact", capacity=8, top_k=2, priority="lru"), z[None, None], None, None,
                  calibration, groups=groups).selected[0, 0].tolist() == [4, 2]
    builder = CalibrationBuilder(1, 8, 16, 2, groups)
    builder.add(z[None, None], np.array([3]))
    assert np.flatnonzero(builder.selection_counts[0]).tolist() == [2, 4]


def test_group_limited_choice_with_bonus_by_hand():
    """Cache-Prior, C = 2 (warm set {0, 1}), lambda 0.2, delta 1: the bonus is added to the selection scores
    first, groups are scored on the scores plus bonus (g0 .50 + .40 = .90 now beats g2 .80), then top-2 in the
    kept groups 1 and 0: {2 (.60), 0 (.30 + .20)}. Scoring groups before the bonus would keep groups 1 and 2
    and give {4, 2}, with no resident expert."""
    z, groups = _grouped_case()
    calibration = Calibration.uniform(1, 8, 16, delta=1.0)
    policy = PolicyConfig(kind="cache_prior", capacity=2, top_k=2, bonus=0.2, priority="lru")
    cache = LogicalCache(policy, calibration, 1, 8, groups)
    out = {}
    assert cache.run_span(0, z[None], None, np.array([3]), out=out)[0].tolist() == [2, 0]
    assert out["demand"][0] == 1 and sorted(cache.resident(0).tolist()) == [0, 2]
    assert replay(policy, z[None, None], None, None, calibration, groups=groups).selected[0, 0].tolist() == [2, 0]


def test_engine_route_honours_groups_on_raw_logits():
    """`LogicalCache.route` from raw router logits and a sigmoid RouterScoring with bias and groups: the same
    selection as `run_span` on the selection scores, and the model's execution weights."""
    rng = np.random.default_rng(0)
    num_layers, num_experts, top_k = 2, 16, 4
    bias = rng.normal(0, 0.1, (num_layers, num_experts))
    scoring = RouterScoring("sigmoid", renormalise=True, scale=2.446, bias=bias, n_group=4, topk_group=2)
    calibration = Calibration.uniform(num_layers, num_experts, 64, delta=0.5)
    policy = preset("cache_prior", 6, top_k)
    engine_cache = LogicalCache(policy, calibration, num_layers, num_experts)  # as the engines build it
    span_cache = LogicalCache(policy, calibration, num_layers, num_experts, scoring.groups)
    logits = rng.normal(0, 2, (12, num_layers, num_experts)).astype(np.float32)
    engine_scoring = EngineScoring.of(scoring, num_layers, num_experts)
    selected, slots, weights = np.empty(top_k, np.int64), np.empty(top_k, np.int64), np.empty(top_k)
    record = np.empty(num_experts, np.float32)
    for t in range(logits.shape[0]):
        for layer in range(num_layers):
            engine_cache.route(layer, logits[t, layer], 5, engine_scoring, record, selected, slots, weights)
            scores = 1 / (1 + np.exp(-logits[t, layer].astype(np.float64))) + bias[layer]
            expected = span_cache.run_span(layer, scores[None], None, np.array([5]))[0]
            assert selected.tolist() == expected.tolist()
            assert len(set(selected // 4)) <= 2
            sig = 1 / (1 + np.exp(-logits[t, layer].astype(np.float64)[selected]))
            np.testing.assert_allclose(weights, sig / sig.sum() * 2.446, rtol=1e-12)


def test_group_rules_are_checked():
    with pytest.raises(ValueError, match="topk_group"):
        RouterScoring("sigmoid", n_group=2, topk_group=3)
    calibration = Calibration.uniform(1, 8, 16)
    with pytest.raises(ValueError, match="groups of two"):
        LogicalCache(PolicyConfig(kind="exact", capacity=8, top_k=2, priority="lru"), calibration, 1, 8, (8, 2))
    with pytest.raises(ValueError, match="exceeds"):
        LogicalCache(PolicyConfig(kind="exact", capacity=8, top_k=4, priority="lru"), calibration, 1, 8, (4, 1))
    config = named_config("deepseek-v3-tiny-groups")
    config.topk_group = 1  # 4 experts kept, top-4 still fits
    assert adapter_for(config).groups == (4, 1)
    config.n_group = 3
    with pytest.raises(ModelSourceError, match="groups"):
        adapter_for(config)


def test_moonlight_named_config():
    config = named_config("moonlight-16b-a3b")
    adapter = adapter_for(config)
    assert (adapter.num_moe_layers, adapter.num_experts, adapter.top_k, adapter.groups) == (26, 64, 6, (1, 1))
    assert adapter.moe_layer_ids[0] == 1 and adapter.n_shared_experts == 2 and adapter.vocab_size == 163840
    assert 3 * config.hidden_size * config.moe_intermediate_size * 2 == pytest.approx(17.3e6, rel=0.01)
    assert (config.kv_lora_rank, config.qk_rope_head_dim, config.routed_scaling_factor) == (512, 64, 2.446)
