"""FP8 checkpoints and FP8 expert stores (CPU, float32, tiny Qwen3.5-MoE with two 128-blocks per expert dimension):
a save_pretrained checkpoint converted with `quantize_experts_fp8` loads through `load_model` (dequantised),
`build_engine_from_checkpoint` and the store (FP8 rows, half the bytes), and the engine over the FP8 store equals
the engine over the dequantised weights and transformers; the named FP8 configs; bf16 checkpoints unchanged."""

import json

import numpy as np
import pytest
import torch

from specmoe.engines import EngineConfig, build_engine, build_engine_from_checkpoint
from specmoe.geometry import Geometry
from specmoe.kernels.fp8 import fp8_row_layout
from specmoe.models import ModelSourceError, load_model
from specmoe.models.checkpoint import CheckpointReader, fp8_quantized
from specmoe.models.fp8_checkpoint import quantize_experts_fp8
from specmoe.models.qwen3_5_moe import build_random_qwen3_5_moe
from specmoe.models.registry import named_config
from specmoe.offload import ExpertStore, OffloadError
from specmoe.routing import Calibration, preset

SEQ = 48


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(bf16 source directory, its FP8 copy): the tiny FP8 config's shapes, written by save_pretrained."""
    config = named_config("qwen3.5-moe-tiny-fp8")
    del config.quantization_config
    model = build_random_qwen3_5_moe(config, 0, torch.bfloat16, "cpu")
    src, dst = tmp_path_factory.mktemp("bf16"), tmp_path_factory.mktemp("fp8")
    model.save_pretrained(src)
    count = quantize_experts_fp8(src, dst)
    assert count == config.num_hidden_layers * config.num_experts * 3
    return src, dst


def engine_of(model, adapter, store, policy="exact_lru", capacity=None):
    calibration = Calibration.uniform(adapter.num_moe_layers, adapter.num_experts, adapter.vocab_size)
    return build_engine(model, preset(policy, capacity or adapter.num_experts, adapter.top_k), calibration,
                        EngineConfig(max_seq_len=SEQ), store=store)


