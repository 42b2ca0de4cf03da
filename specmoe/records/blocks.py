"""Verification blocks for the CPU replay: from block records, or from a synthetic drafter over an AR trace.

A `Blocks` holds N blocks of D = k + 1 positions (the root, then k drafts) as row indices into one table of
raw router and pre-gate logits [T, L, E] and input tokens [T], with the router's rule (`scoring`, as the source
stored it, which the replays route through), so that blocks cut from a trace share its rows
without copies. Block b commits its root and its first ``accepted[b]`` drafts (the bonus token is the next
block's root); blocks of one request follow each other in order.

Sources:
- `blocks_from_records`: the blocks of a speculative run (`specmoe.records.block_records`); rejected positions carry
  the drafter's tokens and the router logits the target computed for them. ``true_rows`` points, where the
  request's committed sequence reaches that far, at the rows of the true continuation (the committed tokens
  at the same positions, recorded as roots or accepted drafts of later blocks).
- `synthetic_blocks`: a synthetic drafter over an AR trace (`specmoe.records.traces`). Block roots walk the trace;
  the accepted length comes from an acceptance profile q_d = P(accepted >= d) (`AcceptanceProfile`: geometric
  rate, a per-depth table, or an accepted-length histogram) with one uniform draw per block, as
  `specmoe.drafters.synthetic` draws it. Rejected positions carry the trace's logits at those positions, the
  true continuation's (the synthetic drafter's wrong token was never run through the model). Confidences are
  c_d = q_d / q_{d-1}, a calibrated drafter.

Acceptance per selector: blocks carry the accepted lengths of the run that made them. A lossy selector that
follows another selector's blocks (exact verification's) replays that run's acceptance: open loop, labelled
`open_loop(...)`; following its own run's records (`records_per_selector`), or synthetic blocks drawn from its
own records' histogram (`AcceptanceProfile.of_records`), is closed loop (`CLOSED_LOOP`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .block_records import BlockRecords
from ..routing.scoring import RouterScoring
from ..limits import MAX_DRAFTS
from ..routing.validate import check_real, integer, real, real_array
from .traces import read_scoring


class BlockSourceError(ValueError):
    """Blocks that cannot be replayed: another geometry than the policy's, empty, k beyond the source."""


