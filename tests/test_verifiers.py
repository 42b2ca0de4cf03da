"""Block-level verifier expert selection worked by hand: eligible-set size, pruning, rescue, ties, weights,
displaced mass; position weights and commitment rates; the expert pool's recency refill and copies; bad input.

Most blocks use logits 0 (an expert a position wants) and LOW = -800 (everything else): exp(-800) is exactly 0
in float64, so a position's softmax puts exactly 1/n on each of its n zero-logit experts and the demands u
are exact binary fractions that can be compared by hand.
"""

import math

import numpy as np
import pytest

from specmoe.verifiers import (SELECTORS, CommitRate, ExpertPool, SelectionBuffers, SelectorConfig, SelectorError,
                               confidence_weights, position_weights, select_block, select_block_into,
                               selector_preset)

LOW = -800.0


def block(num_experts, *wanted):
    """Logits [D, E]: row d is 0 at the experts in wanted[d] and LOW elsewhere."""
    z = np.full((len(wanted), num_experts), LOW)
    for d, experts in enumerate(wanted):
        z[d, list(experts)] = 0.0
    return z


def run(z, alpha, gamma=1.0, resident=None, rescue=None, prune=1.0, kind="acceptmoe", top_k=2, renormalise=False):
    config = SelectorConfig(kind, gamma=gamma, rescue_threshold=rescue, prune_budget=prune)
    resident = np.ones(z.shape[1], dtype=bool) if resident is None else resident
    return select_block(config, z, resident, np.asarray(alpha, dtype=float), top_k, renormalise)


def mask(num_experts, members):
    out = np.zeros(num_experts, dtype=bool)
    out[list(members)] = True
    return out


# -- eligible-set size from the entropy of the demand -------------------------------------------------

# Root wants {0, 1} (A); position 1 wants {2, 3}, position 2 wants {4, 5}; alpha = 1: u_2..u_5 = 1/2 each,
# m = 4, q = 1/4, H = ln 4, e^H = 4.
FOUR = block(8, (0, 1), (2, 3), (4, 5))


@pytest.mark.parametrize("gamma, eligible", [
    (0.5, [0, 1, 2, 3]),            # ceil(0.5 * 4) = 2: the tie among equal u goes to the lower indices
    (0.6, [0, 1, 2, 3, 4]),         # ceil(2.4) = 3
    (1.0, [0, 1, 2, 3, 4, 5]),      # ceil(4) = 4, although e^H is 4 only up to rounding
    (1.05, [0, 1, 2, 3, 4, 5]),     # ceil(4.2) = 5, capped at m = 4
    (0.0, [0, 1]),                  # no extra experts: S = A
])
def test_eligible_size_from_entropy_and_gamma(gamma, eligible):
    assert run(FOUR, [1, 1, 1], gamma).eligible.tolist() == eligible


@pytest.mark.parametrize("gamma", [1e3, 1e18, 1e300, 1.7976931348623157e308])
def test_huge_gamma_saturates_at_every_candidate(gamma):
    # gamma * e^H = 4 gamma beyond any integer: the size saturates at m = 4 (every demanded expert), it does
    # not wrap to a negative integer and fall back to the root's top-K {0, 1}
    assert run(FOUR, [1, 1, 1], gamma).eligible.tolist() == [0, 1, 2, 3, 4, 5]


def test_two_equal_candidates_give_ceil_of_twice_gamma():
    # position 1 wants {2, 3} with alpha 0.5: u_2 = u_3 = 0.25, H = ln 2, extra = min(ceil(2 gamma), 2)
    z = block(6, (0, 1), (2, 3))
    assert run(z, [1, 0.5], gamma=1.0).eligible.tolist() == [0, 1, 2, 3]
    sel = run(z, [1, 0.5], gamma=0.5)  # ceil(1) = 1: expert 2 (lower index)
    assert sel.eligible.tolist() == [0, 1, 2]
    # position 1 executes its top-2 within {0, 1, 2}: expert 2 (logit 0), then 0 (LOW, lower index than 1)
    assert sel.selected.tolist() == [[0, 1], [2, 0]]
    assert sel.displaced.tolist() == [0.0, 0.5]  # expert 3's softmax mass
    assert sel.union.tolist() == [0, 1, 2]


def test_unequal_demand_picks_the_largest():
    # positions 1 and 2 both want 2 (u_2 = 1/2 + 1/2 = 1), besides 3 and 4 (1/2 each): q = (1/2, 1/4, 1/4),
    # e^H = 2^(3/2) = 2.83; gamma = 0.7 -> ceil(1.98) = 2 -> experts 2 and 3 (3 beats 4 on index)
    z = block(6, (0, 1), (2, 3), (2, 4))
    assert run(z, [1, 1, 1], gamma=0.7).eligible.tolist() == [0, 1, 2, 3]
    assert run(z, [1, 1, 1], gamma=1.0).eligible.tolist() == [0, 1, 2, 3, 4]  # ceil(2.83) = 3


