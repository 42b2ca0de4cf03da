"""The device's routing decisions checked against the host's, step by step and bit for bit: the AR engine's
logical cache (`device_cache.DeviceCache` against `LogicalCache`) and the speculative engine's block selection
(`device_select.DevicePool` against `select_block_into` and `ExpertPool`), on seeded random logits
(`device_cache_case`, `device_select_case`). Tests run them under Triton's interpreter on the CPU and on the GPU;
the benchmarks and `scripts/kernel_registers.py` draw their inputs from the same cases."""

from __future__ import annotations

import numpy as np
import torch


def check_device_cache(policy, scoring, calibration, router_logits: np.ndarray, pregate_logits: np.ndarray,
                       tokens: np.ndarray, device, sequences: int = 1) -> dict:
    """The device cache (`device_cache.DeviceCache`) against the host `LogicalCache`, step by step: router_logits
    and pregate_logits float32 [T, L, E], tokens [T]; the T positions are cut into `sequences` sequences (a
    reset between them). At every (position, layer) the selections, slots, execution weights (float32 bits),
    demand and prefetch lists must be equal, and after every step the whole state (integer and float64 arrays,
    counters) bit for bit; the displaced mass within 1e-12 relative. Raises AssertionError at the first
    difference; returns the host's `totals()` and two counts of the host's events that the device reaches by
    other paths than the host's loops: "protected_victims", demand insertions whose victim was protected
    (every resident outside S was), and "window_victims", part 1's insertions whose victim was an expert of the
    window not visited yet."""
    from specmoe.routing import EngineScoring, LogicalCache
    from specmoe.routing import kernels as K

    from .device_cache import DeviceCache

    num_positions, num_layers, num_experts = router_logits.shape
    k = policy.top_k
    host = LogicalCache(policy, calibration, num_layers, num_experts, groups=scoring.groups)
    engine_scoring = EngineScoring.of(scoring, num_layers, num_experts)
    dev = DeviceCache(host, scoring, device)
    z_dev = torch.as_tensor(router_logits, dtype=torch.float32).to(device)
    g_dev = torch.as_tensor(pregate_logits, dtype=torch.float32).to(device)
    tok_dev = torch.as_tensor(np.asarray(tokens, dtype=np.int64)).to(device)
    selected, slots = np.empty(k, np.int64), np.empty(k, np.int64)
    weights, logged = np.empty(k, np.float32), np.empty(num_experts, np.float32)
    cut = {round(i * num_positions / sequences) for i in range(1, sequences)}
    events = {"protected_victims": 0, "window_victims": 0}
    slot_row, prot_row, pred_row, pos = K.EXPERT_SLOT, K.PROTECTED, K.PREDICTED, K.POS
    for t in range(num_positions):
        if t in cut:
            host.reset()
            dev.reset()
        token = int(tokens[t])
        for layer in range(num_layers):
            where = f"position {t}, layer {layer}"
            step_t = host.iscalar[layer, pos]
            d = host.route(layer, router_logits[t, layer], token, engine_scoring, logged, selected, slots, weights)
            # a protected victim: protected at this step, not resident after it (part 1 never evicts one)
            events["protected_victims"] += int(np.sum((host.istate[layer, prot_row] == step_t)
                                                      & (host.istate[layer, slot_row] < 0)))
            inserted = np.zeros(0, np.int64)
            nxt = layer + 1 < num_layers
            if nxt and policy.insert_budget > 0:
                g = pregate_logits[t, layer + 1]
                g = g.astype(np.float64) if scoring.kind == "softmax" else scoring.selection_scores(g, layer + 1)
                before = host.istate[layer + 1, slot_row].copy()
                inserted = host.insert_predicted(layer + 1, g, token).copy()
                # a window expert resident before part 1 and evicted by it (left out, or inserted again later)
                window = host.istate[layer + 1, pred_row, :min(policy.window, num_experts)]
                after = host.istate[layer + 1, slot_row, window]
                moved = (after < 0) | (after != before[window])
                events["window_victims"] += int(np.sum((before[window] >= 0) & moved))
            dev.step(tok_dev[t:t + 1], layer, z_dev[t, layer], g_dev[t, layer + 1] if nxt else None)
            experts, route = dev.experts.cpu().numpy(), dev.route.cpu().numpy()
            demand, prefetch = dev.demand.cpu().numpy(), dev.prefetch.cpu().numpy()
            assert np.array_equal(experts, selected), (where, "selected", experts, selected)
            assert np.array_equal(route[:k], slots), (where, "slots", route[:k], slots)
            assert np.array_equal(route[k:], weights.view(np.int32)), (where, "weights", route[k:].view(np.float32),
                                                                        weights)
            assert demand[0] == d and np.array_equal(demand[1:1 + d], host.demand[:d]) \
                and np.array_equal(demand[1 + k:1 + k + d], host.demand_slots[:d]), (where, "demand", demand, d)
            n = len(inserted)
            if nxt and policy.insert_budget > 0:
                m = dev.max_inserted
                assert prefetch[0] == n and np.array_equal(prefetch[1:1 + n], inserted) and np.array_equal(
                    prefetch[1 + m:1 + m + n], host.slot_of(layer + 1, inserted)), (where, "prefetch", prefetch,
                                                                                    inserted)
            state = dev.state()
            for name in ("istate", "iscalar", "fstate", "fscalar", "counters"):
                a, b = state[name], getattr(host, name)
                assert np.array_equal(a.view(np.int64), b.view(np.int64)), (where, name, np.argwhere(a != b)[:5])
            np.testing.assert_allclose(state["displaced_mass"], host.displaced_mass, rtol=1e-12, atol=1e-300)
    return {**host.totals(), **events}


