"""Algorithm 1 worked by hand, tie rules, statistics, accounting and bad input of the routing core."""

import numpy as np
import pytest

from specmoe.routing import (Calibration, CalibrationError, LogicalCache, PolicyConfig, PolicyError, RouterScoring,
                             TokenPrior,
                             preset, replay)

E = 6  # experts per layer in the hand-worked cases
TOKEN = 7  # the input token whose prior sets the A priorities


def calibration(num_layers=2, num_experts=E, warm=(0, 1, 2), prior=(0.3, 0.1, 0.2), delta=1.0, vocab=10):
    """Warm set `warm` first in every layer; token TOKEN's prior = `prior` (padded with zeros)."""
    ranking = np.array([list(warm) + [e for e in range(num_experts) if e not in warm]] * num_layers)
    dense = np.zeros((num_layers, vocab, num_experts))
    dense[:, TOKEN, : len(prior)] = prior
    return Calibration(ranking, dense, np.full(num_layers, delta), {"model": "hand-made"})


def logits(*order, num_experts=E):
    """Logits whose ranking starts with `order` (descending), the rest below in index order."""
    z = np.zeros(num_experts)
    for rank, e in enumerate(order):
        z[e] = 10.0 - rank
    rest = [e for e in range(num_experts) if e not in order]
    for rank, e in enumerate(rest):
        z[e] = -1.0 - 0.01 * rank
    return z


def cache_for(capacity=3, top_k=2, _cal=None, **policy):
    """A two-layer cache over E experts; `_cal` overrides the arguments of `calibration`."""
    kind = policy.pop("kind", "psr")
    if kind == "psr":
        policy.setdefault("insert_budget", 1)
    return LogicalCache(PolicyConfig(kind=kind, capacity=capacity, top_k=top_k, **policy),
                        calibration(**(_cal or {})), 2, E)


# -- part 1: insertion from the pre-gate ---------------------------------------------------------------
def test_reset_puts_warm_set_ascending_in_slots():
    cache = LogicalCache(preset("psr", 3, 2), calibration(warm=(4, 0, 2)), 2, E)
    assert cache.resident(1).tolist() == [0, 2, 4]
    assert cache.slot_of(1, [0, 2, 4, 1]).tolist() == [0, 1, 2, -1]


def test_insertion_evicts_lowest_priority_and_takes_its_slot():
    cache = cache_for()
    inserted = cache.insert_predicted(1, logits(3, 4), TOKEN)
    assert inserted.tolist() == [3]  # budget n=1: 4 is not inserted
    assert cache.resident(1).tolist() == [0, 3, 2]  # 1 (priority 0.1) evicted, 3 in its slot


def test_resident_candidate_is_protected_once_visited():
    cache = cache_for()
    cache.insert_predicted(1, logits(1, 3), TOKEN)  # 1 is resident and visited first: protected
    assert cache.resident(1).tolist() == [0, 1, 3]  # so 2 (priority 0.2) goes


def test_resident_candidate_later_in_the_ranking_is_not_yet_protected():
    cache = cache_for()
    cache.insert_predicted(1, logits(3, 1), TOKEN)  # 3 inserted before 1 is visited: 1 can be evicted
    assert cache.resident(1).tolist() == [0, 3, 2]


def test_budget_bounds_insertions_and_earlier_insertions_are_protected():
    cache = cache_for(insert_budget=2)
    assert cache.insert_predicted(1, logits(3, 4, 5), TOKEN).tolist() == [3, 4]
    assert cache.resident(1).tolist() == [0, 3, 4]  # 3 evicts 1; 4 evicts 2 (3 is protected)


def test_window_limits_the_candidates_visited():
    cache = cache_for(window=1)
    assert cache.insert_predicted(1, logits(1, 3), TOKEN).tolist() == []
    assert cache.resident(1).tolist() == [0, 1, 2]


def test_no_insertion_when_every_resident_expert_is_protected():
    cache = cache_for(capacity=2, top_k=2, _cal={"warm": (0, 1)})
    assert cache.insert_predicted(1, logits(0, 1, 3), TOKEN).tolist() == []


# -- part 2: selection and demand insertion -------------------------------------------------------------
def test_demand_insertions_in_index_order_evict_by_priority():
    cache = cache_for(kind="exact")
    selected, demand = cache.select(0, logits(5, 4), TOKEN)
    assert selected.tolist() == [5, 4] and demand.tolist() == [4, 5]
    assert cache.resident(0).tolist() == [0, 4, 5]  # 4 takes 1's slot (0.1), then 5 takes 2's (0.2)


