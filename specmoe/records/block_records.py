"""Block records: every verification block of a speculative decoding run, with the routing it saw.

The harness's speculative loop (`specmoe.harness.speculative_generate(..., record=True)`) keeps one record
per verification block; the CPU replay of block-level selection and the GPU engine's trace-following mode
read them, so a block can be re-selected with any selector and pool without the model.

File format (one safetensors file, version 1). N blocks of D = k + 1 positions over L MoE layers of E
experts, top-K:
- ``request`` int64 [N]: the request (prompt) of each block, 0, 1, ... in the order run;
- ``root_position`` int64 [N]: the position of the block's root in its request's sequence (the first
  block's root is the first new token, at position len(prompt));
- ``tokens`` int64 [N, D]: the block's input, the root token then the k drafts;
- ``confidences`` float32 [N, k]: the drafter's probability of each of its drafts;
- ``accepted`` int64 [N]: accepted drafts (the block commits tokens[1 : accepted + 1] and the bonus token);
- ``bonus`` int64 [N]: the target's greedy token after the accepted drafts, the next block's root token;
- ``router_logits`` float32 [N, D, L, E]: the router's raw logits z at every position and layer;
- ``pregate_logits`` float32 [N, D, L, E]: router l applied to layer l-1's MoE input (layer 0 is zero);
- ``selection_bias`` float64 [L, E], only for a router with a selection bias (sigmoid, DeepSeek-V3);
- ``selected`` int64 [N, D, L, K]: the experts each position executed in the run (for checks).
Metadata (strings): ``format`` = "specmoe-blocks", ``version`` = "1", ``geometry`` = JSON {num_layers,
num_experts, top_k, vocab_size, k}, ``model``, ``fingerprint`` (the router fingerprint), ``selector`` (JSON
of the `SelectorConfig`), ``drafter`` (its name), ``pool_size`` (P), ``groups`` (JSON [n_group, topk_group]
of the router's group-limited choice; files without it read as [1, 1]), ``scoring`` (JSON {"kind",
"renormalise", "scale", "groups"}: the router's rule, `specmoe.routing.RouterScoring`, with ``selection_bias``
its bias; files without it read as a softmax router with their ``groups``), ``info`` (JSON: versions, time, ...).
What selection ranks follows from the raw logits by the stored rule (`RouterScoring.selection_scores`), which
every replay applies, as a trace's (`specmoe.records.traces`)).
Router logits of one position sit where a routing trace (`specmoe.records.traces`) keeps them; a block of the
family (L = 16, E = 64) at k = 8 takes 74 KiB.
"""

from __future__ import annotations

import datetime
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..files import read_safetensors, write_safetensors
from ..routing import validate
from ..routing.scoring import RouterScoring
from .traces import read_scoring, scoring_from_metadata

FORMAT, VERSION = "specmoe-blocks", "1"
TENSORS = {"request": np.int64, "root_position": np.int64, "tokens": np.int64, "confidences": np.float32,
           "accepted": np.int64, "bonus": np.int64, "router_logits": np.float32, "pregate_logits": np.float32,
           "selected": np.int64}


class BlockRecordError(ValueError):
    """A block record file that is unreadable, of another format or version, or inconsistent."""


def check_roots(request: np.ndarray, root_position: np.ndarray, accepted: np.ndarray) -> None:
    """Raise BlockRecordError unless each request's blocks follow each other: request ids non-decreasing, the
    first root at a position >= 0 and each next root right after the last committed one (root + accepted + 1:
    the bonus token of a block is the next block's root)."""
    if np.any(np.diff(request) < 0):
        raise BlockRecordError("blocks of a request must be consecutive (request ids non-decreasing)")
    validate.check_range(root_position, 0, np.iinfo(np.int64).max, "root_position", BlockRecordError, "positions")
    same = request[1:] == request[:-1]
    expected = root_position[:-1] + accepted[:-1] + 1
    wrong = np.flatnonzero(same & (root_position[1:] != expected))
    if wrong.size:
        b = int(wrong[0]) + 1
        raise BlockRecordError(f"root_position of block {b} is {int(root_position[b])}; the block before it in "
                               f"request {int(request[b])} commits up to position {int(expected[b - 1]) - 1}, so its "
                               f"root must be {int(expected[b - 1])}")