def device_cache_case(num_layers: int, num_experts: int, num_positions: int, seed: int = 0, vocab: int = 20,
                      prior_density: float = 0.1):
    """Inputs for `check_device_cache`: a calibration with a random warm ranking, a sparse token prior (a
    `prior_density` share of its (layer, token, expert) entries set) on a coarse grid (ties of the A priority) and
    random deltas; router and pre-gate logits [T, L, E] float32 that
    recur over positions (a layer prefers some experts, so the cache hits and misses), rounded to bfloat16 on a
    grid of 1/4 (many exact ties, +-0 included); tokens [T] (some outside the prior's vocabulary)."""
    from specmoe.routing import Calibration
    from specmoe.routing.calibration import TokenPrior

    rng = np.random.default_rng(seed)
    shape = (num_layers, vocab, num_experts)
    dense = np.where(rng.random(shape) < prior_density, np.round(rng.random(shape) * 4) / 4, 0.0)
    calibration = Calibration(np.stack([rng.permutation(num_experts) for _ in range(num_layers)]),
                              TokenPrior.from_dense(dense), rng.uniform(2.0, 4.0, num_layers))
    base = rng.normal(0.0, 1.5, (num_layers, num_experts))

    def logits():
        x = np.round((base + rng.normal(0.0, 1.5, (num_positions, num_layers, num_experts))) * 4) / 4
        x[::7, :, :6] = 0.0
        x[3::7, :, 2:9] = -0.0
        return torch.tensor(x, dtype=torch.float32).to(torch.bfloat16).float().numpy()

    tokens = rng.integers(0, vocab + 3, num_positions)
    return calibration, logits(), logits(), tokens


