"""The block prefetch of speculative decoding (`specmoe.verifiers.prefetch`, `BlockRouter.predict`) on the CPU:
tokens, selections and the pool are bitwise the same with the prefetch on and off (the shipped family's OLMoE
target, the tiny Qwen3.5-MoE config; exact and acceptmoe), whatever the copy timing; trace-following counts what
the CPU replay counts (prefetches, hits, unused, demand copies, peak union slots); a perfect pre-gate leaves
demand copies in layer 0 only; U is never exceeded; bad budgets are refused; the placement rule."""

import dataclasses

import numpy as np
import pytest
import torch

from specmoe.drafters import DrafterConfig, build_drafter
from specmoe.engines import EngineConfig, RunSettings, build_engine
from specmoe.offload import ExpertResidency, ExpertStore
from specmoe.routing import Calibration
from specmoe.speculation import SpeculativeConfig
from specmoe.verifiers import PrefetchTally, place_union, selector_preset

SEQ, NEW, K_DRAFTS, POOL = 64, 12, 4, 32


@pytest.fixture(scope="module")
def drafter(family):
    return build_drafter(DrafterConfig("ar"), family[0])


@pytest.fixture(scope="module")
def calibration(family):
    adapter = family[1]
    return Calibration.uniform(adapter.num_moe_layers, adapter.num_experts, adapter.vocab_size)


@pytest.fixture(scope="module")
def residency(family):
    store = ExpertStore.from_model(family[0], family[1])
    return ExpertResidency(store, family[1].num_experts, "cpu")


def _engine(model, calibration, residency, selector, prefetch, settings=RunSettings(), **kw):
    config = SpeculativeConfig(selector_preset(selector), **{"k": K_DRAFTS, "pool_size": POOL, "max_new_tokens": NEW,
                                                             "prefetch": prefetch, **kw})
    return build_engine(model, None, calibration, EngineConfig(max_seq_len=SEQ), settings, speculative=config,
                        residency=residency)


def _state(engine):
    pool = engine.block_router.pool
    return pool.slot.copy(), pool.pool_mask.copy(), pool.recency.copy(), pool.totals()


def _stats(engine):
    return dataclasses.replace(engine.copies.stats)


def _delta(after, before) -> dict:
    return {f: getattr(after, f) - getattr(before, f) for f in after.FIELDS}


@pytest.mark.parametrize("selector", ["exact", "acceptmoe"])
def test_prefetch_changes_no_token_selection_or_pool(family, drafter, calibration, residency, family_text, selector):
    model = family[0]
    prompt = family_text[:16]
    runs = {}
    for prefetch in (0, 2, 64):
        engine = _engine(model, calibration, residency, selector, prefetch)
        before = _stats(engine)
        result = engine.generate(prompt, NEW, drafter=drafter, record=True)
        runs[prefetch] = result, _state(engine), _delta(engine.copies.stats, before), engine.union_used
        assert result.info["prefetch"] == prefetch and result.info["union_used"] <= result.info["union_slots"]
    (ref, ref_state, ref_stats, _), others = runs[0], [runs[2], runs[64]]
    assert ref_stats["prefetch"] == 0
    for result, state, stats, _ in others:
        assert result.tokens == ref.tokens and list(result.accepted) == list(ref.accepted)
        for a, b in zip(result.block_selected, ref.block_selected, strict=True):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(state[:3], ref_state[:3]):
            np.testing.assert_array_equal(a, b)
        assert state[3] == ref_state[3]  # the pool's logical copies and moves
        assert stats["prefetch"] > 0
        # every copy of a missing expert is a demand copy or a used prefetch; the link carries the rest unused
        hits = stats["prefetch_in_time"] + stats["prefetch_late"]
        assert stats["demand"] + hits == ref_stats["demand"]
        assert stats["prefetch"] == hits + stats["prefetch_unused"]
        assert stats["moved"] == ref_stats["moved"]
    assert runs[64][2]["demand"] < ref_stats["demand"]


def test_copy_timing_changes_nothing_with_the_prefetch(family, drafter, calibration, residency, family_text):
    model = family[0]
    prompt = family_text[:16]
    engine = _engine(model, calibration, residency, "acceptmoe", 4)
    reference = engine.generate(prompt, NEW, drafter=drafter, record=True)
    for in_flight in (1, 4):
        engine.configure(copy_delay=(0.0, 0.001), max_in_flight=in_flight, delay_seed=in_flight)
        delayed = engine.generate(prompt, NEW, drafter=drafter, record=True)
        assert delayed.tokens == reference.tokens and list(delayed.accepted) == list(reference.accepted)
        for a, b in zip(delayed.block_selected, reference.block_selected, strict=True):
            np.testing.assert_array_equal(a, b)
    engine.configure(copy_delay=None, skip_copies=True)
    issued = engine.copies.stats.issued
    engine.generate(prompt, NEW, drafter=drafter)
    assert engine.copies.stats.issued == issued
    engine.configure(skip_copies=False, max_in_flight=2)
    # the slot buffer follows the pool: every pool expert's bytes are in its slot after the run
    engine.generate(prompt, NEW, drafter=drafter)
    store, pool = residency.store, engine.block_router.pool
    for layer in range(store.num_layers):
        table = pool.slot_table(layer)
        for expert in np.flatnonzero(pool.resident(layer)):
            assert torch.equal(residency.slots.data[layer, table[expert]], store.layers[layer][expert])