def test_zero_weight_positions_add_no_candidates():
    # alpha_1 = 0: experts 2 and 3 have u = 0, so m = 0 and S = A; position 1 is confined to A
    sel = run(block(6, (0, 1), (2, 3)), [1, 0], gamma=5.0)
    assert sel.eligible.tolist() == [0, 1]
    assert sel.selected.tolist() == [[0, 1], [0, 1]]
    assert sel.displaced.tolist() == [0.0, 1.0]


# -- pruning within the rerouting budget ----------------------------------------------------------------

# Root wants {0, 1}. Positions 1, 2 (alpha 1) want {2, 3} and {2, 4}; positions 3, 4, 5 (alpha 0.1) want
# {8, 9}, {8, 6}, {8, 7}. Demands: u_2 = 1, u_3 = u_4 = 0.5, u_8 = 0.15, u_6 = u_7 = u_9 = 0.05, so
# q = (20, 10, 10, 3, 1, 1, 1) / 46, H = 1.453 nats, e^H = 4.28; gamma 0.8 -> ceil(3.42) = 4 extra experts:
# S = {0, 1, 2, 3, 4, 8}. Assignments v: v_2 = 2, v_8 = 3, every other wanted expert 1. Outside S: 6, 7, 9,
# so a(S) = 3. Pruning order (increasing u, ties to the higher index): 8, 4, 3, 2.
PRUNE = block(10, (0, 1), (2, 3), (2, 4), (8, 9), (8, 6), (8, 7))
PRUNE_ALPHA = [1, 1, 1, 0.1, 0.1, 0.1]


@pytest.mark.parametrize("resident, budget, eligible", [
    ((0, 1), 0.0, [0, 1, 2, 3, 4, 8]),         # budget 0: no pruning
    ((0, 1), 1.0, [0, 1, 2, 3, 4]),            # limit 3: remove 8 (3 <= 3); 4 would make 4 > 3: stop
    ((0, 1), 0.9, [0, 1, 2, 3, 4, 8]),         # limit 2.7: 8 alone exceeds it; stop at once, though 4 would fit
    ((0, 1, 8), 1.0, [0, 1, 2, 8]),            # 8 resident, kept; remove 4 (1), 3 (2); 2 would make 4 > 3
    ((0, 1, 8), 1 / 3, [0, 1, 2, 3, 8]),       # limit 1: 4 goes before 3 (equal u, higher index first)
    ((0, 1, 2, 3, 4, 8), 1.0, [0, 1, 2, 3, 4, 8]),  # all resident: nothing to prune
])
def test_pruning_order_and_budget(resident, budget, eligible):
    sel = run(PRUNE, PRUNE_ALPHA, gamma=0.8, resident=mask(10, resident), prune=budget)
    assert sel.eligible.tolist() == eligible


def test_pruned_block_routes_inside_the_set_and_reports_missing():
    sel = run(PRUNE, PRUNE_ALPHA, gamma=0.8, resident=mask(10, (0, 1, 8)), prune=1.0)  # S = {0, 1, 2, 8}
    # position 1 wants {2, 3}: 2, then 0 (LOW ties -> lowest index); position 3 wants {8, 9}: 8, then 0
    assert sel.selected.tolist() == [[0, 1], [2, 0], [2, 0], [8, 0], [8, 0], [8, 0]]
    assert sel.union.tolist() == [0, 1, 2, 8]
    assert sel.missing.tolist() == [2]
    assert sel.displaced.tolist() == [0.0, 0.5, 0.5, 0.5, 0.5, 0.5]


def test_the_root_is_never_pruned():
    # S = A = {0, 1} (gamma 0), nothing resident: the root still executes A
    sel = run(FOUR, [1, 1, 1], gamma=0.0, resident=np.zeros(8, dtype=bool))
    assert sel.selected[0].tolist() == [0, 1]
    assert sel.missing.tolist() == [0, 1]


# -- rescue of a likely draft's own top-1 ---------------------------------------------------------------

