"""The schedule floor (`specmoe.engines.schedule`): hand-worked schedules of the model in its docstring, bounds it
must respect on random copy counts, and the per-layer copies of a run replayed through its policy (olmoe-tiny on
the CPU, float32, seeded random weights)."""

import numpy as np
import pytest

from specmoe.engines import EngineConfig, build_engine
from specmoe.engines.helpers import calibration_from_engine
from specmoe.engines.results import COPY_FIELDS, LogitFeed
from specmoe.engines.schedule import policy_copies, schedule_floor
from specmoe.models import load_model
from specmoe.routing import Calibration, preset


def counts(shape, cells):
    out = np.zeros(shape, np.int64)
    for (t, layer), n in cells.items():
        out[t, layer] = n
    return out


def test_without_copies_the_floor_is_the_compute():
    zero = np.zeros((3, 4), np.int64)
    np.testing.assert_allclose(schedule_floor(zero, zero, 0.5, 2.0), [2.0, 2.0, 2.0])


def test_a_demand_copy_is_never_hidden():
    demand = counts((2, 3), {(0, 1): 1, (1, 0): 2})
    np.testing.assert_allclose(schedule_floor(demand, np.zeros_like(demand), 1.0, 2.5), [3 + 2.5, 3 + 5.0])


def test_a_prefetch_hides_at_most_one_layer():
    shape = (1, 2)
    short = counts(shape, {(0, 1): 1})
    none = np.zeros(shape, np.int64)
    assert schedule_floor(none, short, 1.0, 0.5)[0] == pytest.approx(2.0)  # within the layer ahead: hidden
    assert schedule_floor(none, short, 1.0, 3.0)[0] == pytest.approx(2.0 + 2.0)  # 1 of its 3 ms hidden


def test_a_demand_copy_goes_before_the_next_layers_prefetches():
    """Layer 1 demands one copy at its gate (t = 1) while layer 2's two prefetches (released at t = 1) are
    pending: the demand goes first (gate 1 at 2), the prefetches then run 2 -> 4, one of them during layer 1's
    compute, so gate 2 is at 4 and the token ends at 5. Prefetches first would put gate 1 at 4 and the end at 6."""
    demand = counts((1, 3), {(0, 1): 1})
    prefetch = counts((1, 3), {(0, 2): 2})
    assert schedule_floor(demand, prefetch, 1.0, 1.0)[0] == pytest.approx(5.0)


def test_prefetches_beyond_the_link_wait_at_every_layer():
    """Two prefetches per layer of one layer's compute each: one hides behind the layer ahead, one waits."""
    prefetch = counts((2, 4), {(t, layer): 2 for t in range(2) for layer in range(1, 4)})
    np.testing.assert_allclose(schedule_floor(np.zeros_like(prefetch), prefetch, 1.0, 1.0), [4 + 3, 4 + 3])
    one = counts((1, 4), {(0, layer): 1 for layer in range(1, 4)})
    assert schedule_floor(np.zeros_like(one), one, 1.0, 1.0)[0] == pytest.approx(4.0)


def random_cases(seed: int, count: int, tokens: int, layers: int, whole: bool):
    """`count` random (demand, prefetch, layer time, copy time) of up to `tokens` x `layers`; whole: integer
    times (for `tick_by_tick`)."""
    rng = np.random.default_rng(seed)
    for _ in range(count):
        shape = (int(rng.integers(1, tokens)), int(rng.integers(1, layers)))
        demand, prefetch = rng.poisson(rng.uniform(0, 1.2), shape), rng.poisson(rng.uniform(0, 2.0), shape)
        if whole:
            yield demand, prefetch, int(rng.integers(1, 6)), int(rng.integers(1, 9))
        else:
            yield demand, prefetch, rng.uniform(0.01, 0.2), rng.uniform(0.05, 0.5)


def test_random_counts_stay_between_the_link_and_the_serial_sum():
    for demand, prefetch, layer_ms, copy_ms in random_cases(0, 20, 30, 20, whole=False):
        floor = schedule_floor(demand, prefetch, layer_ms, copy_ms)
        compute = demand.shape[1] * layer_ms
        assert (floor >= compute - 1e-9).all()
        assert floor.sum() >= (demand.sum() + prefetch.sum()) * copy_ms - 1e-9  # the link moves one at a time
        assert (floor <= compute + (demand + prefetch).sum(axis=1) * copy_ms + 1e-9).all()  # nothing overlapped
        assert floor.sum() >= compute * demand.shape[0] + demand.sum() * copy_ms - 1e-9  # demand copies never overlap
        more = schedule_floor(demand + 1, prefetch, layer_ms, copy_ms)
        assert (more >= floor - 1e-9).all()