def test_demand_eviction_spares_the_protected_set():
    cache = cache_for(window=1)
    cache.insert_predicted(1, logits(1), TOKEN)  # B = {1}, nothing inserted
    selected, demand = cache.select(1, logits(4, 5), TOKEN)
    assert demand.tolist() == [4, 5]
    # 4 evicts 2 (lowest priority outside S and B), then 5 evicts 0: 1 is spared although its priority is lowest
    assert cache.resident(1).tolist() == [5, 1, 4]


def test_demand_eviction_falls_back_to_protected_experts():
    cache = cache_for(capacity=2, top_k=2, window=2, _cal={"warm": (0, 1), "prior": (0.3, 0.1)})
    cache.insert_predicted(1, logits(0, 1), TOKEN)  # B = {0, 1} = R
    _, demand = cache.select(1, logits(3, 4), TOKEN)
    assert demand.tolist() == [3, 4]
    assert cache.resident(1).tolist() == [4, 3]  # 3 evicts 1 (0.1), then 4 evicts 0


def test_bonus_steers_selection_to_resident_experts():
    # z: 4 and 5 lead by 0.5 over 1 and 2, but the bonus (0.6 * delta 1.0) favours residents 0..2.
    cache = cache_for(kind="cache_prior", bonus=0.6, priority="lru")
    z = np.array([0.0, 0.5, 0.45, -3.0, 1.0, 0.9])
    selected, demand = cache.select(0, z, TOKEN)
    assert selected.tolist() == [1, 2] and demand.tolist() == []


def test_bonus_applies_to_inserted_prefetches():
    cache = cache_for(bonus=0.6)
    cache.insert_predicted(1, logits(5), TOKEN)  # 5 inserted, evicting 1
    z = np.array([0.0, 0.5, 0.45, -3.0, 1.0, 0.9])
    selected, demand = cache.select(1, z, TOKEN)
    assert selected.tolist() == [5, 2] and demand.tolist() == []  # 5 now resident: 1.5; 2: 1.05; 4: 1.0


def test_spec_exec_executes_the_pregate_top_k():
    cache = cache_for(kind="spec_exec", insert_budget=1)
    cache.insert_predicted(1, logits(4, 0, 5), TOKEN)
    selected, demand = cache.select(1, logits(1, 2), TOKEN)
    assert selected.tolist() == [4, 0] and demand.tolist() == []
    selected, _ = cache.select(0, logits(1, 2), TOKEN)  # first layer: no pre-gate, router's own top-K
    assert selected.tolist() == [1, 2]


def test_protect_top_gives_router_top_j_the_bonus():
    z = np.array([0.0, 0.5, 0.45, -3.0, 1.0, 0.9])
    plain = cache_for(kind="cache_prior", bonus=0.6, priority="lru")
    protected = cache_for(kind="cache_prior", bonus=0.6, priority="lru", protect_top=1)
    assert plain.select(0, z, TOKEN)[0].tolist() == [1, 2]
    assert protected.select(0, z, TOKEN)[0].tolist() == [4, 1]


def test_running_delta_uses_mean_logit_range_of_the_request():
    cache = cache_for(kind="cache_prior", bonus=0.5, delta="running", priority="lru")
    # range of the first token is 4.0 -> bonus 2.0: residents 0..2 win over 4, 5 (which lead by < 2)
    z = np.array([0.0, 0.1, 0.2, -3.0, 1.0, 1.5])
    assert cache.select(0, z, TOKEN)[0].tolist() == [2, 1]
    fixed = cache_for(kind="cache_prior", bonus=0.5, priority="lru")  # delta 1.0 -> bonus 0.5
    assert fixed.select(0, z, TOKEN)[0].tolist() == [5, 4]


# -- ties ---------------------------------------------------------------------------------------------
def test_priority_ties_evict_the_lowest_index():
    cache = cache_for(kind="exact", priority="lru")  # warm experts all have lru priority 0
    _, demand = cache.select(0, logits(4, 5), TOKEN)
    assert cache.resident(0).tolist() == [4, 5, 2]


def test_biased_ties_go_to_the_higher_raw_logit_then_lower_index():
    cache = cache_for(kind="cache_prior", bonus=0.5, top_k=1, capacity=1, _cal={"warm": (0,)})
    z = np.array([1.0, 1.5, -5, -5, -5, -5])  # biased: 0 -> 1.5 (resident), 1 -> 1.5 (raw 1.5 wins)
    assert cache.select(0, z, TOKEN)[0].tolist() == [1]
    cache = cache_for(kind="exact", top_k=2)
    z = np.array([-1.0, 2.0, -1.0, 2.0, 2.0, -1.0])  # three-way tie: lowest indices 1, 3
    assert cache.select(0, z, TOKEN)[0].tolist() == [1, 3]


