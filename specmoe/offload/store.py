"""The expert store: every expert of every MoE layer in (pinned) host memory, one contiguous row each.

Row layout of expert (l, e), W = 3 I H elements in the engine's dtype:
    [gate_proj (I x H) | up_proj (I x H) | down_proj (H x I)]
i.e. transformers' fused gate_up_proj[e] ([2I, H], gate rows first) followed by down_proj[e] ([H, I]), so
one host-to-device copy moves one whole expert into one slot. Each layer is its own [E, W] allocation,
filled and (optionally) released from the source one layer at a time: building the store from a model or
a checkpoint never holds two full copies of the expert weights.

FP8 stores (an FP8 checkpoint's experts, or a model whose config declares FP8 weights): the rows are uint8,
the same three matrices in float8 e4m3 followed by their 128 x 128 block inverse scales
(`specmoe.kernels.fp8.fp8_row_layout`; about half the bytes of bf16), so the slot buffers and every copy
move FP8 bytes plus scales, one copy per expert as before, and the slot MoE kernels dequantise on the fly to
the decoder's dtype.
"""

from __future__ import annotations

import torch

from specmoe.geometry import Geometry
from specmoe.kernels.fp8 import fp8_row_layout, is_fp8_rows, pack_fp8_row, quantize_fp8
from specmoe.kernels.moe import expert_weights
from specmoe.models.checkpoint import CheckpointReader, fp8_quantized

from .memory import GiB, OffloadError, check_fits, host_available_bytes


