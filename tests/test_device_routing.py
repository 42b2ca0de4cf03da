"""Routing on the device when every expert is resident (`specmoe.kernels.device_routing`): the same selections and
weights as the host's `LogicalCache.route` on the same logits (ties included), and an engine that runs each
token as one launch decodes exactly as the host-routed engine. Model: `olmoe-tiny`, float32, on the CPU."""

import importlib.util

import numpy as np
import pytest
import torch
from _interpreter import run_in_interpreter

from specmoe.engines import EngineConfig, build_engine
from specmoe.models import load_model
from specmoe.offload import ExpertStore
from specmoe.routing import Calibration, EngineScoring, LogicalCache, RouterScoring, preset
from specmoe.kernels.device_routing import device_routing_applies, route_resident

L, E, K, V = 4, 64, 8, 100


def _host_route(z: np.ndarray, scoring: RouterScoring, policy_name: str = "exact_lru"):
    cache = LogicalCache(preset(policy_name, E, K), Calibration.uniform(L, E, V), L, E)
    cache.reset()
    engine_scoring = EngineScoring.of(scoring, L, E)
    selected, slots = np.zeros((len(z), K), np.int64), np.zeros((len(z), K), np.int32)
    weights, logged = np.zeros((len(z), K), np.float32), np.zeros(E, np.float32)
    for t, row in enumerate(z):
        cache.route(0, row, 1, engine_scoring, logged, selected[t], slots[t], weights[t])
    slot_of = cache.slot_of(0, np.arange(E))
    return selected, slots, weights, slot_of


@pytest.mark.parametrize("renormalise", [False, True])
@pytest.mark.parametrize("policy_name", ["exact_lru", "cache_prior", "psr"])
def test_device_routing_equals_host_routing_with_ties(renormalise, policy_name):
    rng = np.random.default_rng(0)
    # bf16-rounded logits on a coarse grid: many exact ties, negative and positive zeros included
    z = np.round(rng.normal(0, 1.5, (40, E)) * 4) / 4
    z[::5, :8] = 0.0
    z[1::5, 3:9] = -0.0
    z = torch.tensor(z, dtype=torch.float32).to(torch.bfloat16).float()
    scoring = RouterScoring("softmax", renormalise=renormalise, scale=1.5 if renormalise else 1.0)
    selected, slots, weights, slot_of = _host_route(z.numpy(), scoring, policy_name)
    experts_out = torch.zeros(len(z), K, dtype=torch.int64)
    route_out = torch.zeros(len(z), 2 * K, dtype=torch.int32)
    route_resident(z, K, scoring, torch.as_tensor(slot_of, dtype=torch.int32), experts_out, route_out)
    np.testing.assert_array_equal(experts_out.numpy(), selected)
    np.testing.assert_array_equal(route_out[:, :K].numpy(), slots)
    np.testing.assert_allclose(route_out[:, K:].view(torch.float32).numpy(), weights, rtol=1e-6, atol=0)


def test_device_routing_applies_only_where_it_reduces_to_top_k():
    softmax = RouterScoring("softmax")
    assert device_routing_applies(preset("psr", E, K), E, softmax) is None
    assert device_routing_applies(preset("exact_lru", E, K), E, softmax) is None
    assert "C=32" in device_routing_applies(preset("psr", 32, K), E, softmax)
    assert "spec_exec" in device_routing_applies(preset("spec_exec", E, K), E, softmax)
    assert device_routing_applies(preset("psr", E, K), E, RouterScoring("sigmoid")) is None


def _sigmoid_logits_and_bias(seed: int, num_positions: int = 40):
    """bf16-rounded logits with exact ties (equal logits, +-0) and a random nonzero bf16 bias [L, E]."""
    rng = np.random.default_rng(seed)
    z = np.round(rng.normal(0, 1.5, (num_positions, E)) * 4) / 4
    z[::5, :8] = 0.0
    z[1::5, 3:9] = -0.0
    z = torch.tensor(z, dtype=torch.float32).to(torch.bfloat16).float()
    bias = torch.tensor(rng.normal(0, 0.1, (L, E)), dtype=torch.float32).to(torch.bfloat16).float().numpy()
    bias[:, 10:14] = bias[:, 10:11]  # equal biases: ties of the selection scores where the logits tie too
    return z, bias


