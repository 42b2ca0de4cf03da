"""Paired statistics for comparing two configurations on the same questions, prompts or timing rounds.

Each function is one test or interval of the measurement protocol (docs/design.md):

- quality, per task, two runs on identical questions: `paired_difference` (mean difference and its standard
  error, cluster-robust when several scored items share one prompt); `mcnemar_exact` for a 0/1 score per
  question (accuracy, exact match, pass@1 under greedy decoding); `sign_flip_test` for any other per-question
  score, and for scores counted per item of a prompt (IFEval's instruction level: the prompt is the unit,
  so whole prompts are flipped);
- one table of tests is one family: `holm` adjusts its p-values together;
- a one-number summary over tasks: `mean_interval`, the mean of the per-task differences with a t interval
  that treats tasks as independent;
- latency, configurations interleaved in rounds: `log_ratio_ttest`, the ratio of two configurations' latency
  from a paired t-test on log latency over rounds (the round is the unit, not the token);
- latency over prompts: `bootstrap_interval`, a percentile interval of any statistic from resampling prompts;
  `unit_ratio`, the latency ratio of two configurations over paired units of the workload (requests, windows).

A difference that is not significant does not show that two configurations are equal: report its interval.
Bad input (unequal lengths, nothing to test, non-binary outcomes where 0/1 is needed, non-finite values) is a
ValueError naming the argument. Only numpy and scipy are needed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import stats as _st


# -- input checks --------------------------------------------------------------------------------------------
def _vector(values, name: str, *, min_len: int = 1) -> np.ndarray:
    """`values` as a finite float64 vector of at least `min_len` entries, else ValueError naming `name`."""
    try:
        array = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a sequence of numbers") from None
    if array.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {array.shape}")
    if array.size < min_len:
        raise ValueError(f"{name} needs at least {min_len} value{'s' if min_len > 1 else ''}, got {array.size}")
    if not np.isfinite(array).all():
        raise ValueError(f"{name} holds a non-finite value at index {int(np.flatnonzero(~np.isfinite(array))[0])}")
    return array


def _pair(a, b, names=("a", "b"), *, min_len: int = 1) -> tuple[np.ndarray, np.ndarray]:
    x, y = _vector(a, names[0], min_len=min_len), _vector(b, names[1], min_len=min_len)
    if x.size != y.size:
        raise ValueError(f"{names[0]} and {names[1]} must pair up one to one, got {x.size} and {y.size} values")
    return x, y


def _binary(values, name: str) -> np.ndarray:
    array = _vector(values, name)
    bad = np.flatnonzero((array != 0) & (array != 1))
    if bad.size:
        raise ValueError(f"{name} must be 0/1 outcomes (correct or not), got {array[bad[0]]!r} at index {int(bad[0])}")
    return array.astype(bool)


def _cluster_ids(clusters, size: int) -> np.ndarray:
    """Cluster labels (any hashable values) as integer ids 0..G-1, one per item."""
    labels = np.asarray(clusters)
    if labels.ndim != 1 or labels.size != size:
        raise ValueError(f"clusters must give one label per item ({size}), got shape {labels.shape}")
    return np.unique(labels, return_inverse=True)[1].reshape(-1)


def _confidence(confidence: float) -> float:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    return float(confidence)


# -- quality: paired per-question scores ---------------------------------------------------------------------
@dataclass(frozen=True)
class PairedDifference:
    """Mean of a - b over paired items, its standard error and the units it rests on."""

    mean_a: float
    mean_b: float
    difference: float  # mean_a - mean_b
    se: float  # standard error of the difference (cluster-robust with clusters)
    n: int  # paired items
    units: int  # independent units: items, or clusters


def paired_difference(a, b, clusters=None) -> PairedDifference:
    """The mean paired difference of two runs' scores on the same items and its standard error.

    Use it for the "difference" and "se" columns of a quality table. Without `clusters` every item is
    independent: se = sd(a - b) / sqrt(n). With `clusters` (one label per item, e.g. the prompt of each of
    IFEval's instructions) the items of a cluster may be correlated and the cluster is the unit: the
    cluster-robust standard error sqrt(G / (G - 1) * sum_g (sum_{i in g} (d_i - mean d))^2) / n over G clusters
    (the usual small-sample factor G / (G - 1)). Needs two units."""
    x, y = _pair(a, b, min_len=2)
    d = x - y
    mean = float(d.mean())
    if clusters is None:
        se, units = float(d.std(ddof=1) / math.sqrt(d.size)), d.size
    else:
        ids = _cluster_ids(clusters, d.size)
        units = int(ids.max()) + 1
        if units < 2:
            raise ValueError("a cluster-robust standard error needs at least 2 clusters")
        sums = np.bincount(ids, weights=d - mean, minlength=units)
        se = float(math.sqrt(units / (units - 1) * float(np.sum(sums ** 2))) / d.size)
    return PairedDifference(float(x.mean()), float(y.mean()), mean, se, int(d.size), int(units))


@dataclass(frozen=True)
class McNemarResult:
    """Exact McNemar test of two runs' 0/1 outcomes on the same questions."""

    n: int  # paired questions
    only_a: int  # questions a got right and b wrong
    only_b: int  # questions b got right and a wrong
    difference: float  # accuracy of a minus accuracy of b (fraction)
    p_value: float  # two-sided

    @property
    def discordant(self) -> int:
        return self.only_a + self.only_b


def mcnemar_exact(a, b) -> McNemarResult:
    """Exact McNemar test: does a get more questions right than b, beyond chance?

    Use it for a 0/1 score per question (accuracy, exact match, pass@1 under greedy decoding) of two runs on
    the same questions, in the same order. Only discordant questions (right in one run, wrong in the other)
    carry information; under the null each is equally likely to favour either run, so the p-value is the
    two-sided binomial test of only_a successes in only_a + only_b trials at 1/2 (1 when no question is
    discordant)."""
    x, y = _binary(a, "a"), _binary(b, "b")
    if x.size != y.size:
        raise ValueError(f"a and b must pair up one to one, got {x.size} and {y.size} outcomes")
    only_a, only_b = int(np.sum(x & ~y)), int(np.sum(~x & y))
    discordant = only_a + only_b
    p = 1.0 if discordant == 0 else float(_st.binomtest(only_a, discordant, 0.5).pvalue)
    return McNemarResult(int(x.size), only_a, only_b, float(x.mean() - y.mean()), min(p, 1.0))


@dataclass(frozen=True)
class SignFlipResult:
    """Sign-flip permutation test of a mean paired difference."""

    difference: float  # mean of the differences over items
    p_value: float  # two-sided
    units: int  # items, or clusters, whose signs are flipped
    exact: bool  # all 2^units sign patterns enumerated, else Monte Carlo
    n_resamples: int  # sign patterns evaluated (2^units when exact)


def sign_flip_test(differences, clusters=None, *, n_resamples: int = 20000, exact_max_units: int = 16,
                   seed: int = 0) -> SignFlipResult:
    """Paired sign-flip permutation test of mean(differences) = 0, two-sided.

    Use it for paired per-question scores that are not 0/1 (a fraction of tests passed, a similarity), and
    with `clusters` for scores counted per item of a unit (IFEval's instruction level: one label per
    instruction naming its prompt): the whole cluster's signs flip together, so the test acts on per-cluster
    sums and the prompt is the unit. Under the null (each unit's difference is as likely negative as
    positive) every sign pattern is equally likely; the p-value is the share of patterns whose |mean| reaches
    the observed one. With at most `exact_max_units` units all 2^units patterns are enumerated (exact);
    otherwise `n_resamples` random patterns drawn with `seed`, and p = (1 + hits) / (1 + n_resamples), which
    counts the observed pattern and never returns 0."""
    d = _vector(differences, "differences")
    if n_resamples < 1 or exact_max_units < 0:
        raise ValueError(f"need n_resamples >= 1 and exact_max_units >= 0, got {n_resamples} and {exact_max_units}")
    if clusters is None:
        sums = d
    else:
        ids = _cluster_ids(clusters, d.size)
        sums = np.bincount(ids, weights=d)
    units, total = sums.size, float(d.size)
    observed = abs(float(sums.sum()))
    tolerance = 1e-9 * max(observed, float(np.abs(sums).sum()), 1e-300)  # rounding of reordered sums
    if units <= exact_max_units:
        patterns = 1 << units
        hits = 0
        for start in range(0, patterns, 1 << 16):  # sign bits of patterns start .. start + 65535
            codes = np.arange(start, min(start + (1 << 16), patterns), dtype=np.int64)
            signs = 1.0 - 2.0 * ((codes[:, None] >> np.arange(units)) & 1)
            hits += int(np.sum(np.abs(signs @ sums) >= observed - tolerance))
        p = hits / patterns
        return SignFlipResult(float(d.sum() / total), min(p, 1.0), units, True, patterns)
    rng = np.random.default_rng(seed)
    hits, done = 0, 0
    batch = max(1, min(n_resamples, (1 << 22) // max(units, 1)))
    while done < n_resamples:
        count = min(batch, n_resamples - done)
        signs = rng.choice(np.array([-1.0, 1.0]), size=(count, units))
        hits += int(np.sum(np.abs(signs @ sums) >= observed - tolerance))
        done += count
    p = (1 + hits) / (1 + n_resamples)
    return SignFlipResult(float(d.sum() / total), min(p, 1.0), units, False, n_resamples)


def holm(p_values):
    """Holm's step-down adjustment of one family of tests (e.g. every test of one table).

    Use it so that "significant" in a table means significant after correcting for all of its tests. The
    i-th smallest of m p-values becomes max over j <= i of min(1, (m - j + 1) p_(j)): step-down, monotone in
    the raw p-values, never below them. Takes any array (a 1-D list or a 2-D table) or a dict name -> p and
    returns the same shape; NaN entries (no test) are left out of the family and stay NaN."""
    if isinstance(p_values, dict):
        keys = list(p_values)
        return dict(zip(keys, holm([p_values[k] for k in keys]).tolist())) if keys else {}
    try:
        p = np.asarray(p_values, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError("p_values must be numbers") from None
    flat = p.reshape(-1)
    tested = ~np.isnan(flat)
    values = flat[tested]
    if np.any((values < 0) | (values > 1)):
        raise ValueError(f"p-values must lie in [0, 1], got {values[(values < 0) | (values > 1)][0]!r}")
    m = values.size
    order = np.argsort(values, kind="stable")
    stepped = np.minimum(1.0, (m - np.arange(m)) * values[order])
    adjusted = np.empty(m)
    adjusted[order] = np.maximum.accumulate(stepped)
    out = np.full(flat.shape, np.nan)
    out[tested] = adjusted
    return out.reshape(p.shape)


# -- summaries and latency -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class MeanInterval:
    """A mean with its t interval."""

    mean: float
    low: float
    high: float
    se: float
    n: int
    confidence: float


def mean_interval(values, confidence: float = 0.95) -> MeanInterval:
    """The mean of independent values with a t interval: mean +- t_{n-1} * sd / sqrt(n).

    Use it for the one-number summary of a quality table: the mean over tasks of the per-task differences,
    treating the tasks as independent. Its lower end is the largest mean loss the data do not exclude.
    Needs two values."""
    x = _vector(values, "values", min_len=2)
    confidence = _confidence(confidence)
    mean, se = float(x.mean()), float(x.std(ddof=1) / math.sqrt(x.size))
    half = float(_st.t.ppf(0.5 + confidence / 2, x.size - 1)) * se
    return MeanInterval(mean, mean - half, mean + half, se, int(x.size), confidence)


@dataclass(frozen=True)
class LatencyRatio:
    """Latency of a over latency of b from paired rounds, with its interval and p-value."""

    ratio: float  # exp(mean over rounds of log a - log b): the geometric mean of the per-round ratios
    low: float
    high: float
    p_value: float  # two-sided, H0: ratio = 1
    rounds: int
    confidence: float


def log_ratio_ttest(a, b, confidence: float = 0.95) -> LatencyRatio:
    """Paired t-test on log latency over rounds: how much faster or slower a is than b.

    Use it for latencies of configurations timed in the same process with rounds interleaved (A B A B ...):
    a[r] and b[r] are the two configurations' latencies (ms per token) in round r. The round is the unit,
    not the token. d_r = log a_r - log b_r; the ratio is exp(mean d) and its interval exp(mean d +-
    t_{R-1} * sd(d) / sqrt(R)). Needs two rounds and positive latencies. When every round gives the same d
    (sd = 0) the interval is the ratio itself and p is 0 (or 1 when d = 0)."""
    x, y = _pair(a, b, min_len=2)
    if np.any(x <= 0) or np.any(y <= 0):
        raise ValueError("latencies must be positive")
    confidence = _confidence(confidence)
    d = np.log(x) - np.log(y)
    mean, se = float(d.mean()), float(d.std(ddof=1) / math.sqrt(d.size))
    if se == 0.0:
        p, half = (1.0 if mean == 0.0 else 0.0), 0.0
    else:
        t = mean / se
        p = float(2 * _st.t.sf(abs(t), d.size - 1))
        half = float(_st.t.ppf(0.5 + confidence / 2, d.size - 1)) * se
    return LatencyRatio(math.exp(mean), math.exp(mean - half), math.exp(mean + half), min(p, 1.0), int(d.size),
                        confidence)


@dataclass(frozen=True)
class BootstrapInterval:
    """A statistic with its percentile bootstrap interval."""

    estimate: float  # the statistic on the data as given
    low: float
    high: float
    confidence: float
    n_resamples: int


def bootstrap_interval(data, statistic, *, n_resamples: int = 10000, confidence: float = 0.95,
                       seed: int = 0) -> BootstrapInterval:
    """Percentile bootstrap interval of `statistic` over prompts.

    Use it for variation over the prompt set rather than over rounds, e.g. the ratio of two configurations'
    total decode time over prompts: `data` is a tuple of arrays with one entry per prompt (or one array), all
    resampled with the same prompt indices (pairing kept); statistic(*arrays) returns a number, e.g.
    `lambda a, b: a.sum() / b.sum()`. The interval is the (1 -+ confidence) / 2 quantiles of the statistic
    over `n_resamples` resamples drawn with `seed`. It is approximate with few prompts (say below 20)."""
    arrays = tuple(data) if isinstance(data, (tuple, list)) and data and np.ndim(data[0]) == 1 else (data,)
    arrays = tuple(_vector(x, f"data[{i}]") for i, x in enumerate(arrays))
    size = arrays[0].size
    if any(x.size != size for x in arrays):
        raise ValueError(f"the arrays of data must have one entry per prompt each, got lengths "
                         f"{[x.size for x in arrays]}")
    if n_resamples < 1:
        raise ValueError(f"n_resamples must be >= 1, got {n_resamples}")
    confidence = _confidence(confidence)
    estimate = float(statistic(*arrays))
    rng = np.random.default_rng(seed)
    values = np.empty(n_resamples)
    for i in range(n_resamples):
        index = rng.integers(0, size, size)
        values[i] = statistic(*(x[index] for x in arrays))
    if not np.isfinite(values).all():
        raise ValueError("the statistic is not finite on some resamples (e.g. a division by a zero sum)")
    alpha = (1.0 - confidence) / 2
    low, high = np.quantile(values, [alpha, 1.0 - alpha])
    return BootstrapInterval(estimate, float(low), float(high), confidence, int(n_resamples))


def unit_ratio(a_time, a_count, b_time, b_count, *, n_resamples: int = 10000, confidence: float = 0.95,
               seed: int = 0) -> BootstrapInterval:
    """Latency ratio of two configurations over the workload's units (requests, windows, blocks), with a
    percentile bootstrap over the units, paired: (sum a_time / sum a_count) / (sum b_time / sum b_count).

    Use it where rounds only repeat identical deterministic work, so that the interval says how the ratio would
    vary with another workload, not how repeatable the machine is. a_time[u] and b_time[u] are the two
    configurations' times on unit u (each a mean over rounds), a_count[u] and b_count[u] the tokens they count
    per (committed tokens, timed positions); one entry per unit, in the same unit order, resampled with the same
    indices (`bootstrap_interval`): a cluster bootstrap of the ratio of per-token means with the unit as cluster.
    Needs two units; approximate with few (say below 20)."""
    arrays = [_vector(x, name, min_len=2) for x, name in
              ((a_time, "a_time"), (a_count, "a_count"), (b_time, "b_time"), (b_count, "b_count"))]
    if len({x.size for x in arrays}) != 1:
        raise ValueError(f"a_time, a_count, b_time, b_count must have one entry per unit each, got lengths "
                         f"{[x.size for x in arrays]}")
    if any(np.any(x <= 0) for x in arrays):
        raise ValueError("times and token counts must be positive")
    return bootstrap_interval(tuple(arrays), lambda at, ac, bt, bc: (at.sum() / ac.sum()) / (bt.sum() / bc.sum()),
                              n_resamples=n_resamples, confidence=confidence, seed=seed)
