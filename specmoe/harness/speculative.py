"""Greedy speculative decoding of a transformers MoE target with block-level expert selection in its forward.

One request (batch 1), `speculative_generate`:
- prefill: the whole prompt runs in one forward under exact routing (every position its router's own
  top-K). It is routed through the pool like a block, so the pool's recency refill leaves the P experts the
  prompt executed last in it, but its copies are not counted (they belong to the prompt, as in AR decoding,
  where the prompt is not timed either). The target's greedy token after the prompt is the first new token
  (committed, in no block; it counts toward max_new_tokens and, as a stop token, ends the request there).
  The drafter starts from the prompt and that token, with the prompt's hidden states as a DFlash drafter's
  first context features. This is the public DFlash decoding loop's (`dflash_generate`), vLLM's and
  SGLang's first step, so the blocks that follow are theirs.
- verification blocks: the root (the last committed token; the first root is the first new token, at
  position len(prompt)) and k drafts go through the target in one forward of D = k + 1 positions. At every
  MoE layer the patched router hands the raw router logits of all D positions to
  `specmoe.verifiers.select_block` (which computes a sigmoid router's selection scores, as the engine's does), with the model's router rule (`model_scoring`: softmax, or
  sigmoid with its bias, groups and scaling), the pool's residency and the position weights alpha of the
  selector (ones for ``exact``, `CommitRate`'s per-request commitment rates for ``acceptmoe``, the drafter's
  confidences for ``confidence_top1``); the pool records the block's union and copies its missing experts;
  each position executes its selected experts with the model's own weights (`adapter.execution_weights`:
  the unmodified router probabilities at them, renormalised and scaled as the model does).
- acceptance (greedy): a = the longest prefix of drafts equal to the target's greedy tokens at positions
  0..a-1; the block commits those a drafts and the bonus token, the target's greedy token at position a.
  The target's KV cache is cropped to the committed positions it has processed, the pool is refilled by
  recency, the drafter commits (rolling back its own state), until `max_new_tokens` are committed or a
  stop token is (the tokens after it, and beyond max_new_tokens, are dropped from the output).

With the ``exact`` selector the output is AR greedy decoding under exact routing, token for token (up to
floating-point near-ties between a D-position and a one-position forward).

Reported per request (`SpeculativeResult.summary`): tau = committed tokens per verification
(`specmoe.speculation.tau`: accepted drafts + 1 per block, the paper's definition and vLLM's, SGLang's and
`dflash_generate`'s mean acceptance length; the first new token, from the prefill, is in no block; a block cut
by max_new_tokens or a stop token counts the tokens it kept); the acceptance rate of each draft position (blocks whose accepted length reaches
it); the accepted-length histogram; host-to-device copies per committed token (the pool's copies: one per
missing expert per block and layer; refills move experts between GPU slots and copy nothing); displaced
router mass per committed token-layer (mass of a committed position's own top-K that it did not execute,
committed positions = the root and the accepted drafts); the divergence from exact routing of the
next-token distributions of every committed token, the first new token's included
(`divergence_from_exact`); and drafting time (measured, or the drafter's fixed cost) apart from
verification time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from specmoe.models import MoEAdapter, extract_context_feature
from specmoe.routing import Calibration, RouterScoring
from specmoe.speculation import (EXACT, Drafter, SpeculativeConfig, accepted_length, block_weights, commit_block,
                                 crop_cache, drafting_time, prompt_tokens, summarize)
from specmoe.verifiers import (CommitRate, ExpertPool, PrefetchTally, SelectionBuffers, SelectorConfig,
                               predict_prefetch, select_block_into)
from specmoe.verifiers.prefetch import NONE as NO_PREFETCH

from .patch import check_calibration, exact_routing, model_scoring, routed_by
from .recurrent import MixerStates


class BlockRoutingContext:
    """The routing state of a target patched for verification: the pool, the selector and position weights
    of the forward in progress, and what each position saw and executed (layer by layer)."""

    def __init__(self, adapter: MoEAdapter, pool: ExpertPool, routers: list[nn.Module], record: bool = False,
                 scoring: RouterScoring | None = None, prefetch: int = 0):
        self.adapter = adapter
        self.prefetch = prefetch  # the block prefetch budget, counted as the engine makes it (`PrefetchTally`)
        self.tally = PrefetchTally()
        self.ahead = [NO_PREFETCH] * adapter.num_moe_layers  # the experts prefetched for each layer of the forward
        self.predicted: SelectionBuffers | None = None
        self.scoring = scoring or RouterScoring("softmax", renormalise=adapter.norm_topk_prob)
        self.pool = pool
        self.routers = routers
        self.record = record
        self.selector: SelectorConfig | None = None
        self.alpha: np.ndarray | None = None
        self.buffers: SelectionBuffers | None = None
        self.displaced = self.selected = self.scores = self.pregate = None  # [D, L], [D, L, K], [D, L, E] x 2

    def start_block(self, selector: SelectorConfig, alpha: np.ndarray) -> None:
        """Route the next forward (D = len(alpha) positions) with `selector` and position weights `alpha`."""
        self.selector, self.alpha = selector, np.asarray(alpha, dtype=np.float64)

    def begin_forward(self, tokens: np.ndarray, valid: np.ndarray, past_valid) -> None:
        """Called by the decoder stack's pre-hook with the forward's token ids [1, D]."""
        if self.selector is None:
            raise RuntimeError("a verification forward needs start_block(selector, alpha) first")
        batch, span = tokens.shape
        if batch != 1 or span != self.alpha.shape[0] or not valid.all():
            raise RuntimeError(f"the block context routes one unpadded row of {self.alpha.shape[0]} positions, "
                               f"got a forward of {batch} x {span}")
        layers, experts, k = self.adapter.num_moe_layers, self.adapter.num_experts, self.adapter.top_k
        if self.buffers is None or self.buffers.max_positions < span:
            self.buffers = SelectionBuffers(span, experts, k, np.float32)
            self.predicted = SelectionBuffers(span, experts, k, np.float32)
        self.ahead = [NO_PREFETCH] * layers
        self.displaced = np.zeros((span, layers))
        self.selected = np.full((span, layers, k), -1, dtype=np.int64)
        if self.record:
            self.scores = np.zeros((span, layers, experts), dtype=np.float32)
            self.pregate = np.zeros((span, layers, experts), dtype=np.float32)

    def route(self, layer: int, router_logits: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The executed experts [D, K] of MoE layer `layer` for the forward's D positions (`select_block`
        with the pool's residency), recorded into the pool."""
        adapter = self.adapter
        z = router_logits.detach().to("cpu", torch.float32).numpy()
        # softmax: z is what selection ranks; sigmoid: the kernel ranks sigmoid(z) + bias from the raw logits and
        # the scoring's bias, as the engine's `BlockRouter` does
        scores = z if self.scoring.kind == "softmax" else None
        span = z.shape[0]
        select_block_into(self.selector, z, self.pool.resident(layer), self.alpha, adapter.top_k, self.scoring,
                          self.buffers, layer=layer, scores=scores)
        selected = self.buffers.selected[:span]
        pool = self.pool
        missing, _ = pool.use(layer, selected)
        self.tally.count(self.ahead[layer], missing, pool.pool_size, pool.union_slots)
        self.selected[:, layer] = selected
        self.displaced[:, layer] = self.buffers.displaced[:span]
        if self.record:
            self.scores[:, layer] = z  # the raw logits (`specmoe.records.block_records`)
        if layer + 1 < adapter.num_moe_layers and (self.record or self.prefetch):
            g = adapter.router_logits(self.routers[layer + 1], hidden).detach().float().cpu().numpy()
            if self.record:
                self.pregate[:, layer + 1] = g
            # the block prefetch of the next layer from its pre-gate, as the engine's `BlockRouter.predict`
            self.ahead[layer + 1] = predict_prefetch(self.selector, g, pool.resident(layer + 1), self.alpha,
                                                     adapter.top_k, self.scoring, self.predicted, self.prefetch,
                                                     pool.union_slots, layer + 1)
        return torch.from_numpy(selected.copy()).to(router_logits.device)


@dataclass
class SpeculativeResult:
    """One request's speculative decoding (see the module docstring)."""

    tokens: torch.Tensor  # the new committed tokens [n]: the first new token (the prefill's), then the blocks'
    k: int
    num_layers: int
    roots: list[int]  # root position of each verification block (the first: len(prompt), the first new token)
    accepted: list[int]  # accepted drafts of each block
    copies: int  # host-to-device copies of the blocks (the prefill's excluded)
    moves: int  # pool refill moves between GPU slots
    displaced: float  # displaced router mass summed over layers and the blocks' committed positions (a + 1 each)
    logprobs: torch.Tensor  # [n, V] the log-probabilities each new token was decoded from (row 0: the prefill's)
    draft_s: float
    verify_s: float
    prefill_s: float
    pool: ExpertPool
    divergence: dict = field(default_factory=dict)
    prefetch: dict = field(default_factory=dict)  # the blocks' prefetch counts (`PrefetchTally.as_dict`)
    block_s: list[float] = field(default_factory=list)  # each block's drafting + verification seconds
    blocks: list[dict] = field(default_factory=list)  # with record=True: per block, see specmoe.records.block_records

    @property
    def verifications(self) -> int:
        return len(self.accepted)

    @property
    def accepted_hist(self) -> np.ndarray:
        """Blocks by accepted length 0..k."""
        return np.bincount(np.asarray(self.accepted, dtype=np.int64), minlength=self.k + 1)

    def counts(self) -> dict:
        """Sums over the request, which `summarize` pools over requests."""
        return {"requests": 1, "verifications": self.verifications, "block_tokens": sum(a + 1 for a in self.accepted),
                "block_committed": max(int(self.tokens.numel()) - 1, 0), "committed": int(self.tokens.numel()), "accepted_hist": self.accepted_hist, "copies": self.copies,
                "moves": self.moves, "displaced": self.displaced, "num_layers": self.num_layers,
                "draft_s": self.draft_s, "verify_s": self.verify_s, "prefill_s": self.prefill_s,
                **{key: self.divergence.get(key, 0.0) for key in ("kl_sum", "excess_nll_sum", "positions")}}

    def summary(self) -> dict:
        """`summarize` of the request, with the block prefetch's counts per committed token (`prefetch`)."""
        out = summarize([self])
        committed = max(int(self.tokens.numel()), 1)
        out.update({f"{key}_per_token": value / committed for key, value in self.prefetch.items()
                    if key != "union_peak"})
        if self.prefetch:
            out["union_peak"] = self.prefetch["union_peak"]
        return out


def _features(out, drafter: Drafter) -> torch.Tensor | None:
    """The drafter's context features [S, n*H] of a forward's positions (None for drafters without)."""
    if not drafter.target_layer_ids:
        return None
    return extract_context_feature(out.hidden_states, list(drafter.target_layer_ids))[0]


@torch.no_grad()
def speculative_generate(model: nn.Module, adapter: MoEAdapter, drafter: Drafter, prompt, config: SpeculativeConfig,
                         *, calibration: Calibration | None = None, commit_rate: CommitRate | None = None,
                         record: bool = False, divergence: bool = True,
                         stop: Callable[[list[int]], bool] | None = None) -> SpeculativeResult:
    """Decode `prompt` (token ids) greedily with `drafter` and block-level selection (module docstring).

    calibration: its warm set is the pool's start (default: the neutral calibration, experts by index);
    commit_rate: the acceptmoe weights' estimator, reset here (default `CommitRate()`); record: keep every
    block (`result.blocks`, see `specmoe.records.block_records`); divergence: compare the committed positions with
    exact routing (`divergence_from_exact`, one extra forward); stop: called with the new tokens after the first
    new token and after every block, True ends the request there (e.g. a stop string in their text; the
    block's tokens are kept)."""
    from transformers import DynamicCache

    config.check(adapter, drafter)
    calibration = calibration or Calibration.uniform(adapter.num_moe_layers, adapter.num_experts, adapter.vocab_size)
    check_calibration(model, adapter, calibration)
    tokens = prompt_tokens(prompt)
    prompt_len, k, selector = len(tokens), config.k, config.selector
    device = next(model.parameters()).device
    pool = ExpertPool(adapter.num_moe_layers, adapter.num_experts, adapter.top_k, config.pool_size, calibration)
    commit_rate = commit_rate or CommitRate()
    commit_rate.reset()
    context = BlockRoutingContext(adapter, pool, adapter.routers(model), record=record,
                                  scoring=model_scoring(model, adapter), prefetch=config.prefetch)
    cache = DynamicCache(config=model.config)
    mixers = MixerStates(model, cache)  # linear-attention layers' states, rolled back by the loop (none: no-op)
    new: list[int] = []
    roots, accepted, logprobs, blocks = [], [], [], []
    displaced = draft_s = verify_s = 0.0
    block_s: list[float] = []

    def forward(ids: list[int], block_selector: SelectorConfig, alpha: np.ndarray):
        context.start_block(block_selector, alpha)
        out = model(input_ids=torch.tensor([ids], device=device), past_key_values=cache, use_cache=True,
                    output_hidden_states=bool(drafter.target_layer_ids))
        pool.end_block()
        return out

    with routed_by(model, context), mixers:
        started = time.perf_counter()
        out = forward(tokens, EXACT, np.ones(prompt_len))
        base, before = pool.totals(), context.tally.as_dict()
        context.tally.union_peak = 0  # the blocks' peak
        first = int(out.logits[0, -1].argmax())  # the first new token: the root of the first block
        logprobs.append(torch.log_softmax(out.logits[0, -1:].float(), dim=-1).cpu())
        tokens.append(first)
        new.append(first)
        drafter.reset(torch.tensor(tokens), _features(out, drafter))
        prefill_s = time.perf_counter() - started
        done = first in config.stop_tokens or (stop is not None and stop(new))
        while not done and len(new) < config.max_new_tokens:
            started = time.perf_counter()
            drafts, confidences = drafter.propose(k)
            drafting = drafting_time(drafter, started)
            drafts = [int(t) for t in drafts]
            started = time.perf_counter()
            alpha = block_weights(selector, k, commit_rate, confidences)
            mixers.snapshot()
            out = forward([tokens[-1]] + drafts, selector, alpha)
            greedy = out.logits[0].argmax(-1).tolist()
            a = accepted_length(drafts, greedy)
            mixers.rollback(a + 1)  # the recurrent states over the committed positions only (outside any routing)
            crop_cache(cache, len(tokens) + a)  # the committed positions: the prompt, ..., the root, a drafts
            commit_rate.update(a, k)
            logprobs.append(torch.log_softmax(out.logits[0, :a + 1].float(), dim=-1).cpu())
            displaced += float(context.displaced[:a + 1].sum())
            verifying = time.perf_counter() - started
            if record:
                blocks.append(_block_record(context, len(tokens) - 1, [tokens[-1]] + drafts, confidences, a, greedy[a]))
            started = time.perf_counter()
            features = _features(out, drafter)
            drafter.commit(a, greedy[a], None if features is None else features[:a + 1])
            drafting += drafting_time(drafter, started, count_fixed=False)
            draft_s, verify_s = draft_s + drafting, verify_s + verifying
            block_s.append(drafting + verifying)
            roots.append(len(tokens) - 1)
            accepted.append(a)
            done = (commit_block(tokens, new, drafts, a, greedy[a], config.stop_tokens)
                    or (stop is not None and stop(new)))
    del new[config.max_new_tokens:]
    totals = pool.totals()
    result = SpeculativeResult(
        torch.tensor(new, dtype=torch.long), k, adapter.num_moe_layers, roots, accepted,
        totals["copies"] - base["copies"], totals["moves"] - base["moves"], displaced,
        torch.cat(logprobs)[:len(new)], draft_s, verify_s, prefill_s, pool, block_s=block_s, blocks=blocks,
        prefetch={key: value if key == "union_peak" else value - before[key]
                  for key, value in context.tally.as_dict().items()})
    if divergence:
        result.divergence = divergence_from_exact(model, adapter, tokens[:prompt_len], result.tokens, result.logprobs)
    return result


def _block_record(context: BlockRoutingContext, root: int, ids: list[int], confidences, accepted: int,
                  bonus: int) -> dict:
    """One verification block as `specmoe.records.block_records` stores it (without the request index)."""
    return {"root_position": root, "tokens": np.asarray(ids), "confidences": np.asarray(confidences),
            "accepted": accepted, "bonus": bonus, "router_logits": context.scores, "pregate_logits": context.pregate,
            "selected": context.selected}


@torch.no_grad()
def greedy_decode(model: nn.Module, prompt, max_new_tokens: int, stop_tokens=(), after_prefill=None):
    """AR greedy decoding of one prompt under the model's current routing: (new tokens [n], next-token
    log-probabilities [n, V] at the positions that produced them).

    The prompt without its last token is prefilled in one forward, then every step feeds one token (the
    first: the last prompt token) and produces the next, so n new tokens take n routed steps (unlike
    `speculative_generate`, whose prefill takes the whole prompt and decodes the first new token);
    `after_prefill()` is called between the two (e.g. a routing context's `clear_counters`, so that copies
    count decoding only).
    Stops after max_new_tokens or a stop token (kept)."""
    from transformers import DynamicCache

    tokens = prompt_tokens(prompt)
    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    if len(tokens) > 1:
        model(input_ids=torch.tensor([tokens[:-1]], device=device), past_key_values=cache, use_cache=True)
    if after_prefill is not None:
        after_prefill()
    new, logprobs = [], []
    while len(new) < max_new_tokens and not (new and new[-1] in stop_tokens):
        ids = torch.tensor([[new[-1] if new else tokens[-1]]], device=device)
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1].float()
        logprobs.append(torch.log_softmax(logits, dim=-1).cpu())
        new.append(int(logits.argmax()))
    return torch.tensor(new, dtype=torch.long), torch.stack(logprobs)


def exact_continuation(target: nn.Module) -> Callable[[list[int], int], list[int]]:
    """(prefix, n) -> the next n tokens of `target`'s greedy decoding under exact routing (`greedy_decode`
    inside `exact_routing`): the reference continuation that the ``synthetic`` drafter drafts from."""

    def continuation(prefix: list[int], n: int) -> list[int]:
        with exact_routing(target):
            return greedy_decode(target, torch.tensor(prefix), n)[0].tolist()

    return continuation


@torch.no_grad()
def divergence_from_exact(model: nn.Module, adapter: MoEAdapter, prompt, new_tokens: torch.Tensor,
                          logprobs: torch.Tensor) -> dict:
    """How far the committed positions' next-token distributions are from exact routing on the same prefix.

    new_tokens [n] were decoded after `prompt`; logprobs [n, V] are the distributions that produced them
    (row i predicts new token i from the prompt and new tokens < i). Exact routing runs once, teacher-forced,
    over prompt + new_tokens[:-1]. Per position: KL(exact || routed) = sum_v p_exact(v) (log p_exact(v) -
    log p_routed(v)), and the excess NLL of the token actually decoded, log p_exact(x) - log p_routed(x)
    (under greedy decoding x is the routed argmax, so this is usually <= 0; the KL is the quality measure).
    Returns the means (kl, excess_nll), their sums and the number of positions."""
    tokens = prompt_tokens(prompt)
    n = int(new_tokens.numel())
    if n == 0:
        return {"kl": float("nan"), "excess_nll": float("nan"), "kl_sum": 0.0, "excess_nll_sum": 0.0, "positions": 0}
    device = next(model.parameters()).device
    ids = torch.tensor([tokens + new_tokens.tolist()[:-1]], device=device)
    with exact_routing(model, adapter):
        exact = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[0, len(tokens) - 1:].float(), -1).cpu()
    routed = logprobs.float()
    kl = (exact.exp() * (exact - routed)).sum(-1).double().clamp_min(0.0)  # >= 0 but for rounding
    index = new_tokens[:, None].cpu()
    excess = (exact.gather(-1, index) - routed.gather(-1, index))[:, 0].double()
    return {"kl": float(kl.mean()), "excess_nll": float(excess.mean()), "kl_sum": float(kl.sum()),
            "excess_nll_sum": float(excess.sum()), "positions": n}