@pytest.mark.parametrize("groups", [(1, 1), (8, 3)])
@pytest.mark.parametrize("policy_name", ["exact_lru", "psr"])
@pytest.mark.parametrize("layer", [0, 2])
def test_sigmoid_device_routing_equals_host_routing(groups, policy_name, layer):
    from specmoe.kernels.device_routing import bias_rows_on

    z, bias = _sigmoid_logits_and_bias(layer + 7 * groups[0])
    scoring = RouterScoring("sigmoid", renormalise=True, scale=2.446, bias=bias, n_group=groups[0],
                            topk_group=groups[1])
    cache = LogicalCache(preset(policy_name, E, K), Calibration.uniform(L, E, V), L, E)
    cache.reset()
    engine_scoring = EngineScoring.of(scoring, L, E)
    selected, slots = np.zeros((len(z), K), np.int64), np.zeros((len(z), K), np.int32)
    weights, logged = np.zeros((len(z), K), np.float32), np.zeros(E, np.float32)
    for t, row in enumerate(z.numpy()):
        cache.route(layer, row, 1, engine_scoring, logged, selected[t], slots[t], weights[t])
    slot_of = torch.as_tensor(cache.slot_of(layer, np.arange(E)), dtype=torch.int32)
    experts_out = torch.zeros(len(z), K, dtype=torch.int64)
    route_out = torch.zeros(len(z), 2 * K, dtype=torch.int32)
    route_resident(z, K, scoring, slot_of, experts_out, route_out, bias=bias_rows_on(scoring, L, E, "cpu")[layer])
    np.testing.assert_array_equal(experts_out.numpy(), selected)
    np.testing.assert_array_equal(route_out[:, :K].numpy(), slots)
    # torch's float64 exp and numba's may differ in the last bit: a float32 weight may then round the other way
    np.testing.assert_allclose(route_out[:, K:].view(torch.float32).numpy(), weights, rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="selection bias"):
        route_resident(z, K, scoring, slot_of, experts_out, route_out)


@pytest.mark.parametrize("name", ["deepseek-v3-tiny", "deepseek-v3-tiny-groups"])
def test_deepseek_engine_with_device_routing_decodes_as_the_host_routed_engine(name):
    model, adapter = load_model(name, seed=0)
    model.set_experts_implementation("eager")
    store = ExpertStore.from_model(model, adapter)
    cal = Calibration.uniform(adapter.num_moe_layers, adapter.num_experts, adapter.vocab_size)
    policy = preset("psr", adapter.num_experts, adapter.top_k)
    device, host = (build_engine(model, policy, cal, EngineConfig(max_seq_len=40, device_routing=mode), store=store)
                    for mode in ("on", "off"))
    tokens = np.random.default_rng(5).integers(0, adapter.vocab_size, 16)
    a = device.teacher_forced(tokens, prompt_len=4, return_logits=True)
    b = host.teacher_forced(tokens, prompt_len=4, return_logits=True)
    assert a.info["routing"] == "device" and b.info["routing"] == "host"
    np.testing.assert_array_equal(a.selected, b.selected)
    np.testing.assert_array_equal(a.output_tokens, b.output_tokens)
    np.testing.assert_allclose(a.logits, b.logits, rtol=0, atol=1e-5 * np.abs(b.logits).max())


@pytest.fixture(scope="module")
def tiny_engines():
    model, adapter = load_model("olmoe-tiny", seed=0)
    store = ExpertStore.from_model(model, adapter)
    cal = Calibration.uniform(adapter.num_moe_layers, adapter.num_experts, adapter.vocab_size)
    policy = preset("psr", adapter.num_experts, adapter.top_k)
    make = lambda mode: build_engine(model, policy, cal, EngineConfig(max_seq_len=48, device_routing=mode),  # noqa
                                     store=store)
    return make("on"), make("off"), adapter