@dataclass
class Blocks:
    """N verification blocks of D = k + 1 positions (see the module docstring)."""

    router_logits: np.ndarray  # float32 [T, L, E]
    pregate_logits: np.ndarray  # float32 [T, L, E] (layer 0 ignored)
    tokens: np.ndarray  # int64 [T]
    rows: np.ndarray  # int64 [N, D], the row of each block position
    accepted: np.ndarray  # int64 [N], accepted drafts
    request: np.ndarray  # int64 [N], non-decreasing
    confidences: np.ndarray  # float64 [N, k], the drafter's probability of each draft
    top_k: int
    true_rows: np.ndarray | None = None  # int64 [N, D], rows of the true continuation, -1 where unknown
    source: str = ""
    groups: tuple[int, int] = (1, 1)  # (n_group, topk_group) of the router's group-limited choice
    scoring: RouterScoring | None = None  # the router's rule (None: softmax with `groups`), as the source stored it

    def __post_init__(self) -> None:
        self.top_k = integer(self.top_k, "top_k", BlockSourceError, minimum=1)
        self.router_logits = real_array(self.router_logits, "router logits [T, L, E]", BlockSourceError, 3, np.float32)
        self.pregate_logits = real_array(self.pregate_logits, "pre-gate logits [T, L, E]", BlockSourceError, 3,
                                         np.float32)
        self.tokens = np.ascontiguousarray(self.tokens, dtype=np.int64)
        self.rows = np.ascontiguousarray(self.rows, dtype=np.int64)
        self.accepted = np.ascontiguousarray(self.accepted, dtype=np.int64)
        self.request = np.ascontiguousarray(self.request, dtype=np.int64)
        self.confidences = np.ascontiguousarray(self.confidences, dtype=np.float64)
        z = self.router_logits
        if z.ndim != 3 or self.pregate_logits.shape != z.shape or self.tokens.shape != (z.shape[0],):
            raise BlockSourceError(f"logits must be [T, L, E] with pre-gate logits of the same shape and tokens [T], "
                                   f"got {z.shape}, {self.pregate_logits.shape}, {self.tokens.shape}")
        check_real(z, "router logits", BlockSourceError)
        check_real(self.pregate_logits[:, 1:], "pre-gate logits of layers 1..L-1", BlockSourceError)  # layer 0 ignored
        check_real(self.confidences, "draft confidences", BlockSourceError, 0.0, 1.0)
        if self.rows.ndim != 2 or self.rows.shape[0] == 0 or self.rows.shape[1] < 2:
            raise BlockSourceError(f"need at least one block of at least 2 positions (a root and a draft), "
                                   f"got rows of shape {self.rows.shape}")
        n, d = self.rows.shape
        if self.accepted.shape != (n,) or self.request.shape != (n,) or self.confidences.shape != (n, d - 1):
            raise BlockSourceError("accepted [N], request [N] and confidences [N, k] must match the blocks' rows")
        if self.rows.min() < 0 or self.rows.max() >= z.shape[0]:
            raise BlockSourceError("block rows outside the logits table")
        if self.accepted.min() < 0 or self.accepted.max() > d - 1:
            raise BlockSourceError(f"accepted lengths must lie in [0, k={d - 1}]")
        if np.any(np.diff(self.request) < 0):
            raise BlockSourceError("blocks of a request must be consecutive (request ids non-decreasing)")
        if not 1 <= self.top_k <= z.shape[2]:
            raise BlockSourceError(f"top_k {self.top_k} outside [1, E={z.shape[2]}]")
        self.groups, self.scoring = read_scoring(self.scoring, self.groups, z.shape[1], z.shape[2], self.top_k,
                                                 BlockSourceError)

    @property
    def num_blocks(self) -> int:
        return self.rows.shape[0]

    @property
    def k(self) -> int:
        return self.rows.shape[1] - 1

    @property
    def num_layers(self) -> int:
        return self.router_logits.shape[1]

    @property
    def num_experts(self) -> int:
        return self.router_logits.shape[2]

    @property
    def committed(self) -> int:
        """Committed positions (roots and accepted drafts) over all blocks."""
        return int((self.accepted + 1).sum())

    @property
    def tau(self) -> float:
        """Committed tokens per verification (`specmoe.speculation.tau`; recorded blocks are whole, none is cut)."""
        return self.committed / self.num_blocks

    def check(self, num_layers: int, num_experts: int, top_k: int) -> None:
        """Raise BlockSourceError unless the blocks have this geometry (the policy's and calibration's)."""
        have = (self.num_layers, self.num_experts, self.top_k)
        if have != (num_layers, num_experts, top_k):
            raise BlockSourceError(f"blocks of {self.source or 'this source'} have L={have[0]}, E={have[1]}, "
                                   f"K={have[2]}; the policy and calibration have L={num_layers}, E={num_experts}, "
                                   f"K={top_k}")

    def committed_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """(rows of the committed positions in order, the index where each request starts in them)."""
        keep = np.arange(self.rows.shape[1])[None, :] <= self.accepted[:, None]
        rows = self.rows[keep]
        per_block = self.accepted + 1
        first = np.flatnonzero(np.r_[True, np.diff(self.request) != 0])
        starts = np.r_[0, np.cumsum(per_block)][first]
        return rows, starts


# -- block records ------------------------------------------------------------------------------------------
def blocks_from_records(records: BlockRecords, k: int | None = None, source: str = "") -> Blocks:
    """The blocks of `records`, cut to their first k drafts (default: all). A cut block accepts at most k
    drafts (the acceptance of its first k drafts is the same); the positions the record committed beyond them
    are then missing from the replayed committed sequence (every method skips them alike). Raises BlockSourceError for k beyond the recorded blocks or records without blocks."""
    a = records.arrays
    n, d_rec, num_layers, num_experts = a["router_logits"].shape
    if n == 0:
        raise BlockSourceError(f"{source or 'the block records'} hold no block")
    k = d_rec - 1 if k is None else int(k)
    if not 1 <= k <= d_rec - 1:
        raise BlockSourceError(f"k={k} is outside what {source or 'the block records'} hold (1..{d_rec - 1} drafts)")
    d = k + 1
    z = a["router_logits"][:, :d].reshape(n * d, num_layers, num_experts)
    g = a["pregate_logits"][:, :d].reshape(n * d, num_layers, num_experts)
    tokens = a["tokens"][:, :d].reshape(-1)
    rows = np.arange(n * d, dtype=np.int64).reshape(n, d)
    accepted = np.minimum(a["accepted"], k)
    # true continuation: committed position p of a request sits at the row of the block position that committed it
    true_rows = np.full((n, d), -1, dtype=np.int64)
    for request in np.unique(a["request"]):
        blocks = np.flatnonzero(a["request"] == request)
        where: dict[int, int] = {}
        for b in blocks:
            root = int(a["root_position"][b])
            for j in range(int(a["accepted"][b]) + 1):  # root and accepted drafts of the full record
                if j < d:
                    where[root + j] = b * d + j
                else:  # accepted beyond the cut: not in the kept rows
                    break
        for b in blocks:
            root = int(a["root_position"][b])
            for j in range(d):
                true_rows[b, j] = where.get(root + j, -1)
    return Blocks(z, g, tokens, rows, accepted, a["request"], a["confidences"][:, :k].astype(np.float64),
                  records.top_k, true_rows=true_rows, source=source or f"records ({records.drafter})",
                  groups=records.groups, scoring=records.scoring)


