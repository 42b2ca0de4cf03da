"""The rollback logical cache and block-level selection in the CPU replay of verification blocks."""

import numpy as np
import pandas as pd
import pytest

from specmoe.records import (AcceptanceProfile, BlockRecords, Blocks, BlockSourceError, Trace, blocks_from_records,
                             synthetic_blocks)
from specmoe.replay import replay_ar, replay_block_selection, replay_rollback
from specmoe.routing import Calibration, LogicalCache, PolicyConfig, preset
from specmoe.verifiers import selector_preset

L, E, K, V = 3, 12, 2, 20


def random_calibration(rng, num_layers=L, num_experts=E, vocab=V):
    ranking = np.array([rng.permutation(num_experts) for _ in range(num_layers)])
    prior = rng.random((num_layers, vocab, num_experts)) * (rng.random((num_layers, vocab, num_experts)) < 0.3)
    return Calibration(ranking, prior, rng.uniform(1.0, 3.0, num_layers), {"model": "random"})


def random_trace(rng, lengths, num_layers=L, num_experts=E):
    t = sum(lengths)
    z = rng.normal(size=(t, num_layers, num_experts)).astype(np.float32)
    g = (z + 0.5 * rng.normal(size=z.shape)).astype(np.float32)
    g[:, 0] = 0
    starts = np.r_[0, np.cumsum(lengths)[:-1]]
    return Trace(z, g, rng.integers(0, V, t), starts, top_k=K, vocab_size=V)


POLICIES = [
    PolicyConfig(kind="exact", capacity=4, top_k=K),
    PolicyConfig(kind="cache_prior", capacity=4, top_k=K, bonus=0.3),
    PolicyConfig(kind="cache_prior", capacity=5, top_k=K, bonus=0.2, protect_top=1, delta="running"),
    PolicyConfig(kind="psr", capacity=4, top_k=K, bonus=0.3, insert_budget=1, window=3),
    PolicyConfig(kind="psr", capacity=6, top_k=K, bonus=0.5, insert_budget=2, window=4, priority="lru"),
    PolicyConfig(kind="spec_exec", capacity=4, top_k=K, insert_budget=1, window=3),
]


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rollback_equals_replay_of_committed_sequence(policy, seed):
    rng = np.random.default_rng(seed)
    cal = random_calibration(rng)
    trace = random_trace(rng, [40, 23])
    k = int(rng.integers(1, 6))
    profile = AcceptanceProfile.table(np.sort(rng.random(k))[::-1])
    blocks = synthetic_blocks(trace, k, profile, seed=seed)
    assert blocks.accepted.min() < k  # some rejection
    result = replay_rollback(policy, blocks, cal, keep_selected=True)
    reference = replay_ar(policy, blocks, cal, keep_selected=True)
    assert result.committed == reference.committed == blocks.committed
    np.testing.assert_array_equal(result.selected, reference.selected)
    assert result.displaced == pytest.approx(reference.displaced, rel=1e-12, abs=1e-12)


def test_synthetic_blocks_cap_each_request_or_all():
    # blocks_per_request keeps every sequence of the trace in a short run; max_blocks takes the first blocks only
    rng = np.random.default_rng(4)
    trace = random_trace(rng, [40, 40, 40])
    profile = AcceptanceProfile.geometric(0.5)
    every = synthetic_blocks(trace, 3, profile, seed=2)
    counts = np.bincount(every.request, minlength=3)
    assert (counts > 3).all()
    capped = synthetic_blocks(trace, 3, profile, seed=2, blocks_per_request=3)
    assert np.bincount(capped.request).tolist() == [3, 3, 3]
    first = synthetic_blocks(trace, 3, profile, seed=2, max_blocks=3)
    assert first.request.tolist() == [0, 0, 0]
    np.testing.assert_array_equal(capped.rows[:3], every.rows[:3])  # the first request starts as without a cap
    np.testing.assert_array_equal(capped.accepted[:3], every.accepted[:3])
    with pytest.raises(BlockSourceError, match="blocks_per_request"):
        synthetic_blocks(trace, 3, profile, blocks_per_request=0)


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
def test_state_after_rollback_equals_fresh_run_over_committed_prefix(policy):
    rng = np.random.default_rng(7)
    cal = random_calibration(rng)
    trace = random_trace(rng, [30])
    blocks = synthetic_blocks(trace, 4, AcceptanceProfile.geometric(0.6), seed=3)
    from specmoe.replay import RollbackCache

    rb = RollbackCache(policy, cal, L, E, 5)
    fresh = LogicalCache(policy, cal, L, E)
    z, g, tok = blocks.router_logits, blocks.pregate_logits, blocks.tokens
    for b in range(blocks.num_blocks):
        c = int(blocks.accepted[b]) + 1
        rb.block(z, g, tok, blocks.rows[b], c)
        rows = blocks.rows[b, :c]
        for layer in range(L):
            fresh.run_span(layer, z[rows, layer], g[rows, layer] if layer else None, tok[rows])
        for mine, theirs in zip(rb.cache.snapshot(), fresh.snapshot()):
            np.testing.assert_array_equal(mine, theirs)