def _blocks(family, drafter, calibration, family_text):
    from specmoe.harness import speculative_generate
    from specmoe.records import BlockRecords, blocks_from_records

    model, adapter = family
    config = SpeculativeConfig(selector_preset("acceptmoe"), k=K_DRAFTS, pool_size=POOL, max_new_tokens=NEW)
    prompt = family_text[:16]
    runs = [speculative_generate(model, adapter, drafter, torch.tensor(p), config, calibration=calibration,
                                 record=True, divergence=False) for p in (prompt, prompt[4:14])]
    records = BlockRecords.from_requests([r.blocks for r in runs], top_k=adapter.top_k, vocab_size=adapter.vocab_size)
    return blocks_from_records(records)


@pytest.mark.parametrize("union", [None, 12])
def test_trace_following_counts_what_the_replay_counts(family, drafter, calibration, residency, family_text, union):
    """follow() and `replay_block_selection` with the same budget: the same prefetches, hits, unused ones,
    demand copies and peak union slots (one prediction and placement, `specmoe.verifiers.prefetch`); with the
    router logits as the pre-gate (a perfect prediction) only layer 0 makes demand copies."""
    from specmoe.replay import replay_block_selection

    blocks = _blocks(family, drafter, calibration, family_text)
    perfect = dataclasses.replace(blocks, pregate_logits=blocks.router_logits.copy())
    selector = selector_preset("acceptmoe")
    for source in (blocks, perfect):
        for budget in (0, 3, 64):
            expected = replay_block_selection(selector, source, calibration, POOL, prefetch=budget,
                                              union_slots=union).extra
            engine = _engine(family[0], calibration, residency, "acceptmoe", budget, union_slots=union)
            before = _stats(engine)
            results = engine.follow(source, first_position=16)
            got = _delta(engine.copies.stats, before)
            assert got["prefetch"] == expected["prefetch"]
            assert got["prefetch_in_time"] + got["prefetch_late"] == expected["prefetch_hit"]
            assert got["prefetch_unused"] == expected["prefetch_unused"]
            assert got["demand"] == expected["demand"]
            assert engine.union_used == expected["union_peak"] <= engine.block_router.union_slots
            assert max(r.info["union_used"] for r in results) == expected["union_peak"]
    # a perfect pre-gate with room for every prediction: demand copies only where nothing predicts (layer 0)
    layer0 = replay_block_selection(selector, perfect, calibration, POOL, prefetch=64)
    tally = layer0.extra
    assert tally["prefetch_unused"] == 0 and tally["prefetch_hit"] == tally["prefetch"] > 0
    engine = _engine(family[0], calibration, residency, "acceptmoe", 0)
    demand_by_layer = np.zeros(blocks.num_layers, np.int64)
    original = engine.copies.assign

    def counting(layer, slots, experts, prefetch, issue_now=False):
        if not prefetch:
            demand_by_layer[layer] += len(experts)
        return original(layer, slots, experts, prefetch, issue_now)

    engine.copies.assign = counting
    try:
        engine.follow(perfect, first_position=16)
    finally:
        del engine.copies.assign
    assert tally["demand"] == demand_by_layer[0] > 0 and demand_by_layer[1:].sum() > 0


def test_bad_budgets_are_refused():
    for bad in (-1, 1.5, "4", True):
        with pytest.raises(ValueError, match="prefetch"):
            SpeculativeConfig(selector_preset("acceptmoe"), prefetch=bad)
    assert SpeculativeConfig(selector_preset("acceptmoe"), prefetch=0).prefetch == 0


def test_placement_keeps_hits_fills_free_slots_first_and_never_exceeds_u():
    p, u = 10, 4
    slots, demand, used = place_union(np.array([3, 5, 7]), np.array([1, 5]), p, u)
    np.testing.assert_array_equal(slots, [12, 11, 13])  # 5 stays in slot 11; 3 and 7 take the free 12, 13
    np.testing.assert_array_equal(demand, [True, False, True])
    assert used == 4
    # no free slot left: a demand copy takes an unused prefetch's slot, never a hit's
    slots, demand, used = place_union(np.array([2, 4, 8, 9]), np.array([1, 2, 3, 4]), p, u)
    np.testing.assert_array_equal(slots, [11, 13, 10, 12])
    assert used == u
    tally = PrefetchTally()
    tally.count(np.array([1, 2, 3, 4]), np.array([2, 4, 8, 9]), p, u)
    assert tally.as_dict() == {"prefetch": 4, "prefetch_hit": 2, "prefetch_unused": 2, "demand": 2, "union_peak": 4}


