"""The engine's speculative half: speculative decoding (`generate` with a drafter) and trace-following of
verification blocks (`follow` of `Blocks`), through the engine's one decode step (`Engine._forward`) with the
`BlockRouter`, or a block's device path (`DeviceBlocks`). A base class of `Engine` (engine.py), whose runners,
routers, copy stream and settings these methods use; the semantics (acceptance, commit, position weights)
are `specmoe.speculation`'s."""

from __future__ import annotations

import time

import numpy as np
import torch

from specmoe.drafters import check_drafter_fits
from specmoe.records import Blocks
from specmoe.routing import validate
from specmoe.speculation import EXACT, Drafter, accepted_length, block_weights, commit_block, drafting_time

from .recorder import NO_RECORD, StepRecorder
from .results import DecodeResult, LogitFeed
from .runner import StepRunner


class SpeculativeSteps:
    """`Engine`'s speculative decoding and block trace-following (module docstring)."""

    def _use_drafter(self, drafter: Drafter) -> None:
        """Check the drafter against the target and make the decoder capture the hidden states it reads."""
        router = self.block_router
        if drafter.max_drafts is not None and router.config.k > drafter.max_drafts:
            raise ValueError(f"the {drafter.name} drafter drafts at most {drafter.max_drafts} tokens per block, "
                             f"k={router.config.k}")
        check_drafter_fits(drafter, self.geometry, len(self.decoder.layer_kinds))
        layers = tuple(drafter.target_layer_ids)
        if layers == self.decoder.feature_layers:
            return
        self.decoder.capture_features(layers)  # new step buffers: the runners are made again
        self._runners.clear()
        self._make_runners()

    def _speculate(self, tokens: list[int], max_new_tokens: int, stop_tokens, drafter: Drafter,
                   record: bool) -> DecodeResult:
        router = self._need(self.block_router, "speculative decoding", "a SpeculativeConfig")
        g, k = self.geometry, router.config.k
        self._check_logical(self.settings)
        stops = tuple(validate.token_ids(list(stop_tokens), None, g.vocab_size, "stop_tokens", ValueError).tolist())
        if len(tokens) + max_new_tokens + k - 1 > g.max_seq_len:
            raise ValueError(f"a prompt of {len(tokens)} tokens, {max_new_tokens} new tokens and blocks of k + 1 = "
                             f"{k + 1} positions need {len(tokens) + max_new_tokens + k - 1} positions; the static KV "
                             f"cache has {g.max_seq_len}")
        self.calibration.check(g.num_layers, g.num_experts, g.vocab_size, self.fingerprint)
        self._use_drafter(drafter)
        device, why = self._blocks_step()  # before _start: its warm-up
        self._start(router)
        rec = StepRecorder(max_new_tokens, g.num_layers, g.num_experts, g.top_k, self.copies,
                           self.settings.instrument, cuda_stream=self.compute, positions=False)
        new, displaced, blocks = [], 0.0, []
        verify = self._runners[k + 1]
        with self._stream():
            started = time.perf_counter()
            first, features = self._prefill_blocks(tokens, drafter)
            if device is not None:
                device.start(self.settings)
            new.append(first)  # the prefill's greedy token: committed, in no block; the first block's root
            tokens.append(first)
            prefill_ms = (time.perf_counter() - started) * 1e3
            done = first in stops or max_new_tokens == 1
            if not done:
                drafter.reset(torch.tensor(tokens), features)
            t = 0
            while not done:
                started = time.perf_counter()
                drafts, confidences = drafter.propose(k)
                drafted = drafting_time(drafter, started)
                drafts = [int(d) for d in drafts]
                greedy, a, d_mass, selected = self._verify(rec, t, verify, [tokens[-1]] + drafts, len(tokens) - 1,
                                                           confidences, record, device=device)
                displaced += d_mass
                if record:
                    blocks.append(selected)
                started = time.perf_counter()
                rows = self.decoder.features(verify.step)
                drafter.commit(a, greedy[a], None if rows is None else rows[:a + 1])
                rec.draft_ms[t] = 1e3 * (drafted + drafting_time(drafter, started, count_fixed=False))
                t += 1
                done = commit_block(tokens, new, drafts, a, greedy[a], stops) or len(new) >= max_new_tokens
        del new[max_new_tokens:]
        result = self._speculative_result(rec, new, displaced, blocks, prefill_ms, device, why)
        result.prefill_tokens = 1  # the prefill's greedy token: committed, in no block
        return result

    def _prefill_blocks(self, tokens: list[int], drafter: Drafter):
        """The whole prompt under exact selection through the pool, in blocks of k + 1 positions (the verification
        steps' D; one position at a time where the union slots could not hold such a block's missing experts, and
        for the remainder); its copies, moves and time are prompt processing. Returns (the target's greedy token
        after the prompt, the drafter's context features of the prompt positions or None)."""
        router, g = self.block_router, self.geometry
        d = router.config.k + 1
        missing_max = min(g.num_experts - router.config.pool_size, d * g.top_k)
        chunk = d if router.union_slots >= missing_max else 1
        features = None
        at, greedy = 0, None
        while at < len(tokens):
            size = chunk if len(tokens) - at >= chunk else 1
            run = self._runners[size]
            router.begin(run.step, EXACT, np.ones(size))
            self._forward(run, tokens[at:at + size], at, router, NO_RECORD)
            router.end_step(None)
            rows = self.decoder.features(run.step) if drafter.target_layer_ids else None
            if rows is not None:
                if features is None:
                    features = rows.new_empty(len(tokens), rows.shape[1])
                features[at:at + size].copy_(rows[:size])
            greedy = int(run.step.next_np[size - 1])
            at += size
        return greedy, features

    def _verify(self, rec: StepRecorder, t: int, run: StepRunner, ids: list[int], root: int, confidences,
                record: bool, feed: np.ndarray | None = None, accepted: int | None = None,
                pregate: np.ndarray | None = None, device=None):
        """Step t: one verification block (root token and drafts `ids` at position `root`), its acceptance
        (greedy, or the recorded `accepted`), the commitment rates' update and the pool refill. Returns (the
        target's greedy tokens, accepted drafts, displaced mass of the committed positions, selections [D, L, K]
        or None). device: the block's device path (`DeviceBlocks`), or None: the host path."""
        router, g, k = self.block_router, self.geometry, self.block_router.config.k
        rec.begin(t, ids[0], root)
        alpha = block_weights(router.config.selector, k, router.commit_rate, confidences)
        if device is not None:
            greedy, displaced, selected = device.verify(ids, root, alpha, feed, pregate)
            selected = selected.copy() if record else None
        else:
            displaced = np.zeros(k + 1)
            selected = np.empty((k + 1, g.num_layers, g.top_k), np.int64) if record else None
            router.begin(run.step, router.config.selector, alpha, displaced, selected, feed, pregate)
            self._forward(run, ids, root, router, rec)  # the block's host time by part (and GPU gaps, instrumented)
            greedy = run.step.next_np[:k + 1].tolist()
        a = accepted_length(ids[1:], greedy) if accepted is None else accepted
        self.decoder.rollback(run.step, a + 1)
        (router if device is None else device).end_step(a)
        rec.end(t, greedy[a], a)
        return greedy, a, float(displaced[:a + 1].sum()), selected

    def _speculative_result(self, rec: StepRecorder, tokens: list[int], displaced: float, blocks: list,
                            prefill_ms: float, device, why: str | None, **info) -> DecodeResult:
        """The run's result; device: the blocks' device path (its state handed back to the host), or None where
        the host path ran them (why: `device_blocks`)."""
        if device is not None:
            device.finish()
        s = self.settings
        info.update(verify="device" if device else "host", host_blocks_why=why)
        info = {"kernels": self.kernels, "cuda_graphs": self.graphs is not None, **info,
                "union_used": self.union_used, "union_slots": self.block_router.union_slots,
                "peak_slots": self.block_router.config.pool_size + self.union_used,
                "prefetch": self.block_router.config.prefetch,
                "skip_copies": s.skip_copies, "max_in_flight": s.max_in_flight,
                "selector": self.block_router.config.selector.name, "notes": list(self.notes)}
        return rec.result(0, None, info, k=self.block_router.config.k, tokens=tokens, displaced=displaced,
                          block_selected=blocks, prefill_ms=prefill_ms)

    # -- trace-following -------------------------------------------------------------------------------
    @torch.no_grad()
    def follow(self, source, first_position: int = 0, draft_cost_s: float = 0.0, record: bool = False,
               fingerprint: str | None = None, return_logits: bool = False):
        """Trace-following: route from recorded logits on this engine's weights, so times and copies are the
        recorded routing's on this model's shapes (full-size random weights and a small trained model's
        routing, for instance).

        source: a `LogitFeed` with tokens (a recorded autoregressive run: one `DecodeResult`, every step timed),
        or `Blocks` (the verification blocks of a recorded speculative run, `blocks_from_records`, or of a
        synthetic drafter over a trace, `synthetic_blocks`: one `DecodeResult` per request). Each block's input
        is its recorded root and drafts, selection reads its recorded router logits at every position and layer
        (the block prefetch its recorded pre-gate logits), and its accepted length is the recorded one. As in the CPU replay, each request starts at the
        calibration's warm set and its prompt is not run: the first step sits at `first_position` (the KV cache
        below holds whatever it holds), later ones follow the committed lengths. draft_cost_s is charged per
        block as drafting time (no drafter runs). fingerprint: the recorded model's router fingerprint
        (`BlockRecords.fingerprint`; a LogitFeed carries its own), checked against the calibration's, which must
        be the recorded model's. A block result's tokens are the committed ones: accepted drafts and the next
        block's root (the last block's bonus is this model's greedy token)."""
        if isinstance(source, LogitFeed):
            if source.tokens is None:
                raise ValueError("following a logit feed needs its tokens (LogitFeed.of(result) keeps them)")
            return self.teacher_forced(source.tokens, 0, source, return_logits, first_position)
        if not isinstance(source, Blocks):
            raise TypeError(f"follow takes a LogitFeed or Blocks, got {type(source).__name__}")
        router = self._need(self.block_router, "following verification blocks", "a SpeculativeConfig")
        g, k, blocks = self.geometry, router.config.k, source
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
                        record: bool) -> DecodeResult:
        g, k = self.geometry, self.block_router.config.k
        device, why = self._blocks_step()
        self._start(self.block_router)
        rec = StepRecorder(len(ids), g.num_layers, g.num_experts, g.top_k, self.copies, self.settings.instrument,
                           cuda_stream=self.compute, positions=False)
        run, new, displaced, selections = self._runners[k + 1], [], 0.0, []
        with self._stream():
            if device is not None:
                device.start(self.settings, fed=True)
            for i, b in enumerate(ids):
                rows, a = blocks.rows[b], int(blocks.accepted[b])
                greedy, _, d_mass, selected = self._verify(rec, i, run, blocks.tokens[rows].tolist(), position,
                                                           blocks.confidences[b], record,
                                                           feed=blocks.router_logits[rows], accepted=a,
                                                           pregate=blocks.pregate_logits[rows], device=device)
                displaced += d_mass
                if record:
                    selections.append(selected)
                rec.draft_ms[i] = 1e3 * draft_cost_s
                bonus = int(blocks.tokens[blocks.rows[ids[i + 1], 0]]) if i + 1 < len(ids) else greedy[a]
                new += blocks.tokens[rows[1:a + 1]].tolist() + [bonus]
                position += a + 1
        return self._speculative_result(rec, new, displaced, selections, 0.0, device, why, follow=blocks.source)