def test_rescue_keeps_the_top1_of_positions_at_or_above_the_threshold():
    # gamma 0: S = A = {0, 1}. Position 1 (alpha 0.3 >= 0.3) wants {2, 3}, top-1 = 2 (tie, lower index):
    # it executes 2 plus the best of S (0). Position 2 (alpha 0.29) wants {4, 5}: not rescued, executes {0, 1}.
    sel = run(FOUR, [1, 0.3, 0.29], gamma=0.0, rescue=0.3)
    assert sel.eligible.tolist() == [0, 1]
    assert sel.selected.tolist() == [[0, 1], [2, 0], [0, 1]]
    assert sel.union.tolist() == [0, 1, 2]
    assert sel.displaced.tolist() == [0.0, 0.5, 1.0]
    no_rescue = run(FOUR, [1, 0.3, 0.29], gamma=0.0)
    assert no_rescue.selected.tolist() == [[0, 1], [0, 1], [0, 1]]


def test_rescue_does_nothing_when_the_top1_is_eligible():
    # gamma 0.5: S = {0, 1, 2, 3}; position 1's top-1 (2) is eligible, position 2's (4) is not
    sel = run(FOUR, [1, 1, 1], gamma=0.5, rescue=0.3)
    assert sel.selected.tolist() == [[0, 1], [2, 3], [4, 0]]
    assert sel.union.tolist() == [0, 1, 2, 3, 4]


# -- execution weights, displaced mass, exact ----------------------------------------------------------

def softmax(z):
    w = np.exp(z - z.max())
    return w / w.sum()


def softmax_rows(z):
    return np.stack([softmax(row) for row in z])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_weights_are_the_softmax_at_the_executed_experts(dtype):
    z = np.array([[3.0, 2.0, 0.0, 0.0, -1.0, 0.5],
                  [1.0, 0.0, 4.0, 3.0, 0.0, -2.0]], dtype=dtype)
    # A = {0, 1}; gamma 0: S = A, so position 1 executes 0 then 1 and loses its own top-2 {2, 3}
    sel = run(z, [1, 1], gamma=0.0)
    r = softmax_rows(z.astype(np.float64))
    assert sel.selected.tolist() == [[0, 1], [0, 1]]
    np.testing.assert_allclose(sel.weights, r[:, :2], rtol=1e-12)
    np.testing.assert_allclose(sel.displaced, [0.0, r[1, 2] + r[1, 3]], rtol=1e-12)
    renormalised = run(z, [1, 1], gamma=0.0, renormalise=True)
    e = math.e
    np.testing.assert_allclose(renormalised.weights[1], [e / (e + 1), 1 / (e + 1)], rtol=1e-12)
    np.testing.assert_allclose(renormalised.weights.sum(axis=1), 1.0, rtol=1e-12)


def test_renormalised_weights_of_far_below_experts_are_finite():
    # position 1 executes {0, 1}, both at LOW: softmax 0 each, renormalised 1/2 each (not 0 / 0)
    sel = run(FOUR, [1, 1, 1], gamma=0.0, renormalise=True)
    assert sel.weights[1].tolist() == [0.5, 0.5]


def test_exact_executes_every_own_top_k():
    z = np.array([[2.0, 1.0, 1.0, 0.0, -1.0, 0.0],    # tie 1 = 2 at the boundary: lower index, {0, 1}
                  [0.0, 0.0, 0.0, 5.0, 4.0, 0.0],
                  [0.0, 3.0, 0.0, 0.0, 0.0, 3.0]])
    sel = run(z, [1, 0, 0], kind="exact", resident=mask(6, (0, 1, 2)))
    assert sel.selected.tolist() == [[0, 1], [3, 4], [1, 5]]
    assert sel.union.tolist() == sel.eligible.tolist() == [0, 1, 3, 4, 5]
    assert sel.missing.tolist() == [3, 4, 5]
    assert sel.displaced.tolist() == [0.0, 0.0, 0.0]
    np.testing.assert_allclose(sel.weights, np.take_along_axis(softmax_rows(z), sel.selected, 1), rtol=1e-12)


def test_single_position_block_is_the_root():
    sel = run(block(4, (2, 3)), [1.0], gamma=1.0)
    assert sel.eligible.tolist() == [2, 3]
    assert sel.selected.tolist() == [[2, 3]]


# -- the caller-buffer variant and determinism ---------------------------------------------------------

def random_block(rng, positions=9, num_experts=64):
    return rng.normal(scale=2.0, size=(positions, num_experts)).astype(np.float32)


@pytest.mark.parametrize("name", list(SELECTORS))
def test_buffer_variant_matches_and_is_deterministic(name):
    rng = np.random.default_rng(1)
    config = selector_preset(name)
    buffers = SelectionBuffers(17, 64, 8, np.float32)
    for positions in (1, 9, 17):
        z = random_block(rng, positions)
        resident = rng.random(64) < 0.4
        alpha = confidence_weights(rng.uniform(0.2, 1.0, positions - 1))
        expected = select_block(config, z, resident, alpha, 8, True)
        counts = select_block_into(config, z, resident, alpha, 8, True, buffers)
        got = buffers.selection(positions, counts)
        for field in ("eligible", "selected", "union", "missing", "displaced"):
            assert np.array_equal(getattr(got, field), getattr(expected, field)), field
        assert got.weights.dtype == np.float32
        np.testing.assert_allclose(got.weights, expected.weights, rtol=1e-6)
        again = select_block(config, z.copy(), resident.copy(), alpha.copy(), 8, True)
        assert all(np.array_equal(getattr(again, f), getattr(expected, f)) for f in ("eligible", "selected", "weights"))


