"""The expert store: every expert of every MoE layer in (pinned) host memory, one contiguous row each.

Row layout of expert (l, e), W = 3 I H elements in the engine's dtype:
    [gate_proj (I x H) | up_proj (I x H) | down_proj (H x I)]
i.e. transformers' fused gate_up_proj[e] ([2I, H], gate rows first) followed by down_proj[e] ([H, I]), so
one host-to-device copy moves one whole expert into one slot. Each layer is its own [E, W] allocation,
filled and (optionally) released from the source one layer at a time: building the store from a model or
a checkpoint never holds two full copies of the expert weights.
"""

from __future__ import annotations

import torch

from specmoe.geometry import Geometry
from specmoe.models.checkpoint import CheckpointReader

from .memory import GiB, OffloadError, check_fits, host_available_bytes


class ExpertStore:
    """All L x E experts as rows of per-layer [E, W] host tensors (pinned where CUDA is available)."""

    def __init__(self, layers: list[torch.Tensor], geometry: Geometry):
        self.layers = layers
        self.geometry = geometry
        self.dtype = layers[0].dtype
        self.pinned = bool(layers[0].is_pinned()) if torch.cuda.is_available() else False

    @property
    def num_layers(self) -> int:
        return self.geometry.num_layers

    @property
    def num_experts(self) -> int:
        return self.geometry.num_experts

    @property
    def width(self) -> int:
        return self.geometry.expert_width

    @property
    def expert_bytes(self) -> int:
        return self.width * self.layers[0].element_size()

    @property
    def nbytes(self) -> int:
        return self.expert_bytes * self.num_layers * self.num_experts

    def expert(self, layer: int, expert: int) -> torch.Tensor:
        return self.layers[layer][expert]

    def gate_up(self, layer: int, expert: int) -> torch.Tensor:
        g = self.geometry
        return self.layers[layer][expert, : 2 * g.inter * g.hidden].view(2 * g.inter, g.hidden)

    def down(self, layer: int, expert: int) -> torch.Tensor:
        g = self.geometry
        return self.layers[layer][expert, 2 * g.inter * g.hidden:].view(g.hidden, g.inter)

    # -- construction --------------------------------------------------------------------------------
    @staticmethod
    def _check_memory(geometry: Geometry, dtype: torch.dtype, pin: bool | None,
                      host_memory_limit: int | None) -> bool:
        """Fail clearly if the store does not fit in host memory; returns whether to pin it."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        needed = geometry.num_layers * geometry.num_experts * geometry.expert_width * itemsize
        available = host_available_bytes() if host_memory_limit is None else int(host_memory_limit)
        check_fits(f"the expert store ({geometry.num_layers} layers x {geometry.num_experts} experts x "
                   f"{geometry.expert_width * itemsize / 1e6:.1f} MB)", needed, available, "host memory",
                   "Free host memory or use a machine with more; the store must hold every expert.",
                   headroom=min(GiB, needed // 8 + 64 * 1024**2))
        return torch.cuda.is_available() if pin is None else bool(pin)

    @classmethod
    def from_model(cls, model, adapter=None, *, dtype: torch.dtype | None = None, pin: bool | None = None,
                   host_memory_limit: int | None = None, release: bool = False) -> "ExpertStore":
        """Copy a transformers model's experts (on any device) into the store, layer by layer.

        release=True frees each layer's expert parameters on the model after copying it (the model can then
        no longer run its own MoE); otherwise the model is left as it was."""
        if adapter is None:
            from specmoe.models import adapter_for  # transformers is imported only where a model is given

            adapter = adapter_for(model.config)
        geometry = Geometry.of(adapter)
        dtype = dtype or adapter.experts(model, 0)[0].dtype
        pin = cls._check_memory(geometry, dtype, pin, host_memory_limit)
        g = geometry
        layers = []
        for layer in range(g.num_layers):
            gate_up, down = adapter.experts(model, layer)
            if tuple(gate_up.shape) != (g.num_experts, 2 * g.inter, g.hidden) or \
                    tuple(down.shape) != (g.num_experts, g.hidden, g.inter):
                raise OffloadError(f"MoE layer {layer} has expert weights {tuple(gate_up.shape)} / "
                                   f"{tuple(down.shape)}, expected [E, 2I, H] / [E, H, I] with E={g.num_experts}, "
                                   f"I={g.inter}, H={g.hidden}")
            buf = torch.empty((g.num_experts, g.expert_width), dtype=dtype, pin_memory=pin)
            gu = 2 * g.inter * g.hidden
            with torch.no_grad():  # expert by expert: contiguous source and destination, one plain copy each
                for e in range(g.num_experts):
                    buf[e, :gu].copy_(gate_up[e].detach().reshape(-1))
                    buf[e, gu:].copy_(down[e].detach().reshape(-1))
            layers.append(buf)
            if release:
                experts = adapter.moe_blocks(model)[layer].experts
                experts.gate_up_proj = torch.nn.Parameter(torch.empty(0, dtype=gate_up.dtype), requires_grad=False)
                experts.down_proj = torch.nn.Parameter(torch.empty(0, dtype=down.dtype), requires_grad=False)
        return cls(layers, geometry)

    @classmethod
    def from_checkpoint(cls, path, geometry: Geometry, *, dtype: torch.dtype = torch.bfloat16,
                        pin: bool | None = None, host_memory_limit: int | None = None,
                        prefix: str = "model.layers.{layer}.mlp.experts") -> "ExpertStore":
        """Read the experts of a local safetensors checkpoint one tensor at a time.

        Accepts transformers' per-expert layout (`{prefix}.{e}.gate_proj.weight`, `up_proj`, `down_proj`, as
        save_pretrained writes it) and the fused layout (`{prefix}.gate_up_proj` [E, 2I, H],
        `{prefix}.down_proj` [E, H, I]). A missing tensor is an OffloadError naming it."""
        reader = CheckpointReader(path, OffloadError)
        pin = cls._check_memory(geometry, dtype, pin, host_memory_limit)
        g = geometry
        gu = 2 * g.inter * g.hidden
        layers = []
        for layer, layer_id in enumerate(g.layer_ids):
            base = prefix.format(layer=layer_id)
            buf = torch.empty((g.num_experts, g.expert_width), dtype=dtype, pin_memory=pin)
            if f"{base}.gate_up_proj" in reader or f"{base}.down_proj" in reader:
                gate_up = _read(reader, f"{base}.gate_up_proj", (g.num_experts, 2 * g.inter, g.hidden), path, layer)
                buf[:, :gu].copy_(gate_up.reshape(g.num_experts, -1))
                del gate_up
                down = _read(reader, f"{base}.down_proj", (g.num_experts, g.hidden, g.inter), path, layer)
                buf[:, gu:].copy_(down.reshape(g.num_experts, -1))
                del down
            else:
                half = g.inter * g.hidden
                for e in range(g.num_experts):
                    row = buf[e]
                    row[:half].copy_(_read(reader, f"{base}.{e}.gate_proj.weight", (g.inter, g.hidden), path,
                                           layer, e).reshape(-1))
                    row[half:gu].copy_(_read(reader, f"{base}.{e}.up_proj.weight", (g.inter, g.hidden), path,
                                             layer, e).reshape(-1))
                    row[gu:].copy_(_read(reader, f"{base}.{e}.down_proj.weight", (g.hidden, g.inter), path,
                                         layer, e).reshape(-1))
            layers.append(buf)
        return cls(layers, geometry)


def _read(reader: CheckpointReader, key: str, shape: tuple, path, layer: int, expert: int | None = None):
    if key not in reader:
        which = f"expert {expert} of MoE layer {layer}" if expert is not None else f"the experts of MoE layer {layer}"
        raise OffloadError(f"checkpoint {path} is missing weights of {which}: no tensor {key!r}")
    tensor = reader.get(key)
    if tuple(tensor.shape) != shape:
        raise OffloadError(f"checkpoint {path}: {key!r} has shape {tuple(tensor.shape)}, expected {shape}")
    return tensor
