"""The crossover map's core (scripts/crossover_map.py) on a tiny grid: it runs, and its copies move as the
source's parameters say they should."""

import sys
from pathlib import Path

import numpy as np
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


def test_schedule_floors_price_each_policys_copies(table):
    """Each AR policy's floor: the all-resident token plus at least its demand copies (never hidden) and at most all
    of its copies; Cache-Prior's copies are all demand copies, so its floor is exactly that; the floor's winner
    and ratio are read off those columns."""
    from crossover_map import AR_POLICIES, FLOOR

    for name in AR_POLICIES:
        floor, copies, demand = table[f"{name}_floor_ms"], table[name], table[f"{name}_demand"]
        assert (floor >= FLOOR["all_resident_ms"] + demand * FLOOR["copy_ms"] - 1e-9).all(), name
        assert (floor <= FLOOR["all_resident_ms"] + copies * FLOOR["copy_ms"] + 1e-9).all(), name
    np.testing.assert_allclose(table.cache_prior_floor_ms, FLOOR["all_resident_ms"] + table.cache_prior_demand
                               * FLOOR["copy_ms"])
    assert (table.psr_floor_ms < FLOOR["all_resident_ms"] + table.psr * FLOOR["copy_ms"] - 1e-6).all()  # hidden
    floors = table[[f"{name}_floor_ms" for name in AR_POLICIES]]
    assert (table.win_floor == floors.idxmin(axis=1).str.removesuffix("_floor_ms")).all()
    np.testing.assert_allclose(table.cache_prior_over_psr_floor, table.cache_prior_floor_ms / table.psr_floor_ms)


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
    at = {(r.persistence, r.pregate_noise): list(_measured_at(measured, r, 32).measured_ratio)
          for _, r in table.iterrows()}
    assert at == {(0.3, 0.3): [], (0.3, 1.0): [], (0.85, 0.3): [1.25], (0.85, 1.0): []}
    out = tmp_path / "out"
    main(["--out", str(out), "--table", str(tmp_path / "crossover.csv"), "--capacities", "32",
          "--measured", str(tmp_path / "bench_engine.json")])
    assert (out / "crossover_C32.png").stat().st_size > 0 and not (out / "crossover.csv").exists()
    assert len(pd.read_csv(out / "crossover_measured.csv")) == 1


def spec_report(draft_ms: float = 1.684) -> dict:
    """A bench_spec_engine.json of two synthetic sources whose labels nest (skew 1 and skew 1, margin 0) and the
    family's trace: AR at C = P = 32 and acceptmoe SD, 4 requests of 2 rounds."""
    traces = {"olmoe_like_skew_1": {"trace": "olmoe-like:tokens=8192,skew=1", "prefix": "olmoe_like_skew_1_"},
              "olmoe_like_skew_1_margin_0": {"trace": "olmoe-like:tokens=8192,skew=1,margin=0",
                                             "prefix": "olmoe_like_skew_1_margin_0_"},
              "family_trace": {"trace": "/runs/family_trace.safetensors", "prefix": "family_trace_"}}
    table, details = [], {}
    tokens = [10, 12, 8, 10]
    points = (("olmoe_like_skew_1_", 2.4, 0.9, False), ("olmoe_like_skew_1_margin_0_", 2.0, 1.5, True),
              ("family_trace_", 2.2, 1.0, True))
    for prefix, cp, sd, clear in points:  # Cache-Prior's ms per token, SD / Cache-Prior, interval excludes 1
        source = prefix + "synthetic_tau5_k8"
        ms = {"cache_prior": cp, "psr": 3.0, "exact_prefetch": 4.5}
        row = {"source": source, "selector": "acceptmoe", "k": 8, "tau": 4.47, "prefetch": 0,
               "ms_per_token": 2.0, "ms_per_token_with_drafting": 2.0 + draft_ms / 4.47}
        for policy, value in ms.items():
            row[f"ar_{policy}_C32_ms_per_token"] = value
            # per request: the policy's ms per token times the request's tokens, +-5% apart by request
            details[f"{source}/ar_{policy}_C32"] = {"request_tokens": tokens, "request_ms": [
                [value * n * (1 + 0.05 * (-1) ** i) for i, n in enumerate(tokens)]] * 2}
        spread = (0.6, 1.6) if not clear else (sd - 0.02, sd + 0.02)
        row["ratio_sd_drafting_over_ar_cache_prior_C32_over_requests"] = {"ratio": sd, "low": spread[0],
                                                                         "high": spread[1]}
        table.append(row)
        table.append({**row, "selector": "exact"})
    return {"args": {"pool": 32, "draft_ms": draft_ms}, "traces": traces, "table": table, "details": details,
            "ar_configs": ["cache_prior_C32", "psr_C32", "exact_prefetch_C32"]}


