"""Lazy reads of tensors from a local safetensors checkpoint (one file or a sharded index), one at a time,
so that building the expert store never holds a second copy of the model's weights (the store's and the
decoders' reader), and block-wise FP8 checkpoints.

FP8 checkpoints (DeepSeek-V3's and Qwen's FP8 releases): a weight `name.weight` stored as float8 e4m3 has its
block inverse scales in `name.weight_scale_inv` (`specmoe.kernels.fp8` has the format), and config.json a
`quantization_config` with quant_method "fp8" and weight_block_size [128, 128]. `CheckpointReader.get`
returns such a weight dequantised (float32), so the decoders and `load_model` read FP8 checkpoints as they
read bf16 ones; the expert store reads the FP8 bytes and scales themselves (`get_fp8`). `round_experts_to_fp8`
makes a model's experts exactly FP8-representable (the named FP8 configs); `fp8_checkpoint.quantize_experts_fp8`
writes an FP8 copy of a checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specmoe.kernels.fp8 import FP8_BLOCK, FP8_DTYPE, check_scale_grid, dequantize_fp8, quantize_fp8

from .adapter import ModelSourceError

# config.json's quantization_config of an FP8 checkpoint written here (transformers' FineGrainedFP8Config names)
FP8_QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}


def fp8_quantized(config) -> bool:
    """Whether a transformers config (or its text part) declares block-wise FP8 weights (quantization_config
    with quant_method "fp8"); ModelSourceError for a block size other than 128 x 128, the only one the expert
    rows hold."""
    q = getattr(config, "quantization_config", None)
    if q is None and hasattr(config, "get_text_config"):
        q = getattr(config.get_text_config(), "quantization_config", None)
    if q is None:
        return False
    q = q if isinstance(q, dict) else q.to_dict()
    if q.get("quant_method") != "fp8":
        return False
    block = q.get("weight_block_size")
    if block is not None and [int(b) for b in block] != [FP8_BLOCK, FP8_BLOCK]:
        raise ModelSourceError(f"FP8 weights in blocks of {list(block)}: specmoe reads blocks of "
                               f"[{FP8_BLOCK}, {FP8_BLOCK}] only")
    return True


def scale_key(key: str) -> str:
    """The name of the inverse scales of FP8 tensor `key` (`x.weight` -> `x.weight_scale_inv`)."""
    return key[: -len(".weight")] + ".weight_scale_inv" if key.endswith(".weight") else key + "_scale_inv"


class CheckpointReader:
    """Tensor names -> shard files of a checkpoint directory; `get` reads one tensor. A missing directory,
    shard or tensor raises `error` (the caller's error type, e.g. the expert store's OffloadError)."""

    def __init__(self, path, error: type[Exception] = ModelSourceError):
        from safetensors import safe_open

        self.path = Path(path)
        self.error = error
        if not self.path.is_dir():
            raise error(f"{self.path} is not a checkpoint directory")
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as exc:
                raise error(f"{index} is not a safetensors index with a weight_map ({exc})") from exc
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
            if not files:
                raise error(f"checkpoint directory {self.path} has no *.safetensors weights")
            weight_map = {}
        self._handles = {}
        for name in files:
            try:
                self._handles[name] = safe_open(str(self.path / name), framework="pt")
            except Exception as exc:  # missing shard, truncated or corrupt file: safetensors' own error types
                raise error(f"cannot read the weights file {self.path / name}: {exc}") from exc
        if not weight_map:
            for name, handle in self._handles.items():
                for key in handle.keys():
                    weight_map[key] = name
        self.weight_map = weight_map

    def __contains__(self, key: str) -> bool:
        return key in self.weight_map

    def keys(self) -> list[str]:
        """The weights' names, without the FP8 inverse scales."""
        return [k for k in self.weight_map if not k.endswith("_scale_inv")]

    def is_fp8(self, key: str) -> bool:
        """Whether tensor `key` is stored in FP8 with block inverse scales."""
        return scale_key(key) in self.weight_map

    def _raw(self, key: str) -> torch.Tensor:
        if key not in self.weight_map:
            raise self.error(f"checkpoint {self.path} has no tensor {key!r}")
        return self._handles[self.weight_map[key]].get_tensor(key)

    def get(self, key: str) -> torch.Tensor:
        """Tensor `key`; an FP8 one dequantised to float32."""
        if self.is_fp8(key):
            return dequantize_fp8(*self.get_fp8(key))
        return self._raw(key)

    def get_fp8(self, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(q float8 e4m3, scale_inv float32) of FP8 tensor `key`, checked against the 128 x 128 block grid."""
        q, scale = self._raw(key), self._raw(scale_key(key))
        if q.dtype != FP8_DTYPE:
            raise self.error(f"checkpoint {self.path}: {key!r} has inverse scales but dtype {q.dtype}, not "
                             "float8_e4m3fn")
        problem = check_scale_grid(tuple(q.shape), tuple(scale.shape))
        if problem:
            raise self.error(f"checkpoint {self.path}: {key!r} has {problem}")
        return q, scale.float()


def dequantized_state_dict(path, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Every weight of a checkpoint directory, FP8 ones dequantised to `dtype` (`load_model`'s FP8 path; it
    holds the whole state dict in host memory, e.g. about 70 GB in bf16 for Qwen3.6-35B-A3B)."""
    reader = CheckpointReader(path)
    return {key: dequantize_fp8(*reader.get_fp8(key), dtype) if reader.is_fp8(key) else reader.get(key)
            for key in reader.keys()}


def round_experts_to_fp8(model, adapter) -> None:
    """Replace the routed experts' weights of a model in place by their FP8 values dequantised (quantise with
    `quantize_fp8`, dequantise to the weights' dtype): the named FP8 configs' random weights. The FP8 expert
    store made from the model (`ExpertStore.from_model`) then holds exactly these weights."""
    with torch.no_grad():
        for layer in range(adapter.num_moe_layers):
            gate_up, down = adapter.experts(model, layer)
            inter = gate_up.shape[1] // 2
            for w in (gate_up[:, :inter], gate_up[:, inter:], down):
                w.copy_(dequantize_fp8(*quantize_fp8(w), w.dtype))
