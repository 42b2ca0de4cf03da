"""Calibration data of the routing policies: warm set, token prior and mean logit range per layer.

All three are estimated from the router logits of exact routing on held-out text that no evaluation uses,
saved to one safetensors file with its provenance, and checked against the model that loads them.

- warm ranking [L, E]: experts of each layer by how often the router's own top-K selects them (ties to
  the lower index); the warm set at capacity C is its first C entries.
- token prior pi_l(x): for input token x, the fraction of its occurrences in which layer l's top-K holds
  each expert. Stored sparse (CSR over tokens, per layer) because the dense array [L, V, E] of a large
  vocabulary does not fit (V=248k, E=256, L=40 is 10 GB); a dense array is accepted and converted.
  A token never seen in calibration has a zero prior.
- delta [L]: mean of max z - min z, the scale of the Cache-Prior bonus.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np

from specmoe.files import read_safetensors, write_safetensors
from specmoe.geometry import tiled_layers

from . import validate
from .scoring import check_groups

FORMAT_VERSION = 1
_TENSORS = ("warm_ranking", "delta", "prior_indptr", "prior_experts", "prior_values")  # the file's tensors


class CalibrationError(ValueError):
    """A calibration that does not fit the model or policy it is used with, or an unreadable file."""


@dataclass(frozen=True)
class TokenPrior:
    """Sparse token prior: for layer l and token x, experts[indptr[l, x]:indptr[l, x+1]] with values.

    The rows (layer, token) lie one after the other in experts/values (indptr[l, V] == indptr[l+1, 0]),
    each listing its experts once, in increasing order; values are frequencies in [0, 1]. Checked when
    made: the kernels read these offsets and expert ids without bounds checks."""

    indptr: np.ndarray  # int64 [L, V + 1], offsets into experts/values
    experts: np.ndarray  # int32 [nnz]
    values: np.ndarray  # float64 [nnz], frequencies in [0, 1]

    def __post_init__(self) -> None:
        indptr = validate.integer_array(self.indptr, "token prior offsets (prior_indptr)", CalibrationError, 2)
        experts = validate.integer_array(self.experts, "token prior experts (prior_experts)", CalibrationError, 1)
        values = validate.real_array(self.values, "token prior values (prior_values)", CalibrationError, 1,
                                     np.float64)
        if indptr.shape[0] < 1 or indptr.shape[1] < 2:
            raise CalibrationError(f"token prior offsets must be [L >= 1, V + 1 >= 2], got shape {indptr.shape}")
        if values.shape != experts.shape:
            raise CalibrationError(f"token prior: {experts.shape[0]} expert ids but {values.shape[0]} values")
        _check_csr(indptr, experts)
        validate.check_real(values, "token prior values (frequencies)", CalibrationError, 0.0, 1.0)
        object.__setattr__(self, "indptr", np.ascontiguousarray(indptr))
        object.__setattr__(self, "experts", np.ascontiguousarray(experts, dtype=np.int32))
        object.__setattr__(self, "values", values)

    @property
    def num_layers(self) -> int:
        return self.indptr.shape[0]

    @property
    def vocab_size(self) -> int:
        return self.indptr.shape[1] - 1

    @classmethod
    def from_dense(cls, dense: np.ndarray) -> "TokenPrior":
        dense = validate.real_array(dense, "a dense token prior [L, V, E]", CalibrationError, 3, np.float64)
        num_layers, vocab, _ = dense.shape
        layer, token, expert = np.nonzero(dense)  # row-major: sorted by (layer, token)
        indptr = _csr_indptr(layer * vocab + token, num_layers, vocab)
        return cls(indptr, expert.astype(np.int32), dense[layer, token, expert])

    def row(self, layer: int, token: int, num_experts: int) -> np.ndarray:
        out = np.zeros(num_experts)
        lo, hi = self.indptr[layer, token], self.indptr[layer, token + 1]
        out[self.experts[lo:hi]] = self.values[lo:hi]
        return out

    def tiled(self, num_layers: int) -> "TokenPrior":
        """This prior for a deeper model whose layers follow this one's repeated (`specmoe.geometry.tiled_layers`)."""
        rows, experts, values, offset = [], [], [], 0
        for source in tiled_layers(num_layers, self.num_layers):
            lo, hi = self.indptr[source, 0], self.indptr[source, -1]
            rows.append(self.indptr[source] - lo + offset)
            experts.append(self.experts[lo:hi])
            values.append(self.values[lo:hi])
            offset += hi - lo
        return TokenPrior(np.stack(rows), np.concatenate(experts), np.concatenate(values))

    def to_dense(self, num_experts: int) -> np.ndarray:
        dense = np.zeros((self.num_layers, self.vocab_size, num_experts))
        for layer in range(self.num_layers):
            lengths = np.diff(self.indptr[layer])
            tokens = np.repeat(np.arange(self.vocab_size), lengths)
            lo, hi = self.indptr[layer, 0], self.indptr[layer, -1]
            dense[layer, tokens, self.experts[lo:hi]] = self.values[lo:hi]
        return dense


@dataclass(frozen=True)
class Calibration:
    """Warm ranking [L, E], token prior and delta [L], with the provenance of the data they came from."""

    warm_ranking: np.ndarray
    token_prior: TokenPrior
    delta: np.ndarray
    provenance: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.provenance, dict):
            raise CalibrationError(f"calibration provenance must be a dict (a JSON object), got "
                                   f"{type(self.provenance).__name__}")
        warm = validate.integer_array(self.warm_ranking, "warm ranking", CalibrationError, 2)
        if warm.shape[0] < 1 or warm.shape[1] < 1:
            raise CalibrationError(f"warm ranking must be [L >= 1, E >= 1], got shape {warm.shape}")
        num_layers, num_experts = warm.shape
        validate.check_permutations(warm, "warm ranking", CalibrationError)
        delta = validate.real_array(self.delta, "delta", CalibrationError, 1, np.float64)
        validate.check_real(delta, "delta (mean logit range)", CalibrationError, minimum=0.0)
        prior = self.token_prior
        if not isinstance(prior, TokenPrior):
            dense = validate.real_array(prior, "a dense token prior [L, V, E]", CalibrationError, 3)
            if dense.shape[2] != num_experts:
                raise CalibrationError(f"the dense token prior has {dense.shape[2]} experts per layer, the warm "
                                       f"ranking {num_experts}")
            prior = TokenPrior.from_dense(dense)
        if delta.shape != (num_layers,) or prior.num_layers != num_layers:
            raise CalibrationError(
                f"inconsistent calibration shapes: warm ranking {warm.shape}, delta {delta.shape}, "
                f"token prior over {prior.num_layers} layers"
            )
        validate.check_range(prior.experts, 0, num_experts, "token prior experts", CalibrationError,
                             f"the {num_experts} experts of a layer")
        recorded = {"num_layers": num_layers, "num_experts": num_experts, "vocab_size": prior.vocab_size}
        for key, value in recorded.items():
            if key in self.provenance and self.provenance[key] != value:
                raise CalibrationError(f"the provenance records {key} {self.provenance[key]!r}, the arrays "
                                       f"have {value}")
        object.__setattr__(self, "warm_ranking", np.ascontiguousarray(warm))
        object.__setattr__(self, "token_prior", prior)
        object.__setattr__(self, "delta", delta)

    @classmethod
    def uniform(cls, num_layers: int, num_experts: int, vocab_size: int, delta: float = 0.0,
                model: str = "none (no calibration data)") -> "Calibration":
        """The placeholder calibration, without data: warm ranking by expert index, no token prior, `delta` in
        every layer (for exact routing, whose selection reads none of it; `model` says what it stands in for)."""
        prior = TokenPrior(np.zeros((num_layers, vocab_size + 1), dtype=np.int64), np.zeros(0, dtype=np.int32),
                           np.zeros(0))
        return cls(np.tile(np.arange(num_experts), (num_layers, 1)), prior, np.full(num_layers, float(delta)),
                   {"model": model, "num_experts": num_experts})

    @property
    def num_layers(self) -> int:
        return self.warm_ranking.shape[0]

    def tiled(self, num_layers: int) -> "Calibration":
        """This calibration for a deeper model whose layers follow this one's repeated, as a tiled trace does
        (`specmoe.geometry.tiled_layers`): every per-layer array tiled, the provenance saying so."""
        if num_layers == self.num_layers:
            return self
        source = tiled_layers(num_layers, self.num_layers)
        provenance = {**self.provenance, "num_layers": int(num_layers),
                      "tiled_from_layers": self.num_layers}
        return Calibration(self.warm_ranking[source], self.token_prior.tiled(num_layers), self.delta[source],
                           provenance)

    @property
    def num_experts(self) -> int:
        return self.warm_ranking.shape[1]

    @property
    def vocab_size(self) -> int:
        return self.token_prior.vocab_size

    def warm_set(self, capacity: int) -> np.ndarray:
        """The C most frequently selected experts per layer, ascending: int64 [L, C]."""
        if capacity > self.warm_ranking.shape[1]:
            raise CalibrationError(
                f"the calibration ranks {self.warm_ranking.shape[1]} experts per layer, fewer than C={capacity}"
            )
        return np.sort(self.warm_ranking[:, :capacity], axis=1)

    def check(self, num_layers: int, num_experts: int, vocab_size: int | None = None,
              fingerprint: str | None = None) -> None:
        """Raise CalibrationError unless this calibration was made for a model of this geometry (and
        routers, where both sides carry a fingerprint). The one check of a calibration against a model:
        whatever routes a model with a calibration (harness, `specmoe replay`, engines) calls it."""
        problems = []
        if self.num_layers != num_layers:
            problems.append(f"{self.num_layers} MoE layers, the model has {num_layers}")
        if self.num_experts != num_experts:
            problems.append(f"{self.num_experts} experts per layer, the model has {num_experts}")
        if vocab_size is not None and self.vocab_size != vocab_size:
            problems.append(f"vocabulary {self.vocab_size}, the model has {vocab_size}")
        mine = self.provenance.get("fingerprint")
        if fingerprint is not None and mine is not None and mine != fingerprint:
            problems.append(f"router fingerprint {mine[:12]}, the model's is {fingerprint[:12]}")
        if problems:
            source = self.provenance.get("model", "an unnamed model")
            raise CalibrationError(
                f"calibration from {source} does not fit this model: " + "; ".join(problems)
                + ". Calibrate on this model with `specmoe calibrate`."
            )

    # -- files ------------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> Path:
        """Write atomically to `path` (safetensors, provenance as JSON metadata)."""
        prior = self.token_prior
        tensors = dict(zip(_TENSORS, (self.warm_ranking, self.delta, prior.indptr, prior.experts, prior.values)))
        meta = {"format": "specmoe-calibration", "version": str(FORMAT_VERSION),
                "provenance": json.dumps(self.provenance, sort_keys=True)}
        return write_safetensors(path, tensors, meta)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Calibration":
        """Read a calibration file; CalibrationError naming the file if it is unreadable, lacks a tensor, has
        bad metadata or holds values the routing core cannot run on."""
        meta, arrays = read_safetensors(path, CalibrationError, "calibration")
        if meta.get("format") != "specmoe-calibration":
            raise CalibrationError(f"{path} is not a specmoe calibration file")
        missing = sorted(set(_TENSORS) - set(arrays))
        if missing:
            raise CalibrationError(f"{path} lacks the tensor(s) {', '.join(missing)}")
        try:
            provenance = json.loads(meta.get("provenance", "{}"))
        except json.JSONDecodeError as exc:
            raise CalibrationError(f"{path}: the provenance metadata is not valid JSON ({exc})") from None
        try:
            prior = TokenPrior(arrays["prior_indptr"], arrays["prior_experts"], arrays["prior_values"])
            calibration = cls(arrays["warm_ranking"], prior, arrays["delta"], provenance)
        except CalibrationError as exc:
            raise CalibrationError(f"{path}: {exc}") from None
        calibration.provenance["file"] = str(path)
        return calibration


