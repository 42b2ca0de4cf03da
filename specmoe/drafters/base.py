"""The drafter protocol of speculative decoding and the drafter configuration (`build_drafter`, in build.py,
makes a drafter from one).

A drafter proposes the k tokens that one verification block checks (paper, Section 7). The protocol itself,
`Drafter`, lives with the rest of the speculative semantics in `specmoe.speculation` (the harness and the
engines type against it); its rules are these. A drafter's state follows the committed sequence of one
request:

- `reset(prompt, features)`: start a request; the prompt is committed and its last token is the root of
  the first verification block.
- `propose(k) -> (tokens [k], confidences [k])`: the k drafts that continue the committed sequence, and
  c_i, the drafter's probability of its own token i (what confidence weighting reads). Proposing does not
  change what is committed.
- `commit(accepted, bonus_token, features)`: the verification accepted the first `accepted` drafts and the
  target's own token after them (the bonus token) follows; the drafter advances over them and rolls back
  whatever it computed for the rejected drafts. The bonus token is the next root.

Drafters that read the target's hidden states (DFlash) name the target layers in `target_layer_ids`; the
harness then hands them the features of every committed position the target has processed: at `reset`
the prompt without its last token (the prefill), at `commit` the root and the accepted drafts of the block,
each as the hidden states after those layers concatenated ([n, len(layer_ids) * H]). Other drafters get
None. `fixed_cost_s`, where not None, is the drafting time charged per block instead of the measured wall
time (the synthetic drafter's optional cost); the harness measures drafting apart from verification.

Drafters are chosen by name (`DRAFTERS`): ``ar`` (a transformers causal LM with the target's vocabulary),
``dflash`` (a DFlash block drafter conditioned on the target's features) and ``synthetic`` (exact routing's
greedy continuation with a set acceptance profile). ``ar`` and ``dflash`` have two runtimes (`RUNTIMES`):
``hf``, the transformers modules with a DynamicCache (`hf_autoregressive`, `dflash`), and ``static``, our
own decode step over the same weights with a static KV cache, one CUDA graph per drafted token (AR) or per
block (DFlash) on a GPU and the same code eagerly on the CPU (`static_ar`, `static_dflash`). ``auto`` picks
``static`` on a CUDA device where the architecture is supported, else ``hf``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

DRAFTERS = ("ar", "dflash", "synthetic")
RUNTIMES = ("auto", "hf", "static")
COST_MODES = ("charge", "spin")
ATTENTIONS = ("auto", "split_kv", "sdpa")  # the static drafters' ("auto": split_kv on CUDA with Triton, else sdpa)


class DrafterError(ValueError):
    """A drafter that cannot run with this target or configuration (unknown name, other vocabulary,
    hidden size or layers that do not fit the target, k beyond what it drafts, a bad acceptance profile)."""


@dataclass(frozen=True)
class DrafterConfig:
    """A drafter by name, with what building it needs.

    path: checkpoint directory of ``ar`` or ``dflash`` (None: the shipped family's drafter). Synthetic:
    `acceptance` is the rate of a geometric acceptance profile (draft d is committed with probability
    acceptance^d), or `commit_probs` a table q_1 >= q_2 >= ... of the probability that draft d is committed
    (drafts beyond the table are wrong); `seed` seeds its draws (combined with the prompt, so a request's
    drafts do not depend on the order of requests); `cost_s` is the drafting time per block, which
    `cost_mode` "charge" only accounts (reported as drafting time, no wall time passes) and "spin" also
    spends (reported the same, and `propose` busy-waits that long on the host, so a run's wall clock and
    the copies' overlap see it).

    runtime (``ar``, ``dflash``): "hf" (transformers modules), "static" (static KV cache and CUDA graphs; eager
    on the CPU) or "auto" (static on a CUDA device where the architecture is supported, else hf);
    max_seq_len: positions of the static cache (prompt + new tokens + one block); cuda_graphs: capture the
    static drafter's step (False: eager launches, for debugging); attention: "auto" (split-KV on CUDA with
    Triton, else SDPA), "split_kv" or "sdpa" for the static drafter."""

    name: str
    path: str | None = None
    acceptance: float = 0.8
    commit_probs: tuple[float, ...] | None = None
    seed: int = 0
    cost_s: float = 0.0
    cost_mode: str = "charge"
    runtime: str = "auto"
    max_seq_len: int = 4096
    cuda_graphs: bool = True
    attention: str = "auto"

    def __post_init__(self) -> None:
        if self.name not in DRAFTERS:
            raise DrafterError(f"unknown drafter {self.name!r}; expected one of {', '.join(DRAFTERS)}")
        if not 0.0 <= self.acceptance <= 1.0:
            raise DrafterError(f"acceptance must be in [0, 1], got {self.acceptance!r}")
        if self.commit_probs is not None:
            probs = tuple(float(p) for p in self.commit_probs)
            if not probs or not all(0.0 <= p <= 1.0 for p in probs) or any(b > a for a, b in zip(probs, probs[1:])):
                raise DrafterError(f"commit_probs must be a non-empty, non-increasing table of probabilities, "
                                   f"got {self.commit_probs!r}")
            object.__setattr__(self, "commit_probs", probs)
        if not 0.0 <= self.cost_s < math.inf:
            raise DrafterError(f"cost_s must be a finite number >= 0, got {self.cost_s!r}")
        if self.cost_mode not in COST_MODES:
            raise DrafterError(f"cost_mode must be one of {COST_MODES}, got {self.cost_mode!r}")
        if self.runtime not in RUNTIMES:
            raise DrafterError(f"runtime must be one of {RUNTIMES}, got {self.runtime!r}")
        if isinstance(self.max_seq_len, bool) or not isinstance(self.max_seq_len, int) or self.max_seq_len < 2:
            raise DrafterError(f"max_seq_len must be an integer >= 2, got {self.max_seq_len!r}")
        if self.attention not in ATTENTIONS:
            raise DrafterError(f"attention must be one of {ATTENTIONS}, got {self.attention!r}")

    def to_dict(self) -> dict:
        return asdict(self)


def greedy_confidence(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy tokens of logits [n, V] and the probability the distribution gives them (float64)."""
    probs = torch.softmax(logits.float(), dim=-1)
    tokens = probs.argmax(-1)
    return tokens, probs.gather(-1, tokens[:, None])[:, 0].double()