def tick_by_tick(demand, prefetch, layer_ticks: int, copy_ticks: int) -> list[int]:
    """The same model stepped one time unit at a time (integer times, so exact): the link spends each unit on the
    released copy of the earliest (token, layer); compute waits at a gate until no copy due there is left."""
    T, L = demand.shape
    work: dict = {}  # (token, layer) -> [released units left]
    ends, now = [], 0
    for t in range(T):
        start = now
        for layer in range(L):
            if layer:  # compute from the last gate to this one, the link working meanwhile
                for _ in range(layer_ticks):
                    step_link(work)
                    now += 1
            key = (t, layer)
            work[key] = work.get(key, 0) + demand[t, layer] * copy_ticks + (prefetch[t, 0] * copy_ticks if layer == 0 else 0)
            if layer + 1 < L:
                work[(t, layer + 1)] = prefetch[t, layer + 1] * copy_ticks
            while any(left for k, left in work.items() if k <= key):
                step_link(work)
                now += 1
        for _ in range(layer_ticks):
            step_link(work)
            now += 1
        ends.append(now - start)
    return ends


def step_link(work: dict) -> None:
    pending = sorted(k for k, left in work.items() if left)
    if pending:
        work[pending[0]] -= 1


def test_the_floor_is_the_tick_by_tick_schedule():
    for demand, prefetch, layer_ticks, copy_ticks in random_cases(3, 40, 6, 7, whole=True):
        np.testing.assert_allclose(schedule_floor(demand, prefetch, layer_ticks, copy_ticks),
                                   tick_by_tick(demand, prefetch, layer_ticks, copy_ticks))


def test_bad_counts_are_refused():
    with pytest.raises(ValueError, match=r"\[T, L\]"):
        schedule_floor(np.zeros((2, 3)), np.zeros((2, 4)), 1.0, 1.0)
    with pytest.raises(ValueError, match="non-negative"):
        schedule_floor(-np.ones((2, 3)), np.zeros((2, 3)), 1.0, 1.0)


@pytest.fixture(scope="module")
def tiny_engines():
    model, adapter = load_model("olmoe-tiny", seed=0)
    L, E, K, V = adapter.num_moe_layers, adapter.num_experts, adapter.top_k, adapter.vocab_size
    exact = build_engine(model, preset("exact_lru", E, K), Calibration.uniform(L, E, V), EngineConfig(max_seq_len=64))
    rng = np.random.default_rng(1)
    calibration = calibration_from_engine(exact, [rng.integers(0, V, 48) for _ in range(4)],
                                          {"model": "olmoe-tiny seed 0", "text": "random tokens"})
    return model, adapter, calibration


@pytest.mark.parametrize("name", ["psr", "cache_prior"])
def test_policy_copies_are_the_runs_per_layer(tiny_engines, name):
    model, adapter, calibration = tiny_engines
    engine = build_engine(model, preset(name, 16, adapter.top_k), calibration, EngineConfig(max_seq_len=64))
    tokens = np.random.default_rng(2).integers(0, adapter.vocab_size, 24)
    result = engine.teacher_forced(tokens, prompt_len=8)
    demand, prefetch = policy_copies(engine, result)
    assert demand.shape == prefetch.shape == (16, adapter.num_moe_layers)
    fields = list(COPY_FIELDS)
    timed = result.copies[result.timed]
    np.testing.assert_array_equal(demand.sum(axis=1), timed[:, fields.index("demand")])
    np.testing.assert_array_equal(prefetch.sum(axis=1), timed[:, fields.index("prefetch")])
    assert (prefetch[:, 0] == 0).all()  # no pre-gate for layer 0
    if name == "psr":
        assert prefetch.sum() > 0
    else:
        assert prefetch.sum() == 0
    assert demand.sum() > 0
    # followed again as a trace, the same copies; a run whose routing is not the recorded one is refused
    again = engine.teacher_forced(tokens, prompt_len=8, feed=LogitFeed.of(result))
    np.testing.assert_array_equal(policy_copies(engine, again, LogitFeed.of(result))[0], demand)
    result.router_logits = result.router_logits[::-1].copy()
    with pytest.raises(ValueError, match="differ from the run's"):
        policy_copies(engine, result)