def test_snapshot_restore_round_trip():
    rng = np.random.default_rng(1)
    cal = random_calibration(rng)
    cache = LogicalCache(preset("psr", 4, K), cal, L, E)
    z = rng.normal(size=(5, E))
    cache.run_span(1, z, z + 0.1, np.arange(5))
    saved = cache.snapshot()
    before = [a.copy() for a in saved]
    cache.run_span(1, -z, z, np.arange(5))
    cache.restore(saved)
    for a, b in zip(cache.snapshot(), before):
        np.testing.assert_array_equal(a, b)


# -- hand-worked blocks -------------------------------------------------------------------------------------
def hand_blocks(accepted=(1, 0)):
    """One layer, E=6, K=2, two blocks of D=3 positions in one request."""
    z = np.full((6, 1, 6), -5.0, dtype=np.float32)
    tops = [(0, 1), (1, 4), (5, 3), (2, 3), (0, 4), (2, 5)]  # own top-2 of rows 0..5 (first larger)
    for r, (a, b) in enumerate(tops):
        z[r, 0, a], z[r, 0, b] = 3.0, 2.0
    rows = np.array([[0, 1, 2], [3, 4, 5]])
    return Blocks(z, np.zeros_like(z), np.zeros(6, dtype=np.int64), rows, np.array(accepted), np.array([0, 0]),
                  np.array([[0.9, 0.5], [0.8, 0.4]]), top_k=2)


def hand_calibration():
    return Calibration(np.array([[0, 1, 2, 3, 4, 5]]), np.zeros((1, 4, 6)), np.array([1.0]), {"model": "hand"})


def test_hand_worked_rollback_exact():
    # exact routing: every position its own top-2. Pool P=C=2 starts {0, 1}.
    # block 0 executes {0,1},{1,4},{5,3}: missing 3, 4, 5 -> 3 copies; refill by recency: position 2 ran 3 and 5
    # (most recent), so the pool becomes {3, 5}. Block 1 executes {2,3},{0,4},{2,5}: missing 0, 2, 4 -> 3 copies.
    blocks = hand_blocks()
    result = replay_rollback(PolicyConfig(kind="exact", capacity=2, top_k=2), blocks, hand_calibration(),
                             keep_selected=True)
    assert result.copies == 6
    assert result.committed == 3  # block 0: root + 1 draft; block 1: root
    assert result.displaced == 0.0
    assert [sorted(s) for s in result.selected[:, 0].tolist()] == [[0, 1], [1, 4], [2, 3]]


def test_hand_worked_rollback_cache_prior_bonus_and_rollback():
    # cache_prior with a large bonus at C=2: the logical cache {0, 1} wins every position whose top-2 holds
    # one of them; row 2 ({5, 3}) is rejected in block 0 and rolled back, so block 1's root sees the state of
    # rows 0-1 only. The bonus (10 * delta 1) makes resident experts rank first.
    policy = PolicyConfig(kind="cache_prior", capacity=2, top_k=2, bonus=10.0)
    blocks = hand_blocks()
    result = replay_rollback(policy, blocks, hand_calibration(), keep_selected=True)
    reference = replay_ar(policy, blocks, hand_calibration(), keep_selected=True)
    np.testing.assert_array_equal(result.selected, reference.selected)
    # every position routes to the resident {0, 1} (bonus 10 beats any logit gap of 8): the block's union is
    # the pool, so no copy at all
    assert all(sorted(s) == [0, 1] for s in result.selected[:, 0].tolist())
    assert result.copies == 0
    assert result.displaced > 0