def test_engine_with_device_routing_decodes_as_the_host_routed_engine(tiny_engines):
    device, host, adapter = tiny_engines
    tokens = np.random.default_rng(3).integers(0, adapter.vocab_size, 20)
    a = device.teacher_forced(tokens, prompt_len=4, return_logits=True)
    b = host.teacher_forced(tokens, prompt_len=4, return_logits=True)
    assert a.info["routing"] == "device" and b.info["routing"] == "host"
    np.testing.assert_array_equal(a.selected, b.selected)
    np.testing.assert_array_equal(a.output_tokens, b.output_tokens)
    np.testing.assert_array_equal(a.router_logits, b.router_logits)
    np.testing.assert_array_equal(a.pregate_logits, b.pregate_logits)
    np.testing.assert_allclose(a.logits, b.logits, rtol=0, atol=1e-5 * np.abs(b.logits).max())
    assert a.copy_totals() == b.copy_totals()
    ga, gb = device.generate(tokens[:5], 10), host.generate(tokens[:5], 10)
    assert ga.generated == gb.generated and ga.info["routing"] == "device"


def test_engine_routes_on_the_host_where_device_routing_does_not_apply(tiny_engines):
    device, _, adapter = tiny_engines
    tokens = np.random.default_rng(4).integers(0, adapter.vocab_size, 8)
    device.configure(preset("spec_exec", adapter.num_experts, adapter.top_k))
    try:
        result = device.teacher_forced(tokens)
        # not the all-resident top-K step: the policy runs it, on the device where the engine says it does
        path = "host" if device.device_policy() else "device_policy"
        assert result.info["routing"] == path and "spec_exec" in result.info["host_routing_why"]
    finally:
        device.configure(preset("psr", adapter.num_experts, adapter.top_k))


def test_device_routing_setting_is_checked():
    with pytest.raises(ValueError, match="device_routing"):
        EngineConfig(device_routing="gpu")


_KERNEL_CHECK = r"""
import numpy as np, torch
from specmoe.routing import RouterScoring
from specmoe.kernels.device_routing import route_resident
rng = np.random.default_rng(0)
for E, K, D in ((64, 8, 5), (48, 6, 3), (256, 8, 2)):
    z = np.round(rng.normal(0, 1.5, (D, 2 * E)) * 4) / 4  # rows of stride 2E, as the decoder's [z | g] buffer
    z[0, :8] = 0.0
    z[-1, 3:9] = -0.0
    z = torch.tensor(z, dtype=torch.float32).to(torch.bfloat16).float()[:, :E]
    slot_of = torch.tensor(rng.permutation(E), dtype=torch.int32)
    for renorm, scale in ((False, 1.0), (True, 2.5)):
        sc = RouterScoring("softmax", renormalise=renorm, scale=scale)
        outs = []
        for kernel in ("torch", "triton"):
            ex, ro = torch.zeros(D, K, dtype=torch.int64), torch.zeros(D, 2 * K, dtype=torch.int32)
            route_resident(z, K, sc, slot_of, ex, ro, kernel=kernel)
            outs.append((ex, ro))
        assert torch.equal(outs[0][0], outs[1][0]), (E, K, outs[0][0], outs[1][0])
        assert torch.equal(outs[0][1][:, :K], outs[1][1][:, :K])
        w0, w1 = outs[0][1][:, K:].view(torch.float32), outs[1][1][:, K:].view(torch.float32)
        assert torch.allclose(w0, w1, rtol=1e-6, atol=0), (w0, w1)
print("resident routing ok")
"""


