"""The AR offloading engine on the CPU: exactness against transformers, decisions against `replay`,
independence of timing (delays injected into the copy path), the physical-cache, trace-following and
copies-skipped modes, copy accounting, the expert store, and bad input. Model: `olmoe-tiny` (OLMoE-1B-7B's
routing geometry, 16 layers x 64 experts, top-8, hidden 64) with seeded random weights, float32."""

import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from specmoe.engines import Engine, EngineConfig, RunSettings, build_engine, build_engine_from_checkpoint
from specmoe.engines.helpers import calibration_from_engine
from specmoe.engines.results import LogitFeed
from specmoe.geometry import Geometry
from specmoe.models import load_model
from specmoe.models.olmoe_decode import OlmoeDecoder
from specmoe.offload import CopyStream, ExpertResidency, ExpertStore, OffloadError
from specmoe.routing import Calibration, PolicyError, preset, replay

SEQ = 64


@pytest.fixture(scope="module")
def tiny():
    model, adapter = load_model("olmoe-tiny", seed=0)
    return model, adapter


@pytest.fixture(scope="module")
def store(tiny):
    model, adapter = tiny
    return ExpertStore.from_model(model, adapter)


@pytest.fixture(scope="module")
def exact_engine(tiny, store):
    model, adapter = tiny
    cal = Calibration.uniform(adapter.num_moe_layers, adapter.num_experts, adapter.vocab_size)
    return build_engine(model, preset("exact_lru", adapter.num_experts, adapter.top_k), cal,
                        EngineConfig(max_seq_len=SEQ), store=store)


@pytest.fixture(scope="module")
def calibration(exact_engine):
    rng = np.random.default_rng(1)
    windows = [rng.integers(0, exact_engine.geometry.vocab_size, 48) for _ in range(4)]
    return calibration_from_engine(exact_engine, windows, {"model": "olmoe-tiny seed 0", "text": "random tokens"})


@pytest.fixture(scope="module")
def tokens(tiny):
    return np.random.default_rng(2).integers(0, tiny[1].vocab_size, 24)


@pytest.fixture(scope="module")
def make_engine(tiny, store, calibration):
    model, adapter = tiny

    def make(name="psr", capacity=16, policy_overrides=None, device_memory_limit=None, **settings):
        policy = preset(name, capacity, adapter.top_k, **(policy_overrides or {}))
        return build_engine(model, policy, calibration, EngineConfig(max_seq_len=SEQ), RunSettings(**settings),
                            store=store, device_memory_limit=device_memory_limit)

    return make


# -- prompt chunks ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["psr", "spec_exec", "cache_prior"])
def test_prompt_chunks_make_the_policys_decisions_and_execute_them(tiny, store, calibration, tokens, name,
                                                                    monkeypatch):
    """A prompt in steps of 4 positions: every position's selections and the logical copies are the policy's on
    the logits the run recorded (as one position per step makes them), the chunk's MoE runs in groups where a
    later position's insertion takes a slot an earlier one executes (it does here), and a one-position-per-step
    run that follows the recorded logits computes the same outputs (the groups executed the right bytes)."""
    from specmoe.engines.routers import CacheRouter

    model, adapter = tiny
    policy = preset(name, 16, adapter.top_k)
    engine = build_engine(model, policy, calibration, EngineConfig(max_seq_len=SEQ, prefill_chunk=4), store=store)
    groups = []
    real = CacheRouter.next_group
    monkeypatch.setattr(CacheRouter, "next_group", lambda self, layer: groups.append(layer) or real(self, layer))
    chunked = engine.teacher_forced(tokens, prompt_len=20, return_logits=True)
    assert len(groups) > 5 * adapter.num_moe_layers  # 5 chunks x L layers: some of them in several groups
    pregate = chunked.pregate_logits.astype(np.float64) if policy.insert_budget else None
    trace = replay(policy, chunked.router_logits.astype(np.float64), pregate, chunked.input_tokens, calibration)
    np.testing.assert_array_equal(chunked.selected, trace.selected)
    totals = chunked.copy_totals(timed_only=False)
    assert (totals["demand"], totals["prefetch"]) == (trace.demand_copies.sum(), trace.prefetch_copies.sum())
    followed = engine.teacher_forced(tokens, prompt_len=20, return_logits=True, feed=LogitFeed.of(chunked))
    np.testing.assert_array_equal(followed.selected, chunked.selected)
    np.testing.assert_allclose(followed.logits, chunked.logits, rtol=1e-4, atol=1e-4)
    one = build_engine(model, policy, calibration, EngineConfig(max_seq_len=SEQ, prefill_chunk=1), store=store)
    assert one.teacher_forced(tokens, prompt_len=20).output_tokens.shape == chunked.output_tokens.shape