# Worked by hand on `hand_blocks(accepted=(2, 1))` (block 0 commits all three rows, block 1 two), P = 2, pool
# {0, 1} at the start. Every row's softmax is a = e^3 at its top-1, b = e^2 at its top-2, e^-5 elsewhere:
# r = a / N and b / N with N = a + b + 4 e^-5. Weights: acceptmoe's alpha from the prior rates 0.8^d before
# block 0 ([1, .894, .8]) and (4 * 0.8^d + committed) / 5 after it ([1, .917, .844]); confidence_top1's from
# the confidences ([1, .949, .671] and [1, .894, .566]). Block 0's demand outside A = {0, 1}: u4 = .894 b,
# u5 = .8 a, u3 = .8 b (N dropped), entropy e^H = 2.69 (confidence weights 2.75); block 1's outside A = {2, 3}:
# u0 = .917 a, u4 = .917 b, u5 = .844 b, e^H = 2.63 (confidence 2.49). Executed sets list the higher logit
# first; a tie at -5 goes to the lower index. After each block the pool is the P most recently executed.
HAND_SELECTIONS = {
    # own top-2 everywhere: block 0 copies 3, 4, 5; position 2 ran 5, 3 -> pool {3, 5}; block 1 copies 0, 2, 4
    "exact": (dict(), 6, 0.0, [[0, 1], [1, 4], [5, 3], [2, 3], [0, 4]]),
    # extra = ceil(2.69) = 3 = m (2.63 -> 3 in block 1): S holds every demanded expert; a(S) = 0 prunes
    # nothing: the exact selection
    "acceptmoe": (dict(), 6, 0.0, [[0, 1], [1, 4], [5, 3], [2, 3], [0, 4]]),
    # extra = ceil(1.05 * 2.75) = 3 and ceil(1.05 * 2.49) = 3: the exact selection, no rescue needed
    "confidence_top1": (dict(), 6, 0.0, [[0, 1], [1, 4], [5, 3], [2, 3], [0, 4]]),
    # extra = ceil(0.5 * 2.69) = 2: S = {0, 1, 5, 4}; row 2 (own 5, 3) runs 5, 0: copies 4, 5, displaces b.
    # Pool {0, 5}. Block 1: extra = ceil(1.31) = 2, S = {2, 3, 0, 4}; row 4 runs its own 0, 4, row 5 runs 2, 0:
    # copies 2, 3, 4
    "acceptmoe_half_no_prune": (dict(kind="acceptmoe", gamma=0.5, prune_budget=0.0), 5, 1,
                                [[0, 1], [1, 4], [5, 0], [2, 3], [0, 4]]),
    # as above, then pruning: a(S) = v3 = 1 (block 1: v5 = 1), so the least demanded non-resident extra, 4
    # (v4 = 1), leaves S; 5 would exceed the budget (block 1: 0 is resident). Block 0: S = {0, 1, 5}, row 1
    # runs 1, 0 and row 2 5, 0: copies 5, displaces b twice. Block 1: S = {0, 2, 3}, row 4 runs 0, 2
    # (displacing b): copies 2, 3
    "acceptmoe_half": (dict(kind="acceptmoe", gamma=0.5), 3, 3, [[0, 1], [1, 0], [5, 0], [2, 3], [0, 2]]),
    # gamma 0: S = A. Row 2's top-1, 5, is outside S and alpha 0.671 >= 0.3 rescues it: 5, 0; row 1 runs 1, 0:
    # copies 5, displaces b twice. Pool {0, 5}. Block 1: row 4 rescues 0 (alpha .894) and runs 0, 2 (displacing
    # b): copies 2, 3
    "confidence_rescue": (dict(kind="confidence_top1", gamma=0.0), 3, 3,
                          [[0, 1], [1, 0], [5, 0], [2, 3], [0, 2]]),
    # threshold 0.85: row 2 (alpha 0.671) is not rescued and runs 0, 1, displacing a + b; no copy in block 0.
    # Pool {0, 1}. Block 1: row 4 (alpha .894; .8 without the square root) rescues 0: copies 2, 3
    "confidence_rescue_085": (dict(kind="confidence_top1", gamma=0.0, rescue_threshold=0.85), 2, "a+3b",
                              [[0, 1], [1, 0], [0, 1], [2, 3], [0, 2]]),
}