def test_pregate_ranking_ties_go_to_the_lower_index():
    cache = cache_for()
    g = np.array([0.0, 0.0, 0.0, 1.0, 1.0, 0.0])  # 3 and 4 tie: 3 first
    assert cache.insert_predicted(1, g, TOKEN).tolist() == [3]


# -- statistics and priorities ---------------------------------------------------------------------------
def test_ema_statistics_follow_the_routers_own_top_k_not_the_executed_set():
    cache = cache_for(kind="cache_prior", bonus=5.0)
    z1, z2 = logits(4, 5), logits(4, 0)
    cache.select(1, z1, TOKEN)  # executes residents, router wanted 4 and 5
    cache.select(1, z2, TOKEN)
    fast, slow = cache.statistics(1)
    assert fast[4] == pytest.approx(0.5 * 0.5 + 0.5) and slow[4] == pytest.approx(0.98 * 0.02 + 0.02)
    assert fast[5] == pytest.approx(0.25) and fast[0] == pytest.approx(0.5) and fast[1] == 0.0


def test_lru_evicts_least_recently_executed():
    cache = cache_for(kind="exact", priority="lru", top_k=1, capacity=3)
    for e in (0, 1, 2, 0, 3):  # 1 is least recently used when 3 arrives
        cache.select(0, logits(e), TOKEN)
    assert sorted(cache.resident(0).tolist()) == [0, 2, 3]


def test_a_priority_combines_statistics_and_token_prior():
    # after token 0 executes 2, s_fast[2] = 0.5, s_slow[2] = 0.02: priority 0.72 beats 0's prior 0.3
    cache = cache_for(kind="exact", top_k=1)
    cache.select(0, logits(2), TOKEN)
    cache.select(0, logits(4), TOKEN)  # evicts min of {0: 0.3, 1: 0.1, 2: 0.2 + 0.52} -> 1
    cache.select(0, logits(5), TOKEN)  # {0: 0.3, 2: 0.2 + 0.25 + 0.0196, 4: 0.5 + 0.02} -> 0
    assert sorted(cache.resident(0).tolist()) == [2, 4, 5]


# -- accounting ----------------------------------------------------------------------------------------
def test_prefetch_unused_when_evicted_or_left_at_end():
    cache = cache_for(kind="psr", bonus=0.0)
    cache.insert_predicted(1, logits(3), TOKEN)  # prefetch 3 (evicts 1)
    cache.select(1, logits(4, 5), TOKEN)  # executes 4 and 5: evicts 2 then 3 (3 never executed)
    totals = cache.totals()
    assert (totals["prefetch"], totals["demand"], totals["unused"]) == (1, 2, 1)
    cache.insert_predicted(1, logits(1), TOKEN)  # prefetch 1, then the sequence ends
    cache.reset()  # the sequence ends
    assert cache.totals()["unused"] == 2


def test_displaced_mass_and_replaced_slots():
    cache = cache_for(kind="cache_prior", bonus=100.0)
    z = np.log(np.array([0.05, 0.05, 0.1, 0.1, 0.4, 0.3]))
    selected, _ = cache.select(0, z, TOKEN)
    assert sorted(selected.tolist()) == [2, 0] or sorted(selected.tolist()) == [0, 2]
    assert cache.totals()["replaced"] == 2
    assert cache.totals()["displaced_mass"] == pytest.approx(0.7)