def test_speculative_runs_and_earlier_csvs_are_measured_points(tmp_path):
    """--measured takes bench_spec_engine.json (AR at C = P and acceptmoe SD with its drafting, each row on its own
    source's point even where source labels nest; the family's trace left out) and an earlier
    crossover_measured.csv; the fastest measured method is the winner, marked unclear where the interval against
    the next holds 1."""
    import json

    from crossover_map import measured_points

    (tmp_path / "spec.json").write_text(json.dumps(spec_report()))
    measured = measured_points([tmp_path / "spec.json"])
    assert len(measured) == 2 and set(measured["skew"]) == {1.0} and sorted(measured.margin) == [0.0, 0.5]
    by_margin = measured.set_index("margin")
    low, high = by_margin.loc[0.5], by_margin.loc[0.0]
    assert (low.cache_prior_ms, low.psr_ms, low.exact_prefetch_ms) == (2.4, 3.0, 4.5)
    assert low.sd_block_ms == pytest.approx(2.0 + 1.684 / 4.47) and low.C == 32
    assert low.measured_ratio == pytest.approx(0.8) and low.lo < 0.8 < low.hi and low.over == "4 requests"
    # skew 1, margin 0.5: SD (2.38 ms) ahead of Cache-Prior (2.4) inside an interval holding 1; margin 0:
    # Cache-Prior (2.0) ahead of SD (2.38), SD / AR 1.5 (1.48-1.52)
    assert (low.winner, bool(low.clear)) == ("sd_block", False) and low.sd_over_ar == 0.9
    assert (high.winner, bool(high.clear)) == ("cache_prior", True) and high.sd_lo == pytest.approx(1.48)
    measured.to_csv(tmp_path / "earlier.csv", index=False)
    again = measured_points([tmp_path / "earlier.csv", tmp_path / "spec.json"])
    assert len(again) == 4 and list(again.winner) == list(measured.winner) * 2
    pd.testing.assert_frame_equal(again.iloc[:2].drop(columns="file"), again.iloc[2:].reset_index(drop=True).drop(
        columns="file"), check_dtype=False)


def test_a_speculative_run_of_one_trace_is_a_measured_point(tmp_path):
    """bench_spec_engine.json of one --trace: sources without a prefix, the spec in its args, one point."""
    import json

    from crossover_map import measured_points

    report = spec_report()
    report["table"] = [{**row, "source": row["source"].removeprefix("olmoe_like_skew_1_")} for row in report["table"]
                       if row["source"].startswith("olmoe_like_skew_1_synthetic")]
    report["details"] = {k.removeprefix("olmoe_like_skew_1_"): v for k, v in report["details"].items()
                         if k.startswith("olmoe_like_skew_1_synthetic")}
    del report["traces"]
    report["args"]["trace"] = ["olmoe-like:tokens=8192,skew=1"]
    report["trace"] = {"model": "synthetic routing source olmoe-like:skew=1", "tiled_from_layers": None}
    (tmp_path / "one.json").write_text(json.dumps(report))
    measured = measured_points([tmp_path / "one.json"])
    assert len(measured) == 1 and measured.iloc[0]["skew"] == 1.0 and measured.iloc[0].margin == 0.5
    assert measured.iloc[0].cache_prior_ms == 2.4 and measured.iloc[0].sd_over_ar == 0.9


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


def test_a_csv_that_is_not_a_measured_points_file_exits_in_one_line(tmp_path, capsys):
    """--measured with a csv lacking the measured points' columns (e.g. the grid's crossover.csv) exits with status
    2 and the file's name, before any replay."""
    from crossover_map import main

    pd.DataFrame({"C": [32], "psr": [14.7]}).to_csv(tmp_path / "grid.csv", index=False)
    with pytest.raises(SystemExit) as exit_:
        main(["--out", str(tmp_path / "out"), "--measured", str(tmp_path / "grid.csv")])
    assert exit_.value.code == 2 and "grid.csv: not a crossover_measured.csv" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