@pytest.mark.parametrize("case", HAND_SELECTIONS)
def test_hand_worked_block_selection(case):
    fields, copies, displaced, kept = HAND_SELECTIONS[case]
    selector = selector_preset(fields.get("kind", case), **{f: v for f, v in fields.items() if f != "kind"})
    result = replay_block_selection(selector, hand_blocks(accepted=(2, 1)), hand_calibration(), pool_size=2,
                                    keep_selected=True)
    a, b = np.exp(3.0), np.exp(2.0)
    mass = {0.0: 0.0, 1: b, 3: 3 * b, "a+3b": a + 3 * b}[displaced] / (a + b + 4 * np.exp(-5.0))
    assert result.copies == copies
    assert result.displaced == pytest.approx(mass, rel=1e-12, abs=1e-15)
    assert result.selected[:, 0].tolist() == kept
    assert result.committed == 5


def test_counterfactual_counts_changed_sets():
    # block 0 rejects its second draft (row 2, own top-2 (5, 3)); its true continuation is taken to be row 4
    # (own top-2 (0, 4)). Worked by hand as in HAND_SELECTIONS (alpha [1, .894, .8], pool {0, 1}):
    # - gamma 0.3, drafted rows 0-2: extra = ceil(0.3 * 2.69) = 1, S = {0, 1, 5}; a(S) = v3 + v4 = 2 prunes 5
    #   (v5 = 1): S = {0, 1}, row 1 (own 1, 4) runs 1, 0. True rows 0, 1, 4: the only demand outside A is 4
    #   (u4 = .894 b + .8 b, m = 1): S = {0, 1, 4}, a(S) = 0, row 1 runs 1, 4. One committed draft changed.
    # - gamma 1 (the preset): S holds every demanded expert in both, a(S) = 0: row 1 runs its own 1, 4 in both.
    blocks = hand_blocks(accepted=(1, 0))
    blocks.true_rows = np.array([[0, 1, 4], [3, -1, -1]])
    for gamma, changed in ((0.3, 1), (1.0, 0)):
        result = replay_block_selection(selector_preset("acceptmoe", gamma=gamma), blocks, hand_calibration(),
                                        pool_size=2, keep_selected=True, counterfactual=True)
        assert result.compared == 2  # block 0's two committed positions (block 1 lacks its true continuation)
        assert result.compared_drafts == 1
        assert result.changed == result.changed_drafts == changed  # the root's own top-K never changes
        assert result.selected[1, 0].tolist() == ([1, 0] if gamma == 0.3 else [1, 4])
    exact = replay_block_selection(selector_preset("exact"), blocks, hand_calibration(), pool_size=2,
                                   counterfactual=True)
    assert exact.changed == 0 and exact.compared == 2


# -- sources and bad input ----------------------------------------------------------------------------------
def test_acceptance_profiles():
    assert AcceptanceProfile.geometric(0.5).commit_probabilities(3).tolist() == [0.5, 0.25, 0.125]
    assert AcceptanceProfile.table([0.9, 0.5]).commit_probabilities(3).tolist() == [0.9, 0.5, 0.0]
    # histogram: 1 block accepted 0, 2 accepted 1, 1 accepted 2 -> P(a>=1)=3/4, P(a>=2)=1/4
    assert AcceptanceProfile.histogram([1, 2, 1]).commit_probabilities(3).tolist() == [0.75, 0.25, 0.0]
    profile = AcceptanceProfile.for_tau(5.0, 8)
    q = profile.commit_probabilities(8)
    assert 1 + q.sum() == pytest.approx(5.0, abs=1e-6)
    with pytest.raises(BlockSourceError):
        AcceptanceProfile.table([0.5, 0.9])
    with pytest.raises(BlockSourceError):
        AcceptanceProfile.for_tau(9.5, 8)


def test_synthetic_blocks_walk_the_trace():
    rng = np.random.default_rng(0)
    trace = random_trace(rng, [50, 30])
    blocks = synthetic_blocks(trace, 4, AcceptanceProfile.geometric(0.7), seed=1)
    rows, starts = blocks.committed_rows()
    # committed positions of each request are consecutive trace positions from its start
    assert starts.tolist()[0] == 0
    seq0 = rows[:starts[1]]
    assert seq0.tolist() == list(range(seq0.size))
    assert rows[starts[1]] == 50
    np.testing.assert_array_equal(blocks.true_rows, blocks.rows)


