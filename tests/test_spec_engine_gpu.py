"""The speculative engine on a CUDA device, with CUDA graphs and the Triton kernels (the shipped family's
target in float32): exact selection reproduces the AR engine's greedy output, agreement with the harness loop
run on the same device, independence of copy timing, trace-following equal to the CPU replay, and an AR and
a speculative engine alternating on one residency unit. Skipped without CUDA (tests/conftest.py)."""

import numpy as np
import pytest
import torch

from specmoe.assets import family_path
from specmoe.drafters import DrafterConfig, build_drafter
from specmoe.engines import EngineConfig, RunSettings, build_engine
from specmoe.harness import speculative_generate, unpatch
from specmoe.models import load_model
from specmoe.offload import ExpertResidency, ExpertStore
from specmoe.records import BlockRecords, blocks_from_records
from specmoe.replay import replay_block_selection
from specmoe.routing import Calibration, preset
from specmoe.speculation import SpeculativeConfig
from specmoe.verifiers import selector_preset

pytestmark = pytest.mark.gpu
SEQ, NEW, K_DRAFTS, POOL = 256, 32, 4, 32


@pytest.fixture(scope="module")
def gpu_family():
    model, adapter = load_model(str(family_path("target")), device="cuda")
    store = ExpertStore.from_model(model, adapter)
    unit = ExpertResidency(store, adapter.num_experts, "cuda")
    drafter = build_drafter(DrafterConfig("ar"), model)
    calibration = Calibration.uniform(adapter.num_moe_layers, adapter.num_experts, adapter.vocab_size)
    yield model, adapter, unit, drafter, calibration
    unpatch(model)


@pytest.fixture(scope="module")
def prompt(family_text):
    return family_text[:24]


def spec(gpu_family, selector, settings=RunSettings(), block_device="auto", **kw):
    model, _, unit, drafter, calibration = gpu_family
    config = SpeculativeConfig(selector_preset(selector),
                               **{"k": K_DRAFTS, "pool_size": POOL, "max_new_tokens": NEW, **kw})
    engine = build_engine(model, None, calibration, EngineConfig(max_seq_len=SEQ, block_device=block_device),
                          settings, speculative=config, residency=unit)
    engine.drafter = drafter
    return engine


def sd(engine, prompt, **kw):
    """engine.generate with its drafter, as configured by `spec`."""
    c = engine.speculative
    return engine.generate(prompt, c.max_new_tokens, c.stop_tokens, drafter=engine.drafter, **kw)


def test_gpu_exact_selection_equals_ar_engine_greedy(gpu_family, prompt):
    model, adapter, unit, _, calibration = gpu_family
    ar = build_engine(model, preset("exact_lru", adapter.num_experts, adapter.top_k), calibration,
                      EngineConfig(max_seq_len=SEQ), residency=unit)
    expected = ar.generate(prompt, NEW).generated
    engine = spec(gpu_family, "exact")
    result = sd(engine, prompt)
    assert engine._runners[K_DRAFTS + 1].graphs is not None and engine.kernels["backend"] == "triton", engine.notes
    assert result.tokens == expected
    assert result.tau > 1.0  # the family's drafter gets drafts accepted


def test_gpu_agrees_with_the_harness_loop(gpu_family, prompt):
    model, adapter, _, drafter, calibration = gpu_family
    config = SpeculativeConfig(selector_preset("acceptmoe"), k=K_DRAFTS, pool_size=POOL, max_new_tokens=NEW)
    harness = speculative_generate(model, adapter, drafter, torch.tensor(prompt, device="cuda"), config,
                                   calibration=calibration, record=True, divergence=False)
    result = sd(spec(gpu_family, "acceptmoe"), prompt, record=True)
    assert result.tokens == harness.tokens.tolist()
    assert list(result.accepted) == harness.accepted
    # float32 on one device: the engine's and transformers' router logits differ by summation order, about 1e-6
    # relative. A selection changes only where two experts' scores (or gamma e^H and an integer) lie that close;
    # over this run's few thousand decisions, with logits spread over units, the chance is about 1e-3. So every
    # block's selections and the copies must be equal, as the CPU test demands (the old bound let 1% of the
    # selections and 2% of the copies differ). A failure names the block: look for such a near-tie there.
    for b, (mine, theirs) in enumerate(zip(result.block_selected, harness.blocks, strict=True)):
        np.testing.assert_array_equal(np.sort(mine, -1), np.sort(theirs["selected"], -1), err_msg=f"block {b}")
    # the link's copies less the unused block prefetches: the pool's copies
    assert result.counts()["copies"] - result.copy_totals()["prefetch_unused"] == harness.copies


