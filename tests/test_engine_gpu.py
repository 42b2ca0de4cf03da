"""The AR engine on a CUDA device with the full-size OLMoE-1B-7B config (bf16, seeded random weights drawn on
the device): CUDA graphs and Triton kernels in use, all-resident exact decoding against transformers,
decisions against `replay`, independence of copy timing, and the physical-cache mode's dependence on it.
Skipped without CUDA (tests/conftest.py)."""

import numpy as np
import pytest
import torch

from specmoe.engines import EngineConfig, RunSettings, build_engine
from specmoe.engines.helpers import calibration_from_engine, random_model_on_device
from specmoe.engines.results import LogitFeed
from specmoe.offload import ExpertStore
from specmoe.routing import Calibration, preset, replay

pytestmark = pytest.mark.gpu
SEQ = 128


@pytest.fixture(scope="module")
def full():
    model, adapter = random_model_on_device("olmoe-1b-7b", seed=0, dtype=torch.bfloat16, device="cuda")
    store = ExpertStore.from_model(model, adapter)
    return model, adapter, store


@pytest.fixture(scope="module")
def exact_engine(full):
    model, adapter, store = full
    cal = Calibration.uniform(adapter.num_moe_layers, adapter.num_experts, adapter.vocab_size)
    engine = build_engine(model, preset("exact_lru", adapter.num_experts, adapter.top_k), cal,
                          EngineConfig(max_seq_len=SEQ), store=store)
    print("exact engine notes:", engine.notes)
    return engine


@pytest.fixture(scope="module")
def calibration(exact_engine):
    rng = np.random.default_rng(1)
    windows = [rng.integers(0, exact_engine.geometry.vocab_size, 64) for _ in range(2)]
    return calibration_from_engine(exact_engine, windows, {"model": "olmoe-1b-7b random (device draws) seed 0"})


@pytest.fixture(scope="module")
def psr_engine(full, calibration):
    model, adapter, store = full
    return build_engine(model, preset("psr", 16, adapter.top_k, bonus=0.25), calibration,
                        EngineConfig(max_seq_len=SEQ), store=store)


@pytest.fixture(scope="module")
def tokens(full):
    return np.random.default_rng(2).integers(0, full[1].vocab_size, 32)


def _hf_logits(model, tokens) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(tokens, device="cuda")[None]).logits[0].float().cpu().numpy()


def test_gpu_engine_uses_graphs_and_triton(exact_engine):
    assert exact_engine.graphs is not None
    assert exact_engine.kernels["backend"] == "triton", exact_engine.notes


def test_gpu_all_resident_logits_match_transformers(full, exact_engine, tokens):
    model = full[0]
    ref = _hf_logits(model, tokens)
    run = exact_engine.teacher_forced(tokens, return_logits=True)
    rel = np.linalg.norm(run.logits - ref, axis=1) / np.linalg.norm(ref, axis=1)
    print(f"relative L2 error of the logits per position: median {np.median(rel):.4f}, max {rel.max():.4f}")
    assert np.median(rel) < 0.03 and rel.max() < 0.15
    # the argmax agrees wherever transformers' own margin exceeds the numerical noise at that position
    noise = np.abs(run.logits - ref).max(axis=1)
    mine = run.logits.argmax(axis=1)
    margin = ref.max(axis=1) - ref[np.arange(len(tokens)), mine]
    assert np.all(margin <= 2 * noise), (margin, noise)


def test_gpu_greedy_generation_agrees_with_transformers(full, exact_engine, tokens):
    model = full[0]
    prompt, new = tokens[:8], 24
    gen = exact_engine.generate(prompt, new)
    seq = np.concatenate([prompt, gen.generated[:-1]])
    ref = _hf_logits(model, seq)[len(prompt) - 1:]
    tf = exact_engine.teacher_forced(seq, return_logits=True)
    noise = np.abs(tf.logits[len(prompt) - 1:] - ref).max(axis=1)
    picked = np.asarray(gen.generated)
    margin = ref.max(axis=1) - ref[np.arange(new), picked]
    assert np.all(margin <= 2 * noise), (margin, noise)
    with torch.no_grad():
        hf = model.generate(torch.as_tensor(prompt, device="cuda")[None], max_new_tokens=new, min_new_tokens=new,
                            do_sample=False)[0, len(prompt):].tolist()
    same = next((i for i, (a, b) in enumerate(zip(hf, gen.generated)) if a != b), new)
    print(f"greedy tokens identical to transformers' generate for the first {same} of {new}; "
          f"exact argmax agreement along the engine's sequence: {np.mean(margin == 0):.3f}")
    print("engine summary:", gen.summary())


def test_gpu_selections_equal_replay(psr_engine, calibration, tokens):
    run = psr_engine.teacher_forced(tokens)
    trace = replay(psr_engine.policy, run.router_logits.astype(np.float64), run.pregate_logits.astype(np.float64),
                   run.input_tokens, calibration)
    np.testing.assert_array_equal(run.selected, trace.selected)
    totals = run.copy_totals(False)
    assert totals["demand"] == trace.demand_copies.sum() and totals["prefetch"] == trace.prefetch_copies.sum()


def test_gpu_logical_cache_is_independent_of_copy_timing(psr_engine, tokens):
    psr_engine.configure(max_in_flight=2, copy_delay=None)
    base = psr_engine.generate(tokens[:8], 16, return_logits=True)
    for mif in (1, 2, 4):
        psr_engine.configure(max_in_flight=mif, copy_delay=(0.0, 0.0005), delay_seed=mif)
        run = psr_engine.generate(tokens[:8], 16, return_logits=True)
        assert run.generated == base.generated
        np.testing.assert_array_equal(run.selected, base.selected)
        np.testing.assert_array_equal(run.logits, base.logits)
    psr_engine.configure(max_in_flight=2, copy_delay=None)