def test_replay_trace_counts_match_the_cache_counters():
    """`replay`'s per-step counts (one numba span per layer) equal, step by step, what the engines' per-token
    calls (`insert_predicted`, then `select`) return on a second cache, and their sums equal its counters."""
    rng = np.random.default_rng(1)
    z = rng.normal(size=(40, 2, E))
    g = z + rng.normal(size=z.shape)
    policy = preset("psr", 3, 2)
    cache = LogicalCache(policy, calibration(), 2, E)
    steps = []
    for t in range(40):
        if t == 39:  # the last step of layer 1 prefetches an expert, then executes two others already resident:
            # the sequence ends with a prefetch never executed, counted unused at this step when the cache resets
            g[t, 1] = 0.0
            g[t, 1, next(e for e in range(E) if e not in cache.resident(1))] = 5.0
        for layer in range(2):
            inserted = cache.insert_predicted(layer, g[t, layer], TOKEN) if layer else []
            if t == 39 and layer == 1:
                z[t, 1] = -5.0
                z[t, 1, [e for e in cache.resident(1) if e not in inserted][:2]] = (5.0, 4.0)
            selected, demand = cache.select(layer, z[t, layer], TOKEN)
            steps.append((t, layer, len(inserted), len(demand), selected, cache.slot_of(layer, selected)))
    cache.reset()
    trace = replay(policy, z, g, np.full(40, TOKEN), calibration())
    for t, layer, prefetch, demand, selected, slots in steps:
        assert trace.prefetch_copies[t, layer] == prefetch and trace.demand_copies[t, layer] == demand
        assert trace.selected[t, layer].tolist() == selected.tolist()
        assert trace.slots[t, layer].tolist() == slots.tolist()
    assert trace.prefetch_copies[-1, 1] == trace.unused_prefetches[-1, 1] == 1
    totals = cache.totals()
    assert totals["prefetch"] == trace.prefetch_copies.sum() > 0 and trace.prefetch_copies[:, 0].sum() == 0
    assert totals["demand"] == trace.demand_copies.sum() > 0
    assert totals["unused"] == trace.unused_prefetches.sum() > 0
    assert totals["replaced"] == trace.replaced.sum() > 0
    assert totals["displaced_mass"] == pytest.approx(trace.displaced_mass.sum(), rel=1e-12)


def test_invariants_hold_on_random_logits():
    rng = np.random.default_rng(2)
    num_experts, capacity, k = 16, 6, 4
    cal = Calibration(np.tile(rng.permutation(num_experts), (3, 1)), rng.random((3, 10, num_experts)),
                      np.ones(3), {})
    for name in ("exact_lru", "psr", "cache_prior_published", "spec_exec"):
        cache = LogicalCache(preset(name, capacity, k, insert_budget=2) if name in ("psr", "spec_exec")
                             else preset(name, capacity, k), cal, 3, num_experts)
        for t in range(60):
            for layer in range(3):
                before = set(cache.resident(layer).tolist())
                if layer and cache.policy.insert_budget:
                    inserted = cache.insert_predicted(layer, rng.normal(size=num_experts), t % 10)
                    assert len(inserted) <= 2
                    before = set(cache.resident(layer).tolist())
                selected, demand = cache.select(layer, rng.normal(size=num_experts), t % 10)
                resident = cache.resident(layer).tolist()
                assert len(set(resident)) == capacity
                assert set(selected.tolist()) <= set(resident)
                assert sorted(demand.tolist()) == sorted(set(selected.tolist()) - before)
                assert (cache.slot_of(layer, resident) == np.arange(capacity)).all()


# -- Cache-Prior with LRU equals a plain standalone simulation ---------------------------------------------
def standalone_cache_prior(z, warm, capacity, top_k, bonus, delta):
    """Cache-Prior (Skliar et al.) with an LRU cache, written plainly: per layer a list of resident experts
    with their last use; biased top-K; misses replace the least recently used expert outside S."""
    num_tokens, num_layers, num_experts = z.shape
    out = np.empty((num_tokens, num_layers, top_k), dtype=np.int64)
    for layer in range(num_layers):
        last_use = {e: -1 for e in warm[layer][:capacity]}
        for t in range(num_tokens):
            scores = [z[t, layer, e] + (bonus * delta[layer] if e in last_use else 0.0) for e in range(num_experts)]
            chosen = sorted(range(num_experts), key=lambda e: (-scores[e], -z[t, layer, e], e))[:top_k]
            for e in sorted(chosen):
                if e not in last_use:
                    victim = min((u for u in last_use if u not in chosen), key=lambda u: (last_use[u], u))
                    del last_use[victim]
                    last_use[e] = t
            for e in chosen:
                last_use[e] = t
            out[t, layer] = chosen
    return out


@pytest.mark.parametrize("capacity,bonus", [(4, 0.2), (8, 0.3), (12, 1.0)])
def test_cache_prior_lru_matches_standalone_simulation(capacity, bonus):
    rng = np.random.default_rng(capacity)
    num_experts, k, layers = 16, 4, 3
    z = rng.normal(size=(300, layers, num_experts)).astype(np.float32).astype(np.float64)
    warm = np.stack([rng.permutation(num_experts) for _ in range(layers)])
    delta = rng.uniform(2, 4, size=layers)
    cal = Calibration(warm, np.zeros((layers, 3, num_experts)), delta, {})
    trace = replay(preset("cache_prior", capacity, k, bonus=bonus), z, None, None, cal)
    expected = standalone_cache_prior(z, np.sort(warm[:, :capacity], axis=1), capacity, k, bonus, delta)
    assert (trace.selected == expected).all()
    assert trace.replaced.sum() > 0  # the bonus did change decisions


