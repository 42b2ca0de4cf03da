"""The seams the engines share: one `ExpertResidency` unit under several engines, the `Decoder` protocol's
steps of D positions (a verification block) against D single steps, rollback by position, and the registry
that finds a decoder without the engines naming one. Model: `olmoe-tiny`, float32, CPU."""

import numpy as np
import pytest
import torch

from specmoe.engines import EngineConfig, build_engine
from specmoe.models import ModelSourceError, decoder_for, load_model
from specmoe.models.decoder import Decoder, DecodeStep
from specmoe.models.olmoe_decode import OlmoeDecoder
from specmoe.offload import ExpertResidency, ExpertStore
from specmoe.routing import Calibration, preset

SEQ = 48


@pytest.fixture(scope="module")
def tiny():
    model, adapter = load_model("olmoe-tiny", seed=0)
    return model, adapter, ExpertStore.from_model(model, adapter)


@pytest.fixture(scope="module")
def tokens(tiny):
    return np.random.default_rng(3).integers(0, tiny[1].vocab_size, 20)


def _calibration(adapter):
    rng = np.random.default_rng(0)
    warm = np.stack([rng.permutation(adapter.num_experts) for _ in range(adapter.num_moe_layers)])
    return Calibration(warm, rng.random((adapter.num_moe_layers, adapter.vocab_size, adapter.num_experts)) * 0.1,
                       np.full(adapter.num_moe_layers, 2.0), {})


def test_two_engines_share_one_residency_unit_alternately(tiny, tokens):
    """A PSR engine at C=16 and an exact-LRU engine at C=32 on one unit of 32 slots (one pinned store, one copy
    stream), runs interleaved: each run equals the same engine's run on a unit of its own."""
    model, adapter, store = tiny
    cal = _calibration(adapter)
    config = EngineConfig(max_seq_len=SEQ)
    policies = [preset("psr", 16, adapter.top_k), preset("exact_lru", 32, adapter.top_k)]
    shared = ExpertResidency(store, 32, "cpu")
    on_shared = [build_engine(model, p, cal, config, residency=shared) for p in policies]
    alone = [build_engine(model, p, cal, config, store=store) for p in policies]
    assert all(e.copies is shared.copies for e in on_shared) and alone[0].copies is not alone[1].copies
    refs = [e.generate(tokens[:6], 10, return_logits=True) for e in alone]
    for _ in range(2):
        for engine, ref in zip(on_shared, refs):
            run = engine.generate(tokens[:6], 10, return_logits=True)
            assert run.generated == ref.generated
            np.testing.assert_array_equal(run.selected, ref.selected)
            np.testing.assert_array_equal(run.logits, ref.logits)
            assert run.copy_totals() == ref.copy_totals()
    shared.copies.synchronize()  # and the slots hold the bytes of the experts the last engine assigned
    for layer in range(adapter.num_moe_layers):
        for slot, expert in enumerate(shared.copies.owner[layer].tolist()):
            if expert >= 0:
                assert torch.equal(shared.slots.data[layer, slot], store.expert(layer, expert))
    with pytest.raises(ValueError, match="exceeds the 32 slots"):
        build_engine(model, preset("psr", 48, adapter.top_k), cal, config, residency=shared)


def _single_steps(decoder, tokens, start, slot_buf_of, routes):
    """Decode tokens at positions start.. one position per step; returns per position (z | g logits [L, 2E],
    output logits [V])."""
    step = decoder.step(1)
    out = []
    for i, token in enumerate(tokens):
        step.set_input([token], start + i, decoder.geometry.max_seq_len)
        for layer in range(decoder.geometry.num_layers):
            decoder.attention_router(step, layer)
            step.route_np[layer, 0] = routes[i, layer]
            decoder.moe(step, layer, slot_buf_of(layer))
        decoder.head(step)
        out.append((step.logits_np[:, 0].copy(), step.out_logits[0].clone()))
    return out