def test_gpu_physical_cache_mode_depends_on_timing(full, calibration, tokens):
    model, adapter, store = full
    engine = build_engine(model, preset("psr", 32, adapter.top_k, bonus=0.2, insert_budget=8), calibration,
                          EngineConfig(max_seq_len=SEQ), RunSettings(cache_mode="physical"), store=store)
    runs = {}
    for mif in (1, 4):
        engine.configure(max_in_flight=mif)
        runs[mif] = engine.teacher_forced(tokens[:24])
    differ = float((runs[1].selected != runs[4].selected).any(axis=-1).mean())
    print(f"physical cache: token-layers whose executed set differs between max_in_flight 1 and 4: {differ:.3f}")
    assert differ > 0


def test_gpu_copies_skipped_follows_the_trace(psr_engine, tokens):
    base = psr_engine.teacher_forced(tokens)
    psr_engine.configure(skip_copies=True)
    try:
        skipped = psr_engine.teacher_forced(tokens, feed=LogitFeed.of(base))
    finally:
        psr_engine.configure(skip_copies=False)
    np.testing.assert_array_equal(skipped.selected, base.selected)
    assert skipped.copy_totals()["issued"] == 0
    print(f"ms/token with copies {base.summary()['ms_mean']:.2f}, copies skipped {skipped.summary()['ms_mean']:.2f}")


def test_gpu_slots_hold_the_bytes_of_their_experts(psr_engine, tokens):
    psr_engine.teacher_forced(tokens[:16])
    copies = psr_engine.copies
    copies.synchronize()
    print("copy issue path:", copies.issue_path)
    checked = 0
    for layer in range(copies.content.shape[0]):
        for slot, expert in enumerate(copies.content[layer].tolist()):
            if expert >= 0:
                assert torch.equal(copies.slots.data[layer, slot].cpu(), copies.store.layers[layer][expert])
                checked += 1
    assert checked >= 16 * 16


def test_gpu_exact_routing_with_few_slots_matches_all_resident(full, exact_engine, tokens):
    """Exact LRU at C=16 (several demand copies per layer, issued as one batch) computes on the bytes it
    copied: selections and logits equal the all-resident engine's, bitwise."""
    model, adapter, store = full
    small = build_engine(model, preset("exact_lru", 16, adapter.top_k), exact_engine.calibration,
                         EngineConfig(max_seq_len=SEQ), store=store)
    print("copy issue path:", small.copies.issue_path)
    base = exact_engine.teacher_forced(tokens, return_logits=True)
    run = small.teacher_forced(tokens, return_logits=True)
    np.testing.assert_array_equal(run.selected, base.selected)
    np.testing.assert_array_equal(run.logits, base.logits)
    assert run.copy_totals(False)["demand"] > 2 * len(tokens) * adapter.num_moe_layers


def test_gpu_split_kv_engine_matches_transformers_at_a_long_position(full):
    """The default attention on CUDA reads only the written positions: all-resident exact decoding of 1536
    tokens in a 2048-position cache against transformers' forward, at the last 32 positions (and SDPA over the
    whole cache as a second reference)."""
    model, adapter, store = full
    cal = Calibration.uniform(adapter.num_moe_layers, adapter.num_experts, adapter.vocab_size)
    tokens = np.random.default_rng(5).integers(0, adapter.vocab_size, 1536)
    engines = {name: build_engine(model, preset("exact_lru", adapter.num_experts, adapter.top_k), cal,
                                  EngineConfig(max_seq_len=2048, attention=name), store=store)
               for name in ("auto", "sdpa")}
    assert engines["auto"].kernels["attention"] == "split_kv", engines["auto"].notes
    ref = _hf_logits(model, tokens)[-32:]
    for name, engine in engines.items():
        run = engine.teacher_forced(tokens, return_logits=True).logits[-32:]
        rel = np.linalg.norm(run - ref, axis=1) / np.linalg.norm(ref, axis=1)
        print(f"{name}: relative L2 error of the logits at positions 1504..1535: median {np.median(rel):.4f}, "
              f"max {rel.max():.4f}")
        assert np.median(rel) < 0.03 and rel.max() < 0.15


def test_gpu_device_routing_decodes_as_host_routing(full, exact_engine, tokens):
    """All experts resident: the one-launch token with on-device routing gives the host-routed engine's
    selections and tokens (and its logits within rounding of the weights' last float32 bit)."""
    model, adapter, store = full
    host = build_engine(model, preset("exact_lru", adapter.num_experts, adapter.top_k), exact_engine.calibration,
                        EngineConfig(max_seq_len=SEQ, device_routing="off"), store=store)
    a = exact_engine.teacher_forced(tokens, prompt_len=4, return_logits=True)
    b = host.teacher_forced(tokens, prompt_len=4, return_logits=True)
    assert exact_engine.runner.graph_whole is not None
    assert a.info["routing"] == "device" and b.info["routing"] == "host"
    np.testing.assert_array_equal(a.selected, b.selected)
    np.testing.assert_array_equal(a.output_tokens, b.output_tokens)
    np.testing.assert_array_equal(a.router_logits, b.router_logits)
    np.testing.assert_allclose(a.logits, b.logits, rtol=0, atol=1e-2 * np.abs(b.logits).max())