# -- Algorithm 1 (PSR, spec-exec, exact, Cache-Prior; A and LRU priority) equals a plain standalone simulation -
def standalone_algorithm1(policy, z, g, tokens, warm, prior, delta):
    """Algorithm 1 written plainly from the paper and docs/design.md, one layer and token at a time, with dicts:
    part 1 visits the first w experts of the pre-gate ranking (ties to the lower index): a resident one joins
    the protected set B, a missing one (while fewer than n were inserted) evicts the lowest-priority resident
    outside B and joins B. Part 2 executes S: the router's top-K (exact), the pre-gate's top-K (spec_exec,
    the router's in layer 0), or the top-K of z + lambda * delta * [resident or router top-J] (ties: higher
    raw logit, then lower index). Missing members of S enter in index order, evicting the lowest priority
    outside S and B (outside S only if B leaves none). Priority, taken once per step before any insertion:
    LRU 1 + last token executed or inserted (warm -1), A s_fast + s_slow + prior[token]; ties evict the lower
    index. EMAs (0.5, 0.98) follow the router's own top-K. Returns (selected, slots) [T, L, K] and the
    per-step counts demand, prefetch, unused (at the step that prefetched), replaced, displaced [T, L]."""
    num_tokens, num_layers, num_experts = z.shape
    k, capacity = policy.top_k, policy.capacity
    selected = np.zeros((num_tokens, num_layers, k), dtype=np.int64)
    slots = np.zeros_like(selected)
    counts = {name: np.zeros((num_tokens, num_layers)) for name in ("demand", "prefetch", "unused", "replaced",
                                                                       "displaced")}
    for layer in range(num_layers):
        slot_of = {e: s for s, e in enumerate(sorted(warm[layer][:capacity]))}  # resident expert -> its slot
        last_use = {}  # expert -> token of its last execution or insertion
        prefetched = {}  # expert -> token that prefetched it, until it executes
        fast, slow = np.zeros(num_experts), np.zeros(num_experts)
        ranges = []
        for t in range(num_tokens):
            if policy.priority == "lru":
                priority = [1.0 + last_use.get(e, -1) for e in range(num_experts)]
            else:
                priority = [fast[e] + slow[e] + prior[layer, tokens[t], e] for e in range(num_experts)]

            def insert(expert, spared):
                candidates = [e for e in slot_of if e not in spared]
                if not candidates:
                    return False
                victim = min(candidates, key=lambda e: (priority[e], e))
                if victim in prefetched:
                    counts["unused"][prefetched.pop(victim), layer] += 1
                slot_of[expert] = slot_of.pop(victim)
                last_use[expert] = t
                return True

            protected, predicted = set(), None
            if policy.insert_budget and layer > 0:  # part 1
                predicted = sorted(range(num_experts), key=lambda e: (-g[t, layer, e], e))
                for e in predicted[:policy.window]:
                    if e in slot_of:
                        protected.add(e)
                    elif counts["prefetch"][t, layer] < policy.insert_budget and insert(e, protected):
                        protected.add(e)
                        prefetched[e] = t
                        counts["prefetch"][t, layer] += 1
            row = z[t, layer]  # part 2
            ranges.append(row.max() - row.min())
            own = sorted(range(num_experts), key=lambda e: (-row[e], e))[:k]
            if policy.kind == "exact":
                chosen = own
            elif policy.kind == "spec_exec":
                chosen = predicted[:k] if predicted is not None else own
            else:
                scale = policy.bonus * sum(ranges) / len(ranges) if policy.delta == "running" \
                    else policy.bonus * delta[layer]
                biased = [row[e] + scale if e in slot_of or e in own[:policy.protect_top] else row[e]
                          for e in range(num_experts)]
                chosen = sorted(range(num_experts), key=lambda e: (-biased[e], -row[e], e))[:k]
            for e in sorted(chosen):
                if e not in slot_of:
                    assert insert(e, set(chosen) | protected) or insert(e, set(chosen))
                    counts["demand"][t, layer] += 1
            for e in chosen:
                prefetched.pop(e, None)
                last_use[e] = t
            fast *= 0.5
            slow *= 0.98
            for e in own:
                fast[e] += 1.0 - 0.5
                slow[e] += 1.0 - 0.98
            lost = [e for e in own if e not in chosen]
            counts["replaced"][t, layer] = len(lost)
            counts["displaced"][t, layer] = np.exp(row[lost] - row.max()).sum() / np.exp(row - row.max()).sum()
            selected[t, layer] = chosen
            slots[t, layer] = [slot_of[e] for e in chosen]
        for t0 in prefetched.values():  # the sequence ends
            counts["unused"][t0, layer] += 1
    return selected, slots, counts