class ExpertStore:
    """All L x E experts as rows of per-layer [E, W] host tensors (pinned where CUDA is available); `fp8`:
    the rows are FP8 rows (uint8, W bytes), else W = 3 I H elements of the model dtype."""

    def __init__(self, layers: list[torch.Tensor], geometry: Geometry):
        self.layers = layers
        self.geometry = geometry
        self.dtype = layers[0].dtype
        self.fp8 = is_fp8_rows(layers[0])
        self.pinned = bool(layers[0].is_pinned()) if torch.cuda.is_available() else False

    @property
    def num_layers(self) -> int:
        return self.geometry.num_layers

    @property
    def num_experts(self) -> int:
        return self.geometry.num_experts

    @property
    def width(self) -> int:
        """Elements of one row: 3 I H, or the FP8 row's bytes."""
        return self.layers[0].shape[1]

    @property
    def expert_bytes(self) -> int:
        return self.width * self.layers[0].element_size()

    @property
    def nbytes(self) -> int:
        return self.expert_bytes * self.num_layers * self.num_experts

    def expert(self, layer: int, expert: int) -> torch.Tensor:
        return self.layers[layer][expert]

    def weights(self, layer: int, expert: int, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [2I, H], down [H, I]) of one expert: views of the row, or the FP8 row dequantised to
        `dtype` (default float32)."""
        g = self.geometry
        gate_up, down = expert_weights(self.layers[layer][expert: expert + 1], g.hidden, g.inter,
                                       dtype or torch.float32)
        return gate_up[0], down[0]

    def gate_up(self, layer: int, expert: int) -> torch.Tensor:
        return self.weights(layer, expert)[0]

    def down(self, layer: int, expert: int) -> torch.Tensor:
        return self.weights(layer, expert)[1]

    # -- construction --------------------------------------------------------------------------------
    @staticmethod
    def _row(geometry: Geometry, dtype: torch.dtype, fp8: bool) -> tuple[int, torch.dtype]:
        """(row width, row dtype) of a store: FP8 rows (bytes, uint8) or 3 I H elements of `dtype`."""
        if fp8:
            return fp8_row_layout(geometry.hidden, geometry.inter).width, torch.uint8
        return geometry.expert_width, dtype

    @staticmethod
    def _check_memory(geometry: Geometry, dtype: torch.dtype, pin: bool | None,
                      host_memory_limit: int | None, width: int | None = None) -> bool:
        """Fail clearly if the store does not fit in host memory; returns whether to pin it."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        width = geometry.expert_width if width is None else width
        needed = geometry.num_layers * geometry.num_experts * width * itemsize
        available = host_available_bytes() if host_memory_limit is None else int(host_memory_limit)
        check_fits(f"the expert store ({geometry.num_layers} layers x {geometry.num_experts} experts x "
                   f"{width * itemsize / 1e6:.1f} MB)", needed, available, "host memory",
                   "Free host memory or use a machine with more; the store must hold every expert.",
                   headroom=min(GiB, needed // 8 + 64 * 1024**2))
        return torch.cuda.is_available() if pin is None else bool(pin)

    @classmethod
    def from_model(cls, model, adapter=None, *, dtype: torch.dtype | None = None, pin: bool | None = None,
                   host_memory_limit: int | None = None, release: bool = False,
                   fp8: bool | None = None) -> "ExpertStore":
        """Copy a transformers model's experts (on any device) into the store, layer by layer.

        fp8: FP8 rows, each matrix quantised with `specmoe.kernels.fp8.quantize_fp8` (default: where the
        model's config declares FP8 weights, `fp8_quantized`: a model loaded from an FP8 checkpoint or an FP8
        named config; their experts come back exactly where they were quantised by that quantiser, e.g. by
        `quantize_experts_fp8`). release=True frees each layer's expert parameters on the model after copying
        it (the model can then no longer run its own MoE); otherwise the model is left as it was."""
        if adapter is None:
            from specmoe.models import adapter_for  # transformers is imported only where a model is given

            adapter = adapter_for(model.config)
        geometry = Geometry.of(adapter)
        fp8 = fp8_quantized(model.config) if fp8 is None else fp8
        width, dtype = cls._row(geometry, dtype or adapter.experts(model, 0)[0].dtype, fp8)
        pin = cls._check_memory(geometry, dtype, pin, host_memory_limit, width)
        g = geometry
        layers = []
        for layer in range(g.num_layers):
            gate_up, down = adapter.experts(model, layer)
            if tuple(gate_up.shape) != (g.num_experts, 2 * g.inter, g.hidden) or \
                    tuple(down.shape) != (g.num_experts, g.hidden, g.inter):
                raise OffloadError(f"MoE layer {layer} has expert weights {tuple(gate_up.shape)} / "
                                   f"{tuple(down.shape)}, expected [E, 2I, H] / [E, H, I] with E={g.num_experts}, "
                                   f"I={g.inter}, H={g.hidden}")
            buf = (torch.zeros if fp8 else torch.empty)((g.num_experts, width), dtype=dtype, pin_memory=pin)
            gu = 2 * g.inter * g.hidden
            with torch.no_grad():  # expert by expert: contiguous source and destination, one plain copy each
                for e in range(g.num_experts):
                    if fp8:
                        w = gate_up[e].detach().cpu()
                        pack_fp8_row(buf[e], g.hidden, g.inter, (quantize_fp8(w[:g.inter]), quantize_fp8(w[g.inter:]),
                                                                 quantize_fp8(down[e].detach().cpu())))
                        continue
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
        `{prefix}.down_proj` [E, H, I]). Per-expert FP8 weights (with `weight_scale_inv`, the shipped FP8
        layout) make an FP8 store (`dtype` is then the decoder's, not the rows'): their bytes and scales are
        copied as they are. A missing tensor is an OffloadError naming it."""
        reader = CheckpointReader(path, OffloadError)
        first = prefix.format(layer=geometry.layer_ids[0]) + ".0.gate_proj.weight"
        fp8 = first in reader and reader.is_fp8(first)
        width, row_dtype = cls._row(geometry, dtype, fp8)
        pin = cls._check_memory(geometry, row_dtype, pin, host_memory_limit, width)
        g = geometry
        gu = 2 * g.inter * g.hidden
        layers = []
        for layer, layer_id in enumerate(g.layer_ids):
            base = prefix.format(layer=layer_id)
            buf = (torch.zeros if fp8 else torch.empty)((g.num_experts, width), dtype=row_dtype, pin_memory=pin)
            if fp8:
                for e in range(g.num_experts):
                    pack_fp8_row(buf[e], g.hidden, g.inter, [
                        _read_fp8(reader, f"{base}.{e}.{name}.weight", shape, path, layer, e)
                        for name, shape in (("gate_proj", (g.inter, g.hidden)), ("up_proj", (g.inter, g.hidden)),
                                            ("down_proj", (g.hidden, g.inter)))])
            elif f"{base}.gate_up_proj" in reader or f"{base}.down_proj" in reader:
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


def _read_fp8(reader: CheckpointReader, key: str, shape: tuple, path, layer: int, expert: int):
    """(q, scale_inv) of one FP8 expert matrix; an OffloadError if it is missing, misshapen or not FP8."""
    if not reader.is_fp8(key):
        raise OffloadError(f"checkpoint {path}: expert {expert} of MoE layer {layer} is not FP8 like the first "
                           f"expert (no {key!r} with weight_scale_inv)")
    q, scale = reader.get_fp8(key)
    if tuple(q.shape) != shape:
        raise OffloadError(f"checkpoint {path}: {key!r} has shape {tuple(q.shape)}, expected {shape}")
    return q, scale


def _read(reader: CheckpointReader, key: str, shape: tuple, path, layer: int, expert: int | None = None):
    if key not in reader:
        which = f"expert {expert} of MoE layer {layer}" if expert is not None else f"the experts of MoE layer {layer}"
        raise OffloadError(f"checkpoint {path} is missing weights of {which}: no tensor {key!r}")
    tensor = reader.get(key)
    if tuple(tensor.shape) != shape:
        raise OffloadError(f"checkpoint {path}: {key!r} has shape {tuple(tensor.shape)}, expected {shape}")
    return tensor
