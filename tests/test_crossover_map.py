"""The crossover map's core (scripts/crossover_map.py) on a tiny grid: it runs, and its copies move as the
source's parameters say they should."""

import sys
from pathlib import Path

import pandas as pd
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


def test_measured_ratios_are_placed_on_their_points(table, tmp_path):
    """--measured: bench_engine.json rows that followed a synthetic source land on that source's point of the map
    (a recorded trace does not); --table replots an earlier csv with them, without replaying the grid."""
    import json

    from crossover_map import _measured_at, main, measured_points

    table.to_csv(tmp_path / "crossover.csv", index=False)
    spec = "olmoe-like:tokens=8192,persistence=0.85,pregate_noise=0.3"
    report = {"traces": {"olmoe_like_persistence_0_85_pregate_noise_0_3_": {"file": spec},
                         "family_trace_": {"file": "/runs/family_trace.safetensors"}},
              "ratios": {}, "table": {}}
    for prefix, ratio in (("olmoe_like_persistence_0_85_pregate_noise_0_3_", 1.25), ("family_trace_", 0.75)):
        report["ratios"][f"{prefix}C32: cache_prior / psr (host policy)"] = {"ratio": ratio, "lo": ratio - 0.01,
                                                                             "hi": ratio + 0.01, "over": "6 windows"}
        report["ratios"][f"{prefix}C32: exact_lru / psr (host policy)"] = {"ratio": 2.0, "lo": 1.9, "hi": 2.1}
        for policy, ms in (("cache_prior", 5.0 * ratio), ("psr", 5.0)):
            report["table"][f"{prefix}C32_{policy}_host_policy"] = {"ms_mean": ms}
    (tmp_path / "bench_engine.json").write_text(json.dumps(report))
    measured = measured_points([tmp_path / "bench_engine.json"])
    assert len(measured) == 1  # the family's trace is no point of the map
    row = measured.iloc[0]
    assert tuple(row[["persistence", "pregate_noise", "skew", "margin", "C"]]) == (0.85, 0.3, 0.6, 0.5, 32)
    assert (row.measured_ratio, row.cache_prior_ms, row.psr_ms) == (1.25, 6.25, 5.0)
    at = {(r.persistence, r.pregate_noise): _measured_at(measured, r, 32) for _, r in table.iterrows()}
    assert at == {(0.3, 0.3): [], (0.3, 1.0): [], (0.85, 0.3): [1.25], (0.85, 1.0): []}
    out = tmp_path / "out"
    main(["--out", str(out), "--table", str(tmp_path / "crossover.csv"), "--capacities", "32",
          "--measured", str(tmp_path / "bench_engine.json")])
    assert (out / "crossover_C32.png").stat().st_size > 0 and not (out / "crossover.csv").exists()
    assert len(pd.read_csv(out / "crossover_measured.csv")) == 1


def test_bad_measured_or_table_files_exit_in_one_line(tmp_path, capsys):
    """--measured with a missing file or a json that is not bench_engine's, and --table without a file, exit with
    status 2 and the file's name, before any replay."""
    from crossover_map import main

    (tmp_path / "other.json").write_text('{"rounds_ms": {}}')
    for extra, message in ((["--measured", str(tmp_path / "none.json")], "none.json: not a readable"),
                           (["--measured", str(tmp_path / "other.json")], "other.json: not a bench_engine.json"),
                           (["--table", str(tmp_path / "none.csv")], "none.csv: no such file")):
        with pytest.raises(SystemExit) as exit_:
            main(["--out", str(tmp_path / "out")] + extra)
        assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