# -- exactness ------------------------------------------------------------------------------------------
def test_all_resident_exact_matches_transformers(tiny, exact_engine, tokens):
    model, _ = tiny
    with torch.no_grad():
        ref = model(torch.as_tensor(tokens)[None]).logits[0].float().numpy()
    result = exact_engine.teacher_forced(tokens, return_logits=True)
    assert np.abs(result.logits - ref).max() <= 1e-4 * np.abs(ref).max()
    assert result.copy_totals()["issued"] == 0  # C = E: nothing to copy
    prompt = tokens[:6]
    generated = exact_engine.generate(prompt, 12)
    with torch.no_grad():
        hf = model.generate(torch.as_tensor(prompt)[None], max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert generated.generated == hf[0, len(prompt):].tolist()


@pytest.mark.parametrize("name,capacity", [("exact_lru", 16), ("exact_a", 32), ("exact_prefetch", 16),
                                           ("cache_prior", 16), ("psr", 16), ("psr", 32), ("spec_exec", 16)])
def test_selections_equal_replay_of_recorded_logits(make_engine, calibration, tokens, name, capacity):
    engine = make_engine(name, capacity)
    result = engine.teacher_forced(tokens)
    pregate = result.pregate_logits.astype(np.float64) if engine.policy.insert_budget else None
    trace = replay(engine.policy, result.router_logits.astype(np.float64), pregate, result.input_tokens,
                   calibration)
    np.testing.assert_array_equal(result.selected, trace.selected)
    totals = result.copy_totals(timed_only=False)
    assert totals["demand"] == trace.demand_copies.sum()
    assert totals["prefetch"] == trace.prefetch_copies.sum()
    assert totals["prefetch_unused"] == trace.unused_prefetches.sum()
    assert totals["prefetch_in_time"] + totals["prefetch_late"] + totals["prefetch_unused"] == totals["prefetch"]
    assert totals["issued"] == totals["demand"] + totals["prefetch"] - totals["dropped"]


def test_slots_follow_the_logical_cache(make_engine, tokens):
    engine = make_engine("psr", 16)
    engine.teacher_forced(tokens)
    for layer in range(engine.num_layers):
        np.testing.assert_array_equal(engine.copies.owner[layer], engine.router.cache.resident(layer))
    engine.copies.synchronize()
    for layer in range(engine.num_layers):  # and the bytes are those experts'
        for slot, expert in enumerate(engine.router.cache.resident(layer)):
            assert torch.equal(engine.slots.data[layer, slot], engine.store.expert(layer, int(expert)))


# -- timing independence -------------------------------------------------------------------------------
def test_logical_cache_is_independent_of_copy_timing(make_engine, tokens):
    engine = make_engine("psr", 16)
    base = engine.generate(tokens[:6], 10, return_logits=True)
    for mif in (1, 2, 4):
        engine.configure(max_in_flight=mif, copy_delay=(0.0, 0.001), delay_seed=mif)
        run = engine.generate(tokens[:6], 10, return_logits=True)
        assert run.generated == base.generated
        np.testing.assert_array_equal(run.selected, base.selected)
        np.testing.assert_array_equal(run.logits, base.logits)
        assert run.wait_ms.sum() > 0  # the delays were real: layers waited for copies
    assert base.copy_totals()["prefetch"] > 0


def test_copy_batch_event_ring_reuse_keeps_outputs(make_engine, tokens, monkeypatch):
    """Copy batches share a ring of events; with a ring of 2 most questions about a batch are answered for
    a later one (conservative), and routing, tokens and logits stay those of the default ring."""
    engine = make_engine("psr", 16, copy_delay=(0.0, 0.0005))
    base = engine.teacher_forced(tokens[:10], return_logits=True)
    monkeypatch.setattr(CopyStream, "RING", 2)
    small = make_engine("psr", 16, copy_delay=(0.0, 0.0005))
    run = small.teacher_forced(tokens[:10], return_logits=True)
    assert small.copies.last_batch > 2 * CopyStream.RING
    np.testing.assert_array_equal(run.selected, base.selected)
    np.testing.assert_array_equal(run.logits, base.logits)


def test_simulated_link_catches_a_missing_wait(make_engine, tokens):
    engine = make_engine("psr", 16, copy_delay=(0.001, 0.002))
    good = engine.teacher_forced(tokens[:8], return_logits=True)
    engine.copies.wait = lambda *args, **kwargs: None  # a broken engine that never waits for its copies
    bad = engine.teacher_forced(tokens[:8], return_logits=True)
    assert not np.allclose(bad.logits, good.logits)


def test_physical_cache_mode_depends_on_timing(make_engine, tokens):
    engine = make_engine("psr", 32, policy_overrides=dict(bonus=0.2, insert_budget=8), cache_mode="physical",
                         copy_delay=(0.0005, 0.001))
    runs = {}
    for mif in (1, 4):
        engine.configure(max_in_flight=mif)
        runs[mif] = engine.teacher_forced(tokens[:8])
    assert not np.array_equal(runs[1].selected, runs[4].selected)
    engine.configure(cache_mode="logical")  # the same settings on the logical cache: no difference
    logical = [engine.configure(max_in_flight=mif) or engine.teacher_forced(tokens[:8]) for mif in (1, 4)]
    np.testing.assert_array_equal(logical[0].selected, logical[1].selected)


# -- trace-following and copies-skipped ------------------------------------------------------------------
def test_trace_following_and_copies_skipped_reproduce_the_traced_routing(make_engine, tokens):
    engine = make_engine("psr", 16)
    base = engine.generate(tokens[:6], 10)
    feed = LogitFeed.of(base)
    followed = engine.teacher_forced(base.input_tokens, feed=feed)
    np.testing.assert_array_equal(followed.selected, base.selected)
    engine.configure(skip_copies=True)
    skipped = engine.generate(tokens[:6], 10, feed=feed)
    np.testing.assert_array_equal(skipped.selected, base.selected)
    totals, ref = skipped.copy_totals(False), base.copy_totals(False)
    assert totals["issued"] == 0 and totals["skipped"] == ref["issued"]
    assert totals["demand"] == ref["demand"] and totals["prefetch"] == ref["prefetch"]


def test_trace_of_another_model_drives_routing(tiny, store, calibration, tokens, make_engine):
    """A trace from one run steers a differently seeded model (random weights, realistic copy patterns)."""
    engine = make_engine("psr", 16)
    base = engine.teacher_forced(tokens)
    other, adapter = load_model("olmoe-tiny", seed=1)
    engine2 = build_engine(other, engine.policy, calibration, EngineConfig(max_seq_len=SEQ))
    followed = engine2.teacher_forced(tokens, feed=LogitFeed.of(base, with_tokens=False))
    np.testing.assert_array_equal(followed.selected, base.selected)
    np.testing.assert_array_equal(followed.router_logits, base.router_logits)


# -- generation ------------------------------------------------------------------------------------------
def test_generate_stops_at_a_stop_token_and_repeats_exactly(make_engine, tokens):
    engine = make_engine("cache_prior", 16)
    full = engine.generate(tokens[:5], 12)
    stop = full.generated[3]
    first = full.generated.index(stop)
    stopped = engine.generate(tokens[:5], 12, stop_tokens=[stop])
    assert stopped.generated == full.generated[: first + 1]
    again = engine.generate(tokens[:5], 12)
    assert again.generated == full.generated
    np.testing.assert_array_equal(again.selected, full.selected)
    summary = full.summary()
    assert summary["tokens"] == 11 and summary["ms_p99"] >= summary["ms_p50"] > 0
    assert set(summary["copies_per_token"]) >= {"demand", "prefetch_in_time", "prefetch_late", "prefetch_unused"}


# -- expert store and checkpoints ------------------------------------------------------------------------
def _geometry(adapter, model):
    return Geometry.of(adapter)


def test_store_rows_hold_whole_experts(tiny, store):
    model, adapter = tiny
    block = adapter.moe_blocks(model)[5].experts
    assert torch.equal(store.gate_up(5, 7), block.gate_up_proj[7])
    assert torch.equal(store.down(5, 7), block.down_proj[7])
    assert store.expert(5, 7).is_contiguous() and store.expert(5, 7).numel() == store.width


def test_store_from_checkpoint_in_both_layouts(tiny, store, tmp_path):
    from safetensors.torch import save_file

    model, adapter = tiny
    model.save_pretrained(tmp_path / "per_expert")
    loaded = ExpertStore.from_checkpoint(tmp_path / "per_expert", _geometry(adapter, model), dtype=torch.float32)
    fused = {}
    for layer, block in enumerate(adapter.moe_blocks(model)):
        fused[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = block.experts.gate_up_proj.detach().contiguous()
        fused[f"model.layers.{layer}.mlp.experts.down_proj"] = block.experts.down_proj.detach().contiguous()
    (tmp_path / "fused").mkdir()
    save_file(fused, str(tmp_path / "fused" / "model.safetensors"))
    loaded_fused = ExpertStore.from_checkpoint(tmp_path / "fused", _geometry(adapter, model), dtype=torch.float32)
    for layer in range(store.num_layers):
        assert torch.equal(loaded.layers[layer], store.layers[layer])
        assert torch.equal(loaded_fused.layers[layer], store.layers[layer])


def test_engine_from_checkpoint_matches_engine_from_model(tiny, calibration, make_engine, tokens, tmp_path):
    model, adapter = tiny
    model.save_pretrained(tmp_path / "ckpt")
    policy = preset("psr", 16, adapter.top_k)
    engine = build_engine_from_checkpoint(tmp_path / "ckpt", policy, calibration, EngineConfig(max_seq_len=SEQ),
                                          dtype=torch.float32)
    ref = make_engine("psr", 16).teacher_forced(tokens, return_logits=True)
    run = engine.teacher_forced(tokens, return_logits=True)
    np.testing.assert_array_equal(run.selected, ref.selected)
    np.testing.assert_allclose(run.logits, ref.logits, rtol=0, atol=1e-5)


def test_checkpoint_missing_expert_weights_is_a_clear_error(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    model, adapter = tiny
    model.save_pretrained(tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["model.layers.3.mlp.experts.5.up_proj.weight"]
    save_file(tensors, str(path))
    with pytest.raises(OffloadError, match=r"expert 5 of MoE layer 3.*up_proj"):
        ExpertStore.from_checkpoint(tmp_path / "ckpt", _geometry(adapter, model), dtype=torch.float32)


def test_truncated_weights_file_is_a_clear_error(tiny, tmp_path):
    model, adapter = tiny
    model.save_pretrained(tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "model.safetensors"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(OffloadError, match=r"cannot read the weights file .*model\.safetensors"):
        ExpertStore.from_checkpoint(tmp_path / "ckpt", _geometry(adapter, model), dtype=torch.float32)


# -- bad input -------------------------------------------------------------------------------------------
def test_capacity_above_the_number_of_experts_is_rejected(make_engine):
    with pytest.raises(PolicyError, match="C > E"):
        make_engine("psr", 65)


def test_too_little_host_memory_is_a_clear_error(tiny):
    model, adapter = tiny
    with pytest.raises(OffloadError, match=r"expert store .* host memory"):
        ExpertStore.from_model(model, adapter, host_memory_limit=1024**2)


def test_too_little_device_memory_is_a_clear_error(make_engine):
    with pytest.raises(OffloadError, match=r"slot buffers .*Lower the capacity"):
        make_engine("psr", 16, device_memory_limit=1024**2)


def test_bad_settings_and_inputs(make_engine, tokens):
    with pytest.raises(ValueError, match="cache_mode"):
        RunSettings(cache_mode="timed")
    with pytest.raises(ValueError, match="max_in_flight"):
        RunSettings(max_in_flight=0)
    engine = make_engine("psr", 16)
    with pytest.raises(ValueError, match="static KV cache"):
        engine.teacher_forced(np.zeros(SEQ + 1, dtype=np.int64))
    with pytest.raises(ValueError, match="capacity"):
        engine.configure(policy=preset("psr", 32, engine.top_k))
    with pytest.raises(ValueError, match="not a run setting"):
        engine.configure(max_seq_len=8)
    with pytest.raises(ValueError, match="logit feed"):
        engine.teacher_forced(tokens, feed=LogitFeed(np.zeros((3, engine.num_layers, engine.num_experts)),
                                                     np.zeros((3, engine.num_layers, engine.num_experts))))


def test_mismatched_store_is_rejected(tiny, store, calibration):
    model, adapter = tiny
    decoder = OlmoeDecoder.from_model(model, SEQ)
    half = ExpertStore(store.layers[:8], Geometry(8, 64, adapter.top_k, adapter.vocab_size, 64, 32,
                                                  layer_ids=tuple(range(8))))
    with pytest.raises(ValueError, match="does not match the decoder"):
        Engine(decoder, ExpertResidency(half, 16, "cpu"), preset("psr", 16, adapter.top_k), calibration,
                 EngineConfig(max_seq_len=SEQ))


# -- Triton kernels (interpreter on the CPU, where Triton is installed) ------------------------------------
_KERNEL_CHECK = r"""
import torch
from specmoe.kernels import moe, norm_rope
torch.manual_seed(0)
H, I, K, C = 64, 32, 4, 6
buf = torch.randn(C, 3 * H * I) * 0.1
x, res = torch.randn(H), torch.randn(H)
route = torch.zeros(2 * K, dtype=torch.int32)
route[:K] = torch.tensor([5, 0, 3, 2])
route[K:].view(torch.float32)[:] = torch.tensor([0.4, 0.3, 0.2, 0.1])
a1, o1 = torch.empty(K, I), torch.empty(H)
a2, o2 = torch.empty(K, I), res.clone()
moe.slot_moe_torch(x, res, buf, route, a1, o1, H, I)
moe.slot_moe_triton(x, o2, buf, route, a2, o2, H, I, dict(block_n=8, block_k=32, block_h=16, block_k2=16,
                                                             warps1=4, warps2=4))
assert torch.allclose(o1, o2, atol=1e-5), (o1 - o2).abs().max()
w = torch.randn(H)
assert torch.allclose(norm_rope.rmsnorm_torch(x, w, 1e-5), norm_rope.rmsnorm_triton(x, w, 1e-5, torch.empty(H)),
                      atol=1e-5)
x2 = torch.randn(3, H)
assert torch.allclose(norm_rope.rmsnorm_torch(x2, w, 1e-5), norm_rope.rmsnorm_triton(x2, w, 1e-5, torch.empty(3, H)),
                      atol=1e-5)
NH, NKV, HD, S = 4, 2, 16, 8
inv = 1.0 / (10000 ** (torch.arange(0, HD, 2).float() / HD))
f = torch.arange(S).float()[:, None] * inv[None]
qn, kn = torch.randn(NH * HD), torch.randn(NKV * HD)
for D in (1, 3):  # one position, and a block of three
    qkv = torch.randn(D, (NH + 2 * NKV) * HD)
    for clip in (None, 1.5):
        outs = []
        for fn in (norm_rope.qkv_prologue_torch, norm_rope.qkv_prologue_triton):
            q, kc, vc = torch.zeros(D, NH, HD), torch.zeros(NKV, S, HD), torch.zeros(NKV, S, HD)
            fn(qkv, qn, kn, f.cos(), f.sin(), torch.tensor([3]), q, kc, vc, 1e-5, clip)
            outs.append((q, kc, vc))
        for a, b in zip(*outs):
            assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()
print("kernels ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_triton_kernels_match_torch_in_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", _KERNEL_CHECK], env=env, capture_output=True, text=True,
                          timeout=300, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "kernels ok" in done.stdout


def test_engine_inputs_and_calibrations_are_checked(tiny, store, calibration, make_engine, tokens):
    """The engine refuses what would otherwise fail deep in torch or decode silently wrong: a calibration of
    another vocabulary or other routers (the check `patch_model` makes), token ids outside the vocabulary,
    a prompt length outside the tokens, a non-integer cache length."""
    from specmoe.routing import CalibrationError

    model, adapter = tiny
    other_vocab = Calibration.uniform(adapter.num_moe_layers, adapter.num_experts, 8192)
    engine = build_engine(model, preset("psr", 16, adapter.top_k), other_vocab, EngineConfig(max_seq_len=SEQ),
                          store=store)
    with pytest.raises(CalibrationError, match="vocabulary 8192, the model has 512"):
        engine.teacher_forced(tokens)
    assert calibration.provenance["fingerprint"] == adapter.fingerprint(model)
    other, _ = load_model("olmoe-tiny", seed=1)
    foreign = build_engine(other, preset("psr", 16, adapter.top_k), calibration, EngineConfig(max_seq_len=SEQ))
    with pytest.raises(CalibrationError, match="router fingerprint"):
        foreign.teacher_forced(tokens)
    # following the logits of the calibrated model is what that calibration is for
    feed = LogitFeed.of(make_engine("psr", 16).teacher_forced(tokens))
    assert foreign.teacher_forced(tokens, feed=feed).selected.shape == (len(tokens), 16, 8)
    engine = make_engine("psr", 16)
    for bad in ([3, -5, 2], [3, 512], [1.5, 2.0]):
        with pytest.raises(ValueError, match="tokens"):
            engine.teacher_forced(np.array(bad))
    with pytest.raises(ValueError, match="prompt_len must be in \\[0, 24\\]"):
        engine.teacher_forced(tokens, prompt_len=25)
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate(tokens[:4], 0)
    with pytest.raises(ValueError, match="max_seq_len must be an integer"):
        EngineConfig(max_seq_len=64.5)
