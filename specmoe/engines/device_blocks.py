"""Verification blocks on the device: a block's selection, its expert pool, its demand copies and the pool refill
decided by the device, one CUDA graph per block, no host round trip per layer (`EngineConfig.block_device`).

A block of D = k + 1 positions runs, on the compute stream: the staged inputs to the device (the position
weights alpha [D], float64; with trace-following the block's recorded router logits [L, D, E]), then per layer l
attention, router and pre-gate of the D positions (`Decoder.attention_router`); `DevicePool.select` (the block
selector over the pool, `select_block_into`, and `ExpertPool.use`: the missing experts take union slots; the
selections, the route rows with their execution weights, and the layer's demand copy list written on the device:
the host `BlockRouter.route`'s decisions bit for bit, `kernels.device_select`); the demand copy kernel
(`kernels.expert_copy`: the missing experts from the pinned store into their union slots) on a branch forked
after the selection; and the grouped MoE over the route rows, the pool's experts (slots below P) first, beside
the copies, then, after the branch is joined, the missing experts in the union slots (`Decoder.moe`'s late slots:
the same bits as one pass, since each expert's outputs come from the same program either way). Then the head,
the pool refill (`DevicePool.end_block`: `ExpertPool.end_block` with its moves) and the moves as the copy kernel
from the layer's slots to its slots (the host path's `CopyStream.move`), and one device-to-host copy of the
greedy tokens, the selections, the displaced mass per layer and the copy and move counts per layer.

The refill does not depend on the block's acceptance (every verified position's experts count, rejected ones
included), so it belongs to the block's graph; the host reads the greedy tokens after it, computes the accepted
length, rolls the decoder back and updates the commitment rates (`end_step`), which set the next block's alpha.

Copy accounting is the host path's (`CopyStats`): demand = issued = the block's missing experts (skipped in
copies-skipped mode, whose graph has no copy launches), moved = the refill's moves. The pool's counters
(`ExpertPool.copies`, `moves`, `blocks`) are kept on the host from the same counts; the pool's state goes back to
the host pool at the run's end (`finish`), so that the next run, on either path, starts right.

The block prefetch (`SpeculativeConfig.prefetch` > 0): layer l + 1's prediction (`DevicePool.predict` on the
pre-gate logits g_{l+1}, which exist after layer l's attention) and its copies run on a branch forked there
(`PrefetchBranch`, as the AR device policy's), beside layer l's selection and MoE; layer l + 1 joins the branch
before its selection (whose demand copies may take an unused prefetch's slot) and its MoE, and waits for its own
prefetch copies only, not for the next layer's prediction and copies queued behind them. `DevicePool.select`
places the missing experts as the host's `place_union` (hits stay in their prefetch slots), the route rows and
the refill moves read the physical slots.
Counts: demand = the copies left, prefetch hits in time (joined before the layer), unused = prefetched - hits.
With a feed (trace-following) the block's recorded router and pre-gate logits are staged as the records hold them,
[2, D, L, E] (z, then g): one contiguous copy each from the records' rows, not a transpose into the step's [L, D, 2E]
layout (at Qwen3.6's 40 layers and 256 experts a block's staging took 0.25 ms of the H200 host's time with the
transpose, 0.15 without); the selection and the prediction read layer l's [D, E] rows with a stride.

Union slots sized by measurement (U below a block's worst case min(E - P, D K)): a block whose layer misses more
than U experts raises the host path's ValueError after its graph (the kernel leaves that layer's pool unchanged and
points its missing experts' route entries at slot 0, so nothing reads outside the slots; the block's outputs are
not used). `DeviceBlocks.verify` checks each layer's missing count.

Not on this path (the engine keeps the host loop, `block_device_reason`): E > 1024, and the prompt: a speculative
run's prefill stays on the host path (exact selection in blocks, one position at a time where U could not hold a
block's misses; its copies are prompt processing), and the device pool takes the host pool's state after it.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from .device_policy import (PrefetchBranch, captured, copy_delays, delayed_copy, kernels_reason, launch, path_state,
                            staged)


def block_device_reason(choice: str, cuda: bool, router, settings) -> str | None:
    """None if the verification blocks of `router` (a `BlockRouter`) run on the device, else why the host path
    runs them. choice: `EngineConfig.block_device`; settings: the run's `RunSettings` (instrumented runs time each
    layer on the host path)."""
    from specmoe.kernels.device_select import MAX_EXPERTS

    if router is None:
        return "no speculative config"
    why = kernels_reason("block_device", choice, cuda)
    if why is not None:
        return why
    if settings.instrument:
        return "instrumented runs time each layer's host gap"
    g = router.geometry
    if g.num_experts > MAX_EXPERTS:
        return f"E={g.num_experts} > {MAX_EXPERTS} experts (the device refill's key)"
    return None


class DeviceBlocks:
    """The device path of one `BlockRouter` over one decoder step of D = k + 1 positions (module docstring): the
    device pool, the copy views, the staged alpha and feed, and one captured graph per copy setting (copies
    skipped or not, delays) and input (the model's router or a feed). Build it before a request (its warm-up
    writes the KV rows of positions 0 .. D - 1)."""

    def __init__(self, decoder, step, residency, router, stream, cuda_graphs: bool = True,
                 copy_in_graph: bool = True, blocks: int | None = None, block: int | None = None):
        from specmoe.kernels.device_select import DevicePool

        g = decoder.geometry
        path_state(self, decoder, step, residency, router, stream, cuda_graphs, copy_in_graph, blocks, block)
        d, device, pin = step.num_positions, residency.device, stream is not None
        self.prefetch = router.config.prefetch
        self.pool = DevicePool(router.pool, router.config.selector, router.scoring, d, device, self.prefetch)
        self.alpha_host, self.alpha_dev = staged((d,), torch.float64, device, pin)
        # a feed as the records hold it: [2, D, L, E], the router logits, then the pre-gate logits (module docstring)
        self.feed_host, self.feed_dev = staged((2, d, g.num_layers, g.num_experts), torch.float32, device, pin)
        # per layer: demand copies, moves, missing experts, prefetched, prefetch hits, union slots written
        self.counts_dev = torch.zeros(6, g.num_layers, dtype=torch.int64, device=device)
        self.counts_host = torch.zeros(self.counts_dev.shape, dtype=torch.int64, pin_memory=pin)
        self.selections_host = torch.zeros(self.pool.selections.shape, dtype=torch.int64, pin_memory=pin)
        self.displaced_host = torch.zeros(self.pool.displaced_rows.shape, dtype=torch.float64, pin_memory=pin)
        # numpy views of the staged and copied-out buffers, made once (each block reads or writes them all)
        self.alpha_np, self.feed_np = self.alpha_host.numpy(), self.feed_host.numpy()
        self.counts_np, self.displaced_np = self.counts_host.numpy(), self.displaced_host.numpy()
        self.selections_np = self.selections_host.numpy().transpose(1, 0, 2)  # [D, L, K]
        self.first_union_slot = router.config.pool_size  # the union slots, which the demand copies write
        if self.cuda:
            self.branches = PrefetchBranch(device, g.num_layers)  # the block prefetch's prediction and copies
            # the demand copies' branch (high priority: its few programs start while the MoE fills the GPU)
            self.copier = torch.cuda.Stream(device=device, priority=-1)
            self.ev_done = torch.cuda.Event()
            with torch.no_grad(), torch.cuda.stream(stream):
                self._warm_up()

    # -- the block -----------------------------------------------------------------------------------------
    def _body(self, skip: bool, delays, copy_out: bool, fed: bool = False) -> None:
        """Every layer, the head, the refill and its moves, the records (module docstring); copied to the host at
        the end (copy_out). fed: selection reads the staged feed, not the router's output."""
        dec, step, pool, e, last = self.decoder, self.step, self.pool, self.num_experts, self.num_layers - 1
        self.alpha_dev.copy_(self.alpha_host, non_blocking=True)
        if fed:
            self.feed_dev.copy_(self.feed_host, non_blocking=True)
        branch = self.branches if self.cuda and self.prefetch > 0 else None
        for layer in range(self.num_layers):
            dec.attention_router(step, layer, copy_out=False)
            # z_l, and g_{l+1} for the prefetch: the feed's [D, E] rows of stride L E, or the step's logits rows
            router = self.feed_dev[0, :, layer] if fed else step.logits_dev[layer, :, :e]
            if self.prefetch and layer < last:  # the next layer's prefetch, beside this layer's selection and MoE
                pregate = self.feed_dev[1, :, layer + 1] if fed else step.logits_dev[layer, :, e:]
                with branch.deciding(self.stream) if branch else contextlib.nullcontext():
                    pool.predict(layer + 1, pregate, self.alpha_dev)
                with branch.copying(layer + 1) if branch else contextlib.nullcontext():
                    if not skip:
                        self._copy(layer + 1, pool.prefetches[layer + 1], delays, 3 * layer + 2)
            if branch and layer > 0:  # this layer's prefetch copies land before its demand copies and MoE
                branch.join(self.stream, layer)
            pool.select(layer, router, self.alpha_dev, step.route_dev[layer])
            late = None
            if not skip and self.cuda:  # the demand copies beside the MoE of the pool's experts
                self.copier.wait_stream(self.stream)
                with torch.cuda.stream(self.copier):
                    self._copy(layer, pool.demands[layer], delays, 3 * layer)
                late = (self.first_union_slot, lambda: self.stream.wait_stream(self.copier))
            elif not skip:
                self._copy(layer, pool.demands[layer], delays, 3 * layer)
            dec.moe(step, layer, self.residency.slots.layer(layer), copy_in=False, late=late)
        if branch:
            branch.close(self.stream)
        dec.head(step, copy_out=False)
        pool.end_block()
        if not skip:  # the refill's moves: union slot -> pool slot, within each layer's slots
            for layer in range(self.num_layers):
                delayed_copy(self.dst[layer], self.dst[layer], pool.move_lists[layer], delays, 3 * layer + 1,
                             self.cuda, self.blocks, self.block)
        self.counts_dev[0].copy_(pool.demands[:, 0])
        self.counts_dev[1].copy_(pool.move_lists[:, 0])
        self.counts_dev[2:].copy_(pool.layer_counts.T)
        if copy_out:
            self._copy_out()

    def _copy(self, layer: int, listing: torch.Tensor, delays, which: int) -> None:
        delayed_copy(self.src[layer], self.dst[layer], listing, delays, which, self.cuda, self.blocks, self.block)

    def _copy_out(self) -> None:
        self.step.copy_out_next()
        self.selections_host.copy_(self.pool.selections, non_blocking=True)
        self.displaced_host.copy_(self.pool.displaced_rows, non_blocking=True)
        self.counts_host.copy_(self.counts_dev, non_blocking=True)

    def _warm_up(self) -> None:
        """Compile every kernel (two eager passes of a block without copies, the second reading the feed buffer,
        and the copy kernel on an empty list); `start` loads the pool's state afterwards."""
        d = self.step.num_positions
        self.step.set_input([0] * d, 0, self.decoder.geometry.max_seq_len)
        for fed in (False, True):
            self._body(skip=True, delays=None, copy_out=True, fed=fed)
        empty = torch.zeros_like(self.pool.demands[0])
        for src in (self.src[0], self.dst[0]):  # demand copies (from the store), moves (from the slots)
            delayed_copy(src, self.dst[0], empty, None, 0, False, self.blocks, self.block)
        torch.cuda.synchronize()

    # -- a run ---------------------------------------------------------------------------------------------
    def start(self, settings, fed: bool = False) -> None:
        """The first verification block of a request comes next (after the engine's `_start` and, for
        generation, the host path's prefill): the device pool takes the host pool's state; the run's copy
        settings (skip_copies; copy_delay draws a fixed delay per copy launch from delay_seed, on CUDA only);
        fed: selection reads recorded router logits (`verify`'s feed)."""
        self.residency.copies.synchronize()  # the host path's copies and moves have landed
        self.pool.load(self.router.pool)
        self.block_number = self.router.pool.block  # the pool's, as the device pool counts it
        self.skip, self.fed = settings.skip_copies, fed
        self.delays = copy_delays(settings, 3 * self.num_layers, self.cuda)  # demand, moves, prefetch per layer
        if self.use_graphs:  # captured here, not in the run's first block
            with torch.no_grad():
                captured(self)

    def verify(self, ids, root: int, alpha: np.ndarray, feed: np.ndarray | None = None,
               pregate: np.ndarray | None = None):
        """One block (root token and drafts `ids` at position `root`) in one launch, selection weighted by
        `alpha` [D] and reading `feed` [D, L, E] (recorded router logits; the run must have started with
        fed=True) or the model's router; with a feed, the block prefetch reads `pregate` [D, L, E] (recorded
        pre-gate logits, layer 0 unused; required with a prefetch budget). Returns (the greedy tokens, displaced
        mass per position summed over layers as the host sums it, selections [D, L, K])."""
        step = self.step
        if (feed is not None) != self.fed:
            raise ValueError("a run's blocks are all fed or none (DeviceBlocks.start's fed)")
        if feed is not None and self.prefetch and pregate is None:
            raise ValueError("a fed block with a prefetch budget needs its recorded pre-gate logits")
        step.set_input(ids, root, self.decoder.geometry.max_seq_len)
        self.alpha_np[:] = alpha  # the previous block has ended: its graph no longer reads these
        if feed is not None:  # contiguous copies (module docstring); layer 0's pre-gate row is never read
            np.copyto(self.feed_np[0], feed, casting="same_kind")
            if pregate is not None:
                np.copyto(self.feed_np[1], pregate, casting="same_kind")
        launch(self)
        missing = self.counts_np[2]
        if missing.max() > self.router.union_slots:  # the host path's error (`ExpertPool.use`); outputs not valid
            self.finish()  # the slots' bookkeeping follows what the device wrote: the unit stays usable
            raise ValueError(f"verification block at position {root}: layer "
                             f"{int(np.argmax(missing > self.router.union_slots))} misses more than the "
                             f"U={self.router.union_slots} union slots' worth of experts in block "
                             f"{self.block_number}; make the pool with more union_slots")
        # layer by layer, as `BlockRouter.route` adds them: accumulate's running sum is that order by definition
        # (a sum over axis 0 need not be: NumPy may pair the rows), and 0 + the first row is the first row
        displaced = np.add.accumulate(self.displaced_np, axis=0)[-1]
        return step.next_np.tolist(), displaced, self.selections_np

    def end_step(self, accepted: int) -> None:
        """After the block's acceptance (as `BlockRouter.end_step`): the commitment rates, the union slots used,
        the pool's counters and the copy stream's counts of the block (module docstring)."""
        router, pool = self.router, self.router.pool
        router.commit_rate.update(accepted, router.config.k)
        counts = self.counts_np
        _, moves, missing, _, _, written = counts
        n_copies, n_moves, _, n_prefetched, n_hits, _ = counts.sum(axis=1).tolist()
        router.union_used = max(router.union_used, int(written.max()))
        self.block_number += 1
        pool.copies += missing
        pool.moves += moves
        pool.blocks += 1
        stats = self.residency.copies.stats
        stats.demand += n_copies
        stats.prefetch += n_prefetched
        stats.prefetch_in_time += n_hits  # joined before the layer's demand copies and MoE (module docstring)
        stats.prefetch_unused += n_prefetched - n_hits
        if self.skip:
            stats.skipped += n_copies + n_prefetched
        else:
            stats.issued += n_copies + n_prefetched
        stats.moved += n_moves

    def finish(self) -> None:
        """After the run: the host pool takes the device pool's state (slot table, members, recency, block
        number), and the copy stream's slot bookkeeping follows what the device wrote into the slots: the pool's
        experts in their slots, the union slots unknown (a later copy never relies on them)."""
        state, pool = self.pool.state(), self.router.pool
        pool.slot[...], pool.pool_mask[...], pool.recency[...] = state["slot"], state["pool_mask"], state["recency"]
        pool.block = state["block"]
        pool.used[:] = False
        pool._block_copies = 0
        copies, p = self.residency.copies, pool.pool_size
        copies.synchronize()
        held = np.full((self.num_layers, copies.owner.shape[1]), -1, np.int64)
        for layer in range(self.num_layers):
            members = np.flatnonzero(pool.pool_mask[layer])
            held[layer, pool.slot[layer, members]] = members
        copies.owner[:, :p + pool.union_slots] = held[:, :p + pool.union_slots]
        copies.content[:, :p + pool.union_slots] = held[:, :p + pool.union_slots]
        copies.fresh[:] = False
        copies.queued[:] = False
        copies.pending[:] = False


def held_blocks(held: dict, decoder, step, residency, router, stream, cuda_graphs: bool,
                copy_in_graph: bool) -> DeviceBlocks:
    """The device path of `router`'s speculative config on `step`, kept in `held` per config (a `configure` back
    to a config used before finds its graphs); all are dropped when the step changes (new step buffers)."""
    if any(b.step is not step for b in held.values()):
        held.clear()
    key = router.config
    if key not in held:
        with torch.no_grad(), torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            held[key] = DeviceBlocks(decoder, step, residency, router, stream, cuda_graphs, copy_in_graph)
    held[key].router = router  # the router whose host state `start`, `end_step` and `finish` use
    return held[key]
