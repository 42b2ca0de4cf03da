"""Routers: what decides, in one decode step of D positions, which experts each position executes in each MoE
layer, and keeps the slot buffer in step with those decisions. The engine's loop (`Engine._forward`) is the same
for every router; a router is called at three points of it:

- `route(layer)`, once the layer's router logits are on the host: the executed experts of the step's positions,
  written as slot ids and execution weights into the step's route rows; returns the slots the layer executes
  and the demand insertions (slots, experts) that the engine copies at once. A router whose positions of one
  step cannot execute together (`grouped`: a prompt chunk whose later positions reassign slots that earlier
  ones execute) hands the layer out in groups: the engine runs each group's MoE, waits for it, and asks
  `next_group(layer)` until it returns None;
- `predict(layer)`, once the layer's attention has run (its pre-gate logits are on the host), before the
  previous layer's copies are waited for: insertions of predicted experts to prefetch (PSR's part 1; for a
  block, the block prefetch of `specmoe.verifiers.prefetch`);
- `end_step(accepted)`, after the step's head: what the step's outcome changes (the pool's refill after a
  verification block) and the slot moves that follow it.

Two routers:
- `CacheRouter`: the autoregressive policies (exact, Cache-Prior, PSR, speculative execution; logical or
  physical mode) over the logical cache of Algorithm 1 (`LogicalCache.route`, `insert_predicted`). Where every
  expert is resident and the policy is the router's own top-K, the engine runs its fast form on the device
  (`device_reason`).
- `BlockRouter`: speculative decoding's block-level selection (`select_block_into` with the selector's position
  weights and the decoder's router rule, `RouterScoring`: softmax or sigmoid with its selection bias) over an
  `ExpertPool` of P experts plus U union slots, refilled by recency after each block.

Adding a router: implement `Router` (and its `warm`, `reset`, `num_slots`) and give the engine a way to build
it; the engine never looks inside one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np

from specmoe.geometry import Geometry
from specmoe.kernels.device_routing import device_routing_applies
from specmoe.models.decoder import DecodeStep
from specmoe.offload import CopyStream
from specmoe.routing import Calibration, EngineScoring, LogicalCache, PolicyConfig, RouterScoring
from specmoe.verifiers import (CommitRate, ExpertPool, SelectionBuffers, place_union, predict_prefetch,
                               select_block_into)

if TYPE_CHECKING:
    from specmoe.speculation import SpeculativeConfig

NO_DEMAND = None
NO_PREFETCH = np.empty(0, dtype=np.int64)


class Router(Protocol):
    """What the engine's loop needs from a router (module docstring)."""

    num_slots: int  # slots per layer the router assigns
    grouped: bool  # this step's layers run their MoE in several groups (`next_group` after each)

    def warm(self) -> np.ndarray:
        """[L, n] the experts of slots 0 .. n - 1 at the start of a request (after `reset`)."""

    def reset(self) -> None:
        """A new request: the router's state at its warm set."""

    def route(self, layer: int) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray] | None]: ...

    def predict(self, layer: int) -> None: ...

    def end_step(self, accepted: int) -> None: ...

    def next_group(self, layer: int) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray] | None] | None:
        """With `grouped`: the next group of the layer, as `route` returns it, or None after the last."""


