"""Set-up helpers for engine tests and benchmarks: calibration from the engine's own exact decoding, and a
seeded random model drawn directly on the device."""

from __future__ import annotations

import numpy as np
import torch

from specmoe.routing import Calibration, CalibrationBuilder


def calibration_from_engine(engine, windows, provenance: dict | None = None) -> Calibration:
    """Calibrate from the router logits of exact routing: decode each window (teacher-forced) with the
    engine under its current policy, which must be exact with every expert resident (C = E)."""
    policy = engine.policy
    if policy.kind != "exact" or policy.capacity != engine.num_experts:
        raise ValueError("calibrate with exact routing and every expert resident (C = E)")
    g = engine.geometry
    builder = CalibrationBuilder(g.num_layers, g.num_experts, g.vocab_size, g.top_k)
    for window in windows:
        result = engine.teacher_forced(np.asarray(window))
        builder.add(result.router_logits.astype(np.float64), result.input_tokens)
    info = dict(provenance or {})
    if engine.fingerprint is not None:
        info.setdefault("fingerprint", engine.fingerprint)
    return builder.finish(info)


def random_model_on_device(name: str, seed: int, dtype: torch.dtype, device):
    """(model, adapter) of a named config of `specmoe.models` (any architecture) with seeded random weights drawn
    on `device` by one generator (the architecture's `build_random` with a generator: seconds for a full-size
    model on a GPU, where `load_model`'s per-parameter CPU draws take minutes). The weights are not
    `load_model(name)`'s bit for bit."""
    from specmoe.models import adapter_for, named_config
    from specmoe.models.registry import ARCHITECTURES

    config = named_config(name)
    build = ARCHITECTURES[config.model_type].build_random
    model = build(config, seed, dtype, device, torch.Generator(device=device).manual_seed(int(seed)))
    model.eval()
    model.set_experts_implementation("eager")
    return model, adapter_for(config)


def resident_model_on_device(name: str, seed: int, dtype: torch.dtype, device):
    """A named config with seeded random weights on `device` (`random_model_on_device`), its routed experts moved
    into an `ExpertStore` (the model's copies freed: `free_routed_experts`) and a residency unit holding every
    expert on the device: (model, adapter, store, unit), the all-resident target the profile scripts measure."""
    from specmoe.offload import ExpertResidency, ExpertStore

    model, adapter = random_model_on_device(name, seed, dtype, device)
    store = ExpertStore.from_model(model, adapter)
    free_routed_experts(model)
    return model, adapter, store, ExpertResidency(store, adapter.num_experts, device)


def free_routed_experts(model) -> int:
    """Release a transformers MoE model's routed expert weights once an `ExpertStore` holds them: the engines read
    experts from the store and their decoders every other weight from the model, so a full-size model and a slot
    buffer of all its experts then fit one GPU. The model can no longer run its own forward. Returns the bytes
    freed."""
    freed = 0
    for name, module in model.named_modules():
        if name.endswith(".experts"):
            for param in module.parameters(recurse=False):
                freed += param.numel() * param.element_size()
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)
    if freed and next(model.parameters()).is_cuda:
        torch.cuda.empty_cache()
    return freed


def weight_bytes_per_token(engine, position: int = 0, experts_per_layer: int | None = None) -> int:
    """Bytes a decode step at `position` must read with every executed expert resident: the decoder's weights
    and the KV cache its attention reads, plus K expert rows per layer (the memory-bandwidth floor's
    numerator)."""
    k = experts_per_layer or engine.top_k
    return engine.decoder.bytes_per_token(position) + engine.num_layers * k * engine.store.expert_bytes
