"""The engine on a CUDA device with Moonlight-16B-A3B's per-layer shapes (the `moonlight-16b-a3b` named config cut
to 1 dense + 3 MoE layers; bf16, seeded random weights drawn on the device): split-KV latent attention, the Triton
slot MoE kernels (per token and grouped for the prompt chunks), the fused dense kernels (norms, MLA prologue,
SwiGLU), CUDA graphs and device routing of the sigmoid router
in use; all-resident exact decoding against the torch path (SDPA, torch MoE, torch ops, host routing, no graphs);
PSR with C < E with graphs against itself without, and with the policy on the device
(`EngineConfig.policy_device`) against the host policy, from the model's logits and following a recorded run.
Skipped without CUDA (tests/conftest.py)."""

import numpy as np
import pytest
import torch

from specmoe.engines import EngineConfig, build_engine
from specmoe.engines.results import COPY_FIELDS, LogitFeed
from specmoe.models import adapter_for, named_config
from specmoe.models.deepseek_v3 import build_random_deepseek_v3
from specmoe.offload import ExpertStore
from specmoe.routing import Calibration, preset

pytestmark = pytest.mark.gpu
SEQ, LAYERS = 256, 4


@pytest.fixture(scope="module")
def moonlight():
    config = named_config("moonlight-16b-a3b")
    config.num_hidden_layers = LAYERS  # first_k_dense_replace 1: one dense layer, then 3 MoE layers
    model = build_random_deepseek_v3(config, 0, torch.bfloat16, "cuda", torch.Generator(device="cuda").manual_seed(0))
    model.eval()
    model.set_experts_implementation("eager")
    adapter = adapter_for(config)
    return model, adapter, ExpertStore.from_model(model, adapter)


def _engine(moonlight, policy_name, capacity, **config):
    model, adapter, store = moonlight
    cal = Calibration.uniform(adapter.num_moe_layers, adapter.num_experts, adapter.vocab_size)
    policy = preset(policy_name, capacity, adapter.top_k, **({"bonus": 0.25} if policy_name == "psr" else {}))
    engine = build_engine(model, policy, cal, EngineConfig(max_seq_len=SEQ, **config), store=store)
    print(policy_name, capacity, config, "notes:", engine.notes)
    return engine


@pytest.fixture(scope="module")
def tokens(moonlight):
    return np.random.default_rng(2).integers(0, moonlight[1].vocab_size, 48)


def test_gpu_moonlight_kernels_and_graphs_match_the_torch_path(moonlight, tokens):
    fast = _engine(moonlight, "exact_lru", 64)
    assert fast.graphs is not None
    kernels = fast.kernels
    assert (kernels["backend"], kernels["attention"], kernels["dense"]) == ("triton", "split_kv", "fused"), fast.notes
    assert "slot_moe" in kernels["launch"] and any(k.startswith("grouped_slot_moe") for k in kernels["launch"])
    assert fast.decoder.grouped_moe, fast.notes
    run = fast.teacher_forced(tokens, prompt_len=32, return_logits=True)  # two prompt chunks of 16, then steps
    assert run.info["routing"] == "device", run.info
    slow = _engine(moonlight, "exact_lru", 64, backend="torch", attention="sdpa", cuda_graphs=False,
                   device_routing="off")
    assert (slow.kernels["backend"], slow.kernels["attention"], slow.kernels["dense"]) == ("torch", "sdpa", "torch")
    ref = slow.teacher_forced(tokens, prompt_len=32, return_logits=True)
    assert ref.info["routing"] == "host"
    rel = np.linalg.norm(run.logits - ref.logits, axis=1) / np.linalg.norm(ref.logits, axis=1)
    print(f"relative L2 error of the logits per position: median {np.median(rel):.4f}, max {rel.max():.4f}; per "
          f"position {np.round(rel, 3).tolist()}; greedy tokens equal at "
          f"{(run.logits.argmax(1) == ref.logits.argmax(1)).mean():.3f} of positions")
    agree = (np.sort(run.selected, axis=-1) == np.sort(ref.selected, axis=-1)).all(axis=-1)  # [T, L]
    print(f"(position, layer) selections equal: {agree.mean():.3f}")
    # bf16 rounding elsewhere may flip a near-tie of the sigmoid scores (they lie close together), and a position
    # that executes another expert has other logits; every position whose selections agree must agree closely
    assert agree.mean() > 0.9
    assert np.median(rel) < 0.03 and rel[agree.all(axis=1)].max() < 0.05
    assert fast.decoder.bytes_per_token(10) < slow.decoder.bytes_per_token(10)  # split-KV reads written rows only


def test_gpu_moonlight_psr_with_graphs_equals_without(moonlight, tokens):
    graphs = _engine(moonlight, "psr", 32, policy_device="off")  # the host policy's step graphs (the device
    eager = _engine(moonlight, "psr", 32, cuda_graphs=False, policy_device="off")  # policy: the test below)
    assert graphs.graphs is not None and eager.graphs is None
    assert graphs.kernels["attention"] == eager.kernels["attention"] == "split_kv"
    a = graphs.teacher_forced(tokens, prompt_len=32, return_logits=True)
    b = eager.teacher_forced(tokens, prompt_len=32, return_logits=True)
    assert a.info["routing"] == "host" and a.copy_totals()["issued"] > 0
    np.testing.assert_array_equal(a.selected, b.selected)
    np.testing.assert_array_equal(a.output_tokens, b.output_tokens)
    np.testing.assert_allclose(a.logits, b.logits, rtol=0, atol=1e-3 * np.abs(b.logits).max())
    ga, gb = graphs.generate(tokens[:8], 12), eager.generate(tokens[:8], 12)
    assert ga.generated == gb.generated


def test_gpu_moonlight_psr_device_policy_as_the_host_policy(moonlight, tokens):
    """The device policy on the sigmoid router with its selection bias and group-limited choice: tokens,
    selections and demand / prefetch / unused copies as the host policy's (prompt steps one position at a time on
    both), from the model's own logits and following the host run's recorded logits (a feed)."""
    dev = _engine(moonlight, "psr", 32, policy_device="on")
    host = _engine(moonlight, "psr", 32, prefill_chunk=1, policy_device="off")
    same = [COPY_FIELDS.index(name) for name in ("demand", "prefetch", "prefetch_unused")]
    a = dev.teacher_forced(tokens, prompt_len=32, return_logits=True)
    b = host.teacher_forced(tokens, prompt_len=32, return_logits=True)
    feed = LogitFeed.of(b)
    fa = dev.teacher_forced(tokens, prompt_len=32, feed=feed)
    fb = host.teacher_forced(tokens, prompt_len=32, feed=feed)
    for x, y in ((a, b), (fa, fb)):
        assert x.info["routing"] == "device_policy" and y.info["routing"] == "host", (x.info, y.info)
        np.testing.assert_array_equal(x.selected, y.selected)
        np.testing.assert_array_equal(x.output_tokens, y.output_tokens)
        np.testing.assert_array_equal(x.copies[:, same], y.copies[:, same])
    np.testing.assert_allclose(a.logits, b.logits, rtol=0, atol=1e-3 * np.abs(b.logits).max())
    np.testing.assert_array_equal(fa.selected, b.selected)  # following a run repeats its decisions
    assert a.copy_totals()["issued"] > 0
