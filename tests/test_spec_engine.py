"""The speculative engine on the CPU (float32, the shipped family's target and AR drafter): exact selection
reproduces the AR engine's greedy output, agreement with the harness loop (tokens, accepted lengths,
selections, copies, moves), independence of copy timing, slots that follow the pool, autoregressive and
speculative engines alternating on one residency unit, the copy stream's moves, and bad input."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from specmoe.drafters import DrafterConfig, DrafterError, build_drafter
from specmoe.engines import EngineConfig, RunSettings, build_engine
from specmoe.harness import speculative_generate
from specmoe.offload import ExpertResidency, ExpertStore
from specmoe.routing import Calibration, preset
from specmoe.speculation import SpeculativeConfig
from specmoe.verifiers import selector_preset

SEQ, NEW, K_DRAFTS, POOL = 64, 12, 4, 32


@pytest.fixture(scope="module")
def drafter(family):
    return build_drafter(DrafterConfig("ar"), family[0])


@pytest.fixture(scope="module")
def store(family):
    return ExpertStore.from_model(family[0], family[1])


@pytest.fixture(scope="module")
def calibration(family):
    adapter = family[1]
    return Calibration.uniform(adapter.num_moe_layers, adapter.num_experts, adapter.vocab_size)


@pytest.fixture(scope="module")
def prompt(family_text):
    return family_text[:16]


@pytest.fixture(scope="module")
def residency(family, store):
    return ExpertResidency(store, family[1].num_experts, "cpu")


def spec(family, drafter, calibration, residency, selector="acceptmoe", settings=RunSettings(), **kw):
    """A speculative engine with `drafter` (the config's request length and stop tokens: `sd`)."""
    config = SpeculativeConfig(selector_preset(selector),
                               **{"k": K_DRAFTS, "pool_size": POOL, "max_new_tokens": NEW, **kw})
    engine = build_engine(family[0], None, calibration, EngineConfig(max_seq_len=SEQ), settings, speculative=config,
                          residency=residency)
    engine.drafter = drafter
    return engine


def sd(engine, prompt, **kw):
    """engine.generate with its drafter, as configured by `spec`."""
    c = engine.speculative
    return engine.generate(prompt, c.max_new_tokens, c.stop_tokens, drafter=engine.drafter, **kw)


def test_exact_selection_equals_ar_engine_greedy(family, drafter, calibration, residency, prompt):
    model, adapter = family
    ar = build_engine(model, preset("exact_lru", adapter.num_experts, adapter.top_k), calibration,
                      EngineConfig(max_seq_len=SEQ), residency=residency)
    expected = ar.generate(prompt, NEW).generated
    result = sd(spec(family, drafter, calibration, residency, "exact"), prompt)
    assert result.tokens == expected
    assert len(result.accepted) >= 1 and result.tau >= 1.0


@pytest.mark.parametrize("selector", ["acceptmoe", "confidence_top1"])
def test_agrees_with_the_harness_loop(family, drafter, calibration, residency, prompt, selector):
    model, adapter = family
    config = SpeculativeConfig(selector_preset(selector), k=K_DRAFTS, pool_size=POOL, max_new_tokens=NEW)
    harness = speculative_generate(model, adapter, drafter, torch.tensor(prompt), config, calibration=calibration,
                                   record=True, divergence=False)
    result = sd(spec(family, drafter, calibration, residency, selector), prompt, record=True)
    assert harness.copies > 0 and 0 < sum(harness.accepted) < K_DRAFTS * len(harness.accepted)  # not trivial
    assert result.tokens == harness.tokens.tolist()
    assert list(result.accepted) == harness.accepted and list(result.roots) == harness.roots
    # the link's copies less the unused block prefetches: the pool's copies, one per missing expert
    logical = result.counts()["copies"] - result.copy_totals()["prefetch_unused"]
    assert (logical, result.moves) == (harness.copies, harness.moves)
    for mine, theirs in zip(result.block_selected, harness.blocks, strict=True):
        np.testing.assert_array_equal(mine, theirs["selected"])
    assert result.displaced == pytest.approx(harness.displaced, rel=1e-4)
    assert result.summary()["tau"] == pytest.approx(harness.summary()["tau"])


def test_copy_timing_changes_no_token_or_selection(family, drafter, calibration, residency, prompt):
    engine = spec(family, drafter, calibration, residency)
    reference = sd(engine, prompt, record=True)
    for in_flight in (1, 4):
        engine.configure(copy_delay=(0.0, 0.001), max_in_flight=in_flight, delay_seed=in_flight)
        delayed = sd(engine, prompt, record=True)
        assert delayed.tokens == reference.tokens and list(delayed.accepted) == list(reference.accepted)
        for a, b in zip(delayed.block_selected, reference.block_selected, strict=True):
            np.testing.assert_array_equal(a, b)
    # copies-skipped (compute-only time): nothing goes over the link; the slots keep stale bytes, so the
    # tokens are not the model's (as in the AR engine's mode)
    engine.configure(copy_delay=None, skip_copies=True)
    stats = residency.copies.stats
    issued, skipped = stats.issued, stats.skipped
    sd(engine, prompt)
    assert stats.issued == issued and stats.skipped > skipped
    engine.configure(skip_copies=False)


def test_slots_follow_the_pool(family, drafter, calibration, residency, store, prompt):
    engine = spec(family, drafter, calibration, residency)
    sd(engine, prompt)
    assert residency.copies.stats.moved > 0
    for layer in range(store.num_layers):
        table = engine.block_router.pool.slot_table(layer)
        for expert in np.flatnonzero(engine.block_router.pool.resident(layer)):
            assert torch.equal(residency.slots.data[layer, table[expert]], store.layers[layer][expert])


def test_ar_and_spec_engines_alternate_on_one_residency(family, drafter, calibration, store, prompt):
    model, adapter = family
    shared = ExpertResidency(store, POOL + 16, "cpu")
    ar = build_engine(model, preset("psr", 24, adapter.top_k), calibration, EngineConfig(max_seq_len=SEQ),
                      residency=shared)
    spec_engine = spec(family, drafter, calibration, shared, union_slots=16)
    first_ar, first_sd = ar.generate(prompt, NEW).generated, sd(spec_engine, prompt, record=True)
    for _ in range(2):
        assert ar.generate(prompt, NEW).generated == first_ar
        again = sd(spec_engine, prompt, record=True)
        assert again.tokens == first_sd.tokens and again.counts()["copies"] == first_sd.counts()["copies"]
        for a, b in zip(again.block_selected, first_sd.block_selected, strict=True):
            np.testing.assert_array_equal(a, b)


def test_copy_stream_move(store):
    unit = ExpertResidency(store, 8, "cpu")
    copies = unit.copies
    copies.assign(0, np.array([5, 6]), np.array([3, 9]), prefetch=False)
    copies.move(0, np.array([5, 6]), np.array([1, 2]))
    assert torch.equal(unit.slots.data[0, 1], store.layers[0][3]) and torch.equal(unit.slots.data[0, 2],
                                                                                   store.layers[0][9])
    assert copies.owner[0, 1] == 3 and copies.owner[0, 2] == 9 and copies.stats.moved == 2
    with pytest.raises(ValueError, match="disjoint"):
        copies.move(0, np.array([1, 2]), np.array([2, 3]))


def test_bad_input(family, drafter, calibration, residency, prompt):
    model, adapter = family
    with pytest.raises(ValueError, match="does not fit the static KV cache"):
        spec(family, drafter, calibration, residency, k=SEQ)
    for pool_size in (adapter.top_k - 1, adapter.num_experts + 1):
        with pytest.raises(ValueError, match="K <= P <= E"):
            spec(family, drafter, calibration, residency, pool_size=pool_size)
    with pytest.raises(ValueError, match="union slots"):
        spec(family, drafter, calibration, residency, union_slots=adapter.top_k - 1)
    with pytest.raises(ValueError, match="union slots"):  # U > E - P: before any allocation
        spec(family, drafter, calibration, None, union_slots=adapter.num_experts - POOL + 1)
    with pytest.raises(ValueError, match="logically"):
        spec(family, drafter, calibration, residency, settings=RunSettings(cache_mode="physical"))
    with pytest.raises(ValueError, match="positions"):  # the request does not fit the cache
        sd(spec(family, drafter, calibration, residency, max_new_tokens=SEQ), prompt)
    # U = K: enough for the root, not for a block whose drafts miss more: a clear error, not a fallback
    with pytest.raises(ValueError, match="union slots' worth"):
        sd(spec(family, drafter, calibration, residency, "exact", union_slots=adapter.top_k), prompt)
    # a drafter that reads a target layer the target does not have (DFlash drafters are otherwise welcome:
    # tests/test_static_drafters.py)
    missing = SimpleNamespace(name="dflash", target_layer_ids=(1, adapter.num_moe_layers), max_drafts=None,
                              vocab_size=adapter.vocab_size, hidden_size=model.config.hidden_size)
    with pytest.raises(DrafterError, match="hidden states after target layers"):
        sd(spec(family, missing, calibration, residency), prompt)


def test_rollback_leaves_the_kv_cache_of_a_fresh_run(family, drafter, calibration, residency, prompt):
    """After a request with rejections, the KV rows of the committed positions are those of a fresh exact run
    over the committed prefix (rejected drafts' rows above them are simply overwritten by later blocks)."""
    model, adapter = family
    engine = spec(family, drafter, calibration, residency, "exact")
    result = sd(engine, prompt)
    assert any(a < K_DRAFTS for a in result.accepted)  # at least one rejection to roll back
    processed = len(prompt) + len(result.tokens) - 1  # the last bonus token was never fed
    ar = build_engine(model, preset("exact_lru", adapter.num_experts, adapter.top_k), calibration,
                      EngineConfig(max_seq_len=SEQ), residency=residency)
    ar.teacher_forced((list(prompt) + result.tokens)[:processed])
    for name in ("k_cache", "v_cache"):
        mine, fresh = getattr(engine.decoder, name), getattr(ar.decoder, name)  # OLMoE decoder internals
        torch.testing.assert_close(mine[:, :, :processed], fresh[:, :, :processed], atol=1e-4, rtol=1e-4)


def test_stop_token_ends_the_request(family, drafter, calibration, residency, prompt):
    engine = spec(family, drafter, calibration, residency)
    full = sd(engine, prompt).tokens
    stop = full[5]
    cut = sd(spec(family, drafter, calibration, residency, stop_tokens=(stop,)), prompt).tokens
    assert cut == full[:full.index(stop) + 1]


def test_trace_following_equals_the_cpu_replay_of_the_recorded_blocks(family, drafter, calibration, residency,
                                                                       prompt):
    """follow() on a harness run's block records makes the CPU replay's block-level selections and copies
    (`replay_block_selection`: same blocks, same pool start), whatever the copy timing, and commits the
    record's tokens."""
    from specmoe.records import BlockRecords, blocks_from_records
    from specmoe.replay import replay_block_selection

    model, adapter = family
    config = SpeculativeConfig(selector_preset("acceptmoe"), k=K_DRAFTS, pool_size=POOL, max_new_tokens=NEW)
    runs = [speculative_generate(model, adapter, drafter, torch.tensor(p), config, calibration=calibration,
                                 record=True, divergence=False) for p in (prompt, prompt[4:14])]
    records = BlockRecords.from_requests([r.blocks for r in runs], top_k=adapter.top_k,
                                         vocab_size=adapter.vocab_size)
    blocks = blocks_from_records(records)
    selector = selector_preset("acceptmoe")
    expected = replay_block_selection(selector, blocks, calibration, POOL, keep_selected=True)
    engine = spec(family, drafter, calibration, residency)
    for settings in ({}, {"copy_delay": (0.0, 0.002), "max_in_flight": 1}):
        engine.configure(**settings)
        results = engine.follow(blocks, first_position=len(prompt), record=True)  # the first root: token 1
        assert len(results) == 2
        assert sum(r.counts()["copies"] - r.copy_totals()["prefetch_unused"] for r in results) == expected.copies > 0
        committed = np.concatenate([np.concatenate([s[: a + 1] for s, a in zip(r.block_selected, r.accepted)])
                                    for r in results])
        np.testing.assert_array_equal(committed, expected.selected)
        for r, run in zip(results, runs):
            assert list(r.accepted) == run.accepted and len(r.tokens) == sum(a + 1 for a in r.accepted)
            # the record's committed tokens (the harness cut them at max_new_tokens); the last block's bonus
            # is this model's own token
            # (tokens[0], the prefill's token, is in no block)
            committed = run.tokens.tolist()[1:]
            n = min(len(committed), len(r.tokens) - 1)
            assert r.tokens[:n] == committed[:n]
    engine.configure(copy_delay=None, max_in_flight=2)
    # union slots sized by measurement: the replay's peak is the engine's, and U = that peak (at least K) runs
    # these blocks as U = E - P does, with P + U slots per layer
    peak = expected.extra["union_peak"]
    assert max(r.info["union_used"] for r in results) == peak > 0
    assert max(r.info["peak_slots"] for r in results) == POOL + peak  # the slot memory per layer the run needed
    sized = spec(family, drafter, calibration, residency, union_slots=max(peak, adapter.top_k))
    again = sized.follow(blocks, first_position=len(prompt), record=True)
    assert [r.tokens for r in again] == [r.tokens for r in results]
    for a, b in zip(again, results):
        for x, y in zip(a.block_selected, b.block_selected, strict=True):
            np.testing.assert_array_equal(x, y)
    with pytest.raises(ValueError, match="drafts"):
        spec(family, drafter, calibration, residency, k=K_DRAFTS + 1).follow(blocks)
    with pytest.raises(ValueError, match="do not fit the static KV cache"):
        engine.follow(blocks, first_position=SEQ - 2)
    from dataclasses import replace

    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        engine.follow(replace(blocks, tokens=blocks.tokens + adapter.vocab_size))


def test_the_decoder_rolls_back_after_every_block(family, drafter, calibration, residency, prompt, monkeypatch):
    """The engine hands each verification's committed count (root + accepted drafts) to the decoder's state hook
    (`Decoder.rollback`: nothing to do for a KV cache; a recurrent state restores there), once per block."""
    engine = spec(family, drafter, calibration, residency)
    calls = []
    monkeypatch.setattr(engine.decoder, "rollback", lambda step, committed: calls.append((step.num_positions,
                                                                                         committed)))
    result = sd(engine, prompt)
    assert calls == [(K_DRAFTS + 1, a + 1) for a in result.accepted.tolist()]
    assert engine.decoder.layer_kinds == (("attention", "moe"),) * engine.geometry.num_layers


def test_the_whole_token_graph_is_made_for_the_autoregressive_router_only(family, drafter, calibration, residency):
    """Device routing (every expert resident, one launch per token) serves autoregressive policies: a
    speculative-only engine keeps the one-position runner of per-layer launches (as its prefill uses it)."""
    model, adapter = family
    config = EngineConfig(max_seq_len=SEQ, device_routing="on")
    speculative = SpeculativeConfig(selector_preset("acceptmoe"), k=K_DRAFTS, pool_size=POOL)
    spec_only = build_engine(model, None, calibration, config, speculative=speculative, residency=residency)
    both = build_engine(model, preset("exact_lru", adapter.num_experts, adapter.top_k), calibration, config,
                        speculative=speculative, residency=residency)
    assert spec_only.runner.resident_scoring is None and both.runner.resident_scoring is not None


def test_an_engine_refuses_a_run_it_has_no_router_for(family, drafter, calibration, residency, prompt):
    """One engine class: a run whose router the engine was not built with is a clear ValueError naming what to set;
    follow takes a LogitFeed or Blocks."""
    model, adapter = family
    spec_only = spec(family, drafter, calibration, residency)
    with pytest.raises(ValueError, match="autoregressive decoding needs a policy"):
        spec_only.generate(prompt, 4)
    ar_only = build_engine(model, preset("exact_lru", adapter.num_experts, adapter.top_k), calibration,
                           EngineConfig(max_seq_len=SEQ), residency=residency)
    with pytest.raises(ValueError, match="speculative decoding needs a SpeculativeConfig"):
        ar_only.generate(prompt, 4, drafter=drafter)
    with pytest.raises(TypeError, match="LogitFeed or Blocks"):
        ar_only.follow(np.zeros(3))
    with pytest.raises(ValueError, match="an engine needs a policy"):
        build_engine(model, None, calibration, EngineConfig(max_seq_len=SEQ), residency=residency)


def test_each_selector_follows_its_own_runs_records(family, drafter, calibration, residency, prompt, tmp_path):
    """Closed loop in the engine benchmark (scripts/bench_spec_engine.py `block_sources`): with block records of
    exact's and of a lossy selector's run, the lossy selector's row follows its own run's accepted lengths (and
    synthetic blocks at its own histogram), a selector without records follows exact's, labelled open loop, and
    --closed-loop refuses that."""
    import sys
    from pathlib import Path

    from specmoe.harness import record_trace
    from specmoe.records import CLOSED_LOOP, AcceptanceProfile, BlockRecords, BlockSourceError, open_loop

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from bench_spec_engine import block_sources, spec_pass

    model, adapter = family
    paths, accepted = [], {}
    for name in ("exact", "confidence_top1"):
        config = SpeculativeConfig(selector_preset(name), k=K_DRAFTS, pool_size=8, max_new_tokens=NEW)
        runs = [speculative_generate(model, adapter, drafter, torch.tensor(p), config, calibration=calibration,
                                     record=True, divergence=False) for p in (prompt, prompt[4:14])]
        records = BlockRecords.from_requests([r.blocks for r in runs], top_k=adapter.top_k,
                                             vocab_size=adapter.vocab_size, selector=config.selector.to_dict(),
                                             drafter="ar")
        paths.append(records.save(tmp_path / f"blocks_c{len(paths):04d}_ar_{name}.safetensors"))
        accepted[name] = records.arrays["accepted"]
    trace = record_trace(model, [prompt])
    args = SimpleNamespace(records=[str(p) for p in paths], selectors=["exact", "acceptmoe", "confidence_top1"],
                           k=[K_DRAFTS], taus=[2.0], seed=0, max_blocks=None, blocks_per_request=None,
                           closed_loop=False)
    geometry = (adapter.num_moe_layers, adapter.num_experts, adapter.top_k)
    sources = block_sources(args, trace, geometry)
    assert set(sources) == {f"synthetic_tau2_k{K_DRAFTS}", f"ar_records_k{K_DRAFTS}", f"synthetic_ar_hist_k{K_DRAFTS}"}
    _, per_selector, reference = sources[f"ar_records_k{K_DRAFTS}"]
    assert {s: a for s, (_, a) in per_selector.items()} == {
        "exact": CLOSED_LOOP, "confidence_top1": CLOSED_LOOP, "acceptmoe": open_loop("exact")}
    np.testing.assert_array_equal(per_selector["confidence_top1"][0].accepted, accepted["confidence_top1"])
    np.testing.assert_array_equal(per_selector["acceptmoe"][0].accepted, accepted["exact"])
    np.testing.assert_array_equal(reference.accepted, accepted["exact"])  # AR follows exact's committed sequence
    _, tau_source, _ = sources[f"synthetic_tau2_k{K_DRAFTS}"]
    assert tau_source["confidence_top1"][1] == open_loop("exact") and tau_source["exact"][1] == CLOSED_LOOP
    _, histogram, _ = sources[f"synthetic_ar_hist_k{K_DRAFTS}"]
    own = AcceptanceProfile.of_records(BlockRecords.load(paths[1]), K_DRAFTS)
    assert own.values == tuple(float(v) for v in np.bincount(accepted["confidence_top1"]))
    assert histogram["confidence_top1"][0].source.endswith("confidence_top1 accepted-length histogram")
    # the lossy selector's row: trace-following its own records commits its own run's accepted lengths
    config = SpeculativeConfig(selector_preset("confidence_top1"), k=K_DRAFTS, pool_size=8, max_new_tokens=NEW)
    engine = build_engine(model, None, calibration, EngineConfig(max_seq_len=SEQ), speculative=config,
                          residency=residency)
    results = engine.follow(per_selector["confidence_top1"][0], first_position=len(prompt))
    np.testing.assert_array_equal(np.concatenate([r.accepted for r in results]), accepted["confidence_top1"])
    row = spec_pass(engine, per_selector["confidence_top1"][0], len(prompt))
    assert row["committed"] == int((accepted["confidence_top1"] + 1).sum())
    assert row["request_blocks"] == [len(r.accepted) for r in results] and sum(row["request_blocks"]) == row["blocks"]
    args.closed_loop = True
    with pytest.raises(BlockSourceError, match="no block records of selector 'acceptmoe'"):
        block_sources(args, trace, geometry)
    args.selectors = ["exact", "confidence_top1"]
    assert set(block_sources(args, trace, geometry)[f"synthetic_tau2_k{K_DRAFTS}"][1]) == {"exact"}


def test_a_block_timeline_says_where_its_time_goes(family, drafter, calibration, residency, prompt, monkeypatch):
    """`DecodeResult.timeline` of a speculative run: drafting, the block's selection and copy handling on the host,
    the exposed copy wait and the rest (compute), per block and per committed token; the parts of a block add up
    to its wall time. Copy delays show up as copy wait, not as selection; an instrumented run takes the host path
    (the per-layer GPU gaps are instrumented GPU runs' only)."""
    engine = spec(family, drafter, calibration, residency)
    base = sd(engine, prompt)
    line = base.summary()["timeline_ms"]
    assert line["draft"] > 0 and line["selection"] > 0 and line["step"] > 0
    parts = ("selection", "copy_issue", "copy_checks", "copy_wait", "compute")
    assert sum(line[p] for p in parts) == pytest.approx(line["step"], rel=1e-9)
    assert np.isnan(line["idle_other"])  # the CPU has no GPU gaps
    blocks = int(base.timed.sum())
    assert line["per_token"]["step"] == pytest.approx(line["step"] * blocks / base.block_committed)
    engine.configure(copy_delay=(0.002, 0.004), delay_seed=3)
    slow = sd(engine, prompt)
    assert slow.tokens == base.tokens
    waited = slow.timeline()
    assert waited["copy_wait"] > line["copy_wait"] + 1.0  # ms: the delays are waited for, in the copy wait
    assert sum(waited[p] for p in parts) == pytest.approx(waited["step"], rel=1e-9)
    engine.configure(copy_delay=None, instrument=True)
    assert sd(engine, prompt).tokens == base.tokens
    engine.configure(instrument=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # only the reasons are asked: nothing runs in the interpreter
    config = SpeculativeConfig(selector_preset("acceptmoe"), k=K_DRAFTS, pool_size=POOL, max_new_tokens=NEW)
    on = build_engine(family[0], None, calibration, EngineConfig(max_seq_len=SEQ, block_device="on"),
                      speculative=config, residency=residency)
    assert on.device_blocks() is None
    on.configure(instrument=True)
    assert "instrumented" in on.device_blocks()  # instrumented runs verify on the host path
    ar = build_engine(family[0], preset("psr", 32, family[1].top_k), calibration, EngineConfig(max_seq_len=SEQ),
                      residency=residency)
    assert "timeline_ms" not in ar.generate(prompt, 4).summary()  # autoregressive runs: summary's own figures
