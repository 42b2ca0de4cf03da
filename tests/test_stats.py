"""specmoe.stats against scipy and statsmodels on the same data (numbers computed by the references, not
figures copied from a run of the code), and its refusals of bad input."""

import numpy as np
import pytest
from scipy import stats as st

from specmoe import stats


def _statsmodels(module: str):
    """statsmodels.`module`, or skip the calling test: only the tests that compare with statsmodels need it (the
    scipy comparisons run without it)."""
    return pytest.importorskip(f"statsmodels.{module}")


def _outcomes(seed, n, p_a, p_b, agree):
    """Two correlated 0/1 outcome vectors: b copies a with probability `agree`."""
    rng = np.random.default_rng(seed)
    a = rng.random(n) < p_a
    b = np.where(rng.random(n) < agree, a, rng.random(n) < p_b)
    return a.astype(int), b.astype(int)


# -- McNemar --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed, n, p_a, p_b, agree", [(0, 200, 0.6, 0.5, 0.8), (1, 50, 0.5, 0.5, 0.9),
                                                      (2, 1000, 0.7, 0.65, 0.85), (3, 12, 0.5, 0.3, 0.2)])
def test_mcnemar_matches_statsmodels_exact(seed, n, p_a, p_b, agree):
    sm_contingency = _statsmodels("stats.contingency_tables")
    a, b = _outcomes(seed, n, p_a, p_b, agree)
    result = stats.mcnemar_exact(a, b)
    table = [[np.sum((a == 1) & (b == 1)), np.sum((a == 1) & (b == 0))],
             [np.sum((a == 0) & (b == 1)), np.sum((a == 0) & (b == 0))]]
    reference = sm_contingency.mcnemar(table, exact=True)
    assert result.p_value == pytest.approx(reference.pvalue, rel=1e-12)
    assert result.only_a == table[0][1] and result.only_b == table[1][0] and result.n == n
    assert result.difference == pytest.approx(a.mean() - b.mean())
    assert stats.mcnemar_exact(b, a).p_value == pytest.approx(result.p_value, rel=1e-12)  # symmetric


def test_mcnemar_known_cases():
    # 10 discordant, all for a: p = 2 * 0.5^10
    a, b = np.ones(30, int), np.r_[np.zeros(10, int), np.ones(20, int)]
    assert stats.mcnemar_exact(a, b).p_value == pytest.approx(2 * 0.5 ** 10)
    # no discordant pair: nothing to test, p = 1
    same = stats.mcnemar_exact([1, 0, 1], [True, False, True])
    assert same.p_value == 1.0 and same.discordant == 0


def test_mcnemar_refuses_bad_input():
    with pytest.raises(ValueError, match="0/1"):
        stats.mcnemar_exact([1, 0, 0.5], [1, 0, 1])
    with pytest.raises(ValueError, match="pair up"):
        stats.mcnemar_exact([1, 0], [1, 0, 1])
    with pytest.raises(ValueError, match="at least 1"):
        stats.mcnemar_exact([], [])
    with pytest.raises(ValueError, match="non-finite"):
        stats.mcnemar_exact([1, float("nan")], [1, 0])


# -- sign flip -----------------------------------------------------------------------------------------------
def _scipy_sign_flip(d):
    """scipy's exact paired permutation test of the mean difference (pairs swapped = signs flipped)."""
    return st.permutation_test((d, np.zeros_like(d)), lambda x, y, axis: np.mean(x - y, axis=axis),
                               permutation_type="samples", n_resamples=np.inf, vectorized=True).pvalue


@pytest.mark.parametrize("seed, n, shift", [(0, 10, 0.0), (1, 12, 0.5), (2, 14, 1.0), (3, 8, 2.0)])
def test_sign_flip_exact_matches_scipy(seed, n, shift):
    d = np.random.default_rng(seed).normal(shift, 1.0, n)
    result = stats.sign_flip_test(d)
    assert result.exact and result.n_resamples == 2 ** n
    assert result.p_value == pytest.approx(_scipy_sign_flip(d), rel=1e-9)
    assert result.difference == pytest.approx(d.mean())