@pytest.mark.parametrize("block_device", ["auto", "off"])
def test_gpu_copy_timing_changes_no_token_or_selection(gpu_family, prompt, block_device):
    engine = spec(gpu_family, "acceptmoe", block_device=block_device)
    runs = []
    for settings in ({"max_in_flight": 4}, {"max_in_flight": 1, "copy_delay": (0.0, 0.001), "delay_seed": 3}):
        engine.configure(**settings)
        runs.append(sd(engine, prompt, record=True))
    engine.configure(max_in_flight=2, copy_delay=None)
    assert runs[0].info["verify"] == ("host" if block_device == "off" else "device"), runs[0].info
    assert runs[0].tokens == runs[1].tokens and runs[0].counts()["copies"] == runs[1].counts()["copies"]
    for a, b in zip(runs[0].block_selected, runs[1].block_selected, strict=True):
        np.testing.assert_array_equal(a, b)


def test_gpu_trace_following_equals_the_cpu_replay(gpu_family, prompt):
    model, adapter, _, drafter, calibration = gpu_family
    config = SpeculativeConfig(selector_preset("exact"), k=K_DRAFTS, pool_size=POOL, max_new_tokens=NEW)
    run = speculative_generate(model, adapter, drafter, torch.tensor(prompt, device="cuda"), config,
                               calibration=calibration, record=True, divergence=False)
    blocks = blocks_from_records(BlockRecords.from_requests([run.blocks], top_k=adapter.top_k,
                                                            vocab_size=adapter.vocab_size))
    expected = replay_block_selection(selector_preset("acceptmoe"), blocks, calibration, POOL, keep_selected=True)
    engine = spec(gpu_family, "acceptmoe")
    for skip in (False, True):
        engine.configure(skip_copies=skip)
        (result,) = engine.follow(blocks, first_position=len(prompt), record=True)
        assert result.counts()["copies"] - result.copy_totals()["prefetch_unused"] == expected.copies
        committed = np.concatenate([s[: a + 1] for s, a in zip(result.block_selected, result.accepted)])
        np.testing.assert_array_equal(committed, expected.selected)
    engine.configure(skip_copies=False)


@pytest.mark.parametrize("selector", ["exact", "acceptmoe"])
def test_gpu_block_prefetch_changes_no_token_selection_or_pool(gpu_family, prompt, selector):
    """The block prefetch on the device (copies issued after the next layer's attention is launched, into
    physical union slots apart from the pool's logical table): tokens, selections and the pool bitwise as with
    it off, at any copy timing; the pool's copies are the same, fewer of them demand copies; U never exceeded."""
    runs = {}
    for prefetch, settings in ((0, {}), (4, {}), (64, {}), (4, {"max_in_flight": 1, "copy_delay": (0.0, 0.001)})):
        engine = spec(gpu_family, selector, prefetch=prefetch)
        engine.configure(**settings)
        result = sd(engine, prompt, record=True)
        engine.configure(max_in_flight=2, copy_delay=None)
        pool = engine.block_router.pool
        runs[(prefetch, bool(settings))] = result, (pool.slot.copy(), pool.recency.copy(), pool.totals())
        assert result.info["union_used"] <= result.info["union_slots"]
    (off, off_pool) = runs[(0, False)]
    for (prefetch, _), (result, state) in runs.items():
        assert result.tokens == off.tokens and list(result.accepted) == list(off.accepted)
        for a, b in zip(result.block_selected, off.block_selected, strict=True):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(state[0], off_pool[0])
        np.testing.assert_array_equal(state[1], off_pool[1])
        assert state[2] == off_pool[2]
        totals = result.copy_totals()
        assert result.counts()["copies"] - totals["prefetch_unused"] == off.counts()["copies"]
        if prefetch:
            assert totals["prefetch"] > 0 and totals["demand"] < off.copy_totals()["demand"]


def test_gpu_ar_and_spec_engines_alternate_on_one_unit(gpu_family, prompt):
    model, adapter, unit, _, calibration = gpu_family
    ar = build_engine(model, preset("psr", 16, adapter.top_k), calibration, EngineConfig(max_seq_len=SEQ),
                      residency=unit)
    engine = spec(gpu_family, "confidence_top1")
    first_ar, first_sd = ar.generate(prompt, 16).generated, sd(engine, prompt).tokens
    again_ar, again_sd = ar.generate(prompt, 16).generated, sd(engine, prompt).tokens
    assert (first_ar, first_sd) == (again_ar, again_sd)