ALGORITHM1 = [
    dict(kind="psr", bonus=0.5, insert_budget=1, window=4, priority="A"),
    dict(kind="psr", bonus=0.5, insert_budget=2, window=3, priority="A", protect_top=1),
    dict(kind="psr", bonus=0.25, insert_budget=1, window=8, priority="lru", delta="running"),
    dict(kind="psr", bonus=0.0, insert_budget=3, window=6, priority="A"),
    dict(kind="spec_exec", insert_budget=1, window=4, priority="A"),
    dict(kind="spec_exec", insert_budget=2, window=2, priority="lru"),
    dict(kind="exact", priority="A"),
    dict(kind="cache_prior", bonus=1.0, priority="A", protect_top=2),
]


@pytest.mark.parametrize("fields", ALGORITHM1, ids=lambda f: "-".join(str(v) for v in f.values()))
@pytest.mark.parametrize("seed", [0, 1])
def test_algorithm1_matches_standalone_simulation_with_ties(fields, seed):
    """Every policy kind with the A priority (and LRU) against `standalone_algorithm1` on random logits with
    many ties: logits, pre-gate logits, priors and the bonus on a grid of halves, so that raw logits, biased
    scores, pre-gate ranks and priorities tie often and every tie rule decides something."""
    rng = np.random.default_rng(seed)
    num_experts, capacity, k, layers, vocab = 10, 5, 3, 3, 4
    z = rng.integers(-4, 5, size=(120, layers, num_experts)) / 2.0
    g = np.where(rng.random(z.shape) < 0.7, z, rng.integers(-4, 5, size=z.shape) / 2.0)  # a pre-gate near z
    tokens = rng.integers(0, vocab, 120)
    prior = rng.integers(0, 3, size=(layers, vocab, num_experts)) / 4.0 * (rng.random((layers, vocab, num_experts)) < 0.4)
    warm = np.stack([rng.permutation(num_experts) for _ in range(layers)])
    delta = np.array([1.0, 2.0, 1.5])
    cal = Calibration(warm, prior, delta, {})
    policy = PolicyConfig(capacity=capacity, top_k=k, **fields)
    starts = [0, 70]  # two sequences: state resets, unexecuted prefetches count at each end
    trace = replay(policy, z, g, tokens, cal, sequence_starts=starts)
    parts = [standalone_algorithm1(policy, z[a:b], g[a:b], tokens[a:b], warm, prior, delta)
             for a, b in zip(starts, starts[1:] + [len(z)])]
    np.testing.assert_array_equal(trace.selected, np.concatenate([p[0] for p in parts]))
    np.testing.assert_array_equal(trace.slots, np.concatenate([p[1] for p in parts]))
    counts = {name: np.concatenate([p[2][name] for p in parts]) for name in parts[0][2]}
    np.testing.assert_array_equal(trace.demand_copies, counts["demand"])
    np.testing.assert_array_equal(trace.prefetch_copies, counts["prefetch"])
    np.testing.assert_array_equal(trace.unused_prefetches, counts["unused"])
    np.testing.assert_array_equal(trace.replaced, counts["replaced"])
    np.testing.assert_allclose(trace.displaced_mass, counts["displaced"], rtol=1e-12, atol=1e-15)
    assert counts["demand"].sum() > 0 and (policy.kind != "psr" or counts["unused"].sum() > 0)
    if policy.kind in ("psr", "cache_prior") and policy.bonus > 0:
        assert counts["replaced"].sum() > 0  # the bonus changed decisions


