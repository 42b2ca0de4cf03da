"""The ``synthetic`` drafter: separates acceptance from drafter quality.

It drafts the reference continuation, the target's greedy continuation of the committed sequence under
exact routing, with a set acceptance profile: q_d, the probability that draft d is right given the block
(and so, under greedy verification with exact routing, committed). Either geometric, q_d = r^d (each draft
right with probability r given its predecessors), or a table q_1 >= q_2 >= ... (drafts beyond it are
wrong). Per block one uniform draw u decides: drafts d with u < q_d (a leading run, since q does not
increase) are the reference's tokens, every other draft is a wrong token (uniform over the vocabulary
without the reference's token). Its confidence in draft d is c_d = q_d / q_{d-1} (q_0 = 1; 0 after a zero),
so prod_{i<=d} c_i = q_d: a calibrated drafter.

When the committed sequence leaves the reference (a lossy selector committed another token), the reference
is recomputed from the committed sequence. Computing it is not drafting: the drafter's time is its fixed
cost per block (`cost_s`, default 0), reported as the block's drafting time (`fixed_cost_s`). `cost_mode`
says whether that time also passes: "charge" (default) only accounts it; "spin" busy-waits `cost_s` on the
host at the end of `propose` (after the reference, which is not counted), so an engine's wall clock and the
copies in flight see a drafter of that cost. The spin occupies the host thread, not the GPU's compute
stream: it stands for a drafter whose GPU work the copy stream overlaps, as the engine's drafters' does.
Draws are seeded by the seed and the prompt's tokens.
"""

from __future__ import annotations

import time
import zlib
from typing import Callable

import numpy as np
import torch

from specmoe.speculation import advance, prompt_tokens

from .base import COST_MODES, DrafterError

LOOKAHEAD = 32  # reference tokens computed per call beyond those a block needs


class SyntheticDrafter:
    """Drafts from `continuation` (see the module docstring) with geometric rate `acceptance` or the table
    `commit_probs`, over a vocabulary of `vocab_size` tokens; `cost_s` per block, charged or also spent
    (`cost_mode`)."""

    name = "synthetic"
    target_layer_ids: tuple[int, ...] = ()
    hidden_size = None  # reads no target features (vocab_size: the target's, given)
    max_drafts = None

    def __init__(self, continuation: Callable[[list[int], int], list[int]], vocab_size: int,
                 acceptance: float = 0.8, commit_probs=None, seed: int = 0, cost_s: float = 0.0,
                 cost_mode: str = "charge"):
        if cost_mode not in COST_MODES:
            raise DrafterError(f"cost_mode must be one of {COST_MODES}, got {cost_mode!r}")
        self.continuation = continuation
        self.vocab_size = int(vocab_size)
        self.acceptance = float(acceptance)
        self.commit_probs = None if commit_probs is None else np.asarray(commit_probs, dtype=np.float64)
        self.seed = int(seed)
        self.fixed_cost_s = float(cost_s)
        self.cost_mode = cost_mode
        self.tokens: list[int] = []
        self.reference: list[int] = []
        self._drafts: list[int] = []
        self._rng = None

    def commit_probabilities(self, k: int) -> np.ndarray:
        """q_d for depths 1..k (float64 [k])."""
        if self.commit_probs is None:
            return self.acceptance ** np.arange(1, k + 1, dtype=np.float64)
        q = np.zeros(k)
        n = min(k, self.commit_probs.shape[0])
        q[:n] = self.commit_probs[:n]
        return q

    def reset(self, prompt: torch.Tensor, features=None) -> None:
        self.tokens = prompt_tokens(prompt)
        self.reference = list(self.tokens)
        self._drafts = []
        digest = zlib.crc32(np.asarray(self.tokens, dtype=np.int64).tobytes())
        self._rng = np.random.default_rng([self.seed, digest])

    def _reference_ahead(self, k: int) -> np.ndarray:
        """The reference's k tokens after the committed sequence (recomputed where the two parted)."""
        n = len(self.tokens)
        if self.reference[:n] != self.tokens:
            self.reference = list(self.tokens)
        if len(self.reference) < n + k:
            self.reference += self.continuation(self.reference, n + k - len(self.reference) + LOOKAHEAD)
        return np.asarray(self.reference[n:n + k], dtype=np.int64)

    def propose(self, k: int) -> tuple[torch.Tensor, np.ndarray]:
        reference = self._reference_ahead(k)
        q = self.commit_probabilities(k)
        right = int((self._rng.random() < q).sum())
        wrong = (reference + 1 + self._rng.integers(0, self.vocab_size - 1, size=k)) % self.vocab_size
        drafts = np.where(np.arange(k) < right, reference, wrong)
        previous = np.concatenate(([1.0], q[:-1]))
        confidences = np.divide(q, previous, out=np.zeros(k), where=previous > 0)
        self._drafts = drafts.tolist()
        if self.cost_mode == "spin":
            spin(self.fixed_cost_s)
        return torch.from_numpy(drafts), confidences

    def commit(self, accepted: int, bonus_token: int, features=None) -> None:
        self.tokens = advance(self.tokens, self._drafts, accepted, bonus_token)
        self._drafts = []


def spin(seconds: float) -> None:
    """Busy-wait `seconds` on the host (time.sleep overshoots by up to a scheduler tick at these lengths)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass
