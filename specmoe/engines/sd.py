"""The speculative engine: greedy speculative decoding at batch 1 over an `ExpertResidency` unit (in progress:
runs and is tested on the CPU; the same code drives CUDA graphs through `StepRunner`, untested there).

Semantics are the harness loop's (`specmoe.harness.speculative`), on the engine's decoder instead of a
transformers forward. One verification block of D = k + 1 positions (the root and k drafts), layer by layer:
`StepRunner.attention` (attention over the static KV cache, router logits of the D positions) -> host:
`select_block_into` on the pool's residency with the selector's position weights alpha, `ExpertPool.use`
(the block's missing experts take union slots P, P+1, ...), demand copies of the missing experts into their
union slots on the copy stream, the route rows (slot ids from the pool's slot table, the selection's weights)
-> the layer waits only on the copy batches of the slots it executes -> `StepRunner.moe` -> next layer. Then
greedy acceptance (`accepted_length`), the bonus token, rollback by position (the next block's root sits at
the committed length; the KV rows above it are overwritten), the drafter's commit, and the pool refill
(`ExpertPool.end_block`), whose entering experts move from their union slot to a freed pool slot on the copy
stream (`CopyStream.move`), so that the slot buffer always follows the pool's slot table.

Choices:
- prefill: the prompt without its last token runs token by token (D = 1) under exact routing, each token one
  pool block; the pool's recency order after it is the harness's one-forward prefill's (later positions are
  more recent either way), so the first block starts from the same pool. Its copies and moves are not
  counted (prompt processing, as in the harness), and it is not timed.
- union slots: U (default E - P) must hold the root's missing experts, min(K, E - P); a block that misses
  more than U experts in a layer is an error (`ExpertPool.use` raises ValueError, re-raised here with the
  block), never a silent fallback.
- drafters that read the target's hidden states (DFlash: `target_layer_ids`): the decoder writes the hidden
  state after each named layer for the step's positions into `work["features"]` inside its graphs
  (`OlmoeDecoder.capture_features`, transformers' hidden_states[l + 1] convention, as the harness reads
  them); the drafter gets the prompt's rows (gathered from the D = 1 prefill steps) at `reset` and the root's
  and accepted drafts' rows of each verified block at `commit` (a device view, copied by the drafter before
  the next block). A drafter whose layers, hidden size or vocabulary do not fit the target is a DrafterError.
- routing reads only the logits and the token history: copy timing (`RunSettings.copy_delay`,
  `max_in_flight`) changes latency, never a token or a selection; `skip_copies` gives the compute-only time.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from specmoe.drafters import DrafterError
from specmoe.models.decoder import Decoder
from specmoe.offload import ExpertResidency, ExpertStore
from specmoe.replay.blocks import Blocks
from specmoe.routing import Calibration, validate
from specmoe.speculation import (EXACT, Drafter, SpeculativeConfig, accepted_length, block_weights, commit_block,
                                 drafting_time, summarize)
from specmoe.verifiers import CommitRate, ExpertPool, SelectionBuffers, select_block_into

from .ar import EngineConfig, RunSettings
from .runner import StepRunner


class SpecConfig(SpeculativeConfig):
    """`SpeculativeConfig` (union slots and their checks included) whose check also refuses a drafter that does
    not fit the target (`check_drafter_fits`)."""

    def check(self, geometry, drafter: Drafter | None = None) -> None:
        super().check(geometry, drafter)
        if drafter is not None:
            check_drafter_fits(drafter, geometry)


def check_drafter_fits(drafter: Drafter, geometry) -> None:
    """DrafterError unless the drafter's vocabulary is the target's and, for a drafter that reads the target's
    hidden states, every layer it names exists in the target and its hidden size is the target's (drafters
    say what they know: `vocab_size`, `hidden_size`)."""
    g, problems = geometry, []
    vocab = getattr(drafter, "vocab_size", None)
    if vocab is not None and vocab != g.vocab_size:
        problems.append(f"vocabulary {vocab} (target {g.vocab_size})")
    layers = list(drafter.target_layer_ids)
    if layers:
        missing = [i for i in layers if not 0 <= i < g.num_layers]
        if missing:
            problems.append(f"needs the hidden states after target layers {missing}, the target has layers "
                            f"0..{g.num_layers - 1}")
        hidden = getattr(drafter, "hidden_size", None)
        if hidden is not None and hidden != g.hidden:
            problems.append(f"hidden size {hidden} (target {g.hidden})")
    if problems:
        raise DrafterError(f"the {drafter.name} drafter does not fit the target: " + "; ".join(problems))


@dataclass
class SpecResult:
    """One request: the committed tokens, each block's root position and accepted drafts, the pool's copies
    and moves over the blocks (the prefill's excluded), per-block drafting / verification seconds and exposed
    copy wait (CPU: simulated link; NaN on a GPU, where the host does not see it: compare with a copies-skipped
    run), and with record=True each block's selections [D, L, K]."""

    tokens: list[int]
    k: int
    num_layers: int
    roots: list[int]
    accepted: list[int]
    copies: int
    moves: int
    displaced: float
    draft_s: list[float]
    verify_s: list[float]
    wait_s: list[float]
    prefill_s: float
    selected: list[np.ndarray] = field(default_factory=list)
    info: dict = field(default_factory=dict)

    @property
    def tau(self) -> float:
        """Committed tokens per verification (accepted drafts + 1 per block, blocks cut by a stop count whole)."""
        return sum(a + 1 for a in self.accepted) / max(len(self.accepted), 1)

    def counts(self) -> dict:
        """The sums `specmoe.harness.summarize` pools (no divergence: KL is NaN)."""
        return {"requests": 1, "verifications": len(self.accepted), "block_tokens": sum(a + 1 for a in self.accepted),
                "committed": len(self.tokens), "accepted_hist": np.bincount(self.accepted, minlength=self.k + 1),
                "copies": self.copies, "moves": self.moves, "displaced": self.displaced,
                "num_layers": self.num_layers, "draft_s": sum(self.draft_s), "verify_s": sum(self.verify_s),
                "prefill_s": self.prefill_s, "kl_sum": 0.0, "excess_nll_sum": 0.0, "positions": 0}

    def summary(self) -> dict:
        """The harness's per-token figures, plus p50 / p99 over blocks of drafting, verification and copy-wait ms
        and the exposed copy wait per committed token."""
        out = summarize([self.counts()])
        for name in ("draft_s", "verify_s", "wait_s"):
            ms = 1e3 * np.asarray(getattr(self, name) or [0.0])
            out[f"{name[:-2]}_ms_p50"], out[f"{name[:-2]}_ms_p99"] = np.percentile(ms, [50, 99]).tolist()
        out["wait_ms_per_token"] = 1e3 * sum(self.wait_s) / max(len(self.tokens), 1)
        return out


class SpecEngine:
    """Greedy speculative decoding of `decoder` with `drafter` over `residency` (module docstring). The unit
    needs P + U slots per layer and may be shared with an `ArEngine` used alternately."""

    def __init__(self, decoder: Decoder, residency: ExpertResidency, drafter: Drafter, calibration: Calibration,
                 config: SpecConfig, engine_config: EngineConfig = EngineConfig(),
                 settings: RunSettings = RunSettings(), fingerprint: str | None = None):
        g = self.geometry = decoder.geometry
        config.check(g, drafter)
        calibration.check(g.num_layers, g.num_experts)
        engine_config.check_decoder(decoder)
        if settings.cache_mode != "logical":
            raise ValueError("the speculative engine routes logically (outputs never depend on copy timing); "
                             f"cache_mode={settings.cache_mode!r} is the AR engine's")
        if decoder.scoring.kind != "softmax" or decoder.scoring.scale != 1.0:
            raise ValueError("block selection reads softmax router logits with unit scale; this decoder routes "
                             f"with {decoder.scoring.kind} scoring, scale {decoder.scoring.scale}")
        self.union_slots = config.union(g.num_experts)
        residency.check_fits(g.num_layers, g.num_experts, g.expert_width, decoder.dtype,
                             config.pool_size + self.union_slots)
        self.decoder, self.residency, self.copies = decoder, residency, residency.copies
        self.drafter, self.calibration, self.config, self.settings = drafter, calibration, config, settings
        self.fingerprint = fingerprint
        self.pool = ExpertPool(g.num_layers, g.num_experts, g.top_k, config.pool_size, calibration, self.union_slots)
        self.commit_rate = CommitRate()
        self.union_used = 0
        self.buffers = SelectionBuffers(config.k + 1, g.num_experts, g.top_k, np.float32)
        self.renormalise = decoder.scoring.renormalise
        self.cuda = residency.device.type == "cuda"
        self.compute = torch.cuda.Stream(device=residency.device) if self.cuda else None
        if drafter.target_layer_ids:  # before the runners make the decoder's steps
            if not hasattr(decoder, "capture_features"):
                raise DrafterError(f"the {drafter.name} drafter reads the target's hidden states, which this "
                                   f"decoder ({type(decoder).__name__}) does not capture")
            decoder.capture_features(drafter.target_layer_ids)
        self.feeds_features = bool(drafter.target_layer_ids)  # hand the drafter the decoder's features
        with torch.no_grad():
            self._load_warm()  # the kernel checks read real expert bytes from the slots
        self.kernels = engine_config.prepare(decoder, residency, self.compute)
        self.verifier = StepRunner(decoder, config.k + 1, residency, self.compute, engine_config.cuda_graphs)
        self.prefiller = StepRunner(decoder, 1, residency, self.compute, engine_config.cuda_graphs)
        self.notes = decoder.notes + self.verifier.notes + self.prefiller.notes

    def configure(self, **settings) -> None:
        """Change RunSettings fields (copy delay, max_in_flight, skip_copies) for the next runs."""
        settings = self.settings.updated(**settings)
        if settings.cache_mode != "logical":
            raise ValueError(f"cache_mode={settings.cache_mode!r}: the speculative engine routes logically")
        self.settings = settings

    # -- the pool and its slots ------------------------------------------------------------------------
    def _load_warm(self) -> int:
        self.settings.apply(self.residency)
        self.pool.reset()
        warm = []
        for layer in range(self.geometry.num_layers):
            table = self.pool.slot_table(layer)
            members = np.flatnonzero(table >= 0)
            warm.append(members[np.argsort(table[members])])  # the pool's experts in slot order 0 .. P-1
        return self.residency.load_warm(np.stack(warm))

    def _end_block(self) -> None:
        """Pool refill; the slot buffer follows: each expert entering the pool moves from its union slot to
        the pool slot the refill gives it (`ExpertPool.refill_moves`)."""
        self.pool.end_block()
        for layer in range(self.geometry.num_layers):
            src, dst = self.pool.refill_moves(layer)
            if src.size:
                self.copies.move(layer, src, dst)

    # -- one step of D positions -----------------------------------------------------------------------
    def _forward(self, run: StepRunner, ids: list[int], position: int, selector, alpha: np.ndarray,
                 displaced: np.ndarray | None = None, selected: np.ndarray | None = None,
                 feed: np.ndarray | None = None) -> list[int]:
        """Tokens `ids` at `position`.. through the target with block selection at every layer (module
        docstring); returns the greedy token after each position. displaced [D] accumulates the displaced
        router mass over layers; selected [D, L, K] receives the selections; feed [D, L, E]: router logits
        that selection reads instead of the model's (trace-following)."""
        step, pool, copies, b = run.step, self.pool, self.copies, self.buffers
        g, d = self.geometry, len(ids)
        step.set_input(ids, position, g.max_seq_len)
        run.attention(0)
        for layer in range(g.num_layers):
            run.wait_logits(layer)
            z = np.ascontiguousarray(step.router_logits(layer) if feed is None else feed[:, layer])
            select_block_into(selector, z, pool.resident(layer), alpha, g.top_k, self.renormalise, b)
            try:
                missing, slots = pool.use(layer, b.selected[:d])
            except ValueError as exc:
                raise ValueError(f"verification block at position {position}: {exc}") from None
            if missing.size:
                copies.assign(layer, slots.astype(np.int64), missing.astype(np.int64), prefetch=False)
                self.union_used = max(self.union_used, int(missing.size))
            route = step.slots_np[layer]
            route[:] = pool.slot_table(layer)[b.selected[:d]]
            step.weights_np[layer] = b.weights[:d]
            copies.wait(layer, copies.need(layer, np.unique(route)), self.compute)
            if displaced is not None:
                displaced += b.displaced[:d]
            if selected is not None:
                selected[:, layer] = b.selected[:d]
            run.moe(layer)
            if layer + 1 < g.num_layers:
                run.attention(layer + 1)
            else:
                run.head()
        run.wait_head()
        return step.next_np[:d].tolist()

    # -- a request -------------------------------------------------------------------------------------
    def _start_request(self) -> None:
        """The pool at the warm set (its slots copied), positions from 0, the commitment rates reset."""
        self._load_warm()
        self.decoder.reset()
        self.commit_rate.reset()
        if self.cuda:
            torch.cuda.synchronize()
        self.union_used = 0  # the most union slots one layer of one block needed (the prefill's included)

    def _verify(self, tally: "_Tally", ids: list[int], root: int, confidences, record: bool,
                feed: np.ndarray | None = None, accepted: int | None = None) -> list[int]:
        """One verification block (root token and drafts `ids` at position `root`), its acceptance (greedy, or
        the recorded `accepted`), the commitment rates' update and the pool refill, recorded in `tally`;
        returns the target's greedy tokens."""
        g, config, k = self.geometry, self.config, self.config.k
        started, waited = time.perf_counter(), self.copies.wait_s
        alpha = block_weights(config.selector, k, self.commit_rate, confidences)
        displaced = np.zeros(k + 1)
        selected = np.empty((k + 1, g.num_layers, g.top_k), np.int64) if record else None
        greedy = self._forward(self.verifier, ids, root, config.selector, alpha, displaced, selected, feed)
        a = accepted_length(ids[1:], greedy) if accepted is None else accepted
        self.commit_rate.update(a, k)
        self._end_block()
        tally.verify_s.append(time.perf_counter() - started)
        tally.wait_s.append(math.nan if self.cuda else self.copies.wait_s - waited)  # GPU: not seen by the host
        tally.displaced += float(displaced[:a + 1].sum())
        tally.roots.append(root)
        tally.accepted.append(a)
        if record:
            tally.selected.append(selected)
        return greedy

    def _result(self, tally: "_Tally", tokens: list[int], draft_s: list[float], prefill_s: float,
                **info) -> SpecResult:
        totals = self.pool.totals()
        info = {"kernels": self.kernels, "cuda_graphs": self.verifier.graphs is not None, **info,
                "union_used": self.union_used, "skip_copies": self.settings.skip_copies,
                "max_in_flight": self.settings.max_in_flight, "notes": list(self.notes)}
        return SpecResult(tokens, self.config.k, self.geometry.num_layers, tally.roots, tally.accepted,
                          totals["copies"] - tally.base["copies"], totals["moves"] - tally.base["moves"],
                          tally.displaced, draft_s, tally.verify_s, tally.wait_s, prefill_s, tally.selected, info)

    @torch.no_grad()
    def generate(self, prompt, record: bool = False) -> SpecResult:
        """Decode `prompt` (token ids) greedily with the drafter; record: keep each block's selections."""
        g, config, drafter, k = self.geometry, self.config, self.drafter, self.config.k
        tokens = validate.token_ids(prompt, None, g.vocab_size, "prompt", ValueError).tolist()
        if not tokens:
            raise ValueError("generate needs a non-empty prompt")
        if len(tokens) + config.max_new_tokens + k - 1 > g.max_seq_len:
            raise ValueError(f"a prompt of {len(tokens)} tokens, {config.max_new_tokens} new tokens and blocks of "
                             f"k + 1 = {k + 1} positions need {len(tokens) + config.max_new_tokens + k - 1} positions; "
                             f"the static KV cache has {g.max_seq_len}")
        self.calibration.check(g.num_layers, g.num_experts, g.vocab_size, self.fingerprint)
        self._start_request()
        ones = np.ones(1)
        new, draft_s = [], []
        with torch.cuda.stream(self.compute) if self.cuda else contextlib.nullcontext():
            started = time.perf_counter()
            prompt_features = None
            if self.feeds_features:
                rows = self.prefiller.step.work["features"]
                prompt_features = rows.new_empty(len(tokens) - 1, rows.shape[1])
            for position, token in enumerate(tokens[:-1]):
                self._forward(self.prefiller, [token], position, EXACT, ones)
                if prompt_features is not None:
                    prompt_features[position].copy_(rows[0])
                self._end_block()
            drafter.reset(torch.tensor(tokens), prompt_features)
            prefill_s = time.perf_counter() - started
            tally = _Tally(self.pool.totals())  # the prefill's copies are prompt processing: not counted
            while len(new) < config.max_new_tokens:
                started = time.perf_counter()
                drafts, confidences = drafter.propose(k)
                drafted = drafting_time(drafter, started)
                drafts = [int(t) for t in drafts]
                greedy = self._verify(tally, [tokens[-1]] + drafts, len(tokens) - 1, confidences, record)
                a = tally.accepted[-1]
                started = time.perf_counter()
                rows = self.verifier.step.work["features"][:a + 1] if self.feeds_features else None
                drafter.commit(a, greedy[a], rows)
                draft_s.append(drafted + drafting_time(drafter, started, count_fixed=False))
                if commit_block(tokens, new, drafts, a, greedy[a], config.stop_tokens):
                    break
        del new[config.max_new_tokens:]
        return self._result(tally, new, draft_s, prefill_s)

    @torch.no_grad()
    def follow(self, blocks: Blocks, first_position: int = 0, draft_cost_s: float = 0.0, record: bool = False,
               fingerprint: str | None = None) -> list[SpecResult]:
        """Trace-following: the verification blocks of a recorded speculative run (`blocks_from_records`) or of
        a synthetic drafter over a trace (`synthetic_blocks`), one `SpecResult` per request. Each block's
        input is its recorded root and drafts, selection reads its recorded router logits at every position
        and layer, and its accepted length is the recorded one; the target's attention, MoE and head run on
        this engine's weights at those positions, so times and copies are the recorded routing's on this
        model's shapes (full-size random weights and a small trained model's routing, for instance).

        As in the CPU replay, each request's pool starts at the calibration's warm set and its prompt is not
        run: the first root sits at `first_position` (the KV cache below holds whatever it holds), later roots
        follow the committed lengths. draft_cost_s is charged per block as drafting time (no drafter runs).
        fingerprint: the recorded model's router fingerprint (`BlockRecords.fingerprint`), checked against
        the calibration's; the calibration must be the recorded model's. A result's tokens are the committed
        ones: accepted drafts and the next block's root (the last block's bonus is this model's greedy token)."""
        g, k = self.geometry, self.config.k
        blocks.check(g.num_layers, g.num_experts, g.top_k)
        if blocks.k != k:
            raise ValueError(f"blocks of {blocks.k} drafts, the engine verifies k = {k} (cut records with "
                             "blocks_from_records(records, k=...))")
        tokens = blocks.tokens
        if tokens.min() < 0 or tokens.max() >= g.vocab_size:
            raise ValueError(f"block tokens outside the target's vocabulary of {g.vocab_size}")
        self.calibration.check(g.num_layers, g.num_experts, fingerprint=fingerprint)
        first_position = validate.integer(first_position, "first_position", minimum=0)
        results = []
        for request in np.unique(blocks.request):
            ids = np.flatnonzero(blocks.request == request)
            span = first_position + int((blocks.accepted[ids] + 1).sum()) + k
            if span > g.max_seq_len:
                raise ValueError(f"request {request}: {span} positions from position {first_position} do not fit the "
                                 f"static KV cache of {g.max_seq_len}")
            results.append(self._follow_request(blocks, ids, first_position, draft_cost_s, record))
        return results

    def _follow_request(self, blocks: Blocks, ids: np.ndarray, position: int, draft_cost_s: float,
                        record: bool) -> SpecResult:
        self._start_request()
        tally, new = _Tally(self.pool.totals()), []
        with torch.cuda.stream(self.compute) if self.cuda else contextlib.nullcontext():
            for i, b in enumerate(ids):
                rows, a = blocks.rows[b], int(blocks.accepted[b])
                greedy = self._verify(tally, blocks.tokens[rows].tolist(), position, blocks.confidences[b], record,
                                      feed=blocks.router_logits[rows], accepted=a)
                bonus = int(blocks.tokens[blocks.rows[ids[i + 1], 0]]) if i + 1 < len(ids) else greedy[a]
                new += blocks.tokens[rows[1:a + 1]].tolist() + [bonus]
                position += a + 1
        return self._result(tally, new, [draft_cost_s] * len(ids), 0.0, follow=blocks.source)


@dataclass
class _Tally:
    """What a request's verification blocks add up to (`SpecEngine._verify`); base: the pool's totals at the
    first block."""

    base: dict
    roots: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    selected: list[np.ndarray] = field(default_factory=list)
    verify_s: list[float] = field(default_factory=list)
    wait_s: list[float] = field(default_factory=list)
    displaced: float = 0.0


def build_spec_engine(model, drafter: Drafter, config: SpecConfig, calibration: Calibration,
                      engine_config: EngineConfig = EngineConfig(), settings: RunSettings = RunSettings(), *,
                      residency: ExpertResidency | None = None, store: ExpertStore | None = None,
                      host_memory_limit: int | None = None, device_memory_limit: int | None = None) -> SpecEngine:
    """A SpecEngine for a transformers MoE model (like `build_engine`): the decoder's weights from the model;
    experts from the given `residency` unit (share one with an ArEngine: it needs P + U slots per layer), else
    a new unit of P + U slots over `store`, else over a new pinned ExpertStore copied from the model."""
    from specmoe.models import adapter_for, decoder_for

    decoder = decoder_for(model.config).from_model(model, engine_config.max_seq_len)
    config.check(decoder.geometry, drafter)  # the config's errors before any allocation
    if residency is None:
        store = store or ExpertStore.from_model(model, host_memory_limit=host_memory_limit)
        residency = ExpertResidency(store, config.pool_size + config.union(store.num_experts),
                                    next(model.parameters()).device, memory_limit=device_memory_limit)
    fingerprint = adapter_for(model.config).fingerprint(model)
    return SpecEngine(decoder, residency, drafter, calibration, config, engine_config, settings, fingerprint)