def make_records(rng, n=4, k=3, num_layers=L, num_experts=E, top_k=K, selector=None):
    d = k + 1
    accepted = np.array([1, 3, 0, 2])[:n]
    root = np.r_[10, 10 + np.cumsum(accepted[:-1] + 1)]
    arrays = {"request": np.zeros(n, dtype=np.int64), "root_position": root,
              "tokens": rng.integers(0, V, (n, d)), "confidences": rng.random((n, k)).astype(np.float32),
              "accepted": accepted, "bonus": rng.integers(0, V, n),
              "router_logits": rng.normal(size=(n, d, num_layers, num_experts)).astype(np.float32),
              "pregate_logits": rng.normal(size=(n, d, num_layers, num_experts)).astype(np.float32),
              "selected": np.zeros((n, d, num_layers, top_k), dtype=np.int64)}
    return BlockRecords(arrays, top_k=top_k, vocab_size=V, drafter="test",
                        selector=selector_preset(selector).to_dict() if selector else {})


def test_blocks_from_records_true_rows():
    records = make_records(np.random.default_rng(0))
    blocks = blocks_from_records(records)
    # block 0 (root 10, accepted 1): its rejected positions 12, 13 are committed by block 1 (root 12, accepting 3)
    assert blocks.true_rows[0].tolist() == [0, 1, 4, 5]
    assert blocks.true_rows[3, 3] == -1  # beyond the end of the request
    cut = blocks_from_records(records, k=2)
    assert cut.k == 2 and cut.accepted.tolist() == [1, 2, 0, 2]
    with pytest.raises(BlockSourceError, match="k=4"):
        blocks_from_records(records, k=4)


def test_bad_input_is_refused_clearly():
    rng = np.random.default_rng(0)
    cal = random_calibration(rng)
    blocks = blocks_from_records(make_records(rng, num_experts=E + 2))
    with pytest.raises(BlockSourceError, match="E=14"):
        replay_rollback(preset("psr", 4, K), blocks, cal)
    with pytest.raises(BlockSourceError, match="E=14"):
        replay_block_selection(selector_preset("exact"), blocks, cal, pool_size=4)
    other_k = blocks_from_records(make_records(rng, top_k=3))
    with pytest.raises(BlockSourceError, match="K=3"):
        replay_ar(preset("psr", 4, K), other_k, cal)
    trace = random_trace(rng, [10], num_layers=L + 1)
    with pytest.raises(BlockSourceError, match="L=4"):
        replay_rollback(preset("psr", 4, K), synthetic_blocks(trace, 2, AcceptanceProfile.geometric(0.5)), cal)
    with pytest.raises(BlockSourceError, match="no sequence"):
        synthetic_blocks(random_trace(rng, [3]), 4, AcceptanceProfile.geometric(0.5))
    empty = make_records(rng)
    empty.arrays = {k: v[:0] for k, v in empty.arrays.items()}
    with pytest.raises(BlockSourceError, match="no block"):
        blocks_from_records(empty)