def test_a_step_of_d_positions_equals_d_single_steps_and_rolls_back_by_position(tiny):
    """The verification block's shape: one step over D = 5 causal positions gives every position the logits
    (router, pre-gate and LM head) of five single steps; a later step at an earlier position (rejected
    drafts) computes as if the rejected positions had never been written."""
    model, adapter, store = tiny
    decoder = decoder_for(model.config).from_model(model, SEQ)
    assert isinstance(decoder, OlmoeDecoder) and isinstance(decoder.step(1), DecodeStep)
    decoder.use_kernels("torch", "sdpa", "slot", store.layers[0][:16], tune=False)
    rng = np.random.default_rng(4)
    slot_bufs = [store.layers[layer][:16] for layer in range(adapter.num_moe_layers)]
    k = adapter.top_k
    routes = np.zeros((12, adapter.num_moe_layers, 2 * k), np.int32)
    for i in range(12):
        for layer in range(adapter.num_moe_layers):
            routes[i, layer, :k] = rng.choice(16, k, replace=False)
            routes[i, layer].view(np.float32)[k:] = rng.dirichlet(np.ones(k))
    ids = rng.integers(0, adapter.vocab_size, 12)
    with torch.no_grad():
        single = _single_steps(decoder, ids, 0, slot_bufs.__getitem__, routes)
        _single_steps(decoder, ids[:4], 0, slot_bufs.__getitem__, routes)  # the prefix again
        block = decoder.step(5)
        block.set_input(ids[4:9], 4, SEQ)
        for layer in range(adapter.num_moe_layers):
            decoder.attention_router(block, layer)
            block.route_np[layer] = routes[4:9, layer]
            decoder.moe(block, layer, slot_bufs[layer])
        decoder.head(block)
        for i in range(5):
            np.testing.assert_allclose(block.logits_np[:, i], single[4 + i][0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(block.out_logits[i], single[4 + i][1], rtol=1e-5, atol=1e-5)
        assert block.next_np.tolist() == [int(single[4 + i][1].argmax()) for i in range(5)]
        # two of five drafts accepted: the next step starts at position 7 and overwrites 7 and 8
        again = _single_steps(decoder, ids[7:12], 7, slot_bufs.__getitem__, routes[7:12])
    for i in range(5):
        np.testing.assert_allclose(again[i][0], single[7 + i][0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(again[i][1], single[7 + i][1], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="outside the static KV cache"):
        block.set_input(ids[:5], SEQ - 4, SEQ)


def test_engines_find_decoders_through_the_registry_only(tiny, monkeypatch):
    from specmoe.models import registry

    model, adapter, store = tiny
    assert decoder_for(model.config) is OlmoeDecoder
    decoder = OlmoeDecoder.from_model(model, SEQ)
    for name in Decoder.__annotations__:
        assert hasattr(decoder, name), name
    monkeypatch.setitem(registry.ARCHITECTURES, "olmoe", registry.ARCHITECTURES["olmoe"]._replace(decoder=None))
    with pytest.raises(ModelSourceError, match="no decoder for model type 'olmoe'"):
        build_engine(model, preset("exact_lru", 16, adapter.top_k), Calibration.uniform(16, 64, 512),
                     EngineConfig(max_seq_len=SEQ), store=store)


def test_attention_reading_only_written_positions_decodes_like_sdpa(tiny, tokens):
    """attention="split_kv" (on the CPU its torch reference; the Triton kernel on a GPU) gives the engine the
    logits of SDPA over the masked cache, and counts only the written positions as bytes read."""
    model, adapter, store = tiny
    policy = preset("exact_lru", adapter.num_experts, adapter.top_k)
    cal = Calibration.uniform(adapter.num_moe_layers, adapter.num_experts, adapter.vocab_size)
    engines = {name: build_engine(model, policy, cal, EngineConfig(max_seq_len=SEQ, attention=name), store=store)
               for name in ("sdpa", "split_kv", "auto")}
    runs = {name: e.teacher_forced(tokens, return_logits=True) for name, e in engines.items()}
    assert [runs[n].info["attention"] for n in ("sdpa", "split_kv", "auto")] == ["sdpa", "split_kv", "sdpa"]
    np.testing.assert_allclose(runs["split_kv"].logits, runs["sdpa"].logits, rtol=1e-5, atol=1e-5)
    assert engines["split_kv"].decoder.bytes_per_token(3) < engines["sdpa"].decoder.bytes_per_token(3)


def test_bad_input_to_the_new_seams(tiny, tokens):
    """A residency unit without room, an unknown router scoring, a kernel choice outside the known ones, a
    window placed outside the cache: one clear error each, before anything runs."""
    from specmoe.routing import RouterScoring

    model, adapter, store = tiny
    for slots in (0, adapter.num_experts + 1):
        with pytest.raises(ValueError, match=f"{slots} slots per layer: need 1 .. E=64"):
            ExpertResidency(store, slots, "cpu")
    with pytest.raises(ValueError, match="router scoring kind must be one of"):
        RouterScoring("tanh")
    with pytest.raises(ValueError, match="router scoring scale must be a positive number"):
        RouterScoring("sigmoid", scale=0.0)
    with pytest.raises(ValueError, match="attention must be one of"):
        OlmoeDecoder.from_model(model, SEQ).use_kernels("torch", "paged", "slot", store.layers[0][:16], tune=False)
    engine = build_engine(model, preset("exact_lru", 16, adapter.top_k),
                          Calibration.uniform(adapter.num_moe_layers, adapter.num_experts, adapter.vocab_size),
                          EngineConfig(max_seq_len=SEQ), store=store)
    with pytest.raises(ValueError, match="first_position must be >= 0"):
        engine.teacher_forced(tokens, first_position=-1)
    with pytest.raises(ValueError, match="from position 40 do not fit the static KV cache of 48"):
        engine.teacher_forced(tokens, first_position=40)


def test_a_window_at_a_later_position_attends_to_what_the_cache_holds(tiny, tokens):
    """`teacher_forced(first_position=p)` (the position sweep's way to time long contexts): right after a run
    that wrote tokens[:p] into the KV cache, decoding tokens[p:] from position p gives that run's logits."""
    model, adapter, store = tiny
    engine = build_engine(model, preset("exact_lru", adapter.num_experts, adapter.top_k),
                          Calibration.uniform(adapter.num_moe_layers, adapter.num_experts, adapter.vocab_size),
                          EngineConfig(max_seq_len=SEQ), store=store)
    full = engine.teacher_forced(tokens, return_logits=True)
    later = engine.teacher_forced(tokens[12:], first_position=12, return_logits=True)
    np.testing.assert_allclose(later.logits, full.logits[12:], rtol=1e-5, atol=1e-5)
    assert not np.allclose(engine.teacher_forced(tokens[12:], return_logits=True).logits, full.logits[12:])


def test_randomize_cache_is_seeded(tiny):
    """`Decoder.randomize_cache`: the context for timing at long positions, the same for the same seed."""
    model = tiny[0]
    decoder = decoder_for(model.config).from_model(model, 32)
    decoder.randomize_cache(seed=1)
    first = decoder.k_cache.clone(), decoder.v_cache.clone()
    decoder.randomize_cache(seed=1)
    assert torch.equal(decoder.k_cache, first[0]) and torch.equal(decoder.v_cache, first[1])
    decoder.randomize_cache(seed=2)
    assert not torch.equal(decoder.k_cache, first[0]) and first[0].std() > 0.5