# -- acceptance per selector: closed or open loop ---------------------------------------------------------------
CLOSED_LOOP = "closed-loop"  # a selector's blocks come from its own run: its own accepted lengths


def open_loop(selector: str) -> str:
    """The acceptance label of blocks that carry another selector's accepted lengths (`selector`'s run)."""
    return f"open-loop ({selector}'s)"


def records_per_selector(records: list, selectors, require_own: bool = False) -> dict:
    """Block records matched to the selectors that follow them: drafter -> selector -> (records, acceptance).

    A lossy selector (acceptmoe, confidence_top1) commits other tokens, at another rate, than exact verification;
    following exact's blocks with it replays exact's accepted lengths (open loop, optimistic for it). Each
    records file names the selector of its run (`BlockRecords.selector`, its ``kind``), one file per drafter and
    selector (`specmoe sd --records`: blocks_cNNNN_DRAFTER_SELECTOR.safetensors). A selector with records of its
    own for a drafter follows them (`CLOSED_LOOP`); one without follows the drafter's exact records, labelled
    `open_loop("exact")`, unless `require_own`, where that is a BlockSourceError, as is a drafter without exact
    records for such a selector, or two files of one drafter and selector."""
    by_run: dict = {}
    for r in records:
        kind = r.selector.get("kind", "")
        if not kind:
            raise BlockSourceError(f"block records of drafter {r.drafter!r} name no selector")
        if (r.drafter, kind) in by_run:
            raise BlockSourceError(f"two block record files of drafter {r.drafter!r} and selector {kind!r}")
        by_run[(r.drafter, kind)] = r
    out: dict = {}
    for drafter in dict.fromkeys(d for d, _ in by_run):
        out[drafter] = {}
        for name in selectors:
            if (drafter, name) in by_run:
                out[drafter][name] = (by_run[(drafter, name)], CLOSED_LOOP)
            elif require_own:
                raise BlockSourceError(f"closed loop: no block records of selector {name!r} for drafter {drafter!r} "
                                       f"(have {', '.join(k for d, k in by_run if d == drafter)}); record them with "
                                       f"`specmoe sd --records --selectors {name}`")
            elif (drafter, "exact") in by_run:
                out[drafter][name] = (by_run[(drafter, "exact")], open_loop("exact"))
            else:
                raise BlockSourceError(f"no block records of selector {name!r} nor of exact for drafter {drafter!r}")
    return out


# -- synthetic drafter over a trace --------------------------------------------------------------------------
@dataclass(frozen=True)
class AcceptanceProfile:
    """q_d = P(accepted length >= d), d = 1..k: geometric (`rate`), a non-increasing table (`table`), or the
    accepted-length histogram of a run (`histogram`, counts of blocks by accepted drafts 0..)."""

    kind: str  # "geometric" | "table" | "histogram"
    values: tuple = ()

    @classmethod
    def geometric(cls, rate: float) -> "AcceptanceProfile":
        if not 0.0 <= rate <= 1.0:
            raise BlockSourceError(f"acceptance rate must be in [0, 1], got {rate}")
        return cls("geometric", (float(rate),))

    @classmethod
    def table(cls, q) -> "AcceptanceProfile":
        q = tuple(float(x) for x in q)
        if not q or any(not 0.0 <= x <= 1.0 for x in q) or any(b > a for a, b in zip(q, q[1:])):
            raise BlockSourceError(f"an acceptance table must be non-empty, in [0, 1] and non-increasing, got {q}")
        return cls("table", q)

    @classmethod
    def histogram(cls, counts) -> "AcceptanceProfile":
        counts = tuple(float(x) for x in counts)
        if not counts or any(not 0 <= x < math.inf for x in counts) or sum(counts) <= 0:
            raise BlockSourceError(f"an accepted-length histogram needs finite non-negative counts with a positive sum, "
                                   f"got {counts}")
        return cls("histogram", counts)

    @classmethod
    def of_records(cls, records: BlockRecords, k: int | None = None) -> "AcceptanceProfile":
        """The accepted-length histogram of a run's block records (`histogram`), each block's accepted drafts
        cut to k where given (`blocks_from_records`' cut): the acceptance of the selector that ran them."""
        accepted = records.arrays["accepted"]
        if accepted.size == 0:
            raise BlockSourceError("block records without blocks give no acceptance histogram")
        return cls.histogram(np.bincount(accepted if k is None else np.minimum(accepted, int(k))))

    @classmethod
    def for_tau(cls, tau: float, k: int) -> "AcceptanceProfile":
        """The geometric profile whose expected committed tokens per block, 1 + sum_d r^d, is tau at k drafts."""
        k = integer(k, "k (drafts per block)", BlockSourceError, minimum=1, maximum=MAX_DRAFTS)
        tau = real(tau, "tau", BlockSourceError)
        if not 1.0 <= tau < k + 1:
            raise BlockSourceError(f"tau={tau} must lie in [1, k + 1 = {k + 1}) for k={k}")
        depth = np.arange(1, k + 1, dtype=np.float64)
        lo, hi = 0.0, 1.0
        for _ in range(100):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if 1 + float(np.sum(mid ** depth)) < tau else (lo, mid)
        return cls.geometric((lo + hi) / 2)

    def commit_probabilities(self, k: int) -> np.ndarray:
        depth = np.arange(1, k + 1)
        if self.kind == "geometric":
            return self.values[0] ** depth.astype(np.float64)
        if self.kind == "table":
            q = np.zeros(k)
            n = min(k, len(self.values))
            q[:n] = self.values[:n]
            return q
        counts = np.asarray(self.values)
        at_least = counts[::-1].cumsum()[::-1] / counts.sum()  # P(a >= i), i = 0..
        q = np.zeros(k)
        n = min(k, at_least.shape[0] - 1)
        q[:n] = at_least[1:n + 1]
        return q

    @property
    def name(self) -> str:
        if self.kind == "geometric":
            return f"geometric({self.values[0]:.4f})"
        return f"{self.kind}({', '.join(f'{v:g}' for v in self.values)})"