def test_sign_flip_with_ties_and_zeros_matches_scipy():
    d = np.array([1.0, 1.0, -1.0, 0.0, 0.0, 1.0, 2.0, -2.0, 1.0, 0.5])  # tied |mean| among patterns
    assert stats.sign_flip_test(d).p_value == pytest.approx(_scipy_sign_flip(d), rel=1e-9)
    assert stats.sign_flip_test(np.zeros(5)).p_value == 1.0


def test_sign_flip_clusters_flip_per_cluster_sums():
    """Flipping whole clusters is the sign-flip test on the per-cluster sums (scipy on those sums)."""
    rng = np.random.default_rng(4)
    sizes = rng.integers(1, 5, 11)
    clusters = np.repeat([f"prompt{i}" for i in range(sizes.size)], sizes)
    d = rng.choice([-1.0, 0.0, 1.0], size=sizes.sum(), p=[0.25, 0.4, 0.35])
    result = stats.sign_flip_test(d, clusters)
    sums = np.array([d[clusters == c].sum() for c in dict.fromkeys(clusters)])
    assert result.exact and result.units == sizes.size
    assert result.p_value == pytest.approx(_scipy_sign_flip(sums), rel=1e-9)
    assert result.difference == pytest.approx(d.mean())  # the mean over items, not over clusters
    # flipping items instead of prompts is a different (anti-conservative for correlated items) test
    assert stats.sign_flip_test(d).p_value != pytest.approx(result.p_value)


def test_sign_flip_monte_carlo_is_seeded_and_near_exact():
    d = np.random.default_rng(5).normal(0.45, 1.0, 16)
    exact = stats.sign_flip_test(d)
    mc = stats.sign_flip_test(d, exact_max_units=10, n_resamples=40000, seed=3)
    assert exact.exact and not mc.exact and mc.n_resamples == 40000
    assert exact.p_value == pytest.approx(_scipy_sign_flip(d), rel=1e-9)
    se = np.sqrt(exact.p_value * (1 - exact.p_value) / 40000)
    assert abs(mc.p_value - exact.p_value) < 5 * se
    assert stats.sign_flip_test(d, exact_max_units=10, n_resamples=40000, seed=3) == mc
    # a large sample: randomized scipy agrees within Monte Carlo error
    big = np.random.default_rng(6).normal(0.15, 1.0, 100)
    ours = stats.sign_flip_test(big, n_resamples=40000, seed=1).p_value
    ref = st.permutation_test((big, np.zeros_like(big)), lambda x, y, axis: np.mean(x - y, axis=axis),
                              permutation_type="samples", n_resamples=20000, vectorized=True, rng=7).pvalue
    assert abs(ours - ref) < 6 * np.sqrt(ref * (1 - ref) / 20000) + 1e-4
    assert stats.sign_flip_test(np.full(40, 1.0), n_resamples=999).p_value == pytest.approx(1 / 1000)


def test_sign_flip_refuses_bad_input():
    with pytest.raises(ValueError, match="one label per item"):
        stats.sign_flip_test([1.0, 2.0, 3.0], clusters=[0, 1])
    with pytest.raises(ValueError, match="at least 1"):
        stats.sign_flip_test([])
    with pytest.raises(ValueError, match="non-finite"):
        stats.sign_flip_test([1.0, np.inf])
    with pytest.raises(ValueError, match="n_resamples"):
        stats.sign_flip_test(np.ones(30), n_resamples=0)


# -- paired difference ---------------------------------------------------------------------------------------
def test_paired_difference_se_matches_statsmodels_ols():
    sm_api = _statsmodels("api")
    rng = np.random.default_rng(7)
    a, b = rng.random(40), rng.random(40)
    d = a - b
    result = stats.paired_difference(a, b)
    fit = sm_api.OLS(d, np.ones((d.size, 1))).fit()
    assert result.difference == pytest.approx(fit.params[0]) and result.se == pytest.approx(fit.bse[0])
    assert result.se == pytest.approx(st.sem(d)) and result.units == 40


