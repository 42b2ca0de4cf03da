"""The AR engine on a CUDA device with the full-size OLMoE-1B-7B config (bf16, seeded random weights drawn on
the device): CUDA graphs and Triton kernels in use, all-resident exact decoding against transformers,
decisions against `replay`, independence of copy timing, and the physical-cache mode's dependence on it.
Skipped without CUDA (tests/conftest.py)."""

import copy

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


@pytest.fixture(scope="module", params=["on", "off"], ids=["device_policy", "host_policy"])
def psr_engine(full, calibration, request):
    """C = 16 PSR with the device policy (asked for: the default, "auto", keeps a prefetching policy on the host) and
    with the host policy."""
    model, adapter, store = full
    return build_engine(model, preset("psr", 16, adapter.top_k, bonus=0.25), calibration,
                        EngineConfig(max_seq_len=SEQ, policy_device=request.param), store=store)


@pytest.fixture(scope="module")
def tokens(full):
    return np.random.default_rng(2).integers(0, full[1].vocab_size, 32)


@pytest.fixture(scope="module")
def full_fp32(full):
    """The same weights in float32. Transformers' bf16 forward against this one measures how far bf16 arithmetic
    itself moves the logits: the tolerance of the engine's bf16 logits, independent of the engine's own error."""
    return copy.deepcopy(full[0]).float()


def _hf_logits(model, tokens) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(tokens, device="cuda")[None]).logits[0].float().cpu().numpy()


def _rel(a, b) -> np.ndarray:
    """Relative L2 error of a against b per position."""
    return np.linalg.norm(a - b, axis=1) / np.linalg.norm(b, axis=1)


def _assert_bf16_like_transformers(logits, ref, exact) -> None:
    """The engine's bf16 logits [T, V] are as close to the float32 forward's (`exact`) as transformers' bf16
    forward (`ref`) is.

    Both bf16 forwards round every projection, attention output and expert output to bf16 (2^-9 relative), in
    their own order and with their own kernels, and either may flip a router near-tie (bf16 router logits tie
    often) and so run another expert at some positions. So the engine's relative L2 errors against float32,
    sorted, must be at most twice transformers' bf16 errors, sorted (two independent roundings of one size differ
    by sqrt(2) of either; sorting lets the flips fall at other positions), plus 0.005 for positions that both get
    almost exactly. A fixed bound (15% per position, as before) let an engine ten times less accurate than bf16
    pass."""
    rel, rel_hf, rel_pair = _rel(logits, exact), _rel(ref, exact), _rel(logits, ref)
    print(f"relative L2 error of the logits per position against float32: engine median {np.median(rel):.4f} max "
          f"{rel.max():.4f}, transformers bf16 median {np.median(rel_hf):.4f} max {rel_hf.max():.4f}; engine against "
          f"transformers bf16: median {np.median(rel_pair):.4f}, max {rel_pair.max():.4f}")
    assert np.all(np.sort(rel) <= 2 * np.sort(rel_hf) + 0.005), (np.sort(rel), np.sort(rel_hf))


def test_gpu_engine_uses_graphs_and_triton(exact_engine):
    assert exact_engine.graphs is not None
    assert exact_engine.kernels["backend"] == "triton", exact_engine.notes


def test_gpu_all_resident_logits_match_transformers(full, full_fp32, exact_engine, tokens):
    model = full[0]
    ref, exact = _hf_logits(model, tokens), _hf_logits(full_fp32, tokens)
    run = exact_engine.teacher_forced(tokens, return_logits=True)
    _assert_bf16_like_transformers(run.logits, ref, exact)
    # the argmax agrees with float32's wherever float32's margin exceeds what bf16 itself moves a logit (the most
    # transformers' bf16 forward moves any logit of this sequence: not the engine's own error, which a worse
    # engine would enlarge)
    noise = np.abs(ref - exact).max()
    mine = run.logits.argmax(axis=1)
    margin = exact.max(axis=1) - exact[np.arange(len(tokens)), mine]
    assert np.all(margin <= 2 * noise), (margin, noise)