class CacheRouter:
    """The logical-cache router of the autoregressive policies, one position per step (`bind` a step, then
    `begin` each step with its record row and input token)."""

    def __init__(self, policy: PolicyConfig, calibration: Calibration, geometry: Geometry,
                 scoring: RouterScoring, copies: CopyStream):
        g = geometry
        self.policy, self.calibration, self.scoring_model = policy, calibration, scoring
        self.cache = LogicalCache(policy, calibration, g.num_layers, g.num_experts)
        self.scoring = EngineScoring.of(scoring, g.num_layers, g.num_experts)
        self.copies, self.num_layers, self.num_experts = copies, g.num_layers, g.num_experts
        self.inserts = policy.insert_budget > 0
        self.physical, self.max_in_flight = False, 2
        self.feed = self.rec = self.chunk = self.pregate_rule = None
        self.t = self.token = 0
        self.grouped = False  # a prompt chunk: `next_group` after each group's MoE

    @property
    def num_slots(self) -> int:
        return self.policy.capacity

    def warm(self) -> np.ndarray:
        return np.stack([self.cache.resident(layer) for layer in range(self.num_layers)])

    def reset(self) -> None:
        self.cache.reset()

    def device_reason(self, num_slots: int) -> str | None:
        """None if this policy routes as the router's own top-K on a unit of `num_slots` slots (the engine may
        then route on the device), else why it does not."""
        if num_slots != self.num_experts:
            return f"{num_slots} slots < E={self.num_experts}"
        return device_routing_applies(self.policy, self.num_experts, self.scoring_model)

    def slot_map(self) -> np.ndarray:
        """[L, E] the slot of every expert (every expert resident), read by device routing."""
        return np.stack([self.cache.slot_of(layer, np.arange(self.num_experts)) for layer in range(self.num_layers)])

    def bind(self, step: DecodeStep, feed, rec, physical: bool, max_in_flight: int) -> None:
        """Route the run's steps of `step` (D = 1) from `feed` (router and pre-gate logits), recording in `rec`."""
        self.feed, self.rec = feed, rec
        self.physical, self.max_in_flight = physical, max_in_flight
        rule = self.feed_rule(feed)
        own = rule is self.scoring_model
        self.step_scoring = self.scoring if own else EngineScoring.of(rule, self.num_layers, self.num_experts)
        # what part 1 ranks: the raw pre-gate logits (softmax routers), else their selection scores
        self.pregate_rule = None if rule.kind == "softmax" else rule
        self._slots = [step.slots_np[layer, 0] for layer in range(self.num_layers)]
        self._weights = [step.weights_np[layer, 0] for layer in range(self.num_layers)]

    def feed_rule(self, feed) -> RouterScoring:
        """The rule routing applies to the logits of `feed` (None or the model's own: the model's rule). A followed
        trace routes by its source's rule; a softmax one with this model's groups selects as this model does, whose
        execution weights (renormalisation, scaling) then stay (files without a rule read as softmax)."""
        rule = None if feed is None else feed.scoring
        if rule is None or (rule.kind == "softmax" and rule.groups == self.scoring_model.groups):
            return self.scoring_model
        return rule

    def begin(self, t: int, token: int) -> None:
        """The next step: one position, record row t, input `token`."""
        self.t, self.token, self.grouped = t, token, False

    def begin_chunk(self, step: DecodeStep, t: int, tokens) -> None:
        """The next step: a prompt chunk of D positions of `step` (record rows t .., input `tokens`), routed from
        the model's own logits (`route` / `next_group`)."""
        self.chunk, self.t, self.tokens, self.grouped = step, t, list(tokens), True

    def route(self, layer: int):
        if self.grouped:
            self._groups = self._chunk_groups(layer)
            return next(self._groups)
        cache, rec, t = self.cache, self.rec, self.t
        slots = self._slots[layer]
        d = cache.route(layer, self.feed.router(t, layer), self.token, self.step_scoring, rec.router_logits[t, layer],
                        rec.selected[t, layer], slots, self._weights[layer])
        return slots, ((cache.demand_slots[:d], cache.demand[:d]) if d else NO_DEMAND)

    def predict(self, layer: int) -> None:
        if self.grouped:  # a prompt chunk: part 1 runs position by position in `_chunk_groups`
            return
        g = self.rec.pregate_logits[self.t, layer] = self.feed.pregate(self.t, layer)
        if not self.inserts:
            return
        # physical-cache mode: insert only what can be copied at once, so that routing sees issued copies
        budget = max(self.max_in_flight - self.copies.in_flight(), 0) if self.physical else None
        # float32 as recorded: part 1 only ranks g, and float32 -> float64 keeps every order and tie
        if self.pregate_rule is not None:
            g = self.pregate_rule.selection_scores(g, layer)
        inserted = self.cache.insert_predicted(layer, g, self.token, budget=budget)
        if inserted.size:
            self.copies.assign(layer, self.cache.slot_of(layer, inserted), inserted, prefetch=True,
                               issue_now=self.physical)

    def end_step(self, accepted: int) -> None:
        return None

    def next_group(self, layer: int):
        """The next group of a prompt chunk's `layer` ((executed slots, demand) as `route`), or None; call it once
        the previous group's MoE has run (it rewrites the route rows that MoE read)."""
        return next(self._groups, None)

    def _chunk_groups(self, layer: int):
        """Parts 1 and 2 of `layer` for the chunk's positions one after another, as one position per step makes
        them (the same decisions), cut into groups whose MoE can run at once: a group ends before a position
        whose insertion takes a slot that an earlier position of the group executes. Yields (executed slots,
        demand (slots, experts) or None) per group, with the route rows of the other positions at weight 0."""
        step, cache, rec, copies = self.chunk, self.cache, self.rec, self.copies
        slots, weights = step.slots_np[layer], step.weights_np[layer]
        own = np.empty_like(weights)  # each position's execution weights; rows outside the running group get 0
        used = np.zeros(self.num_experts, dtype=np.bool_)  # slots the running group executes
        start, demand_slots, demand_experts = 0, [], []

        def group(end: int):
            weights[:] = 0.0
            weights[start:end] = own[start:end]
            demand = (np.array(demand_slots, np.int64), np.array(demand_experts, np.int64)) if demand_slots else None
            return np.unique(slots[start:end]), demand

        for i, token in enumerate(self.tokens):
            t = self.t + i
            if layer > 0:
                g = rec.pregate_logits[t, layer] = step.pregate_logits(layer)[i]
                if self.pregate_rule is not None:  # chunks route the model's own logits: the model's rule
                    g = self.pregate_rule.selection_scores(g, layer)
                inserted = cache.insert_predicted(layer, g, token) if self.inserts else ()
                if len(inserted):
                    taken = cache.slot_of(layer, inserted)
                    if used[taken].any():
                        yield group(i)
                        start, demand_slots, demand_experts = i, [], []
                        used[:] = False
                    copies.assign(layer, taken, inserted.copy(), prefetch=True)
            d = cache.route(layer, step.router_logits(layer)[i], token, self.scoring, rec.router_logits[t, layer],
                            rec.selected[t, layer], slots[i], own[i])
            if d and used[cache.demand_slots[:d]].any():
                yield group(i)
                start, demand_slots, demand_experts = i, [], []
                used[:] = False
            demand_slots += cache.demand_slots[:d].tolist()
            demand_experts += cache.demand[:d].tolist()
            used[slots[i]] = True
        yield group(len(self.tokens))