def _csr_indptr(rows: np.ndarray, num_layers: int, vocab_size: int) -> np.ndarray:
    """Offsets [L, V + 1] of sorted row ids (layer * V + token) into one global CSR array."""
    offsets = np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=num_layers * vocab_size))])
    return np.stack([offsets[l * vocab_size:(l + 1) * vocab_size + 1] for l in range(num_layers)]).astype(np.int64)


def _check_csr(indptr: np.ndarray, experts: np.ndarray) -> None:
    """Raise CalibrationError unless the offsets indptr [L, V + 1] lay the rows (layer, token) out one after
    the other over the nnz expert ids (from 0 to nnz, never decreasing, each layer starting where the
    previous one ends) and each row lists distinct experts in increasing order."""
    nnz = experts.shape[0]
    if indptr[0, 0] != 0 or indptr[-1, -1] != nnz or (np.diff(indptr, axis=1) < 0).any() \
            or (indptr[1:, 0] != indptr[:-1, -1]).any():
        raise CalibrationError(f"token prior offsets (prior_indptr) do not lay out its {nnz} entries row after "
                               f"row: they must start at 0, never decrease, end at {nnz}, and each layer must start "
                               "where the previous one ends")
    if nnz == 0:
        return
    validate.check_range(experts, 0, np.iinfo(np.int32).max, "token prior experts", CalibrationError)
    rising = np.diff(experts) > 0
    bounds = indptr.ravel()
    rising[bounds[(bounds > 0) & (bounds < nnz)] - 1] = True  # a row may start below its predecessor's end
    if not rising.all():
        entry = int(np.flatnonzero(~rising)[0]) + 1
        layer = int(np.searchsorted(indptr[:, -1], entry, side="right"))
        token = int(np.searchsorted(indptr[layer], entry, side="right")) - 1
        raise CalibrationError(f"token prior of layer {layer}, token {token} lists expert {experts[entry]} twice "
                               "or out of order (experts of a row must be distinct and increasing)")


