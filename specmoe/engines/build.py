"""Building an `Engine`: from a transformers model (`build_engine`) or straight from a local checkpoint directory
(`build_engine_from_checkpoint`), with the slot count its routers need."""

from __future__ import annotations

import torch

from specmoe.offload import ExpertResidency, ExpertStore
from specmoe.routing import Calibration, PolicyConfig
from specmoe.speculation import SpeculativeConfig

from .config import EngineConfig, RunSettings
from .engine import Engine


def build_engine(model, policy: PolicyConfig | None, calibration: Calibration, config: EngineConfig = EngineConfig(),
                 settings: RunSettings = RunSettings(), *, speculative: SpeculativeConfig | None = None,
                 residency: ExpertResidency | None = None, store: ExpertStore | None = None,
                 host_memory_limit: int | None = None, device_memory_limit: int | None = None) -> Engine:
    """An Engine for a transformers MoE model: the decoder's weights taken from the model (on its device and
    dtype). Experts: the given `residency` unit (share one between engines), else a new unit of max(C, P + U)
    slots over `store`, else over a new pinned ExpertStore copied from the model."""
    from specmoe.models import adapter_for, decoder_for

    decoder = decoder_for(model.config).from_model(model, config.max_seq_len)
    if speculative is not None:
        speculative.check(decoder.geometry)  # the config's errors before any allocation
    if residency is None:
        store = store or ExpertStore.from_model(model, host_memory_limit=host_memory_limit)
        residency = ExpertResidency(store, _slots_needed(policy, speculative, store.num_experts),
                                    next(model.parameters()).device, memory_limit=device_memory_limit)
    fingerprint = adapter_for(model.config).fingerprint(model)
    return Engine(decoder, residency, policy, calibration, config, settings, fingerprint, speculative)


def _slots_needed(policy: PolicyConfig | None, speculative: SpeculativeConfig | None, num_experts: int) -> int:
    """Slots per layer for the routers of `policy` (C) and `speculative` (P + U); checks C <= E first."""
    need = 0
    if policy is not None:
        policy.check_experts(num_experts)  # C > E: the policy's error before any allocation
        need = policy.capacity
    if speculative is not None:
        need = max(need, speculative.pool_size + speculative.union(num_experts))
    return need


def build_engine_from_checkpoint(path, policy: PolicyConfig | None, calibration: Calibration,
                                 config: EngineConfig = EngineConfig(), settings: RunSettings = RunSettings(), *,
                                 speculative: SpeculativeConfig | None = None, device="cpu",
                                 dtype: torch.dtype = torch.bfloat16, host_memory_limit: int | None = None,
                                 device_memory_limit: int | None = None) -> Engine:
    """An Engine read from a local checkpoint directory without instantiating the transformers model: the
    experts go straight into the pinned store, the other weights to the device."""
    from transformers import AutoConfig

    from specmoe.geometry import Geometry
    from specmoe.models import CheckpointReader, adapter_for, decoder_for

    hf_config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    adapter = adapter_for(hf_config)
    geometry = Geometry.of(adapter)
    slots = _slots_needed(policy, speculative, geometry.num_experts)
    store = ExpertStore.from_checkpoint(path, geometry, dtype=dtype, host_memory_limit=host_memory_limit,
                                        prefix=adapter.checkpoint_experts())
    residency = ExpertResidency(store, slots, device, memory_limit=device_memory_limit)
    decoder = decoder_for(hf_config).from_checkpoint(path, config.max_seq_len, device, dtype)
    fingerprint = adapter.checkpoint_fingerprint(CheckpointReader(path))
    return Engine(decoder, residency, policy, calibration, config, settings, fingerprint, speculative)
