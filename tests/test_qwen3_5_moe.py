"""Qwen3.5-MoE (Qwen3.6) in the harness: adapter (softmax router, always renormalised, gated shared expert,
Gated DeltaNet and full attention layers), exact routing = transformers, harness and replay decision for
decision, calibration, checkpoint directories (the text model's and the image-text model's layout). A tiny model
written by save_pretrained and loaded back; the Gated DeltaNet layers run in transformers' torch reference."""

import numpy as np
import pytest
import torch

from _architecture_checks import (GEN, check_exact_routing_changes_nothing, left_padded, random_tokens,
                                 tiny_checkpoint)
from specmoe.harness.patch import exact_routing, patch_model, unpatch
from specmoe.models import (Qwen35MoeAdapter, adapter_for, decoder_for, load_model,
                            named_config)
from specmoe.models.checkpoint import CheckpointReader
from specmoe.routing import preset, replay
from specmoe.routing.calibration import CalibrationBuilder

NAME = "qwen3.5-moe-tiny"
C = 6  # of 16 experts: the policies diverge from exact routing


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """`tiny_checkpoint` of the config."""
    loaded = tiny_checkpoint(NAME, tmp_path_factory)
    yield loaded
    unpatch(loaded[0])


def test_checkpoint_directory_loads_the_same_model(tiny):
    model, adapter, path, _, built = tiny
    assert isinstance(adapter, Qwen35MoeAdapter) and adapter == adapter_for(named_config(NAME))
    assert adapter.model_type == "qwen3_5_moe_text" and adapter.norm_topk_prob
    assert adapter.moe_layer_ids == (0, 1, 2, 3) and adapter.num_moe_layers == 4
    assert adapter.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert [type(layer.linear_attn if kind == "linear_attention" else layer.self_attn).__name__
            for layer, kind in zip(model.model.layers, adapter.layer_types)] == \
        ["Qwen3_5MoeGatedDeltaNet"] * 3 + ["Qwen3_5MoeAttention"]
    for (name, a), (_, b) in zip(built.state_dict().items(), model.state_dict().items()):
        assert torch.equal(a, b), name
    assert adapter.fingerprint(model) == adapter.fingerprint(built)
    assert adapter.checkpoint_fingerprint(CheckpointReader(path)) == adapter.fingerprint(model)
    gate, down = adapter.experts(model, 0)
    assert gate.shape == (16, 64, 64) and down.shape == (16, 64, 32)
    shared = adapter.shared_experts(model, 0)
    assert shared.mlp.gate_proj.out_features == 32 and shared.gate.weight.shape == (1, 64)
    from specmoe.models.qwen3_5_moe_decode import Qwen35MoeDecoder

    assert decoder_for(model.config) is Qwen35MoeDecoder


