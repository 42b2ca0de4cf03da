"""CPU replay of three ways to route the verification blocks of speculative decoding under offloading.

- `replay_rollback`: a per-position logical cache with rollback on rejection. Within a block, position d
  routes with an AR policy (`specmoe.routing`, e.g. PSR: part 1 with the pre-gate, part 2 with the bonus) on
  the logical state left by positions < d of the same block; after verification the logical state returns to
  the state after the last committed position (`LogicalCache.snapshot` / `restore`, statistics and counters
  included). Its decisions on committed tokens are those of `specmoe.routing.replay` over the committed
  sequence, so speculative decoding's output is AR decoding's under the same policy.
- `replay_block_selection`: block-level selection (`specmoe.verifiers.select_block_into`) with any selector.
- `replay_ar`: the AR policy over the committed sequence alone (`specmoe.routing.replay`), the reference.

Accounting (the same for both block methods):
- physical memory: an `ExpertPool` of P = C slots per layer plus union slots, refilled by recency after each
  block; a block's copies in a layer are the experts any of its D positions executes that are not in the pool
  (rejected positions included: they were verified, so their experts had to be on the GPU). For the rollback
  cache the logical cache only steers routing (its bonus and its pre-gate insertions); the part-1
  insertions are not copied unless a position executes them. The blocks' pool starts each request at the
  calibration's warm set; prompts are not replayed.
- copies per committed token: all blocks' copies over the committed positions (roots and accepted drafts).
- displaced mass per committed token-layer: the router softmax mass of a committed position's own top-K that
  it did not execute (the routing core's definition), averaged over committed positions and layers only.
- AR-PSR (`replay_ar`): demand plus prefetch copies of the logical cache per committed token (the routing
  core's logical copies), displaced mass as above.

Blocks of a request are replayed in order; the logical cache and the pool are reset at each new request.
Router logits at rejected positions are those the source recorded (block records: the drafter's tokens
as verified by exact routing; synthetic blocks: the true continuation's); a replay cannot recompute the
hidden states that another selection would have produced, so every method sees the same logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numba import njit

from specmoe.routing import Calibration, PolicyConfig, replay
from specmoe.routing import kernels as K
from specmoe.routing.cache import LogicalCache
from specmoe.speculation import block_weights
from specmoe.verifiers import (CommitRate, ExpertPool, PrefetchTally, SelectionBuffers, SelectorConfig,
                               predict_prefetch, select_block_into)
from specmoe.verifiers.prefetch import NONE as NO_PREFETCH

from specmoe.records import Blocks

_NO_TRACE = np.zeros((0, 0), dtype=np.int64)


@dataclass
class MethodResult:
    """Totals of one method over a set of blocks (see the module docstring for the accounting)."""

    method: str  # "rollback", "block", "ar"
    label: str  # the policy's or selector's name
    params: dict
    blocks: int
    committed: int  # committed positions (tokens)
    num_layers: int
    copies: int  # host-to-device copies, summed over blocks and layers
    displaced: float  # displaced router mass, summed over committed token-layers
    selected: np.ndarray | None = None  # int64 [committed, L, K] with keep_selected
    changed: int = 0  # block selection with the true continuation: committed token-layers whose set changed
    compared: int = 0  # ... over this many committed token-layers (blocks whose true continuation is known)
    changed_drafts: int = 0  # the same over accepted drafts only (the root's set never changes)
    compared_drafts: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def copies_per_token(self) -> float:
        return self.copies / max(self.committed, 1)

    @property
    def displaced_per_token_layer(self) -> float:
        return self.displaced / max(self.committed * self.num_layers, 1)

    def row(self) -> dict:
        return {"method": self.method, "label": self.label, **{f"param_{k}": v for k, v in self.params.items()},
                "copies_per_token": self.copies_per_token, "displaced_per_token_layer": self.displaced_per_token_layer,
                "blocks": self.blocks, "committed": self.committed,
                "changed_fraction": self.changed / self.compared if self.compared else float("nan"),
                "changed_fraction_drafts": (self.changed_drafts / self.compared_drafts if self.compared_drafts
                                            else float("nan"))}


def _check(blocks: Blocks, calibration: Calibration, top_k: int) -> None:
    blocks.check(calibration.warm_ranking.shape[0], calibration.warm_ranking.shape[1], top_k)


@njit(cache=True)
def _run_positions(ist, isc, fst, fsc, cnt, params, bonus, delta, pind, pexp, pval, displaced_mass, zt, gt, tokens,
                   rows, use_g, zbuf, gbuf, valid, sel, slots, demand, prefetch, disp, replaced, unused,
                   selected_out, displaced_out):
    """`LogicalCache.run_span` of every layer over the positions rows [S] of the logits table zt, gt [T, L, E]:
    the same kernel (`kernels.run_span`). Writes selected_out [S, L, K], displaced_out [S, L]."""
    s = rows.shape[0]
    num_layers = zt.shape[1]
    num_experts = zt.shape[2]
    k = sel.shape[1]
    tok = np.empty(s, dtype=np.int64)
    for i in range(s):
        tok[i] = tokens[rows[i]]
    for layer in range(num_layers):
        has_g = use_g and layer > 0
        for i in range(s):
            for e in range(num_experts):
                zbuf[i, e] = zt[rows[i], layer, e]
                gbuf[i, e] = gt[rows[i], layer, e] if has_g else zbuf[i, e]
        K.run_span(ist, isc, fst, fsc, cnt, params, bonus, delta, pind, pexp, pval, layer, zbuf[:s], gbuf[:s],
                   has_g, tok, valid[:s], sel[:s], slots[:s], demand[:s], prefetch[:s], disp[:s], replaced[:s],
                   unused)
        total = 0.0
        for i in range(s):
            for j in range(k):
                selected_out[i, layer, j] = sel[i, j]
            displaced_out[i, layer] = disp[i]
            total += disp[i]
        displaced_mass[layer] += total


class RollbackCache:
    """A `LogicalCache` that routes the positions of verification blocks and rolls back the rejected ones."""

    def __init__(self, policy: PolicyConfig, calibration: Calibration, num_layers: int, num_experts: int,
                 max_positions: int, groups: tuple[int, int] = (1, 1)):
        self.cache = LogicalCache(policy, calibration, num_layers, num_experts, groups)
        self.use_g = policy.insert_budget > 0
        m, e, k = max_positions, num_experts, policy.top_k
        self._zbuf, self._gbuf = np.empty((m, e)), np.empty((m, e))
        self._valid = np.ones(m, dtype=np.bool_)
        self._sel, self._slots = np.empty((m, k), dtype=np.int64), np.empty((m, k), dtype=np.int64)
        self._ints = np.empty((3, m), dtype=np.int64)
        self._disp = np.empty(m)

    def run(self, zt, gt, tokens, rows) -> tuple[np.ndarray, np.ndarray]:
        """Route positions rows [S] (consecutive positions of the sequence) of the table zt, gt [T, L, E]:
        (selected [S, L, K], displaced [S, L])."""
        c = self.cache
        s = rows.shape[0]
        selected = np.empty((s, c.num_layers, c.policy.top_k), dtype=np.int64)
        displaced = np.empty((s, c.num_layers))
        if s:
            _run_positions(c.istate, c.iscalar, c.fstate, c.fscalar, c.counters, c.params, c.policy.bonus, c.delta,
                           *c.prior, c.displaced_mass, zt, gt, tokens, rows, self.use_g, self._zbuf, self._gbuf,
                           self._valid, self._sel, self._slots, self._ints[0], self._ints[1], self._disp,
                           self._ints[2], _NO_TRACE, selected, displaced)
        return selected, displaced

    def block(self, zt, gt, tokens, rows, committed: int):
        """One block: route every position rows [D] in order, then roll back to the state after the first
        `committed` positions. Returns (selected [D, L, K], displaced [D, L])."""
        sel_c, disp_c = self.run(zt, gt, tokens, rows[:committed])
        if committed == rows.shape[0]:
            return sel_c, disp_c
        snapshot = self.cache.snapshot()
        sel_r, disp_r = self.run(zt, gt, tokens, rows[committed:])
        self.cache.restore(snapshot)
        return np.concatenate((sel_c, sel_r)), np.concatenate((disp_c, disp_r))


def replay_rollback(policy: PolicyConfig, blocks: Blocks, calibration: Calibration, pool_size: int | None = None,
                    keep_selected: bool = False) -> MethodResult:
    """The rollback logical cache over `blocks` (module docstring); the pool has P = pool_size (default C)."""
    _check(blocks, calibration, policy.top_k)
    num_layers, num_experts, d = blocks.num_layers, blocks.num_experts, blocks.k + 1
    pool_size = policy.capacity if pool_size is None else pool_size
    cache = RollbackCache(policy, calibration, num_layers, num_experts, d, blocks.groups)
    pool = ExpertPool(num_layers, num_experts, policy.top_k, pool_size, calibration)
    zt, gt, tokens = _selection_tables(blocks)
    kept = np.empty((blocks.committed if keep_selected else 0, num_layers, policy.top_k), dtype=np.int64)
    at = 0
    copies = 0
    displaced = 0.0
    current = None
    for b in range(blocks.num_blocks):
        if blocks.request[b] != current:
            current = blocks.request[b]
            cache.cache.reset()
            pool.reset()
        c = int(blocks.accepted[b]) + 1
        selected, disp = cache.block(zt, gt, tokens, blocks.rows[b], c)
        for layer in range(num_layers):
            missing, _ = pool.use(layer, selected[:, layer])
            copies += missing.shape[0]
        pool.end_block()
        displaced += float(disp[:c].sum())
        if keep_selected:
            kept[at:at + c] = selected[:c]
        at += c
    return MethodResult("rollback", policy.name, {"bonus": policy.bonus, "n": policy.insert_budget}, blocks.num_blocks,
                        at, num_layers, copies, displaced, kept if keep_selected else None)


def replay_block_selection(selector: SelectorConfig, blocks: Blocks, calibration: Calibration, pool_size: int,
                           keep_selected: bool = False, counterfactual: bool = False, prefetch: int = 0,
                           union_slots: int | None = None) -> MethodResult:
    """Block-level selection with `selector` over `blocks` and a pool of P = pool_size (module docstring).
    With `counterfactual`, each block whose true continuation is known (`Blocks.true_rows`) is also selected
    with the true continuation's logits at its rejected positions (same pool, same weights): the committed
    token-layers whose executed set differs are counted in `changed` / `compared`.

    prefetch: the block prefetch budget (`specmoe.verifiers.prefetch`, as the engine's `BlockRouter` with
    `SpeculativeConfig.prefetch`), predicted from the blocks' pre-gate logits over U = union_slots (None:
    E - P); `extra` holds its counts (`PrefetchTally.as_dict`: prefetches, hits, unused, demand copies, the
    peak union slots). `copies` counts every missing expert, prefetched or not (selections never change)."""
    top_k = blocks.top_k
    _check(blocks, calibration, top_k)
    num_layers, num_experts, d = blocks.num_layers, blocks.num_experts, blocks.k + 1
    pool = ExpertPool(num_layers, num_experts, top_k, pool_size, calibration, union_slots)
    buffers = SelectionBuffers(d, num_experts, top_k, np.float64)
    other = SelectionBuffers(d, num_experts, top_k, np.float64)
    predicted = SelectionBuffers(d, num_experts, top_k, np.float64)
    tally = PrefetchTally()
    gt = blocks.pregate_logits
    rates = CommitRate()
    zt = blocks.router_logits
    # the source's router rule: selection ranks its scores of the raw logits, the engine's `select_block_into`
    scoring = blocks.scoring
    kept = np.empty((blocks.committed if keep_selected else 0, num_layers, top_k), dtype=np.int64)
    result = MethodResult("block", selector.name, {"gamma": selector.gamma, "prune": selector.prune_budget},
                          blocks.num_blocks, 0, num_layers, 0, 0.0)
    current = None
    for b in range(blocks.num_blocks):
        if blocks.request[b] != current:
            current = blocks.request[b]
            pool.reset()
            rates.reset()
        c = int(blocks.accepted[b]) + 1
        alpha = block_weights(selector, blocks.k, rates, blocks.confidences[b])
        z_block = zt[blocks.rows[b]]  # [D, L, E]
        g_block = gt[blocks.rows[b]] if prefetch else None
        compare = counterfactual and c < d and blocks.true_rows is not None and np.all(blocks.true_rows[b] >= 0)
        z_true = zt[blocks.true_rows[b]] if compare else None
        for layer in range(num_layers):
            resident = pool.resident(layer)
            ahead = NO_PREFETCH
            if prefetch and layer > 0:
                ahead = predict_prefetch(selector, g_block[:, layer], resident, alpha, top_k, scoring, predicted,
                                         prefetch, pool.union_slots, layer)
            if compare:  # before `use`, which may not change the pool but reads it
                select_block_into(selector, z_true[:, layer], resident, alpha, top_k, scoring, other, layer=layer)
            _, _, n_missing = select_block_into(selector, z_block[:, layer], resident, alpha, top_k, scoring, buffers,
                                                layer=layer)
            selected = buffers.selected[:d]
            if compare:
                a = np.sort(selected[:c], axis=1)
                t = np.sort(other.selected[:c], axis=1)
                diff = np.any(a != t, axis=1)
                result.changed += int(diff.sum())
                result.compared += c
                result.changed_drafts += int(diff[1:].sum())
                result.compared_drafts += c - 1
            missing, _ = pool.use(layer, selected)
            tally.count(ahead, missing, pool_size, pool.union_slots)
            result.copies += n_missing
            result.displaced += float(buffers.displaced[:c].sum())
            if keep_selected:
                kept[result.committed:result.committed + c, layer] = selected[:c]
        pool.end_block()
        rates.update(c - 1, blocks.k)
        result.committed += c
    result.selected = kept if keep_selected else None
    if prefetch:
        result.params["prefetch"] = prefetch
    result.extra.update(tally.as_dict())
    return result


def _selection_tables(blocks: Blocks) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(selection scores [T, L, E], pre-gate selection scores [T, L, E], tokens [T]) of the blocks' logits table:
    the raw logits through the source's rule (`RouterScoring.selection_scores`; the logits for softmax)."""
    scoring = blocks.scoring
    if scoring.kind == "softmax":
        return blocks.router_logits, blocks.pregate_logits, blocks.tokens
    return scoring.selection_scores(blocks.router_logits), scoring.selection_scores(blocks.pregate_logits), blocks.tokens


def replay_ar(policy: PolicyConfig, blocks: Blocks, calibration: Calibration,
              keep_selected: bool = False) -> MethodResult:
    """The AR policy over the committed sequence of `blocks` (its requests as sequences): `specmoe.routing.replay`."""
    _check(blocks, calibration, policy.top_k)
    rows, starts = blocks.committed_rows()
    result = replay(policy, blocks.router_logits[rows], blocks.pregate_logits[rows], blocks.tokens[rows], calibration,
                    sequence_starts=starts, scoring=blocks.scoring)
    return MethodResult("ar", policy.name, {"bonus": policy.bonus, "n": policy.insert_budget}, blocks.num_blocks,
                        rows.shape[0], blocks.num_layers, int(result.copies.sum()), float(result.displaced_mass.sum()),
                        result.selected if keep_selected else None,
                        extra={"demand": int(result.demand_copies.sum()), "prefetch": int(result.prefetch_copies.sum())})