def router_fingerprint(router_weights: Iterable[np.ndarray]) -> str:
    """A hash that identifies a model's routing: sha256 over its routers' weights in float32."""
    digest = hashlib.sha256()
    for weight in router_weights:
        array = np.ascontiguousarray(np.asarray(weight, dtype=np.float32))
        digest.update(str(array.shape).encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def _top_k(logits: np.ndarray, k: int, groups: tuple[int, int] = (1, 1)) -> np.ndarray:
    """Top-k indices along the last axis, ties to the lower index (stable sort of -z); with group-limited
    choice (n_group > topk_group > 0) only inside the topk_group groups of the best two-expert sums (ties to
    the lower group), as `kernels._rank_groups`."""
    n_group, topk_group = groups
    if n_group > 1 and topk_group < n_group:
        grouped = logits.reshape(*logits.shape[:-1], n_group, -1)
        best_two = -np.sort(-grouped, axis=-1)[..., :2].sum(axis=-1)
        dropped = np.argsort(-best_two, axis=-1, kind="stable")[..., topk_group:]
        mask = np.zeros(best_two.shape, dtype=bool)
        np.put_along_axis(mask, dropped, True, axis=-1)
        logits = np.where(np.repeat(mask, grouped.shape[-1], axis=-1), -np.inf, logits)
    return np.argsort(-logits, axis=-1, kind="stable")[..., :k]


class CalibrationBuilder:
    """Accumulates router logits of exact routing over held-out sequences; `finish` gives a Calibration.
    `groups`: the router's group-limited choice (n_group, topk_group; `RouterScoring.groups`), which decides
    the router's own top-K."""

    def __init__(self, num_layers: int, num_experts: int, vocab_size: int, top_k: int,
                 groups: tuple[int, int] = (1, 1)):
        num_layers = validate.integer(num_layers, "num_layers", minimum=1)
        num_experts = validate.integer(num_experts, "num_experts", minimum=1)
        vocab_size = validate.integer(vocab_size, "vocab_size", minimum=1)
        top_k = validate.integer(top_k, "top_k", minimum=1, maximum=num_experts)
        self.num_layers, self.num_experts, self.vocab_size, self.top_k = num_layers, num_experts, vocab_size, top_k
        self.groups = check_groups(*groups, num_experts, top_k)
        self.selection_counts = np.zeros((num_layers, num_experts), dtype=np.int64)
        self.range_sum = np.zeros(num_layers)
        self.tokens = 0
        self.token_counts = np.zeros(vocab_size, dtype=np.int64)
        self._keys: list[np.ndarray] = []  # (layer * V + token) * E + expert, once per selection
        self._unique = np.zeros(0, dtype=np.int64)  # compacted keys so far, ascending, and their counts
        self._unique_counts = np.zeros(0, dtype=np.int64)
        self._pending = 0

    def add(self, router_logits: np.ndarray, token_ids: np.ndarray) -> None:
        """Add one sequence: router logits [T, L, E] and the input token of each position [T]."""
        z = validate.real_array(router_logits, "router logits [T, L, E]", CalibrationError, 3, np.float64)
        if z.shape[1:] != (self.num_layers, self.num_experts):
            raise CalibrationError(f"expected router logits [T, {self.num_layers}, {self.num_experts}], got {z.shape}")
        validate.check_real(z, "router logits", CalibrationError)
        x = validate.token_ids(token_ids, z.shape[0], self.vocab_size, "token ids", CalibrationError)
        top = _top_k(z, self.top_k, self.groups)  # [T, L, K]
        layers = np.arange(self.num_layers)[None, :, None]
        np.add.at(self.selection_counts, (np.broadcast_to(layers, top.shape), top), 1)
        self.range_sum += (z.max(axis=2) - z.min(axis=2)).sum(axis=0)
        self.tokens += z.shape[0]
        np.add.at(self.token_counts, x, 1)
        keys = ((layers * self.vocab_size + x[:, None, None]) * self.num_experts + top).ravel()
        self._keys.append(keys)
        self._pending += keys.size
        if self._pending > 20_000_000:
            self._compact()

    def _compact(self) -> None:
        keys = np.concatenate([self._unique, *self._keys])
        counts = np.concatenate([self._unique_counts, np.ones(keys.size - self._unique.size, dtype=np.int64)])
        self._unique, inverse = np.unique(keys, return_inverse=True)
        self._unique_counts = np.bincount(inverse, weights=counts).astype(np.int64)
        self._keys, self._pending = [], self._unique.size

    def finish(self, provenance: dict | None = None) -> Calibration:
        if self.tokens == 0:
            raise CalibrationError("no calibration text: add at least one sequence")
        self._compact()
        keys, counts = self._unique, self._unique_counts
        expert = keys % self.num_experts
        row = keys // self.num_experts  # layer * V + token, sorted
        token = row % self.vocab_size
        values = counts / self.token_counts[token]
        indptr = _csr_indptr(row, self.num_layers, self.vocab_size)
        ranking = np.argsort(-self.selection_counts, axis=1, kind="stable")
        info = {
            "num_layers": self.num_layers, "num_experts": self.num_experts, "top_k": self.top_k,
            "vocab_size": self.vocab_size, "tokens": int(self.tokens),
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
        info.update(provenance or {})
        return Calibration(ranking, TokenPrior(indptr, expert.astype(np.int32), values),
                           self.range_sum / self.tokens, info)
