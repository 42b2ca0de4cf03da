"""specmoe.models: named configs, seeded random weights, checkpoint loading, the OLMoE adapter."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import OlmoConfig, OlmoeConfig, OlmoeForCausalLM
from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter

from specmoe.models import NAMED_CONFIGS, ModelSourceError, OlmoeAdapter, adapter_for, load_model, named_config


@pytest.fixture(scope="module")
def micro():
    return load_model("olmoe-micro", seed=0)


def _ids(vocab, shape, seed):
    return torch.randint(2, vocab, shape, generator=torch.Generator().manual_seed(seed))


def test_named_configs_share_olmoe_routing_geometry():
    olmoe = [name for name, (model_type, _) in NAMED_CONFIGS.items() if model_type == "olmoe"]
    assert set(olmoe) == {"olmoe-1b-7b", "olmoe-tiny", "olmoe-micro"}
    for name in olmoe:
        config = named_config(name)
        assert isinstance(config, OlmoeConfig)
        adapter = adapter_for(config)
        assert (adapter.num_moe_layers, adapter.num_experts, adapter.top_k) == (16, 64, 8), name
        assert adapter.norm_topk_prob is False
        assert adapter.moe_layer_ids == tuple(range(16))


def test_full_size_config_is_olmoe_1b_7b():
    config = named_config("olmoe-1b-7b")
    assert (config.hidden_size, config.intermediate_size, config.vocab_size) == (2048, 1024, 50304)
    assert (config.num_attention_heads, config.num_hidden_layers) == (16, 16)
    assert OlmoeConfig().intermediate_size != config.intermediate_size  # the library default is not this model
    with torch.device("meta"):
        model = OlmoeForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    assert 6.8e9 < params < 7.0e9  # OLMoE-1B-7B: 6.9B parameters
    experts = OlmoeAdapter.from_config(config).experts(model, 0)
    assert tuple(experts[0].shape) == (64, 2 * 1024, 2048) and tuple(experts[1].shape) == (64, 2048, 1024)


def test_unknown_named_config_is_a_clear_error():
    with pytest.raises(ModelSourceError, match="unknown named config 'olmoe-huge'.*olmoe-tiny"):
        named_config("olmoe-huge")
    with pytest.raises(ModelSourceError,
                       match="not a checkpoint directory.*named config.*family target .family, family/deepseek_v3"):
        load_model("olmoe-huge")


def test_random_weights_are_deterministic_and_seeded(micro):
    model, _ = micro
    again, _ = load_model("olmoe-micro", seed=0)
    other, _ = load_model("olmoe-micro", seed=1)
    ref = model.state_dict()
    assert all(torch.equal(ref[k], v) for k, v in again.state_dict().items())
    assert not torch.equal(ref["model.layers.0.mlp.gate.weight"], other.state_dict()["model.layers.0.mlp.gate.weight"])
    # rounded to bfloat16 values: the bfloat16 copy is the same model, with the same router fingerprint
    half, adapter = load_model("olmoe-micro", seed=0, dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16
    assert adapter.fingerprint(half) == adapter.fingerprint(model) != adapter.fingerprint(other)
    assert all(torch.equal(ref[k].to(torch.bfloat16), v) for k, v in half.state_dict().items())


def test_random_routing_is_not_degenerate(micro):
    """Routing of the random model spreads over the experts and the pre-gate predicts the next layer."""
    model, adapter = micro
    inputs = []
    hooks = [r.register_forward_hook(lambda m, args, out: inputs.append((args[0], out[0])))
             for r in adapter.routers(model)]
    with torch.no_grad():
        model(_ids(adapter.vocab_size, (1, 64), 3))
    for h in hooks:
        h.remove()
    k, e = adapter.top_k, adapter.num_experts
    overlaps = []
    for layer, (hidden, logits) in enumerate(inputs):
        top = logits.topk(k, dim=-1).indices
        assert top.unique().numel() >= 3 * k, f"layer {layer} uses few experts"
        assert logits.std(dim=-1).mean() > 0.5
        if layer:
            pregate = F.linear(inputs[layer - 1][0], adapter.routers(model)[layer].weight).topk(k, dim=-1).indices
            overlaps += [len(set(a.tolist()) & set(b.tolist())) for a, b in zip(pregate, top)]
    assert np.mean(overlaps) > 3 * k * k / e  # chance overlap of two random top-K sets is K^2/E


def test_adapter_access_and_execution_weights(micro):
    model, adapter = micro
    weights = adapter.router_weights(model)
    assert len(weights) == 16 and all(w.dtype == np.float32 and w.shape == (64, 32) for w in weights)
    gate_up, down = adapter.experts(model, 3)
    assert tuple(gate_up.shape) == (64, 32, 32) and tuple(down.shape) == (64, 32, 16)
    assert gate_up is model.model.layers[3].mlp.experts.gate_up_proj
    assert adapter.shared_experts(model, 0) is None
    # execution weights = what the model's own router gives for its own selection, with and without renorm
    hidden = torch.randn(10, 32, generator=torch.Generator().manual_seed(0))
    for norm in (False, True):
        config = named_config("olmoe-micro")
        config.norm_topk_prob = norm
        variant = OlmoeAdapter.from_config(config)
        router = OlmoeTopKRouter(config)
        router.weight.data.copy_(model.model.layers[0].mlp.gate.weight)
        logits, scores, index = router(hidden)
        assert variant.norm_topk_prob is norm
        assert torch.equal(variant.execution_weights(logits, index), scores)
        assert torch.equal(variant.router_logits(router, hidden), logits)
        assert torch.allclose(scores.sum(-1), torch.ones(10)) is norm


def test_load_from_save_pretrained_directory(micro, tmp_path):
    model, adapter = micro
    model.save_pretrained(tmp_path / "ckpt")
    loaded, loaded_adapter = load_model(str(tmp_path / "ckpt"))
    assert loaded_adapter == adapter
    assert loaded_adapter.fingerprint(loaded) == adapter.fingerprint(model)
    assert loaded.specmoe_source == str((tmp_path / "ckpt").resolve())
    assert loaded.get_experts_implementation()[""] == "eager" and not loaded.training
    ids = _ids(adapter.vocab_size, (2, 12), 5)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_bad_checkpoint_directories_are_clear_errors(micro, tmp_path):
    model, _ = micro
    with pytest.raises(ModelSourceError, match="no such path"):
        load_model(str(tmp_path / "missing"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelSourceError, match="has no config.json"):
        load_model(str(empty))
    config_only = tmp_path / "config_only"
    model.config.save_pretrained(config_only)
    with pytest.raises(ModelSourceError, match=r"no weights \(\*\.safetensors\)"):
        load_model(str(config_only))
    a_file = tmp_path / "weights.safetensors"
    a_file.write_bytes(b"")
    with pytest.raises(ModelSourceError, match="is not a directory"):
        load_model(str(a_file))
    dense = tmp_path / "dense"
    OlmoConfig(hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
               vocab_size=128).save_pretrained(dense)
    (dense / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelSourceError, match="model type 'olmo' has no MoE layers"):
        load_model(str(dense))
    no_experts = tmp_path / "no_experts"
    OlmoeConfig(num_experts=0, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                vocab_size=128).save_pretrained(no_experts)
    (no_experts / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelSourceError, match=r"OLMoE config has no MoE layers \(num_experts=0\)"):
        load_model(str(no_experts))
