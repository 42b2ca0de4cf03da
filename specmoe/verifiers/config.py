"""Selector configurations and the position weights alpha of block-level verifier expert selection.

A verification block has D = k + 1 positions: position 0 is the root (the last committed token, always
committed), positions 1..k carry the drafts. A selector decides which experts each position of the block
executes in one MoE layer (paper, Section 7 and Appendix B "Block-level selection"):

- ``exact``: every position executes its router's own top-K; the block needs the union of them.
- ``acceptmoe``: one eligible set per block and layer, built from the router demand of every position
  weighted by alpha_d = p_d^(1/2), where p_d is the measured commitment rate at depth d (`CommitRate`);
  gamma = 1, no rescue (AcceptMoE, Liang et al., 2026).
- ``confidence_top1``: the same set built with confidence weights alpha_d = (prod_{i<=d} c_i)^(1/2), where
  c_i is the drafter's probability of its own token i; gamma = 1.05; each draft position with alpha_d >= 0.3
  keeps its own top-1 expert even outside the set (the paper's variant, Section 7).

alpha_0 = 1 in both weightings. The selection itself is `select_block` (selection.py).

Selectors are registered by kind in one table, `SELECTORS`: each `SelectorKind` names its weighting function
(what `block_weights` calls for a block), its default fields (its preset, `selector_preset`) and whether it
is a block selector (an eligible set) or executes every position's own top-K. Adding a selector is one entry.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np

from ..limits import MAX_DRAFTS
from ..routing.validate import integer


class SelectorError(ValueError):
    """A selector configuration that cannot be run (unknown kind, negative gamma, ...)."""


@dataclass(frozen=True)
class SelectorConfig:
    """One verifier expert selector.

    kind: ``exact``, ``acceptmoe`` (position weights) or ``confidence_top1`` (confidence weights); the
    weighting a kind uses is `weights`. gamma: scale of the eligible set's size, extra = min(ceil(gamma *
    e^H), m) experts beyond the root's top-K, where m is the number of candidates with nonzero demand (the
    paper gives no other cap). rescue_threshold: a draft position with alpha_d >= this keeps its own top-1
    expert even if it is not eligible; None: no rescue. prune_budget: AcceptMoE's rerouting budget as a
    multiple of the token->expert assignments that the eligible set already displaces; 0 disables pruning.
    ``exact`` reads none of gamma and prune_budget and takes no rescue.
    """

    kind: str
    gamma: float = 1.0
    rescue_threshold: float | None = None
    prune_budget: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in SELECTORS:
            raise SelectorError(f"unknown selector kind {self.kind!r}; expected one of {', '.join(SELECTORS)}")
        block = SELECTORS[self.kind].block
        for name in ("gamma", "prune_budget"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < math.inf:
                raise SelectorError(f"{name} must be a finite number >= 0, got {value!r}")
            object.__setattr__(self, name, float(value))
        rescue = self.rescue_threshold
        if rescue is not None:
            if isinstance(rescue, bool) or not isinstance(rescue, (int, float)) or not 0.0 <= rescue <= 1.0:
                raise SelectorError(f"rescue_threshold must be None or a number in [0, 1], got {rescue!r}")
            if not block:
                raise SelectorError(f"kind {self.kind!r} executes every position's own top-K: "
                                    "set rescue_threshold=None")
            object.__setattr__(self, "rescue_threshold", float(rescue))
        # what the selection kernel reads: [1 for a block selector, 0 for exact; gamma; rescue threshold, -1 for
        # none; prune_budget] (one float64 array crosses into numba faster than four scalars)
        object.__setattr__(self, "kernel_params", np.array(
            [block, self.gamma, -1.0 if rescue is None else rescue, self.prune_budget]))

    @property
    def weights(self) -> str | None:
        """The position weights this kind uses: "position", "confidence", or None (exact)."""
        return SELECTORS[self.kind].weights

    @property
    def name(self) -> str:
        """A short label for tables, e.g. ``confidence_top1(gamma=1.05, rescue=0.3)``."""
        if not SELECTORS[self.kind].block:
            return self.kind
        parts = [f"gamma={self.gamma:g}"]
        if self.rescue_threshold is not None:
            parts.append(f"rescue={self.rescue_threshold:g}")
        if self.prune_budget != 1.0:
            parts.append(f"prune={self.prune_budget:g}")
        return f"{self.kind}({', '.join(parts)})"

    def to_dict(self) -> dict:
        """The fields, for records and config files (`from_dict` reads them back)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "SelectorConfig":
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise SelectorError(f"unknown selector field(s): {', '.join(sorted(unknown))}")
        return cls(**data)


def selector_preset(name: str, **overrides) -> SelectorConfig:
    """The selector of kind `name` with its registered defaults (`SELECTORS`), with any field overridden."""
    if name not in SELECTORS:
        raise SelectorError(f"unknown selector preset {name!r}; expected one of {', '.join(SELECTORS)}")
    return SelectorConfig(**{"kind": name, **SELECTORS[name].defaults, **overrides})


def _probabilities(values, what: str) -> np.ndarray:
    p = np.asarray(values, dtype=np.float64)
    if p.ndim != 1 or not np.all((p >= 0.0) & (p <= 1.0)):  # also rejects NaN
        raise ValueError(f"{what} must be a 1-D array of probabilities in [0, 1], got {values!r}")
    return p


def position_weights(commit_rate) -> np.ndarray:
    """AcceptMoE's weights alpha [k + 1] from the commitment rates p [k] of depths 1..k: alpha_0 = 1,
    alpha_d = p_d^(1/2)."""
    p = _probabilities(commit_rate, "commitment rates")
    return np.concatenate(([1.0], np.sqrt(p)))


