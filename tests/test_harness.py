"""specmoe.harness: routed routers, per-row routing state, replay agreement, diagnostics, calibration."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _architecture_checks import left_padded
from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter

from specmoe.harness import (
    Selfgen, collect_calibration, copy_stats, exact_routing, excess_nll, original_routing, patch_model, perplexity,
    sample_selfgen, token_nll, unpatch,
)
from specmoe.models import RoutedOlmoeTopKRouter, load_model
from specmoe.routing import Calibration, CalibrationError, PolicyError, preset, replay

GEN = dict(do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=1, eos_token_id=None)
C = 16  # a quarter of the 64 experts: policies diverge from exact routing


def _tokens(vocab, n, seed):
    return torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def micro():
    """The micro model and a calibration made on held-out random token windows."""
    model, adapter = load_model("olmoe-micro", seed=0)
    held_out = [_tokens(adapter.vocab_size, 48, 100 + i) for i in range(6)]
    calibration = collect_calibration(model, adapter, held_out, {"text": "uniform random tokens, seeds 100-105"})
    yield model, adapter, calibration
    unpatch(model)


@pytest.fixture
def model(micro):
    unpatch(micro[0])
    yield micro[0]
    unpatch(micro[0])


def _prompts(vocab, lengths=(6, 11, 8), seed=7):
    return [_tokens(vocab, n, seed + i) for i, n in enumerate(lengths)]


@pytest.mark.parametrize("name", ["exact_lru", "exact_a", "exact_prefetch"])
def test_exact_routing_leaves_forward_logits_bitwise_unchanged(micro, model, name):
    _, adapter, calibration = micro
    ids, mask = left_padded(_prompts(adapter.vocab_size))
    with torch.no_grad():
        reference = model(input_ids=ids, attention_mask=mask).logits
        ctx = patch_model(model, adapter, preset(name, C, 8), calibration)
        assert all(type(r) is RoutedOlmoeTopKRouter for r in adapter.routers(model))
        routed = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(routed, reference)
    assert ctx.totals()["steps"] == 16 * int(mask.sum())  # every unpadded position was routed in every layer
    # a cache-aware policy on the same cache does change the model (the patch is live)
    patch_model(model, adapter, preset("psr", C, 8), calibration)
    with torch.no_grad():
        assert not torch.equal(model(input_ids=ids, attention_mask=mask).logits, reference)


def test_exact_routing_leaves_greedy_generate_bitwise_unchanged(micro, model):
    _, adapter, calibration = micro
    ids, mask = left_padded(_prompts(adapter.vocab_size))
    reference = model.generate(ids, attention_mask=mask, max_new_tokens=8, **GEN)
    patch_model(model, adapter, preset("exact_a", C, 8), calibration)
    routed = model.generate(ids, attention_mask=mask, max_new_tokens=8, **GEN)
    assert torch.equal(routed.sequences, reference.sequences)
    assert all(torch.equal(a, b) for a, b in zip(routed.logits, reference.logits))


@pytest.mark.parametrize("name", ["psr", "cache_prior", "spec_exec", "exact_lru"])
def test_harness_and_replay_agree_decision_for_decision(micro, model, name):
    """Left-padded batch, prompt plus decode steps: each row's recorded logits replayed alone give the
    selections the harness made, and the same copy counts."""
    _, adapter, calibration = micro
    policy = preset(name, C, 8)
    prompts = _prompts(adapter.vocab_size)
    ids, mask = left_padded(prompts)
    ctx = patch_model(model, adapter, policy, calibration, record=True)
    executed = []
    hook = adapter.moe_blocks(model)[5].experts.register_forward_hook(lambda m, args, out: executed.append(args[1]))
    out = model.generate(ids, attention_mask=mask, max_new_tokens=6, **GEN)
    hook.remove()
    copies = {"demand": 0, "prefetch": 0, "unused": 0, "replaced": 0}
    for row, prompt in enumerate(prompts):
        z, g, tokens, selected = ctx.recorded(row)
        assert len(tokens) == len(prompt) + 5 and np.array_equal(tokens[:len(prompt)], prompt.numpy())
        assert np.array_equal(tokens[len(prompt):], out.sequences[row, ids.shape[1]:-1].numpy())
        trace = replay(policy, z, g if policy.insert_budget else None, tokens, calibration)
        assert np.array_equal(trace.selected, selected)
        copies["demand"] += trace.demand_copies.sum()
        copies["prefetch"] += trace.prefetch_copies.sum()
        copies["unused"] += trace.unused_prefetches.sum()
        copies["replaced"] += trace.replaced.sum()
        # what layer 5's experts executed for this row's unpadded positions is the recorded selection
        valid = mask[row].bool()
        ran = torch.cat([executed[0].reshape(len(prompts), -1, 8)[row][valid]] +
                        [step.reshape(len(prompts), 1, 8)[row] for step in executed[1:]])
        assert np.array_equal(ran.numpy(), selected[:, 5])
    ctx.finish()
    totals = ctx.totals()
    assert {key: totals[key] for key in copies} == copies
    if name != "exact_lru":
        assert totals["replaced"] > 0  # the policy did deviate from exact routing somewhere


def test_recorded_logits_are_router_and_pregate(micro, model):
    """z_l is layer l's router output; g_l is router l applied to layer l-1's MoE input."""
    _, adapter, calibration = micro
    ids = _tokens(adapter.vocab_size, 20, 11)[None]
    seen = []  # (MoE input, router logits) per layer
    hooks = [r.register_forward_hook(lambda m, args, out: seen.append((args[0], out[0])))
             for r in adapter.routers(model)]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    moe_inputs, logits = zip(*seen)
    ctx = patch_model(model, adapter, preset("exact_lru", C, 8), calibration, record=True)
    with torch.no_grad():
        model(ids)
    z, g, tokens, selected = ctx.recorded(0)
    assert np.array_equal(tokens, ids[0].numpy())
    wrap = F.linear(moe_inputs[15], adapter.routers(model)[0].weight).detach()  # row 0: router 0, last input
    assert np.array_equal(g[:, 0], wrap.numpy())
    for layer in range(16):
        assert np.array_equal(z[:, layer], logits[layer].numpy())
        assert np.array_equal(selected[:, layer], logits[layer].topk(8, dim=-1).indices.numpy())
        if layer:
            pregate = F.linear(moe_inputs[layer - 1], adapter.routers(model)[layer].weight).detach()
            assert np.array_equal(g[:, layer], pregate.numpy())


def test_routing_is_deterministic(micro, model):
    _, adapter, calibration = micro
    ids, mask = left_padded(_prompts(adapter.vocab_size))
    runs = []
    for _ in range(2):
        ctx = patch_model(model, adapter, preset("psr", C, 8), calibration, record=True)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=6, **GEN)
        runs.append((out.sequences, [ctx.recorded(row)[3] for row in range(3)], ctx.totals()))
    assert torch.equal(runs[0][0], runs[1][0])
    assert all(np.array_equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))
    assert runs[0][2] == runs[1][2]


def test_rows_of_a_left_padded_batch_are_independent(micro, model):
    """Each row of a padded batch routes and generates as the same prompt alone."""
    _, adapter, calibration = micro
    prompts = _prompts(adapter.vocab_size)
    ids, mask = left_padded(prompts)
    ctx = patch_model(model, adapter, preset("psr", C, 8), calibration, record=True)
    batch = model.generate(ids, attention_mask=mask, max_new_tokens=6, **GEN)
    batch_records = [ctx.recorded(row) for row in range(len(prompts))]
    for row, prompt in enumerate(prompts):
        alone = model.generate(prompt[None], max_new_tokens=6, **GEN)
        assert torch.equal(alone.sequences[0], batch.sequences[row, ids.shape[1] - len(prompt):])
        z, _, tokens, selected = ctx.recorded(0)
        assert np.array_equal(tokens, batch_records[row][2])
        assert np.array_equal(selected, batch_records[row][3])
        np.testing.assert_allclose(z, batch_records[row][0], rtol=0, atol=1e-4)


def test_fresh_context_has_counted_nothing(micro, model):
    _, adapter, calibration = micro
    ctx = patch_model(model, adapter, preset("psr", C, 8), calibration)
    ctx.reset(4)
    ctx.finish()
    assert ctx.totals() == {"steps": 0, "demand": 0, "prefetch": 0, "unused": 0, "replaced": 0,
                            "displaced_mass": 0.0, "tokens": 0}


def test_routing_state_must_match_the_kv_cache(micro, model):
    _, adapter, calibration = micro
    ids = _tokens(adapter.vocab_size, 10, 3)[None]
    ctx = patch_model(model, adapter, preset("psr", C, 8), calibration)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        ctx.reset(1)  # the routing state no longer belongs to the sequence in the KV cache
        with pytest.raises(RuntimeError, match="routing state has processed 0 tokens but the KV cache holds 10"):
            model(input_ids=ids[:, :1], attention_mask=torch.ones(1, 11, dtype=torch.long),
                  past_key_values=out.past_key_values, use_cache=True)


def test_unpatch_and_original_routing_restore_the_model(micro, model):
    _, adapter, calibration = micro
    ids = _tokens(adapter.vocab_size, 12, 4)[None]
    with torch.no_grad():
        reference = model(ids).logits
        ctx = patch_model(model, adapter, preset("psr", C, 8), calibration)
        with original_routing(model):
            assert all(type(r) is OlmoeTopKRouter for r in adapter.routers(model))
            assert torch.equal(model(ids).logits, reference)
        assert model.specmoe_context is ctx and not torch.equal(model(ids).logits, reference)
        assert unpatch(model) is ctx and unpatch(model) is None
        assert not hasattr(model, "specmoe_context")
        assert all(type(r) is OlmoeTopKRouter and not hasattr(r, "specmoe_context") for r in adapter.routers(model))
        assert torch.equal(model(ids).logits, reference)


def test_policy_and_calibration_must_fit_the_model(micro, model):
    _, adapter, calibration = micro
    with pytest.raises(PolicyError, match="top_k K=4 but the model routes each token to K=8"):
        patch_model(model, adapter, preset("psr", C, 4), calibration)
    other, other_adapter = load_model("olmoe-micro", seed=1)
    foreign = collect_calibration(other, other_adapter, [_tokens(128, 16, 1)], "random tokens")
    with pytest.raises(CalibrationError, match="router fingerprint .* the model's is"):
        patch_model(model, adapter, preset("psr", C, 8), foreign)
    tiny, tiny_adapter = load_model("olmoe-tiny", seed=0)
    with pytest.raises(CalibrationError, match="vocabulary 128, the model has 512"):
        patch_model(tiny, tiny_adapter, preset("psr", C, 8), calibration)
    assert not hasattr(model, "specmoe_context") and not hasattr(tiny, "specmoe_context")


def test_collect_calibration_provenance(micro, model, tmp_path):
    _, adapter, calibration = micro
    info = calibration.provenance
    assert info["fingerprint"] == adapter.fingerprint(model)
    assert info["model"] == "olmoe-micro (random weights, seed 0)"
    assert info["text"].startswith("uniform random tokens") and info["windows"] == 6 and info["tokens"] == 6 * 48
    assert calibration.warm_set(C).shape == (16, C)
    loaded = Calibration.load(calibration.save(tmp_path / "cal.safetensors"))
    loaded.check(16, 64, 128, fingerprint=adapter.fingerprint(model))
    with pytest.raises(ValueError, match="must describe the text"):
        collect_calibration(model, adapter, [_tokens(128, 8, 0)], {"model": "x"})


def test_perplexity_resets_state_per_window(micro, model):
    _, adapter, calibration = micro
    windows = [_tokens(adapter.vocab_size, n, 20 + n) for n in (24, 17, 24, 9)]
    exact = perplexity(model, None, windows)
    nll = np.concatenate(token_nll(model, None, windows, batch_size=1))
    assert nll.size == sum(len(w) - 1 for w in windows)  # every token after the first of each window
    assert math.isclose(exact, math.exp(nll.mean()), rel_tol=1e-6)
    ctx = patch_model(model, adapter, preset("psr", C, 8), calibration)
    batched = perplexity(model, ctx, windows, batch_size=4)
    single = perplexity(model, ctx, windows, batch_size=1)  # one sequence per forward
    assert math.isclose(batched, single, rel_tol=1e-5) and batched != exact


def test_token_nll_is_the_cross_entropy_of_the_next_token(micro, model):
    """token_nll[i] is -log softmax(logits at position i)[token i + 1], computed here independently with
    F.cross_entropy on one unbatched forward per window (logits[:-1] against tokens[1:]); a Selfgen window
    scores only the tokens after its prompt. Windows of different lengths share a right-padded batch."""
    _, adapter, _ = micro
    windows = [_tokens(adapter.vocab_size, n, 60 + n) for n in (24, 17, 9)]
    with torch.no_grad():
        expected = [F.cross_entropy(model(w[None]).logits[0, :-1].double(), w[1:], reduction="none").numpy()
                    for w in windows]
    for batch_size in (1, 3):
        got = token_nll(model, None, windows, batch_size=batch_size)
        for mine, theirs in zip(got, expected):
            np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-6)
    prompted = token_nll(model, None, Selfgen(windows, [5, 1, 8], seed=0), batch_size=3)
    for mine, theirs, start in zip(prompted, expected, (5, 1, 8)):
        np.testing.assert_allclose(mine, theirs[start - 1:], rtol=1e-5, atol=1e-6)


def test_selfgen_excess_nll_and_copy_stats(micro, model):
    _, adapter, calibration = micro
    sample = sample_selfgen(model, n_windows=3, length=20, seed=5)
    again = sample_selfgen(model, n_windows=3, length=20, seed=5)
    other = sample_selfgen(model, n_windows=3, length=20, seed=6)
    assert all(torch.equal(a, b) for a, b in zip(sample.windows, again.windows))
    assert not all(torch.equal(a, b) for a, b in zip(sample.windows, other.windows))
    assert [len(w) for w in sample.windows] == [20] * 3 and sample.prompt_lengths == [1] * 3
    prompted = sample_selfgen(model, n_windows=2, length=12, seed=5, prompts=[[5, 6, 7]])
    assert prompted.prompt_lengths == [3, 3] and prompted.windows[1][:3].tolist() == [5, 6, 7]

    exact_nll = token_nll(model, None, sample)
    ctx = patch_model(model, adapter, preset("exact_lru", C, 8), calibration)
    same = excess_nll(model, ctx, sample, exact_nll=exact_nll)
    assert same["excess_nll"] == 0.0 and same["excess_ppl_pct"] == 0.0 and same["replaced"] == 0.0
    assert same["tokens"] == 3 * 19 and same["demand"] > 0 and same["prefetch"] == 0.0

    ctx = patch_model(model, adapter, preset("psr", C, 8), calibration)
    result = excess_nll(model, ctx, sample)
    assert result["excess_nll"] != 0.0 and result["replaced"] > 0 and result["prefetch"] > 0
    assert math.isclose(result["excess_ppl_pct"], 100 * (result["ppl_policy"] / result["ppl_exact"] - 1), rel_tol=1e-9)
    assert math.isclose(np.mean(result["per_window_excess"]), result["excess_nll"], rel_tol=1e-9)
    assert result["copies"] == result["demand"] + result["prefetch"] and result["unused"] <= result["prefetch"]
    stats = copy_stats(ctx)  # the counters of the pass excess_nll made, per routed token
    assert stats["tokens"] == 3 * 20 and math.isclose(stats["demand"] * 60, ctx.totals()["demand"])


def test_exact_reference_breaks_bfloat16_ties_like_the_routing_core(micro):
    """In bfloat16, router logits tie at the top-K boundary; every diagnostic's exact reference is the
    routing core's exact policy (ties to the lower index), so an exact policy has zero excess NLL. The
    calibration of the float32 model serves its bfloat16 copy (same weights, same fingerprint)."""
    _, adapter, calibration = micro
    half, _ = load_model("olmoe-micro", seed=0, dtype=torch.bfloat16)
    ids = torch.stack([_tokens(adapter.vocab_size, 32, 50 + i) for i in range(4)])
    seen = []
    hooks = [r.register_forward_hook(lambda m, args, out: seen.append(out[0])) for r in adapter.routers(half)]
    with torch.no_grad():
        half(ids)
    for h in hooks:
        h.remove()
    top = torch.stack(seen).float().sort(dim=-1, descending=True).values
    assert (top[..., 7] == top[..., 8]).any(), "no tie at the top-K boundary: the test would prove nothing"
    with torch.no_grad(), exact_routing(half) as reference:
        expected = half(ids).logits
    assert reference.policy.kind == "exact" and not hasattr(half, "specmoe_context")
    ctx = patch_model(half, adapter, preset("exact_lru", C, 8), calibration)
    with torch.no_grad():
        assert torch.equal(half(ids).logits, expected)
    result = excess_nll(half, ctx, list(ids))
    assert result["excess_nll"] == 0.0 and result["demand"] > 0
