"""Writing FP8 copies of checkpoints: researchers make FP8 variants of bf16 checkpoints with it, the tests make
tiny FP8 checkpoints in the shipped layout (`checkpoint` has the format and the reading)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from specmoe.kernels.fp8 import quantize_fp8

from .adapter import ModelSourceError
from .checkpoint import FP8_QUANTIZATION, CheckpointReader, scale_key
from .registry import _checkpoint_config, adapter_for


def _expert_pattern(adapter) -> re.Pattern:
    """Matches the per-expert routed-expert weights of the adapter's checkpoint layout."""
    prefix = re.escape(adapter.checkpoint_experts()).replace(re.escape("{layer}"), r"\d+")
    return re.compile(rf"^{prefix}\.\d+\.(gate_proj|up_proj|down_proj)\.weight$")


def quantize_experts_fp8(source, destination) -> int:
    """Write an FP8 copy of checkpoint directory `source` to `destination`: the routed experts' weights
    (per-expert layout, as save_pretrained writes it) in float8 e4m3 with 128 x 128 block `weight_scale_inv`
    (`specmoe.kernels.fp8.quantize_fp8`), every other tensor and file as it was, config.json with FP8's
    quantization_config; one shard at a time. Returns the number of tensors quantised."""
    from safetensors.torch import save_file

    source, destination = Path(source), Path(destination)
    config = _checkpoint_config(source)
    pattern = _expert_pattern(adapter_for(config))
    reader = CheckpointReader(source)
    if any(k.endswith(("gate_up_proj", "experts.down_proj")) for k in reader.keys()):
        raise ModelSourceError(f"{source} holds fused expert tensors; quantize_experts_fp8 reads the per-expert "
                               "layout that save_pretrained writes")
    destination.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():  # config, tokenizer, generation config: as they are
        if item.is_file() and item.suffix != ".safetensors" and item.name != "model.safetensors.index.json":
            shutil.copy2(item, destination / item.name)
    shards: dict[str, list[str]] = {}
    for key, shard in reader.weight_map.items():
        shards.setdefault(shard, []).append(key)
    weight_map, count = {}, 0
    for shard, keys in sorted(shards.items()):
        tensors = {}
        for key in keys:
            tensor = reader._raw(key)
            if pattern.match(key) and not reader.is_fp8(key):
                tensors[key], tensors[scale_key(key)] = quantize_fp8(tensor)
                weight_map[scale_key(key)] = shard
                count += 1
            else:
                tensors[key] = tensor
            weight_map[key] = shard
        save_file(tensors, str(destination / shard), metadata={"format": "pt"})
    if (source / "model.safetensors.index.json").is_file():
        (destination / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    cfg = json.loads((source / "config.json").read_text())
    cfg["quantization_config"] = dict(FP8_QUANTIZATION)
    (destination / "config.json").write_text(json.dumps(cfg, indent=2))
    return count