# -- replay ----------------------------------------------------------------------------------------------
def test_replay_is_deterministic_and_resets_per_sequence():
    rng = np.random.default_rng(3)
    z = rng.normal(size=(50, 2, E))
    g = rng.normal(size=z.shape)
    tokens = rng.integers(0, 10, 50)
    policy = preset("psr", 3, 2)
    whole = replay(policy, z, g, tokens, calibration(), sequence_starts=[0, 20])
    again = replay(policy, z, g, tokens, calibration(), sequence_starts=[0, 20])
    first = replay(policy, z[:20], g[:20], tokens[:20], calibration())
    second = replay(policy, z[20:], g[20:], tokens[20:], calibration())
    assert (whole.selected == again.selected).all() and (whole.slots == again.slots).all()
    assert (whole.selected == np.concatenate([first.selected, second.selected])).all()
    assert (whole.unused_prefetches == np.concatenate([first.unused_prefetches, second.unused_prefetches])).all()


def test_padded_positions_leave_state_untouched():
    rng = np.random.default_rng(4)
    z = rng.normal(size=(12, E))
    valid = np.array([False] * 4 + [True] * 8)
    padded = cache_for(bonus=0.3)
    alone = cache_for(bonus=0.3)
    out = padded.run_span(1, z, z, np.full(12, TOKEN), valid)
    ref = alone.run_span(1, z[4:], z[4:], np.full(8, TOKEN))
    assert (out[4:] == ref).all() and padded.totals() == alone.totals()


# -- bad input -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fields,message", [
    (dict(kind="lfu"), "unknown policy kind"),
    (dict(priority="fifo"), "unknown eviction priority"),
    (dict(delta="ema"), "unknown delta mode"),
    (dict(capacity=2, top_k=4), "smaller than top_k"),
    (dict(bonus=-0.1), "bonus"),
    (dict(insert_budget=-1), "insert_budget"),
    (dict(window=0), "window"),
    (dict(protect_top=5), "protect_top"),
    (dict(kind="exact", bonus=0.2), "takes no routing bonus"),
    (dict(kind="cache_prior", insert_budget=1), "kind='psr'"),
    (dict(kind="psr", insert_budget=0), "kind='cache_prior'"),
])
def test_bad_policy_is_a_clear_error(fields, message):
    base = dict(kind="psr", capacity=8, top_k=4, bonus=0.2, insert_budget=1)
    if fields.get("kind") in ("exact", "cache_prior"):
        base["insert_budget"] = 0
        base["bonus"] = 0.0
    with pytest.raises(PolicyError, match=message):
        PolicyConfig(**{**base, **fields})


def test_unknown_preset_and_capacity_above_experts():
    with pytest.raises(PolicyError, match="unknown policy preset"):
        preset("psr_fast", 8, 4)
    with pytest.raises(PolicyError, match="C > E"):
        LogicalCache(preset("psr", 8, 2), calibration(), 2, E)


def test_wrong_logit_shapes_are_clear_errors():
    cache = cache_for()
    with pytest.raises(ValueError, match=r"must be \[positions, 6\]"):
        cache.run_span(0, np.zeros((3, 5)), None, np.zeros(3))
    with pytest.raises(ValueError, match=r"\[T, L, E\]"):
        replay(preset("psr", 3, 2), np.zeros((3, 6)), None, None, calibration())
    with pytest.raises(ValueError, match="pregate_logits"):
        replay(preset("psr", 3, 2), np.zeros((3, 2, 6)), None, None, calibration())
    with pytest.raises(ValueError, match="NaN"):
        replay(preset("exact_lru", 3, 2), np.full((3, 2, 6), np.nan), None, None, calibration())


def test_calibration_from_another_model_is_refused():
    with pytest.raises(CalibrationError, match="8 experts per layer, the model has 6"):
        LogicalCache(preset("psr", 3, 2), calibration(num_experts=8), 2, E)
    with pytest.raises(CalibrationError, match="3 MoE layers, the model has 2"):
        LogicalCache(preset("psr", 3, 2), calibration(num_layers=3), 2, E)
    cal = Calibration(np.tile(np.arange(E), (2, 1)), TokenPrior.from_dense(np.zeros((2, 4, E))), np.ones(2),
                      {"fingerprint": "a" * 64})
    with pytest.raises(CalibrationError, match="router fingerprint"):
        cal.check(2, E, 4, fingerprint="b" * 64)


def test_policies_without_insertion_ignore_the_pregate():
    rng = np.random.default_rng(5)
    z = rng.normal(size=(60, 2, E))
    g = rng.normal(size=z.shape)
    for name in ("exact_lru", "cache_prior"):
        policy = preset(name, 3, 2)
        with_g = replay(policy, z, g, np.full(60, TOKEN), calibration())
        without = replay(policy, z, None, np.full(60, TOKEN), calibration())
        assert (with_g.selected == without.selected).all()
        assert (with_g.demand_copies == without.demand_copies).all()