def test_the_converted_checkpoint_is_the_shipped_fp8_layout(checkpoints):
    src, dst = checkpoints
    config = json.loads((dst / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    reader, source = CheckpointReader(dst), CheckpointReader(src)
    key = "model.layers.1.mlp.experts.3.gate_proj.weight"
    q, scale = reader.get_fp8(key)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (160, 192) and scale.shape == (2, 2)
    assert scale.dtype == torch.float32 and "model.layers.1.mlp.experts.3.gate_proj.weight_scale_inv" in reader
    torch.testing.assert_close(reader.get(key), source.get(key).float(), rtol=0.07, atol=2e-3)
    assert not reader.is_fp8("model.layers.1.mlp.gate.weight")  # only the routed experts are converted
    assert torch.equal(reader.get("model.embed_tokens.weight"), source.get("model.embed_tokens.weight"))


def test_fp8_checkpoint_engine_equals_the_engine_over_the_dequantised_weights(checkpoints):
    _, dst = checkpoints
    model, adapter = load_model(str(dst), dtype=torch.float32)
    assert fp8_quantized(model.config)
    reader = CheckpointReader(dst)  # load_model dequantised the experts
    gate_up = model.model.layers[2].mlp.experts.gate_up_proj[5]
    assert torch.equal(gate_up[:160], reader.get("model.layers.2.mlp.experts.5.gate_proj.weight"))
    geometry = Geometry.of(adapter)
    fp8_store = ExpertStore.from_checkpoint(dst, geometry, prefix=adapter.checkpoint_experts())
    deq_store = ExpertStore.from_model(model, adapter, fp8=False)
    assert fp8_store.fp8 and not deq_store.fp8 and fp8_store.dtype == torch.uint8
    assert fp8_store.width == fp8_row_layout(192, 160).width
    assert fp8_store.expert_bytes < 0.27 * deq_store.expert_bytes  # 1 byte a weight against float32's 4
    for layer, expert in ((0, 0), (3, 15)):
        for a, b in zip(fp8_store.weights(layer, expert), deq_store.weights(layer, expert)):
            assert torch.equal(a, b)
    # the model's own FP8 store (quantised again from the dequantised weights) holds the same weights
    again = ExpertStore.from_model(model, adapter)
    assert again.fp8 and all(torch.equal(a, b) for a, b in zip(again.weights(1, 7), fp8_store.weights(1, 7)))

    tokens = np.random.default_rng(5).integers(0, adapter.vocab_size, 20)
    calibration = Calibration.uniform(adapter.num_moe_layers, adapter.num_experts, adapter.vocab_size)
    policy = preset("psr", adapter.num_experts // 2, adapter.top_k)
    read = build_engine_from_checkpoint(dst, policy, calibration, EngineConfig(max_seq_len=SEQ), dtype=torch.float32)
    assert read.residency.store.fp8 and read.residency.slots.data.dtype == torch.uint8
    reference = engine_of(model, adapter, deq_store, "psr", adapter.num_experts // 2)
    a, b = read.teacher_forced(tokens, return_logits=True), reference.teacher_forced(tokens, return_logits=True)
    np.testing.assert_array_equal(a.selected, b.selected)
    np.testing.assert_array_equal(a.output_tokens, b.output_tokens)
    np.testing.assert_allclose(a.logits, b.logits, rtol=1e-5, atol=1e-5)
    assert read.generate(tokens[:6], 8).generated == reference.generate(tokens[:6], 8).generated
    # all resident, the FP8 engine equals transformers over the dequantised weights
    full = engine_of(model, adapter, fp8_store)
    with torch.no_grad():
        ref = model(torch.as_tensor(tokens)[None]).logits[0].float().numpy()
    logits = full.teacher_forced(tokens, prompt_len=8, return_logits=True).logits
    assert np.abs(logits - ref).max() <= 1e-4 * np.abs(ref).max()


def test_named_fp8_configs():
    full = named_config("qwen3.6-35b-a3b-fp8")
    assert fp8_quantized(full) and full.hidden_size == 2048 and full.moe_intermediate_size == 512
    assert not fp8_quantized(named_config("qwen3.6-35b-a3b"))
    model, adapter = load_model("qwen3.5-moe-tiny-fp8", seed=1)
    store = ExpertStore.from_model(model, adapter)
    assert store.fp8
    for layer, expert in ((0, 2), (3, 9)):  # the random experts are FP8 values: the store holds them exactly
        gate_up, down = store.weights(layer, expert)
        experts = model.model.layers[layer].mlp.experts
        assert torch.equal(gate_up, experts.gate_up_proj[expert]) and torch.equal(down, experts.down_proj[expert])
    tokens = np.random.default_rng(2).integers(0, adapter.vocab_size, 16)
    with torch.no_grad():
        ref = model(torch.as_tensor(tokens)[None]).logits[0].float().numpy()
    logits = engine_of(model, adapter, store).teacher_forced(tokens, prompt_len=6, return_logits=True).logits
    assert np.abs(logits - ref).max() <= 1e-4 * np.abs(ref).max()


def test_fp8_errors(checkpoints, tmp_path):
    config = named_config("qwen3.5-moe-tiny-fp8")
    config.quantization_config = {"quant_method": "fp8", "weight_block_size": [64, 64]}
    with pytest.raises(ModelSourceError, match=r"blocks of \[64, 64\]"):
        fp8_quantized(config)
    _, dst = checkpoints
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    bad.mkdir()
    for item in dst.iterdir():
        (bad / item.name).write_bytes(item.read_bytes())
    tensors = load_file(str(bad / "model.safetensors"))
    tensors["model.layers.0.mlp.experts.1.up_proj.weight_scale_inv"] = torch.ones(1, 1)
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    model_config = json.loads((bad / "config.json").read_text())
    geometry = Geometry(4, model_config["num_experts"], 4, 512, 192, 160, layer_ids=(0, 1, 2, 3))
    with pytest.raises(OffloadError, match=r"inverse scales of shape \(1, 1\), expected \(2, 2\)"):
        ExpertStore.from_checkpoint(bad, geometry)


def test_the_shipped_image_text_layout_in_fp8(tmp_path):
    """Qwen3.5-MoE's shipped layout (model_type qwen3_5_moe, tensors under model.language_model.) converted to FP8:
    load_model gives its text model dequantised, and the engine read from the directory (FP8 store) equals it."""
    from _architecture_checks import image_text_qwen

    model, adapter = load_model("qwen3.5-moe-tiny", seed=0)
    full = image_text_qwen(model)
    src, dst = tmp_path / "bf16", tmp_path / "fp8"
    full.save_pretrained(src)
    assert quantize_experts_fp8(src, dst) == adapter.num_moe_layers * adapter.num_experts * 3
    loaded, loaded_adapter = load_model(str(dst))
    assert loaded_adapter.checkpoint_prefix == "model.language_model." and fp8_quantized(loaded.config)
    reader = CheckpointReader(dst)
    assert torch.equal(loaded.model.layers[1].mlp.experts.down_proj[4],
                       reader.get("model.language_model.layers.1.mlp.experts.4.down_proj.weight"))
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)
    calibration = Calibration.uniform(adapter.num_moe_layers, adapter.num_experts, adapter.vocab_size)
    read = build_engine_from_checkpoint(dst, preset("exact_lru", adapter.num_experts, adapter.top_k), calibration,
                                        EngineConfig(max_seq_len=SEQ), dtype=torch.float32)
    assert read.residency.store.fp8
    tokens = np.random.default_rng(3).integers(0, adapter.vocab_size, 16)
    with torch.no_grad():
        ref = loaded(torch.as_tensor(tokens)[None]).logits[0].float().numpy()
    logits = read.teacher_forced(tokens, prompt_len=6, return_logits=True).logits
    assert np.abs(logits - ref).max() <= 1e-4 * np.abs(ref).max()