@dataclass
class BlockRecords:
    """The verification blocks of a run (see the module docstring); `arrays` holds the tensors by name."""

    arrays: dict[str, np.ndarray]
    top_k: int
    vocab_size: int
    model: str = ""
    fingerprint: str = ""
    selector: dict = field(default_factory=dict)
    drafter: str = ""
    pool_size: int = 0
    info: dict = field(default_factory=dict)
    groups: tuple[int, int] = (1, 1)  # (n_group, topk_group) of the router's group-limited choice
    scoring: RouterScoring | None = None  # the router's rule (None: softmax with `groups`)

    def __post_init__(self) -> None:
        missing = set(TENSORS) - set(self.arrays)
        if missing:
            raise BlockRecordError(f"block records lack the tensors {sorted(missing)}")
        self.arrays = {name: np.ascontiguousarray(self.arrays[name], dtype=dtype) for name, dtype in TENSORS.items()}
        self.top_k = validate.integer(self.top_k, "top_k", BlockRecordError, minimum=1)
        self.vocab_size = validate.integer(self.vocab_size, "vocab_size", BlockRecordError, minimum=1)
        a = self.arrays
        z = a["router_logits"]
        if z.ndim != 4:
            raise BlockRecordError(f"router logits must be [N, D, L, E], got shape {z.shape}")
        n, d = z.shape[:2]
        expected = {"request": (n,), "root_position": (n,), "tokens": (n, d), "confidences": (n, d - 1),
                    "accepted": (n,), "bonus": (n,), "pregate_logits": z.shape, "selected": (*z.shape[:3], self.top_k)}
        wrong = [f"{name} {a[name].shape} (expected {shape})" for name, shape in expected.items() if a[name].shape != shape]
        if wrong:
            raise BlockRecordError("inconsistent block records: " + "; ".join(wrong))
        if not 1 <= self.top_k <= z.shape[3]:
            raise BlockRecordError(f"top_k {self.top_k} outside [1, E={z.shape[3]}]")
        if n and (a["accepted"].min() < 0 or a["accepted"].max() > d - 1):
            raise BlockRecordError(f"accepted lengths must lie in [0, k={d - 1}]")
        validate.check_real(z, "router logits", BlockRecordError)
        validate.check_real(a["pregate_logits"][:, :, 1:], "pre-gate logits of layers 1..L-1", BlockRecordError)
        validate.check_real(a["confidences"], "draft confidences", BlockRecordError, 0.0, 1.0)
        vocab = f"vocabulary of {self.vocab_size}"
        validate.check_range(a["tokens"], 0, self.vocab_size, "tokens", BlockRecordError, vocab)
        validate.check_range(a["bonus"], 0, self.vocab_size, "bonus tokens", BlockRecordError, vocab)
        validate.check_range(a["selected"], 0, z.shape[3], "selected experts", BlockRecordError, "expert ids")
        check_roots(a["request"], a["root_position"], a["accepted"])
        self.groups, self.scoring = read_scoring(self.scoring, self.groups, z.shape[2], z.shape[3], self.top_k,
                                                 BlockRecordError)

    @property
    def num_blocks(self) -> int:
        return self.arrays["router_logits"].shape[0]

    @property
    def geometry(self) -> dict:
        n, d, layers, experts = self.arrays["router_logits"].shape
        return {"num_layers": layers, "num_experts": experts, "top_k": self.top_k, "vocab_size": self.vocab_size,
                "k": d - 1}

    @classmethod
    def from_requests(cls, requests: list[list[dict]], **metadata) -> "BlockRecords":
        """Records of the blocks of requests 0, 1, ...: each a list of per-block dicts holding every tensor
        but ``request`` without the leading N axis (`SpeculativeResult.blocks`); `metadata` fills the other
        fields."""
        blocks = [dict(block, request=index) for index, request in enumerate(requests) for block in request]
        if not blocks:
            raise BlockRecordError("no verification block to record")
        arrays = {name: np.stack([np.asarray(b[name]) for b in blocks]) for name in TENSORS}
        info = {"created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        info.update(metadata.pop("info", {}))
        return cls(arrays, info=info, **metadata)

    def save(self, path: str | os.PathLike) -> Path:
        """Write atomically to `path` in the format of the module docstring."""
        meta = {"format": FORMAT, "version": VERSION, "geometry": json.dumps(self.geometry, sort_keys=True),
                "model": self.model, "fingerprint": self.fingerprint,
                "selector": json.dumps(self.selector, sort_keys=True), "drafter": self.drafter,
                "pool_size": str(self.pool_size), "groups": json.dumps(list(self.groups)),
                "info": json.dumps(self.info, sort_keys=True)}
        meta["scoring"], bias = self.scoring.to_metadata()
        tensors = dict(self.arrays) if bias is None else {**self.arrays, "selection_bias": bias}
        return write_safetensors(path, tensors, meta)

    @classmethod
    def load(cls, path: str | os.PathLike, num_layers: int | None = None, num_experts: int | None = None,
             top_k: int | None = None, fingerprint: str | None = None) -> "BlockRecords":
        """Read block records; with any of the other arguments, refuse (BlockRecordError) records of another
        geometry or, where both carry one, other routers."""
        meta, arrays = read_safetensors(path, BlockRecordError, "block record")
        if meta.get("format") != FORMAT:
            raise BlockRecordError(f"{path} is not a specmoe block record file (format {meta.get('format')!r})")
        if meta.get("version") != VERSION:
            raise BlockRecordError(f"{path} has block record version {meta.get('version')}, this code reads {VERSION}")
        try:
            geometry = json.loads(meta["geometry"])
            if not isinstance(geometry, dict):
                raise BlockRecordError(f"geometry metadata must be a JSON object, got {meta['geometry']!r}")
            geometry = {key: int(value) for key, value in geometry.items()}
            records = cls(arrays, top_k=geometry["top_k"], vocab_size=geometry["vocab_size"], model=meta.get("model", ""),
                          fingerprint=meta.get("fingerprint", ""), selector=json.loads(meta.get("selector", "{}")),
                          drafter=meta.get("drafter", ""), pool_size=int(meta.get("pool_size", 0)),
                          info=json.loads(meta.get("info", "{}")), groups=json.loads(meta.get("groups", "[1, 1]")),
                          scoring=scoring_from_metadata(meta, arrays, BlockRecordError))
        except (KeyError, ValueError, TypeError) as exc:  # BlockRecordError from the checks is a ValueError
            raise BlockRecordError(f"{path}: invalid block records ({type(exc).__name__}: {exc})") from exc
        if geometry != records.geometry:
            raise BlockRecordError(f"{path}: metadata geometry {geometry} disagrees with the tensors {records.geometry}")
        expected = {"num_layers": num_layers, "num_experts": num_experts, "top_k": top_k}
        wrong = [f"{name} {geometry[name]} (expected {want})" for name, want in expected.items()
                 if want is not None and geometry[name] != want]
        if fingerprint and records.fingerprint and fingerprint != records.fingerprint:
            wrong.append(f"router fingerprint {records.fingerprint[:12]} (expected {fingerprint[:12]})")
        if wrong:
            raise BlockRecordError(f"{path} does not fit: " + "; ".join(wrong))
        return records
