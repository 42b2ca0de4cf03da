"""Lazy reads of tensors from a local safetensors checkpoint (one file or a sharded index), one at a time,
so that building the expert store never holds a second copy of the model's weights (the store's and the
decoders' reader)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .adapter import ModelSourceError


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

    def get(self, key: str) -> torch.Tensor:
        if key not in self.weight_map:
            raise self.error(f"checkpoint {self.path} has no tensor {key!r}")
        return self._handles[self.weight_map[key]].get_tensor(key)
