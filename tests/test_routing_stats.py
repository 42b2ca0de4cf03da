"""Routing statistics (`specmoe.routing.statistics`, `specmoe stats`) on a hand-built trace: every statistic
against a value worked out by hand below (or, for the entropy, by scipy)."""

import dataclasses
import json
import math

import numpy as np
import pytest

from specmoe.records import Trace
from specmoe.routing import Calibration
from specmoe.routing.statistics import routing_stats, stats_tables

L, E, K, V = 2, 4, 2, 10
# router logits [T=4, L, E]; sequences: tokens 0..2 and token 3
Z = np.array([
    [[3, 2, 0, 0], [0, 0, 2, 2]],  # t0: layer 0 top {0, 1}, margin 2; layer 1 {2, 3}, margin 2
    [[0, 3, 2, 0], [2, 2, 0, 0]],  # t1: {1, 2}, 2; {0, 1}, 2
    [[0, 0, 3, 1], [2, 0, 2, 0]],  # t2: {2, 3}, 1; {0, 2}, 2
    [[1, 0, 0, 4], [0, 1, 1, 0]],  # t3: {0, 3}, 1; {1, 2}, 1
], dtype=np.float32)
G = np.zeros_like(Z)  # pre-gate row 0 is ignored
G[:, 1] = [[0, 0, 2, 1], [2, 0, 1, 0], [0, 1, 2, 0], [0, 0, 0, 0]]  # top {2, 3}, {0, 2}, {1, 2}, {0, 1} (tie)


@pytest.fixture(scope="module")
def trace():
    return Trace(Z, G, np.array([1, 2, 3, 4]), np.array([0, 3]), K, V, model="hand-built")


@pytest.fixture(scope="module")
def calibration():
    # warm ranking by expert index (warm set at C = 2: {0, 1}), Delta = 2 and 4
    return dataclasses.replace(Calibration.uniform(L, E, V), delta=np.array([2.0, 4.0]))


@pytest.fixture(scope="module")
def stats(trace, calibration):
    return routing_stats(trace, calibration, capacities=(2, 4), windows=(2, 3), bonuses=(0.3, 0.6),
                         policy_capacities=())


def test_entropy_margin_reuse_recall_windows_and_load_by_hand(stats):
    from scipy.special import softmax
    from scipy.stats import entropy

    layer = stats["per_layer"]
    expected = [np.mean([entropy(softmax(Z[t, l].astype(np.float64))) for t in range(4)]) for l in range(L)]
    np.testing.assert_allclose(layer["router_entropy"], expected, rtol=1e-12)
    np.testing.assert_allclose(layer["router_entropy_normalised"], np.array(expected) / math.log(E), rtol=1e-12)
    # margins / Delta: layer 0 [2, 2, 1, 1] / 2, layer 1 [2, 2, 2, 1] / 4
    assert layer["margin_over_delta_mean"] == pytest.approx([0.75, 0.4375])
    assert layer["margin_over_delta_median"] == pytest.approx([0.75, 0.5])
    assert layer["margin_below_0.3"] == pytest.approx([0.0, 0.25])
    assert layer["margin_below_0.6"] == pytest.approx([0.5, 1.0])
    # own top-K members whose lead over the best outsider is below lambda * Delta:
    # lambda 0.6: layer 0 (Delta 2, 1.2): t0 leads 3, 2 -> 0; t1 3, 2 -> 0; t2 3, 1 -> 1; t3 1, 4 -> 1: mean 0.5
    #             layer 1 (Delta 4, 2.4): t0 2, 2 -> 2; t1 2, 2 -> 2; t2 2, 2 -> 2; t3 1, 1 -> 2: mean 2
    # lambda 0.3: layer 0 (0.6): none; layer 1 (1.2): t3's two (lead 1) -> mean 0.5
    assert layer["flippable_0.6"] == pytest.approx([0.5, 2.0])
    assert layer["flippable_0.3"] == pytest.approx([0.0, 0.5])
    # reuse: pairs (t1, t0), (t2, t1) (t3 starts a sequence): layer 0 1/2, 1/2; layer 1 0, 1/2
    assert layer["reuse_consecutive"] == pytest.approx([0.5, 0.25])
    # pre-gate recall, layer 1: 2/2, 1/2, 1/2, 1/2
    assert layer["pregate_recall"][0] is None and layer["pregate_recall"][1] == pytest.approx(0.625)
    # windows within sequences: w 2 -> [t0, t1] only: {0,1,2} and {0,1,2,3}; w 3 -> [t0..t2]: 4 and 4
    assert layer["distinct_w2"] == [3.0, 4.0] and layer["distinct_w3"] == [4.0, 4.0]
    # load: layer 0 every expert 2 of 4 tokens; layer 1 [2, 2, 3, 1] / 4
    assert layer["load_max_over_mean"] == pytest.approx([1.0, 1.5])
    share = np.array([2, 2, 3, 1]) / 8
    assert layer["load_entropy_normalised"] == pytest.approx([1.0, -(share * np.log(share)).sum() / math.log(4)])
    assert stats["mean"]["reuse_consecutive"] == pytest.approx(0.375)
    assert stats["random_routing"]["distinct_w2"] == pytest.approx(4 * (1 - 0.5 ** 2))