def confidence_weights(confidence) -> np.ndarray:
    """Confidence weights alpha [k + 1] from the drafter's probabilities c [k] of its own drafts 1..k:
    alpha_0 = 1, alpha_d = (prod_{i<=d} c_i)^(1/2)."""
    c = _probabilities(confidence, "draft confidences")
    return np.concatenate(([1.0], np.sqrt(np.cumprod(c))))


class CommitRate:
    """The commitment rate p_d of each draft depth d, measured online over one request's verified blocks.

    Depth d of a block counts as committed if the block's accepted length (accepted drafts, the bonus token
    not included) is at least d; a block of k drafts observes depths 1..k. Before any block, and blended
    with the observations after, a Beta prior per depth worth `prior_blocks` pseudo-blocks at the geometric
    rate `prior_accept`^d (each draft accepted with probability `prior_accept` given its predecessors):

        p_d = (prior_blocks * prior_accept^d + committed_d) / (prior_blocks + observed_d)

    Defaults 0.8 and 4: with k = 8 the prior expects 3.3 accepted drafts per block, near the 3.6 of the
    family's AR drafter and the 3–4 of OLMo-1B on OLMoE (paper, Table 9), and four real blocks weigh as
    much as the prior.
    """

    def __init__(self, prior_accept: float = 0.8, prior_blocks: float = 4.0):
        if not 0.0 <= prior_accept <= 1.0:
            raise ValueError(f"prior_accept must be in [0, 1], got {prior_accept!r}")
        if not 0.0 < prior_blocks < math.inf:
            raise ValueError(f"prior_blocks must be a finite number > 0, got {prior_blocks!r}")
        self.prior_accept = float(prior_accept)
        self.prior_blocks = float(prior_blocks)
        self._prior: dict[int, np.ndarray] = {}  # k -> the prior's terms of `rates` (per block on the hot path)
        self.reset()

    def reset(self) -> None:
        """Forget the observations (a new request)."""
        self.committed = np.zeros(0, dtype=np.int64)  # [depth - 1]: blocks that committed this depth
        self.observed = np.zeros(0, dtype=np.int64)  # [depth - 1]: blocks that drafted this depth

    def update(self, accepted_length: int, k: int) -> None:
        """Record one verified block of k drafts of which the first `accepted_length` were accepted."""
        k = integer(k, "k (drafts of the block)", minimum=1, maximum=MAX_DRAFTS)
        accepted_length = integer(accepted_length, "accepted_length", minimum=0, maximum=k)
        if k > self.observed.shape[0]:
            grow = k - self.observed.shape[0]
            self.committed = np.concatenate((self.committed, np.zeros(grow, dtype=np.int64)))
            self.observed = np.concatenate((self.observed, np.zeros(grow, dtype=np.int64)))
        self.observed[:k] += 1
        self.committed[:accepted_length] += 1

    def rates(self, k: int) -> np.ndarray:
        """p_d for depths 1..k, float64 [k]."""
        prior = self._prior.get(k)
        if prior is None:  # prior_blocks * prior_accept^d, depths 1..k (the same bits every block)
            prior = self._prior[k] = self.prior_blocks * self.prior_accept ** np.arange(1, k + 1)
        n = self.observed.shape[0]
        if n >= k:  # the counts as float64 in the sums below, as the zero-padded copies of a shorter history
            return (prior + self.committed[:k]) / (self.prior_blocks + self.observed[:k])
        committed, observed = np.zeros(k), np.zeros(k)
        committed[:n], observed[:n] = self.committed, self.observed
        return (prior + committed) / (self.prior_blocks + observed)


# -- the registry -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SelectorKind:
    """One registered selector kind.

    weigh(k, commit_rate, confidences) -> alpha [k + 1], float64: the position weights of a block of k drafts,
    given the request's `CommitRate` and the drafter's confidences c [k] in its own drafts (alpha_0 = 1).
    weights: a label of that weighting for tables ("position", "confidence", None for unweighted).
    defaults: the kind's default `SelectorConfig` fields (its preset). block: True for a block selector (one
    eligible set per block and layer, built from the weighted demand); False for a kind that executes every
    position's own top-K (the union; it reads neither gamma nor prune_budget and takes no rescue)."""

    weigh: Callable[[int, CommitRate, np.ndarray], np.ndarray]
    weights: str | None
    defaults: dict = field(default_factory=dict)
    block: bool = True


def unweighted(k: int, commit_rate: CommitRate, confidences) -> np.ndarray:
    """alpha = 1 at every position of the block."""
    return np.ones(k + 1)


def commit_rate_weights(k: int, commit_rate: CommitRate, confidences) -> np.ndarray:
    """AcceptMoE's weights from the request's commitment rates (`position_weights`, whose check of its input
    this skips: the rates lie in [0, 1] by construction; once per verification block, on the host's critical
    path)."""
    alpha = np.empty(k + 1)
    alpha[0] = 1.0
    np.sqrt(commit_rate.rates(k), out=alpha[1:])
    return alpha


def drafter_confidence_weights(k: int, commit_rate: CommitRate, confidences) -> np.ndarray:
    """Confidence weights from the drafter's confidences in its drafts (`confidence_weights`)."""
    return confidence_weights(confidences)


# The paper's selectors (Section 7, Appendix B), by kind; each kind's defaults are its preset.
SELECTORS: dict[str, SelectorKind] = {
    "exact": SelectorKind(unweighted, None, block=False),
    "acceptmoe": SelectorKind(commit_rate_weights, "position", dict(gamma=1.0, rescue_threshold=None)),
    "confidence_top1": SelectorKind(drafter_confidence_weights, "confidence",
                                    dict(gamma=1.05, rescue_threshold=0.3)),
}