def reference(config, z, resident, alpha, k):
    """A slow restatement of the selection (float64, Python loops), for random blocks."""
    z = z.astype(np.float64)
    r = softmax_rows(z)
    own = [sorted(range(z.shape[1]), key=lambda e: (-z[d, e], e))[:k] for d in range(z.shape[0])]
    if config.kind == "exact":
        return own
    root = set(own[0])
    u = np.zeros(z.shape[1])
    v = np.zeros(z.shape[1], dtype=int)
    for d, experts in enumerate(own):
        for e in experts:
            v[e] += 1
            if e not in root:
                u[e] += alpha[d] * r[d, e]
    cand = sorted((e for e in range(z.shape[1]) if u[e] > 0), key=lambda e: (-u[e], e))
    extra = 0
    if cand:
        q = u[cand] / u[cand].sum()
        extra = min(math.ceil(config.gamma * math.exp(-(q * np.log(q)).sum()) - 1e-9), len(cand))
    chosen = cand[:extra]
    eligible = root | set(chosen)
    limit = config.prune_budget * sum(v[e] for e in range(z.shape[1]) if e not in eligible)
    removed = 0
    for e in reversed(chosen):
        if resident[e]:
            continue
        if removed + v[e] > limit:
            break
        removed += v[e]
        eligible.discard(e)
    rows = [own[0]]
    for d in range(1, z.shape[0]):
        row = []
        top1 = own[d][0]
        if config.rescue_threshold is not None and alpha[d] >= config.rescue_threshold and top1 not in eligible:
            row.append(top1)
        row += sorted(eligible, key=lambda e: (-z[d, e], e))[: k - len(row)]
        rows.append(row)
    return rows


@pytest.mark.parametrize("name", list(SELECTORS))
def test_random_blocks_match_a_slow_restatement(name):
    rng = np.random.default_rng(2)
    config = selector_preset(name)
    for _ in range(40):
        positions = int(rng.integers(1, 18))
        z = random_block(rng, positions, 32)
        z[:, :4] = np.round(z[:, :4])  # some exact ties
        resident = rng.random(32) < 0.5
        alpha = position_weights(rng.uniform(0, 1, positions - 1))
        sel = select_block(config, z, resident, alpha, 4, False)
        assert sel.selected.tolist() == reference(config, z, resident, alpha, 4)


# -- position weights and commitment rates --------------------------------------------------------------

def test_position_and_confidence_weights():
    np.testing.assert_allclose(position_weights([0.81, 0.64]), [1.0, 0.9, 0.8])
    np.testing.assert_allclose(confidence_weights([0.81, 0.64]), [1.0, 0.9, 0.72])  # sqrt(0.81 * 0.64)
    assert position_weights([]).tolist() == [1.0]
    for bad in ([1.2], [np.nan], [[0.5]], [-0.1]):
        with pytest.raises(ValueError):
            position_weights(bad)
        with pytest.raises(ValueError):
            confidence_weights(bad)


def test_commit_rate_prior_and_updates():
    rates = CommitRate(prior_accept=0.8, prior_blocks=4)
    np.testing.assert_allclose(rates.rates(3), [0.8, 0.64, 0.512])  # 0.8^d before any block
    rates.update(2, 3)  # depths 1, 2 committed, 3 not
    # (4 * 0.8^d + committed) / (4 + 1): 4.2 / 5, 3.56 / 5, 2.048 / 5; depth 4 never drafted: the prior
    np.testing.assert_allclose(rates.rates(4), [0.84, 0.712, 0.4096, 0.4096])
    rates.update(0, 2)
    np.testing.assert_allclose(rates.rates(3), [4.2 / 6, 3.56 / 6, 2.048 / 5])
    rates.update(3, 3)  # everything committed
    np.testing.assert_allclose(rates.rates(1), [5.2 / 7])
    with pytest.raises(ValueError, match="accepted_length"):
        rates.update(4, 3)
    rates.reset()
    np.testing.assert_allclose(rates.rates(2), [0.8, 0.64])
    with pytest.raises(ValueError, match="prior_accept"):
        CommitRate(prior_accept=1.5)
    with pytest.raises(ValueError, match="prior_blocks"):
        CommitRate(prior_blocks=0)


# -- the expert pool ------------------------------------------------------------------------------------

WARM = [3, 1, 0, 2, 4, 5]  # the calibration's ranking of the 6 experts


def test_pool_refill_by_recency_and_copies():
    pool = ExpertPool(1, 6, 2, 2, np.array([WARM]))
    assert np.flatnonzero(pool.resident(0)).tolist() == [1, 3]  # warm set, ascending in slots 0, 1
    assert pool.slot_table(0).tolist() == [-1, 0, -1, 1, -1, -1]
    # block 0: missing 0, 2, 4, 5 -> union slots 2..5 (4 copies); last positions: 3@0, 0@1, 2@1, 4@2, 5@2
    missing, slots = pool.use(0, [[3, 0], [2, 0], [4, 5]])
    assert missing.tolist() == [0, 2, 4, 5] and slots.tolist() == [2, 3, 4, 5]
    assert pool.slot_table(0).tolist() == [2, 0, 3, 1, 4, 5]
    assert pool.ranking(0).tolist() == [4, 5, 0, 2, 3, 1]  # 1 never executed: last
    # refill keeps {4, 5}: 1 and 3 leave slots 0, 1; 4 and 5 move there (2 moves)
    assert pool.end_block() == (4, 2)
    assert pool.slot_table(0).tolist() == [-1, -1, -1, -1, 0, 1]
    assert [m.tolist() for m in pool.refill_moves(0)] == [[4, 5], [0, 1]]  # union slots 4, 5 -> pool slots 0, 1
    # block 1: missing 1 -> slot 2; recency 5@0, 1@1, 4@1 -> keep {1, 4}: 4 stays in slot 0, 1 takes 5's slot 1
    missing, slots = pool.use(0, [[5, 1], [1, 4]])
    assert missing.tolist() == [1] and slots.tolist() == [2]
    assert pool.end_block() == (1, 1)
    assert pool.slot_table(0).tolist() == [-1, 1, -1, -1, 0, -1]
    assert [m.tolist() for m in pool.refill_moves(0)] == [[2], [1]]
    # block 2: the root alone executes 4 and 1, both resident: no copy, no move
    missing, _ = pool.use(0, [[4, 1]])
    assert missing.size == 0
    assert pool.end_block() == (0, 0)
    assert pool.totals() == {"blocks": 3, "copies": 5, "moves": 3}


def test_pool_keeps_never_executed_experts_in_warm_order():
    pool = ExpertPool(1, 6, 2, 3, np.array([WARM]))  # warm set {0, 1, 3} in slots 0, 1, 2
    pool.use(0, [[5, 4]])
    # ranking: 4, 5 (executed), then 3, 1, 0, 2 (warm order): keep {3, 4, 5}; 4, 5 take slots 0, 1 of 0, 1
    assert pool.end_block() == (2, 2)
    assert pool.slot_table(0).tolist() == [-1, -1, -1, 2, 0, 1]
    pool.reset()
    assert np.flatnonzero(pool.resident(0)).tolist() == [0, 1, 3]


def test_pool_is_deterministic_and_drives_selection():
    rng = np.random.default_rng(3)
    blocks = [[random_block(rng, 9, 16) for _ in range(2)] for _ in range(4)]
    config = selector_preset("confidence_top1")
    alpha = confidence_weights(np.full(8, 0.7))
    histories = []
    for _ in range(2):
        pool = ExpertPool(2, 16, 8, 8, np.tile(np.arange(16), (2, 1)))
        history = []
        for layers in blocks:
            for layer, z in enumerate(layers):
                sel = select_block(config, z, pool.resident(layer), alpha, 8, False)
                missing, slots = pool.use(layer, sel.selected)
                assert missing.tolist() == sel.missing.tolist()
                table = pool.slot_table(layer)
                assert np.all(table[sel.union] >= 0) and len(set(table[sel.union])) == sel.union.size
                history.append(table.copy())
            history.append(pool.end_block())
            assert pool.pool_mask.sum(axis=1).tolist() == [8, 8]
            assert sorted(pool.slot_table(0)[pool.resident(0)]) == list(range(8))
        histories.append(history)
    assert all(np.array_equal(a, b) for a, b in zip(*histories))