def synthetic_blocks(trace, k: int, profile: AcceptanceProfile, seed: int = 0, max_blocks: int | None = None,
                     source: str = "", blocks_per_request: int | None = None) -> Blocks:
    """Blocks of a synthetic drafter over `trace` (a `specmoe.records.Trace`), see the module docstring. Each
    recorded sequence is a request; its blocks start at its first position and stop where fewer than k + 1
    positions remain, after `blocks_per_request` blocks of the request, or once `max_blocks` blocks are made in all
    (a cap per request keeps every request in a short run: the units of an interval over requests)."""
    k = integer(k, "k (drafts per block)", BlockSourceError, minimum=1, maximum=MAX_DRAFTS)
    if blocks_per_request is not None:
        blocks_per_request = integer(blocks_per_request, "blocks_per_request", BlockSourceError, minimum=1)
    q = profile.commit_probabilities(k)
    rng = np.random.default_rng(seed)
    rows, accepted, request = [], [], []
    offsets = np.arange(k + 1)
    for index, (lo, hi) in enumerate(trace.sequences()):
        p, first = lo, len(rows)
        while p + k + 1 <= hi and (max_blocks is None or len(rows) < max_blocks) and \
                (blocks_per_request is None or len(rows) - first < blocks_per_request):
            a = int((rng.random() < q).sum())
            rows.append(p + offsets)
            accepted.append(a)
            request.append(index)
            p += a + 1
    if not rows:
        raise BlockSourceError(f"the trace has no sequence of at least k + 1 = {k + 1} positions")
    previous = np.concatenate(([1.0], q[:-1]))
    confidence = np.divide(q, previous, out=np.zeros(k), where=previous > 0)
    n = len(rows)
    rows = np.asarray(rows, dtype=np.int64)
    return Blocks(trace.router_logits, trace.pregate_logits, trace.token_ids, rows, np.asarray(accepted),
                  np.asarray(request), np.tile(confidence, (n, 1)), trace.top_k, true_rows=rows.copy(),
                  source=source or f"synthetic {profile.name}, k={k}", groups=getattr(trace, "groups", (1, 1)),
                  scoring=getattr(trace, "scoring", None))


def with_true_continuation(blocks: Blocks) -> Blocks:
    """The blocks whose true continuation is known (`Blocks.true_rows` all set), with the true continuation's
    rows at their rejected positions: what a drafter whose wrong tokens cost nothing extra would leave the pool
    (the synthetic source's convention, on recorded text). Raises BlockSourceError if no block qualifies."""
    if blocks.true_rows is None:
        raise BlockSourceError(f"{blocks.source or 'these blocks'} carry no true continuation")
    keep = np.all(blocks.true_rows >= 0, axis=1)
    if not keep.any():
        raise BlockSourceError(f"no block of {blocks.source or 'these blocks'} has a known true continuation")
    rows = blocks.true_rows[keep]
    return Blocks(blocks.router_logits, blocks.pregate_logits, blocks.tokens, rows, blocks.accepted[keep],
                  blocks.request[keep], blocks.confidences[keep], blocks.top_k, true_rows=rows.copy(),
                  source=f"{blocks.source}, true continuation", groups=blocks.groups,
                  scoring=blocks.scoring)