def test_per_call_budget_limits_insertions_but_keeps_protection():
    cache = cache_for(insert_budget=2)
    assert cache.insert_predicted(1, logits(3, 4), TOKEN, budget=1).tolist() == [3]
    cache = cache_for(insert_budget=2, window=1)
    assert cache.insert_predicted(1, logits(1, 3), TOKEN, budget=0).tolist() == []
    cache.select(1, logits(4, 5), TOKEN)  # 1 was visited, so protected: 2 and 0 are evicted
    assert cache.resident(1).tolist() == [5, 1, 4]


@pytest.mark.parametrize("renormalise", [True, False])
def test_engine_route_equals_select_slot_of_and_softmax(renormalise):
    """`route` (the engines' one-call part 2) gives the decisions of `select`, the slots of `slot_of` and
    the softmax of the router logits at S, on twin caches fed the same float32 logits."""
    rng = np.random.default_rng(5)
    num_experts, capacity, k = 16, 6, 4
    cal = Calibration(np.tile(rng.permutation(num_experts), (2, 1)), rng.random((2, 10, num_experts)),
                      np.ones(2), {})
    policy = preset("psr", capacity, k, insert_budget=1, bonus=0.5)
    twins = [LogicalCache(policy, cal, 2, num_experts) for _ in range(2)]
    scoring = RouterScoring(renormalise=renormalise)
    record, selected = np.empty(num_experts, np.float32), np.empty(k, np.int64)
    slots, weights = np.empty(k, np.int32), np.empty(k, np.float32)
    for t in range(40):
        for layer in range(2):
            z = rng.normal(size=num_experts).astype(np.float32)
            g = rng.normal(size=num_experts)
            for cache in twins:
                cache.insert_predicted(layer, g, t % 10)
            want, demand = twins[0].select(layer, z.astype(np.float64), t % 10)
            d = twins[1].route(layer, z, t % 10, scoring, record, selected, slots, weights)
            assert selected.tolist() == want.tolist()
            assert twins[1].demand[:d].tolist() == demand.tolist()
            assert twins[1].demand_slots[:d].tolist() == twins[0].slot_of(layer, demand).tolist()
            assert slots.tolist() == twins[0].slot_of(layer, want).tolist()
            assert np.array_equal(record, z)
            p = np.exp(z.astype(np.float64) - z.max())
            p = p[want] / (p[want].sum() if renormalise else p.sum())
            np.testing.assert_allclose(weights, p.astype(np.float32), rtol=1e-6)
    assert twins[0].totals() == twins[1].totals()


def test_engine_route_with_a_sigmoid_router_ranks_biased_scores_and_weights_unbiased():
    """DeepSeek-V3-style scoring: `route` selects on sigmoid(z) + bias (bonus included) and weights the
    executed experts by sigmoid(z), renormalised and scaled: the same decisions as `select` fed the
    selection scores, the weights computed here by hand."""
    rng = np.random.default_rng(6)
    num_experts, capacity, k, layers = 12, 6, 3, 2
    cal = Calibration(np.tile(np.arange(num_experts), (layers, 1)), rng.random((layers, 5, num_experts)),
                      np.full(layers, 0.4), {})
    bias = rng.normal(scale=0.3, size=(layers, num_experts))
    scoring = RouterScoring("sigmoid", renormalise=True, scale=2.5, bias=bias)
    policy = preset("cache_prior", capacity, k, bonus=0.5)
    twins = [LogicalCache(policy, cal, layers, num_experts) for _ in range(2)]
    record, selected = np.empty(num_experts, np.float32), np.empty(k, np.int64)
    slots, weights = np.empty(k, np.int32), np.empty(k, np.float64)
    for t in range(30):
        for layer in range(layers):
            z = rng.normal(size=num_experts).astype(np.float32)
            sig = 1.0 / (1.0 + np.exp(-z.astype(np.float64)))
            want, _ = twins[0].select(layer, sig + bias[layer], t % 5)
            twins[1].route(layer, z, t % 5, scoring, record, selected, slots, weights)
            assert selected.tolist() == want.tolist()
            np.testing.assert_allclose(weights, 2.5 * sig[want] / sig[want].sum(), rtol=1e-12)
    with pytest.raises(ValueError, match="sigmoid routers only"):
        RouterScoring("softmax", bias=bias)
    with pytest.raises(ValueError, match="bias has shape"):
        twins[1].route(0, z, 0, RouterScoring("sigmoid", bias=bias[:, :5]), record, selected, slots, weights)