def test_pool_bad_input():
    warm = np.array([WARM])
    with pytest.raises(ValueError, match="P=7.*K=2, E=6"):
        ExpertPool(1, 6, 2, 7, warm)
    with pytest.raises(ValueError, match="P=1.*K=2"):
        ExpertPool(1, 6, 2, 1, warm)
    with pytest.raises(ValueError, match="warm ranking"):
        ExpertPool(1, 6, 2, 2, np.array([[0, 0, 1, 2, 3, 4]]))
    pool = ExpertPool(1, 6, 2, 2, warm, union_slots=1)
    with pytest.raises(ValueError, match="union slots"):
        pool.use(0, [[0, 2]])  # two missing experts, one union slot
    assert pool.use(0, [[0, 1]])[0].tolist() == [0]  # the failed call changed nothing
    with pytest.raises(ValueError, match="already used"):
        pool.use(0, [[0, 1]])
    with pytest.raises(ValueError, match="outside"):
        ExpertPool(1, 6, 2, 2, warm).use(0, [[0, 6]])
    with pytest.raises(ValueError, match="selected must be"):
        ExpertPool(1, 6, 2, 2, warm).use(0, [0, 1])


# -- configurations and bad input -----------------------------------------------------------------------

def test_presets():
    assert selector_preset("acceptmoe") == SelectorConfig("acceptmoe", gamma=1.0, rescue_threshold=None)
    top1 = selector_preset("confidence_top1")
    assert (top1.gamma, top1.rescue_threshold, top1.prune_budget, top1.weights) == (1.05, 0.3, 1.0, "confidence")
    assert selector_preset("acceptmoe").weights == "position" and selector_preset("exact").weights is None
    assert selector_preset("confidence_top1", rescue_threshold=0.0).name == "confidence_top1(gamma=1.05, rescue=0)"
    assert SelectorConfig.from_dict(top1.to_dict()) == top1


def test_a_selector_is_one_registry_entry(monkeypatch):
    """A kind added to SELECTORS is a preset, validates, and weighs its blocks through block_weights."""
    from specmoe.speculation import block_weights
    from specmoe.verifiers import SelectorKind

    def linear(k, commit_rate, confidences):
        return np.concatenate(([1.0], np.cumprod(np.asarray(confidences, dtype=np.float64))))

    monkeypatch.setitem(SELECTORS, "confidence_linear", SelectorKind(linear, "confidence", dict(gamma=2.0)))
    config = selector_preset("confidence_linear", rescue_threshold=0.5)
    assert (config.gamma, config.rescue_threshold, config.weights) == (2.0, 0.5, "confidence")
    assert config.kernel_params.tolist() == [1.0, 2.0, 0.5, 1.0]
    assert block_weights(config, 2, CommitRate(), [0.5, 0.5]).tolist() == [1.0, 0.5, 0.25]
    assert block_weights(selector_preset("exact"), 2, CommitRate(), [0.5, 0.5]).tolist() == [1.0, 1.0, 1.0]
    rates = CommitRate()
    assert np.array_equal(block_weights(selector_preset("acceptmoe"), 3, rates, [0.1] * 3),
                          np.concatenate(([1.0], np.sqrt(rates.rates(3)))))