def test_image_text_checkpoint_loads_its_text_model(tmp_path):
    """The shipped layout: a Qwen3_5MoeForConditionalGeneration checkpoint (model_type qwen3_5_moe, tensors under
    model.language_model.) loads as the text model: the same weights, the image-text model's logits, and the
    fingerprint read from the files."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    text, _ = load_model(NAME, seed=3)
    config = Qwen3_5MoeConfig(text_config=named_config(NAME).to_dict(),
                              vision_config=dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2,
                                                 out_hidden_size=64))
    full = Qwen3_5MoeForConditionalGeneration(config).eval()
    full.model.language_model.load_state_dict(text.model.state_dict())
    full.lm_head.load_state_dict(text.lm_head.state_dict())
    full.save_pretrained(tmp_path)
    model, adapter = load_model(str(tmp_path))
    assert adapter.model_type == "qwen3_5_moe" and adapter.checkpoint_prefix == "model.language_model."
    assert adapter.num_experts == 16 and adapter.top_k == 4
    assert adapter.checkpoint_fingerprint(CheckpointReader(tmp_path)) == adapter.fingerprint(model) \
        == adapter.fingerprint(text)
    for (name, a), (_, b) in zip(text.state_dict().items(), model.state_dict().items()):
        assert torch.equal(a, b), name
    ids = random_tokens(adapter.vocab_size, 9, 1)[None]
    with torch.no_grad():  # the image-text model runs its own experts kernel and position ids: close, not bitwise
        torch.testing.assert_close(model(input_ids=ids).logits, full(input_ids=ids).logits)


def test_exact_routing_leaves_forward_and_generate_unchanged(tiny):
    model, adapter, *_ = tiny
    check_exact_routing_changes_nothing(model, adapter)


def test_execution_weights_are_the_routers(tiny):
    """The adapter's arithmetic against the router's own output: softmax, top-K, renormalised to one."""
    model, adapter, *_ = tiny
    router = adapter.routers(model)[0]
    hidden = torch.randn(40, adapter.hidden_size, generator=torch.Generator().manual_seed(3))
    logits, weights, selected = router(hidden)
    assert torch.equal(adapter.router_logits(router, hidden), logits)
    assert torch.equal(adapter.selection_scores(logits, 0), logits)
    assert torch.equal(adapter.execution_weights(logits, selected), weights)
    torch.testing.assert_close(weights.sum(-1), torch.ones(40), rtol=1e-6, atol=0)
    scoring = adapter.router_scoring()
    assert scoring.kind == "softmax" and scoring.renormalise


def test_shared_expert_is_added_with_its_gate(tiny):
    """Under a policy that is not exact routing, each MoE block's output is the routed experts at the policy's
    selection and weights plus sigmoid(gate(h)) * shared_expert(h); without the gate, or without the shared
    expert, it is not (the gates of the random model spread over (0, 1) from token to token)."""
    model, adapter, _, calibration, _ = tiny
    policy = preset("psr", C, adapter.top_k)
    seen = {}
    blocks = adapter.moe_blocks(model)
    hooks = [block.register_forward_hook(lambda m, a, out, layer=layer: seen.setdefault(layer, []).append((a[0], out)))
             for layer, block in enumerate(blocks)]
    hooks += [router.register_forward_hook(lambda m, a, out, layer=layer: seen.setdefault(("r", layer), []).append(out))
              for layer, router in enumerate(adapter.routers(model))]
    ids = random_tokens(adapter.vocab_size, 24, 77)[None]
    patch_model(model, adapter, policy, calibration)
    try:
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        unpatch(model)
        for hook in hooks:
            hook.remove()
    for layer in range(adapter.num_moe_layers):
        (hidden, out), = seen[layer]
        (_, weights, selected), = seen[("r", layer)]
        h = hidden.reshape(-1, adapter.hidden_size)
        gate_up, down = adapter.experts(model, layer)
        with torch.no_grad():
            routed = torch.zeros_like(h)
            for k in range(adapter.top_k):
                g, u = torch.einsum("nh,nih->ni", h, gate_up[selected[:, k]]).chunk(2, dim=-1)
                routed += weights[:, k, None] * torch.einsum("ni,nhi->nh", torch.nn.functional.silu(g) * u,
                                                             down[selected[:, k]])
            shared = adapter.shared_experts(model, layer)
            gate = torch.sigmoid(shared.gate(h))
            ungated = shared.mlp(h)
        out = out.reshape(-1, adapter.hidden_size)
        torch.testing.assert_close(out, routed + shared(h), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(shared(h), gate * ungated)
        assert gate.std() > 0.1 and gate.median() < 0.9
        assert (out - (routed + ungated)).abs().max() > 100 * 1e-5  # the gate is applied
        assert (out - routed).abs().max() > 100 * 1e-5  # the shared expert is added


@pytest.mark.parametrize("name", ["exact_lru", "cache_prior", "psr", "spec_exec"])
def test_harness_and_replay_agree_decision_for_decision(tiny, name):
    model, adapter, _, calibration, _ = tiny
    policy = preset(name, C, adapter.top_k)
    prompts = [random_tokens(adapter.vocab_size, n, 30 + i) for i, n in enumerate((7, 12))]
    ids, mask = left_padded(prompts)
    ctx = patch_model(model, adapter, policy, calibration, record=True)
    try:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=6, **GEN)
    finally:
        unpatch(model)
    diverged = 0
    for row, prompt in enumerate(prompts):
        z, g, tokens, selected = ctx.recorded(row)
        assert np.array_equal(tokens[len(prompt):], out.sequences[row, ids.shape[1]:-1].numpy())
        trace = replay(policy, z, g if policy.insert_budget else None, tokens, calibration, groups=adapter.groups)
        assert np.array_equal(trace.selected, selected)
        exact = replay(preset("exact_lru", adapter.num_experts, adapter.top_k), z, None, tokens, calibration,
                       groups=adapter.groups)
        diverged += int((np.sort(exact.selected, -1) != np.sort(selected, -1)).any(-1).sum())
    if name != "exact_lru":
        assert diverged > 0  # the policy is not exact routing in disguise


def test_calibration_counts_the_models_choice(tiny):
    model, adapter, _, calibration, _ = tiny
    assert calibration.provenance["fingerprint"] == adapter.fingerprint(model)
    assert calibration.provenance["model_type"] == "qwen3_5_moe_text"
    windows = [random_tokens(adapter.vocab_size, 30, 300 + i) for i in range(2)]
    builder = CalibrationBuilder(adapter.num_moe_layers, adapter.num_experts, adapter.vocab_size, adapter.top_k,
                                 adapter.groups)
    counts = np.zeros((adapter.num_moe_layers, adapter.num_experts), dtype=np.int64)
    with torch.no_grad(), exact_routing(model, adapter, record=True) as context:
        for window in windows:
            model(input_ids=window[None])
            z, _, tokens, selected = context.recorded(0)
            builder.add(z.astype(np.float64), tokens)
            for layer in range(adapter.num_moe_layers):
                np.add.at(counts[layer], selected[:, layer].ravel(), 1)
    assert np.array_equal(builder.selection_counts, counts)


def test_qwen36_named_config():
    config = named_config("qwen3.6-35b-a3b")
    adapter = adapter_for(config)
    assert (adapter.num_moe_layers, adapter.num_experts, adapter.top_k) == (40, 256, 8)
    assert adapter.moe_layer_ids == tuple(range(40)) and adapter.norm_topk_prob
    assert adapter.layer_types == ("linear_attention",) * 3 + ("full_attention",) + adapter.layer_types[4:]
    assert [i for i, kind in enumerate(adapter.layer_types) if kind == "full_attention"] == list(range(3, 40, 4))
    assert (adapter.moe_intermediate_size, adapter.shared_expert_intermediate_size) == (512, 512)
    assert 3 * config.hidden_size * config.moe_intermediate_size * 2 == pytest.approx(6.3e6, rel=0.01)
    assert (config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim) == (32, 128, 128)



def test_gdn_kernels_of_an_optional_package_run_on_cuda_only(tiny, monkeypatch):
    """Where flash-linear-attention or causal-conv1d is installed transformers binds their kernels for every
    device, and they run on CUDA tensors only. `gdn_kernels_on_cuda_only` (the adapter calls it) keeps them for
    CUDA tensors and runs transformers' torch version elsewhere: a CPU forward gives the reference's logits with
    kernels that refuse the CPU bound in; `__wrapped__` stays the torch version (what the trainer's fallback
    swaps in); a second call changes nothing (later swaps are kept)."""
    import types

    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as real

    from specmoe.models.qwen3_5_moe import GDN_FUNCTIONS, gdn_kernels_on_cuda_only

    model, _, _, _, _ = tiny
    ids = random_tokens(model.config.vocab_size, 8, seed=3)[None]
    with torch.no_grad(), exact_routing(model):
        reference_logits = model(input_ids=ids).logits
    calls = []
    module = types.SimpleNamespace()
    for name in GDN_FUNCTIONS:
        def kernel(*args, _name=name, **kwargs):
            tensor = next(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
            calls.append(_name)
            if not tensor.is_cuda:
                raise RuntimeError("a CUDA-only kernel on a CPU tensor")
            return "kernel"

        kernel.__wrapped__ = getattr(real, name).__wrapped__
        setattr(module, name, kernel)
    with torch.no_grad(), exact_routing(model):  # bound as transformers binds them: the CPU forward fails
        monkeypatch.setattr(real, "torch_chunk_gated_delta_rule", module.torch_chunk_gated_delta_rule)
        with pytest.raises(RuntimeError, match="CUDA-only"):
            model(input_ids=ids)
    gdn_kernels_on_cuda_only(module)
    for name in GDN_FUNCTIONS:
        assert getattr(module, name).__wrapped__ is getattr(real, name).__wrapped__
        monkeypatch.setattr(real, name, getattr(module, name))
    calls.clear()
    with torch.no_grad(), exact_routing(model):
        logits = model(input_ids=ids).logits
    torch.testing.assert_close(logits, reference_logits, rtol=0, atol=0)
    assert calls == []  # the CPU never reached the kernels

    class OnCuda(torch.Tensor):  # a tensor that says it is on CUDA: the kernel runs
        @property
        def is_cuda(self):
            return True

    x = torch.zeros(1, 4, 3).as_subclass(OnCuda)
    assert module.causal_conv1d_update(x, torch.zeros(1, 4, 2), torch.zeros(4, 3)) == "kernel"
    assert calls == ["causal_conv1d_update"]
    swapped = module.causal_conv1d_fn = object()
    gdn_kernels_on_cuda_only(module)
    assert module.causal_conv1d_fn is swapped
