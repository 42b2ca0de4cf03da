"""Synthetic routing sources (specmoe.records.synthetic): determinism, parameters that move the statistics they
name, the resolver where a trace is read, and the fitted "olmoe-like" source against OLMoE's copy counts."""

import numpy as np
import pytest

from specmoe.records import Trace
from specmoe.records.synthetic import (OLMOE_COPIES, SOURCES, SourceParams, input_sha256, is_source, paper_copies,
                                       read_calibration, read_trace, synthetic_calibration, synthetic_trace)
from specmoe.records.traces import TraceError
from specmoe.routing.statistics import routing_stats

SMALL = SourceParams(num_layers=4, num_experts=32, top_k=4, vocab_size=256, sequence_length=256,
                     persistence=0.8, margin=0.5, pregate_noise=0.5, skew=0.5)


def test_a_draw_is_a_trace_deterministic_by_seed():
    a, b = synthetic_trace(SMALL, 600, seed=3), synthetic_trace(SMALL, 600, seed=3)
    assert isinstance(a, Trace) and a.router_logits.shape == (600, 4, 32) and a.top_k == 4
    for name in ("router_logits", "pregate_logits", "token_ids", "sequence_starts"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert list(a.sequence_starts) == [0, 256, 512]
    assert not np.array_equal(a.router_logits, synthetic_trace(SMALL, 600, seed=4).router_logits)
    longer = synthetic_trace(SMALL, 900, seed=3)  # more tokens extend a draw
    np.testing.assert_array_equal(longer.router_logits[:600], a.router_logits)
    cal, again = synthetic_calibration(SMALL, 512), synthetic_calibration(SMALL, 512)
    np.testing.assert_array_equal(cal.warm_ranking, again.warm_ranking)
    np.testing.assert_array_equal(cal.token_prior.values, again.token_prior.values)
    cal.check(a.num_layers, a.num_experts, a.vocab_size, fingerprint=a.fingerprint)


def test_the_calibration_is_a_held_out_draw():
    trace = synthetic_trace(SMALL, 512, seed=0)
    calibration = synthetic_calibration(SMALL, 512, seed=0)  # same seed, another split: other tokens
    from specmoe.routing import CalibrationBuilder

    builder = CalibrationBuilder(4, 32, 256, 4)
    builder.add(trace.router_logits, trace.token_ids)
    assert not np.array_equal(builder.finish().token_prior.values, calibration.token_prior.values)
    assert calibration.token_prior.values.size > 0  # the token affinities give the prior something to find


def _stats(**changes):
    trace = synthetic_trace(SMALL.replace(**changes), 1024, seed=1)
    return routing_stats(trace, synthetic_calibration(SMALL.replace(**changes), 1024), capacities=(16,),
                         policy_capacities=())


@pytest.mark.parametrize("field, low, high, statistic, direction", [
    ("persistence", 0.5, 0.95, "reuse_consecutive", +1),
    ("pregate_noise", 1.5, 0.2, "pregate_recall", +1),
    ("skew", 0.0, 1.5, "load_max_over_mean", +1),
    ("margin", 0.0, 1.5, "margin_over_delta_mean", +1),
    ("margin", 0.0, 1.5, "margin_below_0.2", -1),
    ("scale", 0.5, 3.0, "router_entropy", -1),
])
def test_each_parameter_moves_the_statistic_it_names(field, low, high, statistic, direction):
    lo, hi = _stats(**{field: low}), _stats(**{field: high})
    assert direction * (hi["mean"][statistic] - lo["mean"][statistic]) > 0, (statistic, lo["mean"], hi["mean"])


def test_reuse_lowers_lru_misses_and_scale_leaves_copies_alone():
    lo, hi = _stats(persistence=0.5), _stats(persistence=0.95)
    assert hi["lru_copies_per_token"][16] < lo["lru_copies_per_token"][16]
    a, b = _stats(scale=0.5), _stats(scale=3.0)  # ranks and a bonus in units of Delta: decisions do not move
    assert a["lru_copies_per_token"] == b["lru_copies_per_token"]


def test_the_resolver_reads_files_and_source_specs(tmp_path):
    trace = read_trace("olmoe-like:tokens=300,seed=2")
    np.testing.assert_array_equal(trace.router_logits, synthetic_trace("olmoe-like", 300, seed=2).router_logits)
    path = tmp_path / "t.safetensors"
    trace.save(path)
    assert not is_source(str(path)) and is_source("olmoe-like") and not is_source("olmoe-unlike")
    np.testing.assert_array_equal(read_trace(str(path)).router_logits, trace.router_logits)
    with pytest.raises(Exception, match="bad routing source spec"):
        read_trace("olmoe-like:tokens=many")


def test_a_spec_sets_a_point_of_the_map():
    """"NAME:key=value" overrides the named source's parameters: the trace and its calibration are those of the
    changed source (what the engines follow at a crossover map point), and a bad key, value or range is named."""
    spec = "olmoe-like:tokens=300,margin=0,skew=0.3"
    point = SOURCES["olmoe-like"].replace(margin=0.0, skew=0.3)
    trace = read_trace(spec)
    np.testing.assert_array_equal(trace.router_logits, synthetic_trace(point, 300).router_logits)
    assert not np.array_equal(trace.router_logits, synthetic_trace("olmoe-like", 300).router_logits)
    assert trace.model == "synthetic routing source olmoe-like:margin=0,skew=0.3"
    calibration = read_calibration(spec)
    np.testing.assert_array_equal(calibration.delta, read_calibration("olmoe-like:margin=0,skew=0.3").delta)
    assert not np.array_equal(calibration.warm_ranking, read_calibration("olmoe-like").warm_ranking)
    assert input_sha256(spec) != input_sha256("olmoe-like:tokens=300")
    for bad, named in (("olmoe-like:margin=x", "margin=x"), ("olmoe-like:colour=1", "colour=1"),
                       ("olmoe-like:skew=nan", "skew=nan"), ("olmoe-like:persistence=1.5", "persistence")):
        with pytest.raises(TraceError, match=named):
            read_trace(bad)


def test_a_spec_sets_the_geometry_of_another_model():
    """"NAME:num_experts=E,top_k=K,num_layers=L" draws the named source's statistics at another model's shapes
    (Qwen3.6's 256 experts, Moonlight's top-6), checked as a trace of that geometry is; the geometry is part of the
    source's name and identity; bad values are named."""
    trace = read_trace("olmoe-like:tokens=64,num_experts=256", num_experts=256, top_k=8)
    assert trace.router_logits.shape == (64, 16, 256) and trace.top_k == 8
    assert trace.model == "synthetic routing source olmoe-like:num_experts=256"
    point = SOURCES["olmoe-like"].replace(top_k=6, num_layers=4)
    six = read_trace("olmoe-like:tokens=64,top_k=6,num_layers=4", num_experts=64, top_k=6)
    np.testing.assert_array_equal(six.router_logits, synthetic_trace(point, 64).router_logits)
    assert six.top_k == 6 and six.num_layers == 4
    assert input_sha256("olmoe-like:tokens=64,top_k=6") != input_sha256("olmoe-like:tokens=64")
    with pytest.raises(TraceError, match="num_experts 64"):  # the default geometry checked against a model's
        read_trace("olmoe-like:tokens=64", num_experts=256, top_k=8)
    for bad, named in (("olmoe-like:num_experts=2.5", "num_experts=2.5"), ("olmoe-like:top_k=0", "top_k must be"),
                       ("olmoe-like:num_experts=4", "top_k 8 exceeds num_experts 4")):
        with pytest.raises(TraceError, match=named):
            read_trace(bad)


def test_specmoe_replay_and_stats_accept_a_source(tmp_path, capsys):
    from specmoe.cli import main

    assert main(["replay", "--trace", "olmoe-like:tokens=256", "--calibration", "olmoe-like", "--policy", "psr",
                 "-C", "32", "--out", str(tmp_path / "replay")]) == 0
    assert "copies per token" in capsys.readouterr().out
    assert main(["stats", "--trace", "olmoe-like:tokens=256", "--calibration", "olmoe-like", "--capacities", "32",
                 "--policy-capacities", "32", "--out", str(tmp_path / "stats.json")]) == 0
    assert "OLMoE-1B-7B" in capsys.readouterr().out


def test_olmoe_like_reproduces_the_papers_copy_counts():
    """The shipped fit on the CPU replay (held-out calibration): every copy count of OLMOE_COPIES within 15% (PSR's
    demand copies, which the fit does not reach, within a factor of 2)."""
    copies = paper_copies(synthetic_trace("olmoe-like", 8192, seed=1), read_calibration("olmoe-like"),
                          tuple(OLMOE_COPIES))
    for capacity, row in OLMOE_COPIES.items():
        for name, target in row.items():
            tolerance = 0.5 if name == "psr_demand" else 0.15
            assert abs(copies[capacity][name] / target - 1) <= tolerance, (capacity, name, copies[capacity][name], target)
    assert SOURCES["olmoe-like"].num_experts == 64 and SOURCES["olmoe-like"].top_k == 8