@pytest.mark.parametrize("fields, message", [
    (dict(kind="union"), "unknown selector kind 'union'; expected one of exact, acceptmoe, confidence_top1"),
    (dict(kind="acceptmoe", gamma=-1.0), "gamma must be a finite number >= 0, got -1.0"),
    (dict(kind="acceptmoe", gamma=float("nan")), "gamma"),
    (dict(kind="acceptmoe", prune_budget=-0.5), "prune_budget must be a finite number >= 0, got -0.5"),
    (dict(kind="acceptmoe", rescue_threshold=1.5), "rescue_threshold must be None or a number in"),
    (dict(kind="exact", rescue_threshold=0.3), "rescue_threshold=None"),
])
def test_bad_config(fields, message):
    with pytest.raises(SelectorError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SelectorConfig(**fields)


def test_bad_preset_and_field():
    with pytest.raises(SelectorError, match="unknown selector preset 'psr'"):
        selector_preset("psr")
    with pytest.raises(SelectorError, match="unknown selector field"):
        SelectorConfig.from_dict({"kind": "exact", "capacity": 3})


def test_bad_block_input():
    config = selector_preset("acceptmoe")
    z = np.zeros((3, 6))
    ok = dict(resident=np.ones(6, dtype=bool), alpha=np.ones(3), top_k=2, renormalise=False)

    def call(**changes):
        args = {**ok, **changes}
        return select_block(changes.get("config", config), changes.get("z", z), args["resident"], args["alpha"],
                            args["top_k"], args["renormalise"])

    with pytest.raises(ValueError, match="router logits must be"):
        call(z=np.zeros(6))
    with pytest.raises(ValueError, match="router logits must be"):
        call(z=np.zeros((0, 6)))
    with pytest.raises(ValueError, match="top_k"):
        call(top_k=7)
    with pytest.raises(ValueError, match="resident must be a bool array"):
        call(resident=np.ones(5, dtype=bool))
    with pytest.raises(ValueError, match="resident must be a bool array"):
        call(resident=np.ones(6))
    with pytest.raises(ValueError, match="alpha must have one weight per position"):
        call(alpha=np.ones(2))
    for value in (np.nan, np.inf, -np.inf):
        bad = z.copy()
        bad[1, 4] = value
        with pytest.raises(ValueError, match=r"router logit \[1, 4\] is not finite"):
            call(z=bad)
        with pytest.raises(ValueError, match=r"router logit \[1, 4\] is not finite"):
            call(z=bad, config=selector_preset("exact"))
    with pytest.raises(ValueError, match=r"alpha\[2\] must be finite and >= 0"):
        call(alpha=np.array([1.0, 0.5, -0.1]))
    with pytest.raises(ValueError, match="SelectorConfig"):
        call(config="acceptmoe")
    buffers = SelectionBuffers(2, 6, 2)
    with pytest.raises(ValueError, match="1 <= D <= 2"):
        select_block_into(config, z, ok["resident"], ok["alpha"], 2, False, buffers)


# -- sigmoid routers (DeepSeek-V3): selection scores sigmoid(z) + bias, demand from normalised sigmoids -----

LN3, LN7 = math.log(3.0), math.log(7.0)
# sigmoid(ln 3) = 3/4, sigmoid(0) = 1/2, sigmoid(-ln 3) = 1/4, sigmoid(ln 7) = 7/8, sigmoid(-ln 7) = 1/8
SIGMOID_Z = np.array([[LN3, 0.0, -LN3, -LN7],     # sigmoid 3/4, 1/2, 1/4, 1/8
                      [-LN7, LN7, -LN3, 0.0],     # sigmoid 1/8, 7/8, 1/4, 1/2 (sum 7/4)
                      [0.0, -LN7, -LN7, LN3]])    # sigmoid 1/2, 1/8, 1/8, 3/4 (sum 3/2)
SIGMOID_BIAS = np.array([[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.4, 0.0]])  # layer 1 boosts expert 2 by 0.4


def sigmoid_scoring(n_group=1, topk_group=1):
    from specmoe.routing import RouterScoring
    return RouterScoring("sigmoid", renormalise=True, scale=2.5, bias=SIGMOID_BIAS, n_group=n_group,
                         topk_group=topk_group)


def test_sigmoid_router_block_selection_worked_by_hand():
    # layer 1: selection scores s = sigmoid(z) + (0, 0, 0.4, 0):
    #   root  s = (0.75, 0.5, 0.65, 0.125): own top-2 A = [0, 2] (the bias puts 2 before 1)
    #   pos 1 s = (0.125, 0.875, 0.65, 0.5): own [1, 2]; r_1 = sigmoid / (7/4): r_11 = 1/2
    #   pos 2 s = (0.5, 0.125, 0.525, 0.75): own [3, 2]; r_2 = sigmoid / (3/2): r_23 = 1/2
    # alpha (1, 1, 1/2): u_1 = 1 * 1/2, u_3 = 1/2 * 1/2 = 1/4 (2 is in A); m = 2, q = (2/3, 1/3),
    # e^H = 3 / 2^(2/3) = 1.89; gamma 0.5: ceil(0.94) = 1 extra, expert 1: S = {0, 1, 2}
    config = SelectorConfig("acceptmoe", gamma=0.5)
    resident = mask(4, (0, 1, 3))
    sel = select_block(config, SIGMOID_Z, resident, np.array([1.0, 1.0, 0.5]), 2, sigmoid_scoring(), layer=1)
    assert sel.eligible.tolist() == [0, 1, 2]
    # pos 1 executes its top-2 of s in S: [1, 2] (its own); pos 2: [2, 0] (0.525 > 0.5), losing expert 3
    assert sel.selected.tolist() == [[0, 2], [1, 2], [2, 0]]
    assert sel.union.tolist() == [0, 1, 2] and sel.missing.tolist() == [2]
    np.testing.assert_allclose(sel.displaced, [0.0, 0.0, 0.5], rtol=1e-12)  # r_23 = (3/4) / (3/2)
    # weights: the unbiased sigmoid renormalised over the executed pair, times 2.5
    np.testing.assert_allclose(sel.weights, [[0.75 * 2.5, 0.25 * 2.5], [35 / 18, 10 / 18], [0.5, 2.0]], rtol=1e-12)
    # gamma 1: ceil(1.89) = 2 = m: S = every expert; pos 2 then executes its own [3, 2]
    sel = select_block(selector_preset("acceptmoe"), SIGMOID_Z, resident, np.array([1.0, 1.0, 0.5]), 2,
                       sigmoid_scoring(), layer=1)
    assert sel.eligible.tolist() == [0, 1, 2, 3]
    assert sel.selected.tolist() == [[0, 2], [1, 2], [3, 2]]
    # layer 0 (no bias): the root's own top-2 is [0, 1]
    sel = select_block(selector_preset("exact"), SIGMOID_Z, resident, np.ones(3), 2, sigmoid_scoring(), layer=0)
    assert sel.selected.tolist() == [[0, 1], [1, 3], [3, 0]]


def test_sigmoid_router_group_limited_own_top_k():
    # groups {0, 1} and {2, 3}, one kept; layer 1's s as above:
    #   root  groups 0.75 + 0.5 = 1.25, 0.65 + 0.125 = 0.775: group 0, own [0, 1]
    #   pos 1 groups 1.0, 1.15: group 1, own [2, 3]; pos 2 groups 0.625, 1.275: group 1, own [3, 2]
    scoring = sigmoid_scoring(n_group=2, topk_group=1)
    exact = select_block(selector_preset("exact"), SIGMOID_Z, np.ones(4, dtype=bool), np.ones(3), 2, scoring, layer=1)
    assert exact.selected.tolist() == [[0, 1], [2, 3], [3, 2]]
    # a block selector keeps the root's group-limited top-K as A; the other positions rank inside S:
    # u_3 = 1 * r_13 + 1/2 * r_23 = (1/2)/(7/4) + 1/4 = 15/28, u_2 = (1/4)/(7/4) + 1/2 * (1/8)/(3/2) = 31/168;
    # q = (90, 31) / 121, e^H = 1.77; gamma 0.5: ceil(0.88) = 1 extra, expert 3: S = {0, 1, 3}
    sel = select_block(SelectorConfig("acceptmoe", gamma=0.5), SIGMOID_Z, np.ones(4, dtype=bool),
                       np.array([1.0, 1.0, 0.5]), 2, scoring, layer=1)
    assert sel.eligible.tolist() == [0, 1, 3]
    assert sel.selected.tolist() == [[0, 1], [1, 3], [3, 0]]


def test_sigmoid_exact_selection_is_the_routing_cores_choice_and_weights():
    # exact selection = the routing core's own top-K (`_rank_groups` on sigmoid(z) + bias) and weights
    # (`execution_weights`), bitwise, on random logits with a random bias and groups; given scores rank the same
    from specmoe.routing import RouterScoring
    from specmoe.routing.kernels import _rank_groups, execution_weights, selection_scores
    rng = np.random.default_rng(3)
    num_experts, k = 16, 4
    for n_group, topk_group in ((1, 1), (4, 2), (8, 3)):
        bias = rng.normal(0, 0.3, (2, num_experts))
        scoring = RouterScoring("sigmoid", renormalise=True, scale=2.446, bias=bias, n_group=n_group,
                                topk_group=topk_group)
        for _ in range(20):
            z = rng.normal(0, 2, (5, num_experts)).astype(np.float32)
            sel = select_block(selector_preset("exact"), z, np.ones(num_experts, dtype=bool), np.ones(5), k,
                               scoring, layer=1)
            scores = np.empty((5, num_experts))
            for d in range(5):
                selection_scores(z[d], 1, bias[1], scores[d])
                own = np.empty(k, dtype=np.int64)
                _rank_groups(scores[d], scores[d], k, own, n_group, topk_group)
                assert sel.selected[d].tolist() == own.tolist()
                weights = np.empty(k)
                execution_weights(z[d], own, 1, True, 2.446, weights)
                assert sel.weights[d].tolist() == weights.tolist()
            given = select_block(selector_preset("confidence_top1"), z, np.ones(num_experts, dtype=bool),
                                 np.linspace(1, 0.2, 5), k, scoring, scores=scores)
            computed = select_block(selector_preset("confidence_top1"), z, np.ones(num_experts, dtype=bool),
                                    np.linspace(1, 0.2, 5), k, scoring, layer=1)
            assert given.selected.tolist() == computed.selected.tolist()


def test_softmax_scoring_equals_the_renormalise_flag():
    from specmoe.routing import RouterScoring
    rng = np.random.default_rng(4)
    z = rng.normal(0, 2, (6, 12))
    for renormalise in (False, True):
        flag = select_block(selector_preset("acceptmoe"), z, np.ones(12, dtype=bool), np.ones(6), 3, renormalise)
        rule = select_block(selector_preset("acceptmoe"), z, np.ones(12, dtype=bool), np.ones(6), 3,
                            RouterScoring("softmax", renormalise=renormalise))
        for a, b in zip(flag.__dict__.values(), rule.__dict__.values()):
            assert np.array_equal(a, b)