def device_select_case(num_blocks: int, num_layers: int, positions: int, num_experts: int, seed: int = 0):
    """Router logits float32 [B, L, D, E] on a bfloat16 grid with deliberate ties (duplicated expert columns,
    repeated rows, +-0) and position weights float64 [B, D] in [0, 1] with equal values, for `check_device_select`."""
    rng = np.random.default_rng(seed)
    z = torch.from_numpy(rng.normal(0.0, 1.5, (num_blocks, num_layers, positions, num_experts))).to(torch.bfloat16)
    z = z.float().numpy()
    z[..., 7] = z[..., 3]  # tied experts
    z[..., num_experts - 1] = z[..., 0]
    z[:, :, positions // 2] = z[:, :, 1]  # tied positions
    z[..., 5] = -0.0
    z[..., 6] = 0.0
    alpha = np.round(rng.uniform(0.0, 1.0, (num_blocks, positions)), 1)  # ties, and values at rescue thresholds
    alpha[:, 0] = 1.0
    return np.ascontiguousarray(z, dtype=np.float32), alpha


def check_device_select(selector, scoring, pool, router_logits: np.ndarray, alpha: np.ndarray, device,
                        max_positions: int | None = None, pregate_logits: np.ndarray | None = None,
                        prefetch: int = 0) -> dict:
    """Block selection and the pool on the device (`device_select.DevicePool`) against the host
    (`select_block_into` with float32 weights, `ExpertPool.use`, `end_block`), block by block and layer by layer:
    router_logits float32 [B, L, D, E], alpha [B, D]; `pool` a fresh host pool (it is advanced). The counts,
    eligible set, union, missing experts and slots, selections, route rows, the weights' float32 bits and the
    displaced mass to 1e-12 relative (float64 exp may differ in the last bit between numba, numpy and libdevice),
    and after each block the pool's slot table, members, recency and refill moves must be equal. max_positions:
    the device pool's (default the blocks' D; larger: blocks shorter than the pool's buffers).

    prefetch > 0 (with pregate_logits float32 [B, L, D, E]): the block prefetch of every layer >= 1 too, against
    `predict_prefetch` and `place_union` as `BlockRouter` uses them: the prefetch list, the demand list (the copies
    only, in their physical slots), the route rows' physical slots, the layer's counts (prefetched, hits, union
    slots written) and the refill moves' physical sources.

    Raises AssertionError at the first difference; returns the host pool's totals, and with prefetch the
    placement's totals: prefetch, hit, unused, demand, the peak union slots and `spilled` (demand copies that
    took an unused prefetch's slot, the rule's last resort)."""
    from specmoe.verifiers import PrefetchTally, SelectionBuffers, place_union, predict_prefetch, select_block_into

    from .device_select import DevicePool

    num_blocks, num_layers, positions, num_experts = router_logits.shape
    k, p, u = pool.top_k, pool.pool_size, pool.union_slots
    if prefetch and (pregate_logits is None or pregate_logits.shape != router_logits.shape):
        raise ValueError("a prefetch check needs pre-gate logits shaped as the router logits")
    dev = DevicePool(pool, selector, scoring, max_positions or positions, device, prefetch=prefetch)
    rows_of = slice(0, positions)
    buffers = SelectionBuffers(positions, num_experts, k)
    predicted = SelectionBuffers(positions, num_experts, k, np.float32)
    tally, spilled = PrefetchTally(), 0
    for block in range(num_blocks):
        a = np.ascontiguousarray(alpha[block], dtype=np.float64)
        a_dev = torch.tensor(a, device=device)
        physical = np.tile(np.arange(p, p + u), (num_layers, 1))
        for layer in range(num_layers):
            where = f"block {block} layer {layer}"
            prefetched = np.empty(0, np.int64)
            if prefetch and layer:
                g = np.ascontiguousarray(pregate_logits[block, layer])
                prefetched = predict_prefetch(selector, g, pool.resident(layer), a, k, scoring, predicted, prefetch, u,
                                              layer)
                dev.predict(layer, torch.tensor(g, device=device), a_dev)
                listing = dev.prefetches[layer].cpu().numpy()
                n = int(listing[0])
                assert np.array_equal(listing[1:1 + n], prefetched) and \
                    np.array_equal(listing[1 + num_experts:1 + num_experts + n], np.arange(p, p + n)), \
                    f"{where}: prefetch list\nhost   {prefetched}\ndevice {listing[1:1 + n]}"
            z = router_logits[block, layer]
            counts = select_block_into(selector, z, pool.resident(layer), a, k, scoring, buffers, layer=layer)
            missing, slots = pool.use(layer, buffers.selected[:positions])
            route = pool.slot_table(layer)[buffers.selected[:positions]]
            copies, copy_slots = missing, slots
            if prefetch:  # the physical slots, as `BlockRouter.route` places them
                placed, copy, used = place_union(missing, prefetched, p, u)
                physical[layer, slots - p] = placed
                slot_map = np.arange(p + u)
                slot_map[slots] = placed
                route = slot_map[route]
                copies, copy_slots = missing[copy], placed[copy]
                spilled += int((copy_slots < p + prefetched.size).sum())
                tally.count(prefetched, missing, p, u)
                placement = (prefetched.size, missing.size - int(copy.sum()), used)
            if layer % 2:  # as the engine calls it: logits rows of stride 2E, the step's route rows [D, 2K]
                rows = torch.zeros(positions, 2 * num_experts, dtype=torch.float32, device=device)
                rows[:, :num_experts] = torch.tensor(z, device=device)
                route_out = torch.zeros(positions, 2 * k, dtype=torch.int32, device=device)
                dev.select(layer, rows[:, :num_experts], a_dev, route_out)
                dev.route[rows_of].copy_(route_out[:, :k])
                assert np.array_equal(route_out[:, k:].cpu().numpy(), buffers.weights[:positions].view(np.int32)), \
                    f"{where}: the route rows' weights"
            else:
                dev.select(layer, torch.tensor(z, device=device), a_dev)
            got = dev.counts.cpu().numpy()
            assert tuple(got) == (*counts, 1), f"{where}: counts {got} != {counts}"
            got = tuple(int(x) for x in dev.layer_counts[layer].cpu().numpy())
            want = (missing.size, *placement) if prefetch else (missing.size, 0, 0, missing.size)
            assert got == want, f"{where}: layer counts (missing, prefetched, hits, union written) {got} != {want}"
            n_eligible, n_union, n_missing = counts
            n_copies = copies.size
            assert int(dev.demand[0]) == n_copies, f"{where}: the demand list's count"
            for name, host, device_value in (
                    ("eligible", buffers.eligible[:n_eligible], dev.eligible[:n_eligible]),
                    ("union", buffers.union[:n_union], dev.union[:n_union]),
                    ("missing", copies, dev.missing[:n_copies]),
                    ("missing slots", copy_slots, dev.missing_slots[:n_copies]),
                    ("selected", buffers.selected[:positions], dev.selected[rows_of]),
                    ("route", route, dev.route[rows_of]),
                    ("weights", buffers.weights[:positions].view(np.int32), dev.weights[rows_of].view(torch.int32))):
                device_value = device_value.cpu().numpy()
                assert np.array_equal(host, device_value), f"{where}: {name}\nhost   {host}\ndevice {device_value}"
            displaced = dev.displaced[rows_of].cpu().numpy()
            assert np.allclose(displaced, buffers.displaced[:positions], rtol=1e-12, atol=0.0), \
                f"{where}: displaced\nhost   {buffers.displaced[:positions]}\ndevice {displaced}"
        pool.end_block()
        dev.end_block()
        state = dev.state()
        for name in ("slot", "pool_mask", "recency"):
            assert np.array_equal(getattr(pool, name), state[name]), f"block {block}: pool {name} differs"
        assert state["block"] == pool.block
        moves, n_moves = dev.moves.cpu().numpy(), dev.n_moves.cpu().numpy()
        for layer in range(num_layers):
            src, dst = pool.refill_moves(layer)
            if prefetch:
                src = physical[layer, src - p]
            n = n_moves[layer]
            assert n == src.size and np.array_equal(moves[layer, 0, :n], src) and \
                np.array_equal(moves[layer, 1, :n], dst), f"block {block} layer {layer}: refill moves differ"
    totals = pool.totals()
    if prefetch:
        totals.update(tally.as_dict(), spilled=spilled)
    return totals