def test_gpu_greedy_generation_agrees_with_transformers(full, full_fp32, exact_engine, tokens):
    model = full[0]
    prompt, new = tokens[:8], 24
    gen = exact_engine.generate(prompt, new)
    seq = np.concatenate([prompt, gen.generated[:-1]])
    ref = _hf_logits(model, seq)[len(prompt) - 1:]
    exact = _hf_logits(full_fp32, seq)[len(prompt) - 1:]
    # each greedy token is float32's argmax up to a near-tie: within twice the most that transformers' bf16 forward
    # moves any logit of this sequence from float32 (bf16's own rounding, measured without the engine; bounding
    # by the engine's own error, as before, let a worse engine pass more easily)
    noise = np.abs(ref - exact).max()
    picked = np.asarray(gen.generated)
    margin = exact.max(axis=1) - exact[np.arange(new), picked]
    print(f"greedy margins against float32: max {margin.max():.4f}, bf16 noise {noise:.4f}")
    assert np.all(margin <= 2 * noise), (margin, noise)
    with torch.no_grad():
        hf = model.generate(torch.as_tensor(prompt, device="cuda")[None], max_new_tokens=new, min_new_tokens=new,
                            do_sample=False)[0, len(prompt):].tolist()
    same = next((i for i, (a, b) in enumerate(zip(hf, gen.generated)) if a != b), new)
    print(f"greedy tokens identical to transformers' generate for the first {same} of {new}; "
          f"float32 argmax agreement along the engine's sequence: {np.mean(margin == 0):.3f}")
    print("engine summary:", gen.summary())


def test_gpu_selections_equal_replay(psr_engine, calibration, tokens):
    run = psr_engine.teacher_forced(tokens)
    assert run.info["routing"] == ("host" if psr_engine.config.policy_device == "off" else "device_policy"), run.info
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


def test_gpu_split_kv_engine_matches_transformers_at_a_long_position(full, full_fp32):
    """The default attention on CUDA reads only the written positions: all-resident exact decoding of 1536
    tokens in a 2048-position cache against transformers' forward, at the last 32 positions (and SDPA over the
    whole cache as a second reference), as close to the float32 forward as transformers' bf16 forward is."""
    model, adapter, store = full
    cal = Calibration.uniform(adapter.num_moe_layers, adapter.num_experts, adapter.vocab_size)
    tokens = np.random.default_rng(5).integers(0, adapter.vocab_size, 1536)
    engines = {name: build_engine(model, preset("exact_lru", adapter.num_experts, adapter.top_k), cal,
                                  EngineConfig(max_seq_len=2048, attention=name), store=store)
               for name in ("auto", "sdpa")}
    assert engines["auto"].kernels["attention"] == "split_kv", engines["auto"].notes
    ref, exact = _hf_logits(model, tokens)[-32:], _hf_logits(full_fp32, tokens)[-32:]
    for name, engine in engines.items():
        print(f"{name}, positions 1504..1535:")
        _assert_bf16_like_transformers(engine.teacher_forced(tokens, return_logits=True).logits[-32:], ref, exact)


def test_gpu_device_routing_decodes_as_host_routing(full, exact_engine, tokens):
    """All experts resident: the one-launch token with on-device routing gives the host-routed engine's
    selections, router logits and tokens, and its logits up to what the execution weights' last float32 bit
    (torch's exp on the device against numba's on the host) can change in bf16."""
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
    # The two differ only in the execution weights' last float32 bit (2^-24 relative). The expert kernel rounds
    # each weighted expert output to bf16 (spacing 2^-8 to 2^-7 relative), so such a bit flips that rounding for
    # about 2^-16 of the elements, by one bf16 step each; the router logits, equal bitwise above, show that
    # nothing larger reaches the routers. The final logits are bf16 values too: each may land one bf16 step (at
    # most 2^-7 of itself) away, on top of the propagated flips (estimated well below 2^-8 of the largest logit).
    # Hence |a - b| <= 2^-8 * (|b| + max |b|) per logit: one bf16 step of each logit plus 2^-8 of the largest,
    # where the old bound, 1% of the largest logit, allowed 2.5 steps of it at every logit, however small.
    bound = 2.0 ** -8 * (np.abs(b.logits) + np.abs(b.logits).max())
    excess = np.abs(a.logits - b.logits) / bound
    print(f"device against host routing: logits that differ {np.mean(a.logits != b.logits):.2e}, "
          f"worst difference {excess.max():.3f} of its bound")
    assert np.all(excess <= 1.0), excess.max()