class BlockRouter:
    """Block-level selection over the expert pool (module docstring), for steps of any D (`begin` each block
    with its selector and position weights).

    With a prefetch budget (`SpeculativeConfig.prefetch`), `predict(l)` runs the block's selector on the D
    positions' pre-gate logits and copies the predicted missing experts into union slots at once
    (`specmoe.verifiers.prefetch`); `route(l)` then places the real missing experts (`place_union`). The pool's
    slot table stays logical (a block's missing experts in union slots P, P+1, ... by expert order); in a layer
    that prefetched, `physical` maps each logical union slot of the current block to the slot that holds its
    expert, and the route rows and the refill moves read it. Elsewhere (and always with budget 0) the two are the
    same: the row is the identity, and the per-layer step does no placement."""

    def __init__(self, config: SpeculativeConfig, calibration: Calibration, geometry: Geometry,
                 scoring: RouterScoring, copies: CopyStream):
        g = geometry
        self.config, self.geometry, self.copies, self.scoring = config, g, copies, scoring
        self.union_slots = config.union(g.num_experts)
        self.pool = ExpertPool(g.num_layers, g.num_experts, g.top_k, config.pool_size, calibration, self.union_slots)
        self.commit_rate = CommitRate()
        self.buffers = SelectionBuffers(config.k + 1, g.num_experts, g.top_k, np.float32)
        self.predicted = SelectionBuffers(config.k + 1, g.num_experts, g.top_k, np.float32)  # the prefetch's
        p = config.pool_size
        self._union = np.arange(p, p + self.union_slots, dtype=np.int64)  # the identity row of `physical`
        self.physical = np.tile(self._union, (g.num_layers, 1))
        self._slot_map = np.arange(p + self.union_slots, dtype=np.int64)  # logical slot -> physical (route rows)
        self.prefetched = [NO_PREFETCH] * g.num_layers  # this block's prefetched experts (ascending), per layer
        self.union_used = 0  # the most union slots one layer of one block used (prefetches included)
        self.step = self.selector = self.alpha = self.feed = self.pregate = self.displaced = self.selected = None

    @property
    def num_slots(self) -> int:
        return self.config.pool_size + self.union_slots

    def warm(self) -> np.ndarray:
        warm = []
        for layer in range(self.geometry.num_layers):
            table = self.pool.slot_table(layer)
            members = np.flatnonzero(table >= 0)
            warm.append(members[np.argsort(table[members])])  # the pool's experts in slot order 0 .. P-1
        return np.stack(warm)

    def reset(self) -> None:
        self.pool.reset()
        self.commit_rate.reset()
        self.union_used = 0
        self.prefetched = [NO_PREFETCH] * self.geometry.num_layers
        self.physical[:] = self._union

    def begin(self, step: DecodeStep, selector, alpha: np.ndarray, displaced: np.ndarray | None = None,
              selected: np.ndarray | None = None, feed: np.ndarray | None = None,
              pregate: np.ndarray | None = None) -> None:
        """The next step's block: `selector` with position weights `alpha` [D]; displaced [D] accumulates the
        displaced router mass over layers; selected [D, L, K] receives the selections; feed [D, L, E]: router
        raw logits that selection reads instead of the model's (trace-following; records hold raw logits), routed
        by the decoder's rule like the model's own; pregate [D, L, E]: the pre-gate logits the prefetch reads
        with a feed (None: the model's)."""
        self.step, self.selector, self.alpha = step, selector, alpha
        self.displaced, self.selected, self.feed, self.pregate = displaced, selected, feed, pregate

    def route(self, layer: int):
        step, pool, b, d = self.step, self.pool, self.buffers, self.step.num_positions
        z = np.ascontiguousarray(step.router_logits(layer) if self.feed is None else self.feed[:, layer])
        select_block_into(self.selector, z, pool.resident(layer), self.alpha, self.geometry.top_k, self.scoring, b,
                          layer=layer)
        try:
            missing, slots = pool.use(layer, b.selected[:d])
        except ValueError as exc:
            raise ValueError(f"verification block at position {int(step.input_np[d])}: {exc}") from None
        route = step.slots_np[layer]
        route[:] = pool.slot_table(layer)[b.selected[:d]]
        demand, prefetched = NO_DEMAND, self.prefetched[layer]
        if prefetched.size:  # copies started early: the experts' physical union slots (class docstring)
            used = prefetched.size
            if missing.size:
                p = self.config.pool_size
                placed, copy, used = place_union(missing, prefetched, p, self.union_slots)
                self.physical[layer, slots - p] = placed
                self._slot_map[slots] = placed  # the route rows point where the experts physically are
                route[:] = self._slot_map[route]
                self._slot_map[slots] = slots
                if copy.any():
                    demand = (placed[copy], missing[copy].astype(np.int64))
            self.union_used = max(self.union_used, int(used))
        elif missing.size:  # every missing expert a demand copy into the slot the pool gave it
            demand = (slots.astype(np.int64), missing.astype(np.int64))
            self.union_used = max(self.union_used, int(missing.size))
        step.weights_np[layer] = b.weights[:d]
        if self.displaced is not None:
            self.displaced += b.displaced[:d]
        if self.selected is not None:
            self.selected[:, layer] = b.selected[:d]
        return np.unique(route), demand

    def predict(self, layer: int) -> None:
        """The block prefetch of `layer` (>= 1) from the D positions' pre-gate logits, copies issued at once."""
        budget = self.config.prefetch
        if not budget:
            return
        g = self.step.pregate_logits(layer) if self.pregate is None else self.pregate[:, layer]
        experts = predict_prefetch(self.selector, np.ascontiguousarray(g), self.pool.resident(layer), self.alpha,
                                   self.geometry.top_k, self.scoring, self.predicted, budget, self.union_slots, layer)
        self.prefetched[layer] = experts
        if experts.size:
            slots = np.arange(self.config.pool_size, self.config.pool_size + experts.size, dtype=np.int64)
            self.copies.assign(layer, slots, experts, prefetch=True, issue_now=True)

    grouped = False  # the whole block executes at once

    def end_step(self, accepted: int | None) -> None:
        """The pool refill; the slot buffer follows: each expert entering the pool moves from the union slot
        that holds it to the pool slot the refill gives it (`ExpertPool.refill_moves`, through `physical`);
        prefetches the block did not execute count unused. accepted: the block's accepted drafts, which update
        the commitment rates (None: a prefill block)."""
        if accepted is not None:
            self.commit_rate.update(accepted, self.config.k)
        self.pool.end_block()
        p = self.config.pool_size
        for layer in range(self.geometry.num_layers):
            src, dst = self.pool.refill_moves(layer)
            prefetched = self.prefetched[layer]
            if not prefetched.size:  # logical union slots are physical
                if src.size:
                    self.copies.move(layer, src, dst)
                continue
            self.copies.retire(layer, self._union[:prefetched.size])
            if src.size:
                self.copies.move(layer, self.physical[layer, src - p], dst)
            self.prefetched[layer] = NO_PREFETCH
            self.physical[layer] = self._union
