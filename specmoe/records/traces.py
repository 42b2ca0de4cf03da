"""Routing traces: router and pre-gate logits per token, recorded from a model under exact routing.

A trace lets the AR engine follow realistic routing with random-weight full-size models, and lets
`specmoe.routing.replay` run any policy over recorded logits without a model.

File format (one safetensors file, version 1):
- tensors: ``router_logits`` float32 [T, L, E], z[t, l] of the model's own router; ``pregate_logits``
  float32 [T, L, E], g[t, l] = router of layer l applied to the MoE input of layer l-1; row 0 (no layer
  before it) holds router 0 applied to the MoE input of layer L-1, which routing ignores but a tiled trace
  uses (`Trace.tiled`; NaN in traces recorded before it was kept); ``token_ids`` int64 [T], the input token at each position; ``sequence_starts`` int64 [S],
  the position where each recorded sequence begins (first 0, strictly increasing).
- metadata (strings): ``format`` = "specmoe-trace", ``version`` = "1", ``geometry`` = JSON
  {"num_layers": L, "num_experts": E, "top_k": K, "vocab_size": V}, ``model`` (the source it was recorded
  from), ``fingerprint`` (`specmoe.routing.router_fingerprint` of the routers), ``groups`` (JSON [n_group,
  topk_group], the router's group-limited choice, `specmoe.routing.RouterScoring.groups`; files without it
  read as [1, 1], none), ``scoring`` (JSON {"kind", "renormalise", "scale", "groups"}: the router's rule,
  `specmoe.routing.RouterScoring`), ``info`` (JSON: dtype, device, transformers version, creation time, ...);
  with a selection bias (sigmoid routers, DeepSeek-V3) also the tensor ``selection_bias`` float64 [L, E].
The logits are always the router's raw logits z; what routing ranks follows from them by the stored rule
(`RouterScoring.selection_scores`: z itself for softmax routers, sigmoid(z) + bias for sigmoid ones), which
every consumer applies (`specmoe.routing.replay(..., scoring=trace.scoring)`, `LogitFeed.of_trace`). A file
without ``scoring`` (written before traces carried the rule) reads as a softmax router with its ``groups``.
Positions are concatenated over sequences; a policy's cache is reset at every sequence start. A trace is
recorded by `specmoe.harness.record_trace` (the command: `specmoe trace`, `specmoe.experiments.trace`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..files import read_safetensors, write_safetensors
from ..geometry import tiled_layers
from ..routing import validate
from ..routing.replay import valid_sequence_starts
from ..routing.scoring import RouterScoring, check_groups

FORMAT, VERSION = "specmoe-trace", "1"


class TraceError(ValueError):
    """A trace that does not fit the model or geometry it is used with, or an unreadable trace file."""


@dataclass
class Trace:
    """Recorded routing of exact decoding over one or more sequences (see the module docstring). Checked when
    made or loaded: finite logits (pre-gate row 0 excepted), token ids within the vocabulary, integer
    sequence starts, so that replay never meets a value the routing kernels cannot index with."""

    router_logits: np.ndarray
    pregate_logits: np.ndarray
    token_ids: np.ndarray
    sequence_starts: np.ndarray
    top_k: int
    vocab_size: int
    model: str = ""
    fingerprint: str = ""
    info: dict = field(default_factory=dict)
    groups: tuple[int, int] = (1, 1)  # (n_group, topk_group) of the router's group-limited choice
    scoring: RouterScoring | None = None  # the router's rule (None: softmax with `groups`)

    def __post_init__(self) -> None:
        self.top_k = validate.integer(self.top_k, "top_k", TraceError, minimum=1)
        self.vocab_size = validate.integer(self.vocab_size, "vocab_size", TraceError, minimum=1)
        if not isinstance(self.info, dict):
            raise TraceError(f"trace info must be a dict (a JSON object), got {type(self.info).__name__}")
        z = validate.real_array(self.router_logits, "router logits [T, L, E]", TraceError, 3, np.float32)
        g = validate.real_array(self.pregate_logits, "pre-gate logits [T, L, E]", TraceError, 3, np.float32)
        if g.shape != z.shape:
            raise TraceError(f"pre-gate logits {g.shape} differ from router logits {z.shape}")
        validate.check_real(z, "router logits", TraceError)
        validate.check_real(g[:, 1:], "pre-gate logits of layers 1..L-1", TraceError)  # row 0 is ignored
        self.router_logits, self.pregate_logits = z, g
        self.token_ids = validate.token_ids(self.token_ids, z.shape[0], self.vocab_size, "token ids", TraceError)
        self.sequence_starts = np.ascontiguousarray(
            validate.integer_array(self.sequence_starts, "sequence_starts", TraceError, 1))
        if not valid_sequence_starts(self.sequence_starts, z.shape[0]):
            raise TraceError("sequence_starts must begin at 0 and increase strictly within [0, T)")
        if not self.top_k <= z.shape[2]:
            raise TraceError(f"top_k {self.top_k} outside [1, E={z.shape[2]}]")
        self.groups, self.scoring = read_scoring(self.scoring, self.groups, z.shape[1], z.shape[2], self.top_k,
                                                 TraceError)

    @property
    def num_tokens(self) -> int:
        return self.router_logits.shape[0]

    @property
    def num_layers(self) -> int:
        return self.router_logits.shape[1]

    @property
    def num_experts(self) -> int:
        return self.router_logits.shape[2]

    @property
    def geometry(self) -> dict:
        return {"num_layers": self.num_layers, "num_experts": self.num_experts, "top_k": self.top_k,
                "vocab_size": self.vocab_size}

    def sequences(self):
        """(start, end) of each recorded sequence."""
        bounds = list(self.sequence_starts) + [self.num_tokens]
        return list(zip(bounds[:-1], bounds[1:]))

    def check(self, num_layers: int | None = None, num_experts: int | None = None, top_k: int | None = None,
              vocab_size: int | None = None, fingerprint: str | None = None) -> None:
        """Raise TraceError unless the trace has this geometry (and routers, where both carry a fingerprint)."""
        expected = {"num_layers": num_layers, "num_experts": num_experts, "top_k": top_k, "vocab_size": vocab_size}
        problems = [f"{name} {self.geometry[name]} (expected {want})" for name, want in expected.items()
                    if want is not None and self.geometry[name] != want]
        if fingerprint and self.fingerprint and fingerprint != self.fingerprint:
            problems.append(f"router fingerprint {self.fingerprint[:12]} (expected {fingerprint[:12]})")
        if problems:
            raise TraceError(f"trace recorded from {self.model or 'an unnamed model'} does not fit: "
                             + "; ".join(problems) + ". Record a trace of this model with `specmoe trace`.")

    def tiled(self, num_layers: int) -> "Trace":
        """This trace for a deeper model of the same E and K: layer l follows recorded layer l mod L
        (`specmoe.geometry.tiled_layers`), with the pre-gate of each repeat's first layer from row 0 (router 0 on
        the last layer's MoE input: the prediction a layer stack repeated this way would make). The router's
        per-layer bias is tiled too; `info["tiled_from_layers"]` records the original depth."""
        if num_layers == self.num_layers:
            return self
        source = tiled_layers(num_layers, self.num_layers)
        wrap = self.pregate_logits[:, 0]
        if not (np.isfinite(wrap).all() and np.any(wrap != 0)):
            raise TraceError(f"the trace of {self.model or 'an unnamed model'} has no pre-gate logits for its first "
                             "layer from its last (recorded before traces kept them), so it cannot be tiled over "
                             f"{num_layers} layers: record it again with `specmoe trace`")
        return Trace(self.router_logits[:, source], self.pregate_logits[:, source], self.token_ids,
                     self.sequence_starts, self.top_k, self.vocab_size, self.model, self.fingerprint,
                     {**self.info, "tiled_from_layers": self.num_layers}, self.groups, self.scoring.tiled(num_layers))

    # -- files ------------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> Path:
        """Write atomically to `path` in the format of the module docstring."""
        tensors = {"router_logits": self.router_logits, "pregate_logits": self.pregate_logits,
                   "token_ids": self.token_ids, "sequence_starts": self.sequence_starts}
        meta = {"format": FORMAT, "version": VERSION, "geometry": json.dumps(self.geometry, sort_keys=True),
                "model": self.model, "fingerprint": self.fingerprint, "groups": json.dumps(list(self.groups)),
                "info": json.dumps(self.info, sort_keys=True)}
        meta["scoring"], bias = self.scoring.to_metadata()
        if bias is not None:
            tensors["selection_bias"] = bias
        return write_safetensors(path, tensors, meta)

    @classmethod
    def load(cls, path: str | os.PathLike, num_layers: int | None = None, num_experts: int | None = None,
             top_k: int | None = None, vocab_size: int | None = None, fingerprint: str | None = None) -> "Trace":
        """Read a trace; with any of the geometry arguments, refuse (TraceError) one of another geometry."""
        meta, arrays = read_safetensors(path, TraceError, "trace")
        if meta.get("format") != FORMAT:
            raise TraceError(f"{path} is not a specmoe trace (format {meta.get('format')!r})")
        if meta.get("version") != VERSION:
            raise TraceError(f"{path} has trace format version {meta.get('version')}, this code reads {VERSION}")
        missing = {"router_logits", "pregate_logits", "token_ids", "sequence_starts"} - set(arrays)
        if missing:
            raise TraceError(f"{path} lacks the tensors {sorted(missing)}")
        try:
            geometry = json.loads(meta["geometry"])
            geometry = {key: int(geometry[key]) for key in ("num_layers", "num_experts", "top_k", "vocab_size")}
        except (KeyError, ValueError, TypeError) as exc:
            raise TraceError(f"{path} has no valid geometry metadata ({type(exc).__name__}: {exc})") from exc
        try:
            info = json.loads(meta.get("info", "{}"))
        except json.JSONDecodeError as exc:
            raise TraceError(f"{path}: the info metadata is not valid JSON ({exc})") from None
        try:
            trace = cls(arrays["router_logits"], arrays["pregate_logits"], arrays["token_ids"],
                        arrays["sequence_starts"], top_k=geometry["top_k"], vocab_size=geometry["vocab_size"],
                        model=meta.get("model", ""), fingerprint=meta.get("fingerprint", ""), info=info,
                        groups=json.loads(meta.get("groups", "[1, 1]")),
                        scoring=scoring_from_metadata(meta, arrays, TraceError))
        except (TraceError, json.JSONDecodeError) as exc:
            raise TraceError(f"{path}: {exc}") from None
        if (geometry["num_layers"], geometry["num_experts"]) != (trace.num_layers, trace.num_experts):
            raise TraceError(f"{path}: metadata geometry {geometry} disagrees with the tensors' shape "
                             f"{trace.router_logits.shape}")
        trace.check(num_layers, num_experts, top_k, vocab_size, fingerprint)
        return trace


def scoring_from_metadata(meta: dict, arrays: dict, error: type[Exception]) -> RouterScoring | None:
    """The router's rule a record file stores (``scoring`` metadata, ``selection_bias`` tensor), or None for a
    file without one (read as softmax with the file's ``groups``)."""
    if "scoring" not in meta:
        return None
    try:
        return RouterScoring.from_metadata(meta["scoring"], arrays.get("selection_bias"))
    except ValueError as exc:
        raise error(str(exc)) from None


def read_scoring(scoring, groups, num_layers: int, num_experts: int, top_k: int,
                 error: type[Exception]) -> tuple[tuple[int, int], RouterScoring]:
    """(groups, scoring) of a record: the rule given (its groups win; its bias must be [L, E]), or a softmax
    router with `groups` (records without a rule)."""
    if scoring is None:
        groups = read_groups(groups, num_experts, top_k, error)
        return groups, RouterScoring("softmax", n_group=groups[0], topk_group=groups[1])
    if not isinstance(scoring, RouterScoring):
        raise error(f"the router scoring must be a RouterScoring, got {type(scoring).__name__}")
    groups = read_groups(scoring.groups, num_experts, top_k, error)
    try:
        scoring.bias_rows(num_layers, num_experts)
    except ValueError as exc:
        raise error(str(exc)) from None
    return groups, scoring


def read_groups(groups, num_experts: int, top_k: int, error: type[Exception]) -> tuple[int, int]:
    """(n_group, topk_group) as ints, checked against E and K (`specmoe.routing.scoring.check_groups`)."""
    try:
        n_group, topk_group = groups
        return check_groups(n_group, topk_group, num_experts, top_k)
    except (TypeError, ValueError) as exc:
        raise error(f"invalid expert groups {groups!r}: {exc}") from None