def test_paired_difference_cluster_robust_se_matches_statsmodels():
    sm_api = _statsmodels("api")
    rng = np.random.default_rng(8)
    clusters = np.repeat(np.arange(25), rng.integers(1, 6, 25))
    a = (rng.random(clusters.size) < 0.7).astype(float)
    b = (rng.random(clusters.size) < 0.6).astype(float)
    result = stats.paired_difference(a, b, clusters)
    fit = sm_api.OLS(a - b, np.ones((a.size, 1))).fit(cov_type="cluster", cov_kwds={"groups": clusters})
    assert result.se == pytest.approx(fit.bse[0], rel=1e-10)
    assert result.units == 25 and result.n == a.size
    with pytest.raises(ValueError, match="2 clusters"):
        stats.paired_difference([1, 0, 1], [0, 0, 1], clusters=["p", "p", "p"])


# -- Holm ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed, m", [(0, 1), (1, 5), (2, 17), (3, 90)])
def test_holm_matches_statsmodels(seed, m):
    sm_multitest = _statsmodels("stats.multitest")
    rng = np.random.default_rng(seed)
    p = np.minimum(1.0, rng.random(m) ** 3)
    reference = sm_multitest.multipletests(p, method="holm")[1]
    np.testing.assert_allclose(stats.holm(p), reference, rtol=1e-12)


def test_holm_keeps_shape_ties_and_nan():
    sm_multitest = _statsmodels("stats.multitest")
    p = [0.01, 0.04, 0.04, 0.03, 0.5]
    reference = sm_multitest.multipletests(p, method="holm")[1]
    np.testing.assert_allclose(stats.holm(p), reference)
    table = np.array([[0.001, np.nan, 0.02], [0.2, 0.04, np.nan]])
    adjusted = stats.holm(table)
    assert adjusted.shape == table.shape and np.isnan(adjusted[0, 1]) and np.isnan(adjusted[1, 2])
    tested = ~np.isnan(table)
    np.testing.assert_allclose(adjusted[tested], sm_multitest.multipletests(table[tested], method="holm")[1])
    named = stats.holm({"gsm8k": 0.01, "mmlu": 0.02, "bbh": 0.5})
    assert named == pytest.approx(dict(zip(["gsm8k", "mmlu", "bbh"],
                                           sm_multitest.multipletests([0.01, 0.02, 0.5], method="holm")[1])))
    assert stats.holm([]).size == 0
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        stats.holm([0.5, 1.2])


# -- latency ratio over rounds -------------------------------------------------------------------------------
@pytest.mark.parametrize("seed, rounds", [(0, 3), (1, 5), (2, 12)])
def test_log_ratio_ttest_matches_scipy_ttest_rel(seed, rounds):
    rng = np.random.default_rng(seed)
    b = rng.uniform(20, 30, rounds)
    a = b * rng.normal(0.8, 0.05, rounds)
    result = stats.log_ratio_ttest(a, b)
    reference = st.ttest_rel(np.log(a), np.log(b))
    low, high = reference.confidence_interval(0.95)
    assert result.p_value == pytest.approx(reference.pvalue, rel=1e-10)
    assert result.ratio == pytest.approx(np.exp(np.mean(np.log(a) - np.log(b))))
    assert (result.low, result.high) == pytest.approx((np.exp(low), np.exp(high)), rel=1e-10)
    assert result.rounds == rounds
    narrow = stats.log_ratio_ttest(a, b, confidence=0.5)
    assert result.low < narrow.low < narrow.ratio < narrow.high < result.high