def test_lru_miss_rate_by_hand(stats):
    # C = 2, warm {0, 1}. Layer 0: t0 {0,1} hits; t1 {1,2} misses 2 (evicts 0); t2 {2,3} misses 3 (evicts 1);
    # reset; t3 {0,3} misses 3: 3 misses. Layer 1: t0 {2,3} 2 misses; t1 {0,1} 2; t2 {0,2} misses 2 (evicts 1);
    # reset; t3 {1,2} misses 2: 6 misses. Rates over T K = 8 selections; C = E = 4: every expert resident.
    assert stats["lru_miss_rate"] == {2: [3 / 8, 6 / 8], 4: [0.0, 0.0]}
    assert stats["lru_copies_per_token"] == {2: 9 / 4, 4: 0.0}


def test_tables_and_in_sample_calibration(trace, stats):
    layers, miss, policies = stats_tables(stats)
    assert layers.loc["mean", "reuse_consecutive"] == pytest.approx(0.375)
    assert miss.loc["copies per token", "C=2"] == pytest.approx(2.25) and policies.empty
    own = routing_stats(trace, capacities=(), windows=(), bonuses=(), policy_capacities=(2,))
    assert own["calibration"] == "in-sample (from the trace)"
    # in-sample Delta: mean of max - min per layer: layer 0 (3 + 3 + 3 + 4) / 4, layer 1 (2 + 2 + 2 + 1) / 4
    assert own["per_layer"]["delta"] == pytest.approx([3.25, 1.75])
    assert set(own["policies"]) == {"exact_lru@C=2", "cache_prior@C=2", "psr@C=2", "spec_exec@C=2"}
    # in-sample warm sets: layer 0 {0, 1} (3 misses as above); layer 1 by load [2, 2, 3, 1]: {2, 0}: t0 {2,3}
    # misses 3, t1 {0,1} misses 0 and 1, t2 {0,2} misses 2, reset, t3 {1,2} misses 1: 5 misses
    assert own["policies"]["exact_lru@C=2"]["copies"] == pytest.approx(8 / 4)


def test_stats_command_on_a_trace_file(trace, calibration, tmp_path, capsys):
    from specmoe.cli import main

    trace.save(tmp_path / "t.safetensors")
    calibration.save(tmp_path / "c.safetensors")
    out = tmp_path / "s.json"
    assert main(["stats", "--trace", str(tmp_path / "t.safetensors"), "--calibration", str(tmp_path / "c.safetensors"),
                 "--capacities", "2,4", "--policy-capacities", "2", "--windows", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "LRU miss rate" in printed and "reuse_consecutive" in printed
    written = json.loads(out.read_text())
    assert written["lru_miss_rate"] == {"2": [0.375, 0.75], "4": [0.0, 0.0]}
    assert written["per_layer"]["reuse_consecutive"] == [0.5, 0.25] and written["calibration"] == "given"
    assert "floor_ms" not in written["policies"]["exact_lru@C=2"]

    # --floor: each policy's schedule floor; a policy without prefetches waits for every demand copy
    assert main(["stats", "--trace", str(tmp_path / "t.safetensors"), "--calibration", str(tmp_path / "c.safetensors"),
                 "--capacities", "2", "--policy-capacities", "2", "--windows", "2", "--floor", "1.0,0.5",
                 "--out", str(out)]) == 0
    assert "floor_ms: the schedule floor at 1 ms all resident, 0.5 ms per copy" in capsys.readouterr().out
    written = json.loads(out.read_text())
    lru, psr = written["policies"]["exact_lru@C=2"], written["policies"]["psr@C=2"]
    assert lru["floor_ms"] == pytest.approx(1.0 + 0.5 * lru["demand"])
    assert 1.0 + 0.5 * psr["demand"] - 1e-9 <= psr["floor_ms"] <= 1.0 + 0.5 * psr["copies"] + 1e-9
    assert written["floor"] == {"all_resident_ms": 1.0, "copy_ms": 0.5}
    for bad in ("1.0", "1,-2", "a,b"):
        assert main(["stats", "--trace", str(tmp_path / "t.safetensors"), "--floor", bad]) == 2
        assert "ALL_RESIDENT_MS,COPY_MS" in capsys.readouterr().err


def test_stats_command_records_a_trace_of_a_model(tmp_path):
    from specmoe.cli import main
    from specmoe.models import load_model

    checkpoint = tmp_path / "ckpt"
    load_model("olmoe-micro")[0].save_pretrained(checkpoint)
    ids = tmp_path / "ids.npy"
    np.save(ids, np.arange(2, 50))
    out = tmp_path / "s.json"
    assert main(["stats", "--model", str(checkpoint), "--tokens", str(ids), "--window", "24", "--out", str(out)]) == 0
    written = json.loads(out.read_text())
    assert (written["tokens"], written["sequences"]) == (48, 2)
    assert written["calibration"] == "in-sample (from the trace)" and written["lru_miss_rate"]