_SIGMOID_KERNEL_CHECK = r"""
import numpy as np, torch
from specmoe.routing import RouterScoring
from specmoe.kernels.device_routing import route_resident
rng = np.random.default_rng(1)
for E, K, D, groups in ((64, 6, 5, (1, 1)), (64, 6, 4, (8, 3)), (48, 6, 3, (4, 2)), (16, 4, 3, (4, 2))):
    z = np.round(rng.normal(0, 1.5, (D, 2 * E)) * 4) / 4  # rows of stride 2E, as the decoder's [z | g] buffer
    z[0, :8] = 0.0
    z[-1, 3:9] = -0.0
    z = torch.tensor(z, dtype=torch.float32).to(torch.bfloat16).float()[:, :E]
    bias = torch.tensor(rng.normal(0, 0.1, (2, E)), dtype=torch.float32).to(torch.bfloat16).double()
    bias[:, 2:6] = bias[:, 2:3]  # equal scores where the logits tie
    slot_of = torch.tensor(rng.permutation(E), dtype=torch.int32)
    for renorm, scale in ((False, 1.0), (True, 2.446)):
        sc = RouterScoring("sigmoid", renormalise=renorm, scale=scale, bias=bias.numpy(), n_group=groups[0],
                           topk_group=groups[1])
        outs = []
        for kernel in ("torch", "triton"):
            ex, ro = torch.zeros(D, K, dtype=torch.int64), torch.zeros(D, 2 * K, dtype=torch.int32)
            route_resident(z, K, sc, slot_of, ex, ro, kernel=kernel, bias=bias[1].contiguous())
            outs.append((ex, ro))
        assert torch.equal(outs[0][0], outs[1][0]), (E, groups, outs[0][0], outs[1][0])
        assert torch.equal(outs[0][1][:, :K], outs[1][1][:, :K])
        w0, w1 = outs[0][1][:, K:].view(torch.float32), outs[1][1][:, K:].view(torch.float32)
        assert torch.allclose(w0, w1, rtol=1e-6, atol=0), (w0, w1)
print("sigmoid resident routing ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_sigmoid_routing_kernel_matches_torch_in_the_interpreter():
    done = run_in_interpreter(_SIGMOID_KERNEL_CHECK)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "sigmoid resident routing ok" in done.stdout


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_routing_kernel_matches_torch_in_the_interpreter():
    done = run_in_interpreter(_KERNEL_CHECK)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resident routing ok" in done.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("num_positions", [1, 17])
def test_gpu_routing_kernel_matches_torch(num_positions):
    from specmoe.kernels import checks

    for scoring in (RouterScoring("softmax"), RouterScoring("softmax", renormalise=True, scale=2.5)):
        checks.check_resident_routing(num_positions, 64, 8, scoring, "cuda")  # raises if they disagree
        checks.check_resident_routing(num_positions, 256, 8, scoring, "cuda")
    for experts, groups in ((64, (1, 1)), (256, (8, 4))):  # sigmoid: Moonlight's and DeepSeek-V3's shapes
        bias = np.random.default_rng(experts).normal(0, 0.1, (2, experts))
        scoring = RouterScoring("sigmoid", renormalise=True, scale=2.446, bias=bias, n_group=groups[0],
                                topk_group=groups[1])
        checks.check_resident_routing(num_positions, experts, 8, scoring, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("groups", [(1, 1), (8, 3)])
def test_gpu_sigmoid_device_routing_equals_host_routing(groups):
    """The float64 torch ops and the Triton kernel on the device select and weight as the torch ops on the CPU
    (which are the host's routing: test_sigmoid_device_routing_equals_host_routing)."""
    from specmoe.kernels.device_routing import bias_rows_on

    z, bias = _sigmoid_logits_and_bias(11, num_positions=64)
    scoring = RouterScoring("sigmoid", renormalise=True, scale=2.446, bias=bias, n_group=groups[0],
                            topk_group=groups[1])
    slot_of = torch.arange(E, dtype=torch.int32)
    outs = []
    for device, kernel in (("cpu", "torch"), ("cuda", "torch"), ("cuda", "triton")):
        ex = torch.zeros(len(z), K, dtype=torch.int64, device=device)
        ro = torch.zeros(len(z), 2 * K, dtype=torch.int32, device=device)
        route_resident(z.to(device), K, scoring, slot_of.to(device), ex, ro, kernel=kernel,
                       bias=bias_rows_on(scoring, L, E, device)[1])
        outs.append((ex.cpu(), ro.cpu()))
    for ex, ro in outs[1:]:
        assert torch.equal(outs[0][0], ex) and torch.equal(outs[0][1][:, :K], ro[:, :K])
        torch.testing.assert_close(ro[:, K:].view(torch.float32), outs[0][1][:, K:].view(torch.float32),
                                   rtol=1e-6, atol=0)