def test_log_ratio_ttest_degenerate_and_bad_input():
    same = stats.log_ratio_ttest([10.0, 10.0, 10.0], [20.0, 20.0, 20.0])
    assert same.ratio == pytest.approx(0.5) and same.low == same.high == same.ratio and same.p_value == 0.0
    with pytest.raises(ValueError, match="positive"):
        stats.log_ratio_ttest([1.0, 0.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="at least 2"):
        stats.log_ratio_ttest([1.0], [2.0])
    with pytest.raises(ValueError, match="pair up"):
        stats.log_ratio_ttest([1.0, 2.0, 3.0], [1.0, 2.0])


# -- mean over tasks -----------------------------------------------------------------------------------------
def test_mean_interval_matches_scipy_t_interval():
    differences = [0.4, -1.2, 2.5, 0.9, 1.7, -0.3, 0.8, 1.1]
    result = stats.mean_interval(differences)
    low, high = st.ttest_1samp(differences, 0.0).confidence_interval(0.95)
    assert (result.low, result.high) == pytest.approx((low, high), rel=1e-12)
    assert result.mean == pytest.approx(np.mean(differences)) and result.se == pytest.approx(st.sem(differences))
    low90, high90 = st.t.interval(0.9, len(differences) - 1, loc=np.mean(differences), scale=st.sem(differences))
    assert (stats.mean_interval(differences, 0.9).low, stats.mean_interval(differences, 0.9).high) == \
        pytest.approx((low90, high90))
    with pytest.raises(ValueError, match="at least 2"):
        stats.mean_interval([1.0])
    with pytest.raises(ValueError, match="confidence"):
        stats.mean_interval([1.0, 2.0], confidence=1.5)


# -- bootstrap over prompts ----------------------------------------------------------------------------------
def test_bootstrap_interval_agrees_with_scipy_percentile_bootstrap():
    rng = np.random.default_rng(9)
    a = rng.gamma(4.0, 5.0, 30)
    b = a * rng.normal(1.2, 0.1, 30)

    def ratio(x, y, axis=-1):
        return np.sum(x, axis=axis) / np.sum(y, axis=axis)

    result = stats.bootstrap_interval((a, b), ratio, n_resamples=20000, seed=1)
    reference = st.bootstrap((a, b), ratio, paired=True, vectorized=True, n_resamples=20000, method="percentile",
                             rng=2).confidence_interval
    width = reference.high - reference.low
    assert result.estimate == pytest.approx(a.sum() / b.sum())
    assert abs(result.low - reference.low) < 0.05 * width and abs(result.high - reference.high) < 0.05 * width
    again = stats.bootstrap_interval((a, b), ratio, n_resamples=20000, seed=1)
    assert again == result  # seeded


def test_bootstrap_interval_single_array_and_bad_input():
    x = np.random.default_rng(10).normal(5.0, 2.0, 40)
    result = stats.bootstrap_interval(x, np.median, n_resamples=5000)
    reference = st.bootstrap((x,), np.median, vectorized=False, n_resamples=5000, method="percentile",
                             rng=0).confidence_interval
    assert result.estimate == pytest.approx(np.median(x))
    assert abs(result.low - reference.low) < 0.15 * (reference.high - reference.low)
    assert abs(result.high - reference.high) < 0.15 * (reference.high - reference.low)
    with pytest.raises(ValueError, match="one entry per prompt"):
        stats.bootstrap_interval(([1.0, 2.0], [1.0, 2.0, 3.0]), lambda x, y: x.sum() / y.sum())
    with pytest.raises(ValueError, match="not finite"):
        stats.bootstrap_interval(([1.0, 2.0], [0.0, 1.0]), lambda x, y: x.sum() / y.sum() if y.sum() else np.inf,
                                 n_resamples=200)


def test_unit_ratio_against_a_hand_estimate_and_scipy_bootstrap():
    from scipy.stats import bootstrap

    from specmoe.stats import unit_ratio

    rng = np.random.default_rng(3)
    units = 40
    count = rng.integers(20, 60, units).astype(float)
    b_time = count * rng.uniform(0.9, 1.1, units)  # about 1 ms per token
    a_time = 0.8 * b_time * rng.uniform(0.95, 1.05, units)  # about 0.8x, paired by unit
    r = unit_ratio(a_time, count, b_time, count, n_resamples=4000, seed=1)
    assert r.estimate == pytest.approx(a_time.sum() / b_time.sum())  # the same counts: sum a / sum b
    reference = bootstrap((a_time, count, b_time, count),
                          lambda at, ac, bt, bc: (at.sum() / ac.sum()) / (bt.sum() / bc.sum()),
                          paired=True, vectorized=False, n_resamples=4000, method="percentile",
                          random_state=np.random.default_rng(7)).confidence_interval
    assert r.low == pytest.approx(reference.low, abs=0.004) and r.high == pytest.approx(reference.high, abs=0.004)
    assert r.low < r.estimate < r.high
    with pytest.raises(ValueError, match="one entry per unit"):
        unit_ratio(a_time, count, b_time[:-1], count[:-1])
    with pytest.raises(ValueError, match="positive"):
        unit_ratio(a_time, 0 * count, b_time, count)
