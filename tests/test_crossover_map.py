"""The crossover map's core (scripts/crossover_map.py) on a tiny grid: it runs, and its copies move as the
source's parameters say they should."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))


@pytest.fixture(scope="module")
def table():
    from crossover_map import crossover_map

    grid = {"persistence": (0.3, 0.85), "pregate_noise": (0.3, 1.0), "skew": (0.6,), "margin": (0.5,)}
    return crossover_map(grid, capacities=(32,), tokens=1024, calibration_tokens=2048)


def test_one_row_per_point_with_every_method(table):
    from crossover_map import METHODS

    assert len(table) == 4 and set(table.C) == {32}
    assert table[list(METHODS)].notna().all().all() and (table[list(METHODS)] > 0).all().all()
    assert set(table.win_copies) <= set(METHODS) and set(table.win_ms) <= set(METHODS)
    assert (table.psr_demand <= table.psr).all()


def test_reuse_lowers_exact_lru_copies(table):
    for noise in (0.3, 1.0):
        part = table[table.pregate_noise == noise].set_index("persistence")
        assert part.exact_lru[0.85] < part.exact_lru[0.3]
        assert part.reuse_consecutive[0.85] > part.reuse_consecutive[0.3]


def test_pregate_noise_lowers_recall_and_raises_psr_demand(table):
    for persistence in (0.3, 0.85):
        part = table[table.persistence == persistence].set_index("pregate_noise")
        assert part.pregate_recall[1.0] < part.pregate_recall[0.3]
        assert part.psr_demand[1.0] > part.psr_demand[0.3]


def test_latency_proxy_prices_copies_with_the_quoted_h200_figures(table):
    from crossover_map import H200, per_copy_ms

    row = table.iloc[0]
    assert row.exact_lru_ms == pytest.approx(H200["all_resident_ms"] + row.exact_lru * per_copy_ms("exact_lru", 32))
    assert per_copy_ms("exact_lru", 32) == pytest.approx((12.69 - 1.76) / 44.9)