def test_qwen3_5_moe_prefetch_changes_nothing():
    """The tiny Qwen3.5-MoE config (Gated DeltaNet layers; the block step's pre-gate logits at every position):
    prefetch on and off commit the same tokens and selections."""
    from specmoe.models import load_model

    model, adapter = load_model("qwen3.5-moe-tiny", seed=0)
    calibration = Calibration.uniform(adapter.num_moe_layers, adapter.num_experts, adapter.vocab_size)
    drafter = build_drafter(DrafterConfig("synthetic", acceptance=0.6), model)
    prompt = np.random.default_rng(7).integers(4, adapter.vocab_size, 12).tolist()
    runs = []
    for prefetch in (0, 64):
        config = SpeculativeConfig(selector_preset("acceptmoe"), k=K_DRAFTS, pool_size=adapter.num_experts // 2,
                                   max_new_tokens=NEW, prefetch=prefetch)
        engine = build_engine(model, None, calibration, EngineConfig(max_seq_len=SEQ), speculative=config)
        before = _stats(engine)
        runs.append((engine.generate(prompt, NEW, drafter=drafter, record=True),
                     _delta(engine.copies.stats, before)))
    (off, off_stats), (on, on_stats) = runs
    assert on.tokens == off.tokens and list(on.accepted) == list(off.accepted)
    for a, b in zip(on.block_selected, off.block_selected, strict=True):
        np.testing.assert_array_equal(a, b)
    assert on_stats["prefetch"] > 0 and on_stats["demand"] < off_stats["demand"]


def test_replay_sd_reports_the_prefetch(tmp_path, capsys):
    """`specmoe replay-sd --prefetch`: demand copies and unused prefetches per committed token for each budget
    (budget 0: every copy is a demand copy), exact and each selector's preset; the budget list is validated."""
    from specmoe.cli import main
    from specmoe.rundir import read_table
    from specmoe.records.synthetic import synthetic_calibration, synthetic_trace

    synthetic_calibration("olmoe-like", tokens=512).save(tmp_path / "cal.safetensors")
    synthetic_trace("olmoe-like", tokens=256).save(tmp_path / "trace.safetensors")
    args = ["replay-sd", "--calibration", str(tmp_path / "cal.safetensors"), "--trace", str(tmp_path / "trace.safetensors"),
            "--tau", "4", "-k", "8", "--lambdas", "0", "--budgets", "1", "--gammas", "1", "--prune-budgets", "1",
            "--no-progress"]
    assert main(args + ["--prefetch", "0,4", "--out", str(tmp_path / "out")]) == 0
    assert "acceptmoe_prefetch4_demand" in capsys.readouterr().out
    row = read_table(tmp_path / "out").iloc[0]
    for name in ("exact", "acceptmoe", "confidence_top1"):
        assert row[f"{name}_prefetch0_demand"] == pytest.approx(row[f"{name}_copies" if name != "exact" else
                                                                    "exact_block_copies"])
        assert row[f"{name}_prefetch4_demand"] < row[f"{name}_prefetch0_demand"]
        assert row[f"{name}_prefetch0_unused"] == 0 and row[f"{name}_prefetch4_unused"] > 0
        # the union slots the preset needed (sizes SpeculativeConfig.union_slots), without prefetch: its rows' peak
        assert 0 < row[f"{name}_union_peak"] == row[f"{name}_prefetch0_union_peak"] <= 64 - row["C"]
    assert main(args + ["--prefetch", "-1", "--out", str(tmp_path / "bad")]) == 2
    assert "--prefetch" in capsys.readouterr().err


def test_the_harness_counts_the_prefetch_as_the_engine_makes_it(family, drafter, calibration, residency, family_text):
    """The harness loop's prefetch counts (`PrefetchTally` over its blocks) are the engine's copy stream's over the
    same request's blocks (prefill excluded in both)."""
    from specmoe.harness import speculative_generate

    model, adapter = family
    prompt = family_text[:16]
    config = SpeculativeConfig(selector_preset("acceptmoe"), k=K_DRAFTS, pool_size=POOL, max_new_tokens=NEW,
                               prefetch=4)
    harness = speculative_generate(model, adapter, drafter, torch.tensor(prompt), config, calibration=calibration,
                                   divergence=False)
    result = _engine(model, calibration, residency, "acceptmoe", 4).generate(prompt, NEW, drafter=drafter)
    totals = result.copy_totals()
    assert harness.prefetch["prefetch"] == totals["prefetch"] > 0
    assert harness.prefetch["prefetch_hit"] == totals["prefetch_in_time"] + totals["prefetch_late"]
    assert harness.prefetch["prefetch_unused"] == totals["prefetch_unused"]
    assert harness.prefetch["demand"] == totals["demand"]
    assert harness.prefetch["demand"] + harness.prefetch["prefetch_hit"] == harness.copies
    assert harness.summary()["demand_per_token"] == pytest.approx(totals["demand"] / len(harness.tokens))
