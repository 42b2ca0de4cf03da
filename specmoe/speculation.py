"""The semantics of greedy speculative decoding, shared by the harness loop, the engines and the replay.

One request is a prefill and a sequence of verification blocks. The prefill processes the whole prompt; its
greedy token is the first new token and the root of the first block. A block has D = k + 1 positions: the root (the last
committed token) and k drafts from a `Drafter`. The target verifies all D positions in one step; greedy
acceptance keeps the longest prefix of drafts equal to the target's greedy tokens (`accepted_length`), and
the block commits those drafts and the bonus token, the target's greedy token after them (`commit_block`,
`advance`). The verifier's expert selection weights the block's positions by alpha [D] (`block_weights`,
dispatched through the selector registry `specmoe.verifiers.SELECTORS`). tau = committed tokens per
verification (`tau`, the one definition): the tokens the verification blocks committed (accepted drafts + 1 per
block; a block cut by max_new_tokens or a stop token counts the tokens it kept; the prefill's first new token is
in no block) over the number of blocks.

Everything here is plain Python and numpy: the harness (transformers models), the engines (static decoders)
and the CPU replay (recorded blocks) call it, and it imports none of them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from specmoe.limits import MAX_DRAFTS, MAX_TOKENS
from specmoe.routing.validate import integer
from specmoe.verifiers import SELECTORS, CommitRate, SelectorConfig, selector_preset

EXACT = selector_preset("exact")
PREFETCH = 0  # the default block prefetch budget: off until a GPU measurement shows it pays (docs/block-prefetch.md)


class Drafter(Protocol):
    """What the speculative loop needs from a drafter (see `specmoe.drafters` for the protocol's rules).

    `reset(prompt, features)` starts a request (the prompt and the first new token, the prefill's greedy
    token: the root of the first block); `propose(k)` returns the k drafts that continue the committed
    sequence and the drafter's confidence c_i in each; `commit(accepted, bonus_token, features)` advances over
    the committed tokens and rolls back the rest. `vocab_size` must be the target's and `hidden_size` the
    hidden size of the target features it reads (None: none; `specmoe.drafters.check_drafter_fits` checks
    both); `target_layer_ids` names the target layers whose hidden states the drafter reads (empty: none);
    `max_drafts` the largest k of one `propose` (None: any); `fixed_cost_s` the drafting time charged per
    block instead of the measured time (None: measured)."""

    name: str
    vocab_size: int  # the drafter's vocabulary: must be the target's
    hidden_size: int | None  # of the target features it reads (None: it reads none)
    target_layer_ids: tuple[int, ...]
    max_drafts: int | None  # the largest k one `propose` can give (None: any)
    fixed_cost_s: float | None

    def reset(self, prompt, features=None) -> None: ...

    def propose(self, k: int) -> tuple[object, np.ndarray]: ...

    def commit(self, accepted: int, bonus_token: int, features=None) -> None: ...


@dataclass(frozen=True)
class SpeculativeConfig:
    """The settings of speculative decoding: the selector, k drafts per block, P pool experts per layer, the most
    new tokens per request, the tokens that end a request, U union slots per layer for a block's missing
    experts (the engine's slot buffer; None: E - P, always enough; the harness's pool needs none), and the block
    prefetch budget: at most `prefetch` experts per layer and block copied ahead of the layer from the pre-gate
    logits' prediction (`specmoe.verifiers.prefetch`; 0: off; never changes a selection)."""

    selector: SelectorConfig
    k: int = 8
    pool_size: int = 32
    max_new_tokens: int = 64
    stop_tokens: tuple[int, ...] = ()
    union_slots: int | None = None
    prefetch: int = PREFETCH

    def __post_init__(self) -> None:
        if not isinstance(self.selector, SelectorConfig):
            raise ValueError(f"selector must be a SelectorConfig, got {type(self.selector).__name__}")
        object.__setattr__(self, "k", integer(self.k, "k (drafts per block)", minimum=1, maximum=MAX_DRAFTS))
        object.__setattr__(self, "max_new_tokens", integer(self.max_new_tokens, "max_new_tokens", minimum=1,
                                                           maximum=MAX_TOKENS))
        object.__setattr__(self, "pool_size", integer(self.pool_size, "pool_size", minimum=1))
        object.__setattr__(self, "prefetch", integer(self.prefetch, "prefetch (experts per layer and block)",
                                                     minimum=0))
        object.__setattr__(self, "stop_tokens", tuple(int(t) for t in self.stop_tokens))

    def union(self, num_experts: int) -> int:
        """U, the union slots per layer (E - P unless set)."""
        return num_experts - self.pool_size if self.union_slots is None else self.union_slots

    def check(self, geometry, drafter: Drafter | None = None) -> None:
        """ValueError unless the pool fits the model (K <= P <= E), the union slots hold what the root alone may
        miss (min(K, E - P) <= U <= E - P), a block of k + 1 positions fits `geometry.max_seq_len` (where the
        geometry has one: a decoder's static KV cache) and the drafter drafts k tokens.

        geometry: anything with `top_k` and `num_experts` (a `MoEAdapter`, a `specmoe.geometry.Geometry`)."""
        k_top, experts = geometry.top_k, geometry.num_experts
        if not k_top <= self.pool_size <= experts:
            raise ValueError(f"pool size P={self.pool_size} must satisfy K <= P <= E (K={k_top}, E={experts})")
        if drafter is not None and drafter.max_drafts is not None and self.k > drafter.max_drafts:
            raise ValueError(f"the {drafter.name} drafter drafts at most {drafter.max_drafts} tokens per block, "
                             f"k={self.k}")
        u, low = self.union(experts), min(k_top, experts - self.pool_size)
        if not low <= u <= experts - self.pool_size:
            raise ValueError(f"union slots U={u} must be in [min(K, E - P) = {low}, E - P = "
                             f"{experts - self.pool_size}] (the root alone may miss K experts)")
        max_seq_len = getattr(geometry, "max_seq_len", None)
        if max_seq_len is not None and self.k + 1 > max_seq_len:
            raise ValueError(f"a block of k + 1 = {self.k + 1} positions does not fit the static KV cache of "
                             f"{max_seq_len} positions")


# -- one block ------------------------------------------------------------------------------------------------
def prompt_tokens(prompt) -> list[int]:
    """A prompt (a 1-D tensor or array, or a sequence of token ids) as a list; at least one token."""
    flat = prompt.reshape(-1).tolist() if hasattr(prompt, "reshape") else np.asarray(prompt).reshape(-1).tolist()
    tokens = [int(t) for t in flat]
    if not tokens:
        raise ValueError("a prompt needs at least one token")
    return tokens


def block_weights(selector: SelectorConfig, k: int, commit_rate: CommitRate, confidences) -> np.ndarray:
    """Position weights alpha [k + 1] of a block of k drafts for `selector`: its kind's registered weighting
    (`specmoe.verifiers.SELECTORS`) of the request's commitment rates or the drafter's confidences [k]."""
    return SELECTORS[selector.kind].weigh(k, commit_rate, confidences)


def accepted_length(drafts: list[int], greedy: list[int]) -> int:
    """Greedy acceptance of a verification block: the longest prefix of `drafts` equal to the target's greedy
    tokens `greedy` at the block's positions 0, 1, ... (greedy[a] is then the bonus token)."""
    a = 0
    while a < len(drafts) and drafts[a] == greedy[a]:
        a += 1
    return a


def advance(tokens: list[int], drafts: list[int], accepted: int, bonus_token: int) -> list[int]:
    """The committed tokens after a verification that accepted the first `accepted` of `drafts`."""
    if not 0 <= accepted <= len(drafts):
        raise ValueError(f"accepted {accepted} outside [0, {len(drafts)}] drafts")
    return tokens + drafts[:accepted] + [int(bonus_token)]


def commit_block(tokens: list[int], new: list[int], drafts: list[int], accepted: int, bonus: int,
                 stop_tokens) -> bool:
    """Append a block's committed tokens (the accepted drafts and the bonus) to the sequence `tokens` and the
    request's output `new`; a stop token among them ends the request (the tokens after it are dropped from
    `new`): returns whether it did."""
    committed = drafts[:accepted] + [bonus]
    tokens += committed
    new += committed
    stops = [i for i, t in enumerate(committed) if t in stop_tokens]
    if stops:
        del new[len(new) - len(committed) + stops[0] + 1:]
    return bool(stops)


def keeps_recurrent_state(layer) -> bool:
    """Whether a transformers cache layer keeps a linear-attention layer's states (`conv_states`,
    `recurrent_states`), which hold no positions to crop."""
    return hasattr(layer, "conv_states") and hasattr(layer, "recurrent_states")


def crop_cache(cache, length: int) -> None:
    """Cut a transformers KV cache back to its first `length` positions, the rollback after a verification (a
    negative count to `crop`, which every transformers 5 release reads as positions to remove). Layers with a
    recurrent state (linear attention: `conv_states` and `recurrent_states`) hold no positions and are left as they
    are: the harness rolls them back itself (`specmoe.harness.recurrent`)."""
    remove = cache.get_seq_length() - int(length)
    if remove < 0:
        raise ValueError(f"cannot crop a cache of {cache.get_seq_length()} positions to {length}")
    if not remove:
        return
    layers = getattr(cache, "layers", ())
    recurrent = [keeps_recurrent_state(layer) for layer in layers]
    if not any(recurrent):
        cache.crop(-remove)
        return
    for layer, keeps_state in zip(layers, recurrent, strict=True):
        if keeps_state and hasattr(layer, "keys"):
            raise NotImplementedError(f"cannot crop a cache layer with both KV rows and a recurrent state "
                                      f"({type(layer).__name__})")
        if not keeps_state:
            layer.crop(-remove)


def drafting_time(drafter: Drafter, started: float, count_fixed: bool = True) -> float:
    """Drafting time since `started`, or the drafter's fixed cost per block (charged once, at propose)."""
    if drafter.fixed_cost_s is not None:
        return drafter.fixed_cost_s if count_fixed else 0.0
    return time.perf_counter() - started


# -- a run ------------------------------------------------------------------------------------------------------
def tau(block_committed: int, verifications: int) -> float:
    """tau = committed tokens per verification: the tokens the verification blocks committed (accepted drafts +
    1 each, a block cut by max_new_tokens or a stop token counting only the tokens it kept, the prefill's first
    new token in none) over the blocks (NaN without a block). The one formula: the harness, the engines, the
    replays and the benchmarks report this."""
    return block_committed / verifications if verifications else float("nan")


def summarize(results) -> dict:
    """Per committed token (or verification) figures pooled over requests: results with `counts()` (the
    harness's and the engines') or those counts. KL and excess NLL are means over committed positions (NaN if
    not computed)."""
    rows = [r if isinstance(r, dict) else r.counts() for r in results]
    total = {key: sum(row[key] for row in rows) for key in rows[0] if key != "num_layers"}
    hist = total["accepted_hist"]
    committed, blocks = max(total["committed"], 1), max(total["verifications"], 1)
    reached = hist[::-1].cumsum()[::-1][1:]  # blocks whose accepted length is at least d, d = 1..k
    return {"requests": total["requests"], "verifications": total["verifications"], "committed": total["committed"],
            "tau": tau(total["block_committed"], total["verifications"]), "acceptance_by_position": (reached / blocks).tolist(),
            "accepted_hist": hist.tolist(), "copies_per_token": total["copies"] / committed,
            "moves_per_token": total["moves"] / committed,
            "displaced_per_token_layer": total["displaced"] / (max(total["block_tokens"], 1) * rows[0]["num_layers"]),
            "kl": total["kl_sum"] / total["positions"] if total["positions"] else float("nan"),
            "excess_nll": total["excess_nll_sum"] / total["positions"] if total["positions"] else float("nan"),
            "draft_ms_per_token": 1e3 * total["draft_s"] / committed,
            "verify_ms_per_token": 1e3 * total["verify_s"] / committed}