# -- the command --------------------------------------------------------------------------------------------
def test_replay_sd_command(tmp_path, capsys):
    from specmoe.cli import main
    from specmoe.rundir import read_table
    from specmoe.replay.command import points_of

    rng = np.random.default_rng(5)
    cal = random_calibration(rng)
    cal.save(tmp_path / "cal.safetensors")
    random_trace(rng, [60, 40]).save(tmp_path / "trace.safetensors")
    make_records(rng, selector="acceptmoe").save(tmp_path / "blocks.safetensors")
    args = ["replay-sd", "--calibration", str(tmp_path / "cal.safetensors"), "--trace", str(tmp_path / "trace.safetensors"),
            "--records", str(tmp_path / "blocks.safetensors"), "--tau", "2", "--accept-hist-from",
            str(tmp_path / "blocks.safetensors"), "-k", "3", "-C", "4", "--lambdas", "0,0.5", "--budgets", "0,1",
            "--gammas", "1,2", "--prune-budgets", "0,1", "--out", str(tmp_path / "out")]
    assert main(args + ["--max-cells", "2"]) == 0  # stopped after two sources; the same command resumes
    done = {p: p.stat().st_mtime_ns for p in (tmp_path / "out" / "cells").iterdir()}
    assert len(done) == 2
    assert main(args) == 0
    assert all(p.stat().st_mtime_ns == t for p, t in done.items())  # finished sources were not recomputed
    summary = read_table(tmp_path / "out")
    assert summary.source.tolist() == ["records test (blocks)", "synthetic tau 2", "synthetic histogram of blocks"]
    # whose accepted lengths each selector's rows replay: the acceptmoe run's records and histogram are
    # acceptmoe's own (closed loop), exact's and confidence_top1's rows over them are open loop; a tau is a profile
    # standing in for exact's
    assert summary.acceptance_from.tolist() == ["acceptmoe", "profile", "acceptmoe"]
    assert summary.acceptmoe_acceptance.tolist() == ["closed-loop", "open-loop (exact's)", "closed-loop"]
    assert summary.exact_acceptance.tolist() == ["open-loop (acceptmoe's)", "closed-loop", "open-loop (acceptmoe's)"]
    assert summary.confidence_top1_acceptance.tolist()[0] == "open-loop (acceptmoe's)"
    results = pd.concat(points_of(summary))
    assert set(results.method) == {"ar_psr", "rollback", "block_exact", "block_acceptmoe", "block_confidence_top1"}
    assert "rollback_over_ar_psr" in capsys.readouterr().out
    assert main(["report", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "report" / "frontier.png").stat().st_size > 1000
    assert "synthetic tau 2" in (tmp_path / "out" / "report" / "report.md").read_text()
    capsys.readouterr()
    # bad input: one line, exit 2
    assert main([*args[:3], "--records", str(tmp_path / "blocks.safetensors"), "--records-k", "5", "-C", "4", "--out",
                 str(tmp_path / "bad")]) == 2
    assert "k=5" in capsys.readouterr().err
    assert main([*args[:3], "-C", "4", "--out", str(tmp_path / "bad")]) == 2
    assert "--records" in capsys.readouterr().err
    assert main([*args[:5], "-k", "3", "-C", "4", "--out", str(tmp_path / "bad")]) == 2  # no acceptance given
    assert "acceptance" in capsys.readouterr().err


def test_frontier_and_interpolation():
    from specmoe.replay.report import frontier, interpolate

    points = pd.DataFrame({"displaced_per_token_layer": [0.0, 0.1, 0.1, 0.2, 0.3],
                           "copies_per_token": [10.0, 6.0, 7.0, 8.0, 2.0]})
    front = frontier(points)
    assert front.copies_per_token.tolist() == [10.0, 6.0, 2.0]
    assert interpolate(front, 0.05) == pytest.approx(8.0)
    assert interpolate(front, 0.2) == pytest.approx(4.0)
    assert np.isnan(interpolate(front, 0.4))


def test_with_true_continuation():
    from specmoe.records import with_true_continuation

    blocks = blocks_from_records(make_records(np.random.default_rng(0)))
    true = with_true_continuation(blocks)
    assert true.num_blocks == 3  # the last block's continuation runs past the request
    assert true.rows[0].tolist() == [0, 1, 4, 5]
    np.testing.assert_array_equal(true.committed_rows()[0], blocks.committed_rows()[0][:true.committed])


def test_plot_lays_four_sources_out_two_by_two_with_one_legend_outside():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from specmoe.replay.report import figure

    rng = np.random.default_rng(0)
    tables = []
    for i in range(4):
        rows = [{"method": m, "displaced_per_token_layer": d, "copies_per_token": c}
                for m in ("rollback", "block_acceptmoe", "block_confidence_top1")
                for d, c in zip(rng.uniform(0, 0.2, 5), rng.uniform(1, 10, 5))]
        rows += [{"method": "block_exact", "displaced_per_token_layer": 0.0, "copies_per_token": 9.0},
                 {"method": "ar_psr", "displaced_per_token_layer": 0.05, "copies_per_token": 7.0}]
        table = pd.DataFrame(rows)
        table["source"], table["k"], table["tau"] = f"source {i}", 8, 3.0
        tables.append(table)
    fig = figure(tables)
    fig.canvas.draw()
    axes = [ax for ax in fig.axes if ax.axison]
    assert len(axes) == 4 and {ax.get_subplotspec().get_geometry()[:2] for ax in axes} == {(2, 2)}
    width, height = fig.get_size_inches()
    assert 0.8 < width / height < 1.6  # a grid, not a strip
    assert len(fig.legends) == 1 and all(ax.get_legend() is None for ax in axes)
    legend = fig.legends[0].get_window_extent()
    assert not any(ax.get_window_extent().overlaps(legend) for ax in axes)
    assert len(fig.legends[0].get_texts()) == 5
    assert min(ax.title.get_fontsize() for ax in axes) >= 10 and axes[-1].xaxis.label.get_text() and axes[-1].xaxis.label.get_fontsize() >= 10
    plt.close(fig)
