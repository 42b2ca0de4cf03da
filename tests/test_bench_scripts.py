"""The GPU benchmark scripts' bookkeeping on the CPU: bench_spec_engine's SD / AR ratios with a drafting time per
block and the per-request details its json keeps (without a model), and its rows per --trace (olmoe-tiny, the
timed passes stood in for)."""

import importlib.util
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from bench_spec_engine import markdown, request_ratio, saved_details, summary_table  # noqa: E402

from specmoe.stats import unit_ratio  # noqa: E402

SD, AR = "src/exact", "src/ar_psr_C8"


def measured(requests: int = 3, num_rounds: int = 2):
    """Sources, rounds and details as bench_spec_engine's main loop leaves them: one SD row and one
    AR configuration, `requests` requests, each round's per-request times; tau deliberately unlike committed /
    blocks, so that a drafting cost computed from tau differs from one computed from the measured blocks."""
    rng = np.random.default_rng(0)
    tokens = [10, 14, 8, 11][:requests]
    blocks = [3, 4, 2, 5][:requests]
    sources = {"src": (4, {"exact": (None, "closed-loop")}, None)}
    rounds, sd, ar = {SD: [], AR: []}, {"block_ms": [], "request_ms": []}, {"request_ms": []}
    for _ in range(num_rounds):
        block_ms = [rng.uniform(1.0, 2.0, b) for b in blocks]
        sd["block_ms"].append(np.concatenate(block_ms))
        sd["request_ms"].append([float(x.sum()) for x in block_ms])
        rounds[SD].append(sum(sd["request_ms"][-1]) / sum(tokens))
        ar_ms = [float(rng.uniform(0.3, 0.4) * t) for t in tokens]
        ar["request_ms"].append(ar_ms)
        rounds[AR].append(sum(ar_ms) / sum(tokens))
    sd.update(request_tokens=tokens, request_blocks=blocks, blocks=sum(blocks), committed=sum(tokens), tau=5.0,
              union_used=2, copies_per_token=1.0, demand_per_token=1.0, prefetch_per_token=0.0,
              prefetch_unused_per_token=0.0, moves_per_token=0.0, verify="host", host_blocks_why="test")
    ar.update(request_tokens=tokens, copies_per_token=2.0, routing="device_policy")
    return sources, rounds, {SD: sd, AR: ar}


def table(draft_ms: float, requests: int = 3):
    sources, rounds, details = measured(requests)
    args = SimpleNamespace(prefetch=[0], block_paths=["host"], draft_ms=draft_ms)
    return summary_table(sources, rounds, details, [("psr", 8)], args), rounds, details


def test_drafting_adds_its_time_per_measured_block_to_each_request():
    (row,), rounds, details = table(2.2)
    sd, ar = details[SD], details[AR]
    # ms per committed token with drafting: verification + 2.2 ms x measured blocks / committed tokens (not / tau)
    assert np.isclose(row["ms_per_token_with_drafting"], np.mean(rounds[SD]) + 2.2 * 9 / 32)
    assert row["draft_ms_per_block"] == 2.2
    # over requests: each request's SD time (mean over rounds) plus 2.2 ms per block, the same bootstrap
    expected = unit_ratio(np.mean(sd["request_ms"], axis=0) + 2.2 * np.array([3, 4, 2]), [10, 14, 8],
                          np.mean(ar["request_ms"], axis=0), [10, 14, 8])
    got = row["ratio_sd_drafting_over_ar_psr_C8_over_requests"]
    assert np.allclose([got["ratio"], got["low"], got["high"]], [expected.estimate, expected.low, expected.high])
    assert got["ratio"] > row["ratio_sd0_over_ar_psr_C8_over_requests"]["ratio"]
    # over rounds: each round's SD ms per token plus the drafting per token
    extra = 2.2 * 9 / 32
    assert np.isclose(row["ratio_sd_drafting_over_ar_psr_C8"]["ratio"],
                      np.exp(np.mean(np.log(np.add(rounds[SD], extra)) - np.log(rounds[AR]))))
    # zero drafting is the same function at 0: unchanged, and no drafting fields without --draft-ms
    (plain,), _, _ = table(0.0)
    assert plain["ratio_sd0_over_ar_psr_C8_over_requests"] == row["ratio_sd0_over_ar_psr_C8_over_requests"]
    zero = unit_ratio(np.mean(sd["request_ms"], axis=0), [10, 14, 8], np.mean(ar["request_ms"], axis=0), [10, 14, 8])
    assert np.isclose(plain["ratio_sd0_over_ar_psr_C8_over_requests"]["ratio"], zero.estimate)
    assert not any("drafting" in key for key in plain)
    # one request: no interval over requests, the rounds' ratio with drafting
    (single,), rounds1, _ = table(2.2, requests=1)
    assert single["ratio_sd_drafting_over_ar_psr_C8_over_requests"] is None
    assert np.isclose(single["ratio_sd_drafting_over_ar_psr_C8"]["ratio"],
                      np.exp(np.mean(np.log(np.add(rounds1[SD], 2.2 * 3 / 10)) - np.log(rounds1[AR]))))


def test_markdown_has_the_drafting_columns_only_with_draft_ms():
    for draft_ms in (0.0, 2.2):
        rows, _, _ = table(draft_ms)
        report = {"date": "today", "machine": {"gpu": "cpu", "torch": "x"}, "command": "bench", "rounds_done": 2,
                  "args": {"rounds": 2, "pool": 8, "ar_policies": ["psr"], "draft_ms": draft_ms}, "union_max": 2,
                  "capacities": [8], "copy": {"stream_ms": 0.1}, "table": rows, "ar_configs": ["psr_C8"], "errors": []}
        lines = markdown(report).splitlines()
        header = next(x for x in lines if x.startswith("| source | selector"))
        row = next(x for x in lines if x.startswith("| src |"))
        assert ("SD with drafting / fastest AR" in header) == bool(draft_ms)
        assert header.count("|") == row.count("|") == lines[lines.index(header) + 1].count("|")
        ar_header = lines.index("| source | AR config | path | ms/token | compute-only ms/token | copies/token |")
        assert lines[ar_header + 2].startswith("| src | psr_C8 | device_policy | ")  # where the AR policy ran
        if draft_ms:
            assert f"{rows[0]['ms_per_token_with_drafting']:.3f}" in row.split("|")[-3]
            assert "3 requests" in row.split("|")[-2]


def test_markdown_compares_sd_with_ar_at_the_peak_slot_memory():
    """The table of SD against each AR policy at C = P + U_max (the capacity summary_table records per source):
    the ratio cells are the rows' intervals for that configuration; without an AR row at that capacity, no table."""
    sources, rounds, details = measured()
    args = SimpleNamespace(prefetch=[0], block_paths=["host"], draft_ms=2.2)
    rows = summary_table(sources, rounds, details, [("psr", 8)], args, {"src": 8})
    assert rows[0]["equal_memory_c"] == 8
    report = {"date": "today", "machine": {"gpu": "cpu", "torch": "x"}, "command": "bench", "rounds_done": 2,
              "args": {"rounds": 2, "pool": 6, "ar_policies": ["psr"], "draft_ms": 2.2}, "union_max": 2,
              "capacities": [6, 8], "copy": {"stream_ms": 0.1}, "table": rows, "ar_configs": ["psr_C8"], "errors": []}
    lines = markdown(report).splitlines()
    at = next(i for i, x in enumerate(lines) if x.startswith("SD against each AR policy at the speculative"))
    header, row = lines[at + 2], lines[at + 4]
    assert header.count("|") == row.count("|") == lines[at + 3].count("|") == 8
    cells = [c.strip() for c in row.split("|")[1:-1]]
    low = rows[0]["ratio_sd_drafting_over_ar_psr_C8_over_requests"]["low"]
    assert cells[:4] == ["src", "exact", "4", "psr_C8"] and f"{low:.3f}" in cells[-1] and "3 requests" in cells[-1]
    rows = summary_table(sources, rounds, details, [("psr", 8)], args, {"src": 10})  # no AR row at C = 10
    assert not any(x.startswith("SD against each AR policy") for x in markdown({**report, "table": rows}).splitlines())


def test_saved_details_recompute_the_ratios():
    (row,), _, details = table(2.2)
    saved = json.loads(json.dumps(saved_details(details)))  # what the json keeps
    assert set(saved[SD]) == {"request_ms", "request_tokens", "request_blocks", "blocks", "committed", "tau"}
    assert set(saved[AR]) == {"request_ms", "request_tokens"}
    assert np.shape(saved[SD]["request_ms"]) == (2, 3)  # [round][request]
    for draft_ms, tag in ((0.0, "sd0"), (2.2, "sd_drafting")):
        again = request_ratio(saved[SD], saved[AR], draft_ms)
        assert np.isclose(again["ratio"], row[f"ratio_{tag}_over_ar_psr_C8_over_requests"]["ratio"])


def test_bench_engine_configs_are_checked_before_a_model_is_built(monkeypatch, tmp_path):
    """bench_engine's --configs: the names come from the arguments alone (`config_rows`, the named config's E and
    K), so a typo exits with the known names before any model is built, and a known name gets past the check to
    the model."""
    import bench_engine
    import pytest

    class Built(Exception):
        pass

    def build(*args, **kwargs):
        raise Built

    monkeypatch.setattr(bench_engine, "random_model_on_device", build)
    base = ["--out", str(tmp_path / "out"), "--model", "olmoe-tiny", "--device", "cpu", "--capacities", "16",
            "--trace", "olmoe-like", "--trace-calibration", "olmoe-like"]
    with pytest.raises(SystemExit) as exit_:
        bench_engine.main(base + ["--configs", "C16_psr", "trace_C16_psrr"])
    message = str(exit_.value)
    assert message.startswith("unknown configurations ['trace_C16_psrr']; known: ")
    assert "'trace_C16_psr_host_policy'" in message and "'all_resident_host_routing'" in message
    assert not (tmp_path / "out").exists()  # nothing was set up
    with pytest.raises(Built):  # every known name passes the check
        bench_engine.main(base + ["--configs", "all_resident_host_routing", "C16_spec_exec", "trace_C16_psr_host_policy"])
    # the names the rounds run, in their order: per prefix, per capacity and policy, device path then host path
    args = SimpleNamespace(
        capacities=[32, 16], psr_window=8, policy_paths=["device", "host"], trace=["olmoe-like:margin=0", "b.npz"],
        trace_calibration=["olmoe-like", "b.json"])
    rows = bench_engine.config_rows(args, 64, 8)
    policies = ["exact_lru", "exact_prefetch", "cache_prior", "psr", "spec_exec"]
    assert list(rows) == ["", "olmoe_like_margin_0_", "b_"]
    assert [name for name, _, _ in rows[""]] == ["all_resident", "all_resident_host_routing"] + [
        f"C{c}_{p}{path}" for c in (32, 16) for p in policies for path in ("", "_host_policy")]
    assert [(name, key) for name, key, _ in rows["b_"]] == [
        (f"b_C{c}_{p}{path}", f"{c}{path}" if path else c) for c in (32, 16) for p in policies
        for path in ("", "_host_policy")]
    assert rows["b_"][7][2].name == rows[""][9][2].name  # the same policy, C32 psr on the host path
    # the engines built: what the selected rows and the position sweep run, and all resident always
    args.configs, args.positions = ["b_C16_psr_host_policy"], []
    assert bench_engine.needed_engines(rows, args, 64) == {64, "16_host_policy"}
    args.configs = ["C32_psr", "all_resident_host_routing"]
    assert bench_engine.needed_engines(rows, args, 64) == {64, 32, "host"}
    args.positions = [100, 500]  # the sweep: all resident on both routings and PSR at every capacity
    assert bench_engine.needed_engines(rows, args, 64) == {64, 32, 16, "host"}
    args.configs, args.positions = None, []
    assert bench_engine.needed_engines(rows, args, 64) == {64, "host", 32, 16, "32_host_policy", "16_host_policy"}
    args.trace_calibration = ["olmoe-like"]
    with pytest.raises(SystemExit, match="one per --trace"):
        bench_engine.config_rows(args, 64, 8)
    args.trace_calibration, args.trace = ["a", "b"], ["a.npz", "x/a.npz"]
    with pytest.raises(SystemExit, match="two traces are labelled 'a'"):
        bench_engine.config_rows(args, 64, 8)


def test_help_and_docs_state_the_drafting_option_and_the_early_config_check(capsys):
    import bench_engine
    import bench_spec_engine
    import pytest

    for script in (bench_spec_engine, bench_engine):
        with pytest.raises(SystemExit) as exit_:
            script.main(["--help"])
        assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--draft-ms DRAFT_MS drafting ms per verification block" in text
    assert "With --draft-ms MS" in text  # bench_spec_engine's docstring
    assert "before any model is built" in text  # bench_engine's docstring and --configs
    docs = Path(__file__).resolve().parents[1] / "docs"
    assert "`--draft-ms MS`" in (docs / "speculative.md").read_text()


def test_spec_engine_follows_several_traces_each_with_its_own_calibration(monkeypatch, tmp_path):
    """bench_spec_engine with two --trace: every source name carries its trace's label (bench_engine's
    `trace_label`), each trace's SD and AR engines have its own calibration and follow its own blocks and committed
    tokens, U_max and the AR capacities are per trace; with one trace the names are unprefixed. The passes are
    stand-ins that record what they were given (no timing)."""
    import bench_spec_engine
    import pytest

    from specmoe.records.synthetic import synthetic_calibration, synthetic_trace

    files = {}
    for i, label in enumerate(("family_trace", "olmoe_like")):
        trace = synthetic_trace("olmoe-like", 1024, seed=i)
        calibration = synthetic_calibration("olmoe-like", tokens=1024, seed=10 + i, name=label)
        files[label] = (str(trace.save(tmp_path / f"{label}.safetensors")),
                        str(calibration.save(tmp_path / f"{label}.json")),
                        {row.tobytes() for row in trace.router_logits.astype(np.float32)})
    union_used = {"family_trace": 3, "olmoe_like": 5}
    calls = []

    def owner(engine):  # the trace whose calibration the engine has
        return engine.calibration.provenance["model"].removeprefix("synthetic routing source ")

    def spec_pass(engine, blocks, first_position):
        calls.append(("sd", owner(engine), blocks.router_logits[blocks.rows.ravel()]))
        return {"ms_per_token": 1.0, "block_ms": np.ones(2), "request_ms": [1.0, 1.0], "request_tokens": [3, 3],
                "request_blocks": [1, 1], "copies_per_token": 1.0, "moves_per_token": 0.0, "demand_per_token": 1.0,
                "prefetch_per_token": 0.0, "prefetch_unused_per_token": 0.0, "tau": 3.0, "blocks": 2, "committed": 6,
                "union_used": union_used[owner(engine)], "verify": "host", "host_blocks_why": "test"}

    def ar_pass(engine, feeds, first_position):
        calls.append(("ar", owner(engine), np.concatenate([f.router_logits for f in feeds])))
        return {"ms_per_token": 0.5, "copies_per_token": 2.0, "p99": 1.0, "request_ms": [0.5, 0.5],
                "request_tokens": [3, 3]}

    monkeypatch.setattr(bench_spec_engine, "spec_pass", spec_pass)
    monkeypatch.setattr(bench_spec_engine, "ar_pass", ar_pass)
    monkeypatch.setattr(bench_spec_engine, "target_pass", lambda *a: {"ms_per_token": 0.25, "routing": "device"})
    monkeypatch.setattr(bench_spec_engine, "measure_bandwidth", lambda *a: 1.0)
    monkeypatch.setattr(bench_spec_engine, "measure_copy_ms", lambda *a: {"stream_ms": 0.1})
    base = ["--model", "olmoe-tiny", "--device", "cpu", "--pool", "8", "--k", "4", "--taus", "3",
            "--selectors", "exact", "--ar-policies", "exact_lru", "--rounds", "1", "--max-blocks", "2",
            "--first-position", "8", "--max-seq-len", "64", "--block-paths", "host", "--prefetch", "0"]

    def run(labels):
        out = tmp_path / "_".join(labels)
        calls.clear()
        rc = bench_spec_engine.main(base + ["--out", str(out), "--trace", *(files[x][0] for x in labels),
                                            "--trace-calibration", *(files[x][1] for x in labels)])
        report = json.loads((out / "bench_spec_engine.json").read_text())
        # the source's tokens beyond the tiny target's vocabulary are a note, not an error that fails the run
        assert rc == 0 and not report["errors"] and any("modulo" in w for w in report["warnings"])
        return json.loads((out / "bench_spec_engine.json").read_text()), (out / "bench_spec_engine.md").read_text()

    report, md = run(["family_trace", "olmoe_like"])
    assert [row["source"] for row in report["table"]] == ["family_trace_synthetic_tau3_k4",
                                                          "olmoe_like_synthetic_tau3_k4"]
    assert report["union_max"] == union_used
    assert report["capacities"] == {"family_trace": [8, 11], "olmoe_like": [8, 13]}
    assert "U_max = 3 (family_trace); 5 (olmoe_like)" in md
    assert "AR at C = 8, 11 (family_trace); 8, 13 (olmoe_like)" in md
    assert sorted(key for key in report["rounds_ms"] if "/ar_" in key and not key.endswith("/skip")) == [
        "family_trace_synthetic_tau3_k4/ar_exact_lru_C11", "family_trace_synthetic_tau3_k4/ar_exact_lru_C8",
        "olmoe_like_synthetic_tau3_k4/ar_exact_lru_C13", "olmoe_like_synthetic_tau3_k4/ar_exact_lru_C8"]
    for row in report["table"]:  # each SD row against its own trace's AR rows
        mine = report["capacities"][row["source"].removesuffix("_synthetic_tau3_k4")]
        assert sorted(int(k.split("_C")[1].split("_")[0]) for k in row if k.endswith("_ms_per_token")
                      and k.startswith("ar_") and "compute" not in k) == mine
    assert {(kind, name) for kind, name, _ in calls} == {(kind, name) for kind in ("sd", "ar") for name in files}
    for kind, name, rows in calls:  # every pass follows the rows of the trace whose calibration its engine has
        assert all(row.tobytes() in files[name][2] for row in rows), (kind, name)
    assert set(report["traces"]) == set(files) and report["traces"]["olmoe_like"]["prefix"] == "olmoe_like_"

    timelines = []

    def timeline_pass(engine, blocks, first_position, draft_ms, results):
        assert len(results) >= 1 and all(r.info["verify"] == "host" for r in results)  # main's plain pass
        timelines.append((owner(engine), draft_ms))
        return {**dict.fromkeys(bench_spec_engine.TIMELINE_PARTS, 0.5), "per_token": {"step": 0.25}, "verify": "host"}

    monkeypatch.setattr(bench_spec_engine, "timeline_pass", timeline_pass)
    base += ["--timeline", "--draft-ms", "1.5"]
    report, md = run(["family_trace"])  # one trace: the names and the header as before
    assert [row["source"] for row in report["table"]] == ["synthetic_tau3_k4"]
    assert report["table"][0]["key"] == "synthetic_tau3_k4/exact"
    assert "synthetic_tau3_k4/ar_exact_lru_C11" in report["rounds_ms"]
    assert report["union_max"] == 3 and report["capacities"] == [8, 11] and "traces" not in report
    assert "U_max = 3 union slots used at most; AR at C = 8, 11 (exact_lru)" in md
    assert timelines == [("family_trace", 1.5)] and list(report["timeline"]) == ["synthetic_tau3_k4/exact"]
    # each round's target step: a block's compute (copies skipped: the stand-in's 1 ms blocks) in target steps
    assert report["rounds_ms"]["target_step"] == [0.25]
    assert report["table"][0]["block_compute_over_target_step"]["ratio"] == pytest.approx(4.0)
    assert "in target steps" in md and "| synthetic_tau3_k4/exact | 4 | 1.000 | 4.00 (" in md
    assert "Per-block timeline" in md and "| synthetic_tau3_k4/exact | host | 0.500 |" in md
    assert "| 0.500 | - | 0.250 |" in md  # no prefetch branch on the host path; step per committed token

    with pytest.raises(SystemExit, match="one per --trace"):  # before any model is built
        bench_spec_engine.main(base + ["--out", str(tmp_path / "bad"), "--trace", files["family_trace"][0],
                                       files["olmoe_like"][0], "--trace-calibration", files["family_trace"][1]])
    with pytest.raises(SystemExit, match="two traces are labelled 'olmoe_like'"):
        bench_spec_engine.main(base + ["--out", str(tmp_path / "bad"), "--trace", "olmoe-like",
                                       files["olmoe_like"][0], "--trace-calibration", "olmoe-like",
                                       files["olmoe_like"][1]])
    assert not (tmp_path / "bad").exists()


def test_policy_ratios_on_the_path_that_ran():
    """bench_engine's C < E ratios: each policy over PSR on the device path and on the host path (the engine's
    default, so often the only one run), and host over device where both ran; the values are `window_ratio`'s."""
    from bench_engine import policy_ratios, window_ratio

    rng = np.random.default_rng(1)

    def made(scale):
        windows = [list(rng.uniform(0.9, 1.1, 3) * scale * 64) for _ in range(2)]
        return {"rounds": [float(np.sum(w)) / 192 for w in windows], "windows": windows, "tokens": [64, 64, 64]}

    names = ["exact_lru", "cache_prior", "psr"]
    host_only = {f"trace_C32_{n}_host_policy": made(s) for n, s in zip(names, (3.0, 1.2, 1.0))}
    ratios = policy_ratios(host_only.get, ["", "trace_"], [32], names)
    assert set(ratios) == {"trace_C32: exact_lru / psr (host policy)", "trace_C32: cache_prior / psr (host policy)"}
    assert ratios["trace_C32: cache_prior / psr (host policy)"] == window_ratio(
        host_only["trace_C32_cache_prior_host_policy"], host_only["trace_C32_psr_host_policy"])
    both = {**host_only, "trace_C32_cache_prior": made(1.5), "trace_C32_psr": made(1.4)}
    ratios = policy_ratios(both.get, ["trace_"], [32], names)
    assert {"trace_C32: cache_prior / psr", "trace_C32: cache_prior host policy / device policy",
            "trace_C32: psr host policy / device policy"} <= set(ratios)
    assert ratios["trace_C32: cache_prior / psr"]["ratio"] != ratios["trace_C32: cache_prior / psr (host policy)"]["ratio"]


def test_bench_engine_times_windows_at_the_first_position(monkeypatch, tmp_path):
    """bench_engine --first-position: a window that does not fit the KV cache exits before any model is built;
    otherwise every timed window (warm-up, rounds, extra passes) sits at that position over a randomised cache."""
    import bench_engine
    import pytest

    from specmoe.models import olmoe_decode

    base = ["--out", str(tmp_path / "out"), "--model", "olmoe-tiny", "--device", "cpu", "--capacities", "16",
            "--configs", "C16_cache_prior_host_policy", "--policy-paths", "host", "--rounds", "1", "--windows", "1",
            "--prompt", "2", "--tokens", "3", "--max-seq-len", "64", "--positions", "--no-hf", "--calib-windows", "1",
            "--warmup-tokens", "2"]
    with pytest.raises(SystemExit, match="do not fit --max-seq-len 64"):
        bench_engine.main(base + ["--first-position", "60"])
    assert not (tmp_path / "out").exists()

    positions, randomized = [], []
    run_windows = bench_engine.run_windows

    feeds = []  # (capacity, skip_copies, followed a feed) of each pass

    def recording(engine, windows, trace=None, prompt=0, first_position=0):
        positions.append(first_position)
        feeds.append((engine.policy.capacity, engine.settings.skip_copies, trace is not None))
        return run_windows(engine, windows, trace, prompt, first_position)

    monkeypatch.setattr(bench_engine, "run_windows", recording)
    original = olmoe_decode.OlmoeDecoder.randomize_cache
    monkeypatch.setattr(olmoe_decode.OlmoeDecoder, "randomize_cache",
                        lambda self, seed: (randomized.append(seed), original(self, seed))[1])
    bench_engine.main(base + ["--first-position", "40"])
    report = json.loads((tmp_path / "out" / "bench_engine.json").read_text())
    assert report["rounds_done"] == 1 and not report["errors"], report["errors"]
    # only the engines the selected configuration needs (and all resident): no sweep, no other capacity or path
    assert set(report["engine_notes"]) == {str(max(skipped_c for skipped_c, _, _ in feeds)), "16_host_policy"}
    assert positions and set(positions) == {40}  # rounds, the instrumented and the copies-skipped passes
    assert randomized  # the context below the windows holds random keys and values
    # the compute-only pass follows the recorded routing where copies are skipped (C < E), and its own router with
    # every expert resident (a feed would route on the host there)
    skipped = {capacity: fed for capacity, skip, fed in feeds if skip}
    assert skipped == {16: True, max(skipped): False} and max(skipped) > 16, feeds


def test_bench_device_cache_builds_its_cases_and_times_the_host_step(tmp_path):
    """bench_device_cache without CUDA: each geometry's case fits its policy (C < E, logits [T, L, E]), the host step's
    time is measured, another version of the kernel module loads from a file, and main() refuses to run without a
    CUDA device in one line."""
    import bench_device_cache as bench
    import pytest

    for geometry, (layers, experts, top_k, capacity, _) in bench.GEOMETRIES.items():
        policy, scoring, calibration, z, g, tokens = bench.case(geometry, "psr", 2, 0.3)
        assert (policy.capacity, policy.top_k) == (capacity, top_k) and z.shape == g.shape == (2, layers, experts)
        assert calibration.warm_ranking.shape == (layers, experts) and len(tokens) == 2
    policy, scoring, calibration, z, g, tokens = bench.case("olmoe-1b-7b", "cache_prior", 2, 0.1)
    assert bench.host_step_us(policy, scoring, calibration, z, g, tokens, repeats=1) > 0
    import specmoe.kernels.device_cache as current

    other = bench.load_module(current.__file__)
    assert other is not current and hasattr(other, "DeviceCache")
    # the table's warps columns: the default's own row is "current", others their own, untimed NaN
    row = {"current_warps": 4, "current_both_us": 29.0, "w1_both_us": 45.7}
    assert (bench.warps_both_us(row, "w4"), bench.warps_both_us(row, "w1")) == (29.0, 45.7)
    assert bench.np.isnan(bench.warps_both_us(row, "w8"))
    if not bench.torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA device and Triton"):
            bench.main(["--out", str(tmp_path / "x.json")])


def test_bench_expert_copy_grid_and_refusal_without_cuda(tmp_path):
    """bench_expert_copy: the copy engine first, then every kernel launch shape once, the kernel's default shape
    always among them; rates in GB/s; without CUDA it stops in one line."""
    import bench_expert_copy as bench
    import pytest

    from specmoe.kernels.expert_copy import COPY_BLOCK, COPY_BLOCKS

    grid = bench.configs([4, 8], [1024, 4096, 1024])
    assert grid[0] == ("engine", 0, 0) and len(grid) == len(set(grid)) == 1 + 4 + int(
        (COPY_BLOCKS, COPY_BLOCK) not in {(4, 1024), (8, 1024), (4, 4096), (8, 4096)})
    assert ("kernel", COPY_BLOCKS, COPY_BLOCK) in bench.configs([64], [8192])
    assert bench.gb_per_s(12_582_912, 0.231) == pytest.approx(54.47, abs=0.01)
    if not bench.torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs one"):
            bench.main(["--out", str(tmp_path / "x.json")])


def test_bench_attention_takes_a_named_configs_shapes(tmp_path, capsys):
    """bench_attention --model: the attention shapes of a named config (OLMoE's heads, Qwen3.6's gated attention with
    two KV heads of 256), multi-head latent attention refused by name; without CUDA it stops in one line."""
    import bench_attention as bench
    import pytest

    assert bench.attention_shape("olmoe-1b-7b") == (16, 16, 128)
    assert bench.attention_shape("qwen3.6-35b-a3b") == (16, 2, 256)
    with pytest.raises(ValueError, match="multi-head latent attention"):
        bench.attention_shape("moonlight-16b-a3b")
    with pytest.raises(ValueError, match="unknown named config 'nope'"):
        bench.attention_shape("nope")
    if not bench.torch.cuda.is_available():
        assert bench.main(["--out", str(tmp_path / "a.json"), "--model", "qwen3.6-35b-a3b"]) == 2
        assert "needs a CUDA device" in capsys.readouterr().err


def test_new_bench_scripts_refuse_bad_arguments_in_one_line(tmp_path, capsys):
    """bench_expert_copy and bench_device_cache: a size the run cannot take exits with status 2 and a line naming
    the option, before any device work."""
    import bench_device_cache
    import bench_expert_copy
    import pytest

    out = ["--out", str(tmp_path / "x.json")]
    for main, extra, option in ((bench_expert_copy.main, ["--words", "1000"], "--words must be powers of two"),
                                (bench_expert_copy.main, ["--programs", "0"], "--programs must be at least 1"),
                                (bench_expert_copy.main, ["--expert-mb", "0"], "--expert-mb must be positive"),
                                (bench_device_cache.main, ["--tokens", "0"], "--tokens and --rounds"),
                                (bench_device_cache.main, ["--prior-density", "2"], "--prior-density must lie"),
                                (bench_device_cache.main, ["--policies", "psrr"], "invalid choice: 'psrr'"),
                                (bench_device_cache.main, ["--warps", "3"], "invalid choice: 3")):
        with pytest.raises(SystemExit) as exit_:
            main(out + extra)
        assert exit_.value.code == 2 and option in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_profile_device_policy_refuses_bad_arguments(tmp_path):
    import subprocess

    script = Path(__file__).resolve().parents[1] / "scripts" / "profile_device_policy.py"
    env = {**os.environ, "PYTHONPATH": str(script.parents[1]), "OUT": str(tmp_path)}
    for extra, message in ((["--rounds", "0"], "--rounds must be at least 1"),
                           (["--module", str(tmp_path / "nope.py")], "nope.py: no such file")):
        done = subprocess.run([sys.executable, str(script), *extra], capture_output=True, text=True, env=env)
        assert done.returncode == 2 and message in done.stderr, done.stderr


def test_graph_launch_check_refuses_a_machine_without_cuda():
    """scripts/graph_launch_check.py refuses an unknown model by name and names what it needs on a machine without
    CUDA (and takes --help there)."""
    import subprocess

    import torch

    script = Path(__file__).resolve().parents[1] / "scripts" / "graph_launch_check.py"
    done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "profiled pass" in done.stdout, done.stderr
    done = subprocess.run([sys.executable, str(script), "no-such-model"], capture_output=True, text=True)
    assert done.returncode == 2 and "unknown named config 'no-such-model'" in done.stderr, done.stderr
    if not torch.cuda.is_available():
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
        assert done.returncode == 1 and "needs a CUDA device" in done.stderr, done.stderr


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_host_block_time_times_the_device_paths_host_work_without_a_gpu():
    """scripts/host_block_time.py (a subprocess: it sets TRITON_INTERPRET before Triton is imported) follows
    synthetic blocks on the device path with the launch stubbed out and prints the host's µs per block per pass,
    then the functions under cProfile; bad arguments are refused by name. Also at Qwen3.5-MoE's tiny geometry
    (16 experts, top-4: the synthetic blocks take the model's geometry; they had OLMoE's and were refused)."""
    import os
    import subprocess

    root = Path(__file__).resolve().parents[1]
    script = root / "scripts" / "host_block_time.py"
    env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for extra in ([], ["--model", "qwen3.5-moe-tiny", "--pool", "8"]):
        done = subprocess.run([sys.executable, str(script), "--k", "3", "--tau", "2.5", "--blocks", "8", "--passes",
                               "2", "--profile", "5", *extra], capture_output=True, text=True, timeout=600, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        passes = [line for line in done.stdout.splitlines() if line.startswith("pass ")]
        assert [p.split(":")[0] for p in passes] == ["pass 0", "pass 1"]
        assert all(float(p.split()[2]) > 0 and "(host only, 8 blocks)" in p for p in passes), passes
        assert "Ordered by: internal time" in done.stdout and "function calls" in done.stdout
    done = subprocess.run([sys.executable, str(script), "--tau", "9", "--k", "3"], capture_output=True, text=True,
                          env=env)
    assert done.returncode == 2 and "--tau in [1, k + 1)" in done.stderr


def test_sweep_grouped_moe_covers_the_tuners_candidates_and_needs_cuda(monkeypatch):
    """scripts/sweep_grouped_moe.py: its grid of tiles (60 plain, 20 swapped per kernel) holds every candidate the
    grouped MoE's tuner picks from (gate/up and down, as (rows, block_k, warps, stages, swap)), `--tiles candidates`
    is those candidates alone, and it names what it needs on a machine without CUDA."""
    import pytest
    import sweep_grouped_moe
    import torch

    from specmoe.kernels import grouped_moe as gm

    grid = sweep_grouped_moe.tiles()
    for name in ("gate_up", "down"):
        assert len(grid[name]) == len(set(grid[name])) == 80
        assert sum(t[4] for t in grid[name]) == 20
    up = [(c["block_n"], c["block_k"], c["warps"], c["stages"], c["swap"]) for c in gm.GATE_UP_CANDIDATES]
    down = [(c["block_h"], c["block_k2"], c["warps2"], c["stages2"], c["swap2"]) for c in gm.DOWN_CANDIDATES]
    assert set(up) <= set(grid["gate_up"]) and set(down) <= set(grid["down"])
    assert sweep_grouped_moe.tiles("candidates") == {"gate_up": up, "down": down}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        sweep_grouped_moe.main([])


def test_tuning_spread_swaps_the_tuners_timer_and_tabulates_the_steps(monkeypatch):
    """scripts/tuning_spread.py: `use_timer("eager")` puts do_bench on one operand in every tuner's place and
    `use_timer("graph")` the package's own back; the table gives each timer's step range, spread and distinct
    choices; it names what it needs on a machine without CUDA."""
    import pytest
    import torch
    import tuning_spread

    from specmoe.kernels import gemv, moe, tuning

    own = (tuning.graph_ms, moe.rotation, gemv.rotation)
    monkeypatch.setattr(tuning, "graph_ms", own[0])  # restored after the test whatever use_timer leaves
    monkeypatch.setattr(moe, "rotation", own[1])
    monkeypatch.setattr(gemv, "rotation", own[2])
    tuning_spread.use_timer("eager")
    assert tuning.graph_ms is tuning_spread.eager_timer
    assert moe.rotation(1, "cuda") == gemv.rotation(1, "cuda") == 1
    tuning_spread.use_timer("graph")
    assert (tuning.graph_ms, moe.rotation, gemv.rotation) == own
    rows = [{"timer": "graph", "step_ms": 1.10, "choice": "a"}, {"timer": "eager", "step_ms": 1.24, "choice": "b"},
            {"timer": "graph", "step_ms": 1.12, "choice": "a"}, {"timer": "eager", "step_ms": 1.10, "choice": "c"},
            {"timer": "graph", "step_ms": 1.16, "choice": "d"}, {"timer": "eager", "step_ms": 1.26, "choice": "b"}]
    table = tuning_spread.spread_table(rows).splitlines()
    assert table[2] == "| graph | 3 | 1.100 | 1.120 | 1.160 | 1.055 | 2 (2: 1.110, 1: 1.160) |"
    assert table[3] == "| eager | 3 | 1.100 | 1.240 | 1.260 | 1.145 | 2 (2: 1.250, 1: 1.100) |"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        tuning_spread.main([])


def test_profile_blocks_refuses_bad_arguments_and_a_machine_without_cuda(capsys):
    import profile_blocks
    import pytest

    with pytest.raises(SystemExit) as exit_:
        profile_blocks.main(["--k", "4", "--tau", "5"])
    assert exit_.value.code == 2 and "--tau in [1, k + 1)" in capsys.readouterr().err
    if not profile_blocks.torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA device"):
            profile_blocks.main([])


def test_profile_blocks_splits_each_requests_first_block_from_the_later_ones():
    """profile_blocks.first_and_later: each request's first timed block apart from its later ones (untimed steps
    left out; a request of one block has no later ones)."""
    import profile_blocks

    def request(ms, timed):
        return SimpleNamespace(ms=np.array(ms), timed=np.array(timed))

    results = [request([9.0, 3.0, 2.0, 2.2], [False, True, True, True]), request([4.0, 2.4], [True, True]),
               request([5.0], [True]), request([7.0], [False])]
    first, later = profile_blocks.first_and_later(results)
    assert first == pytest.approx((3.0 + 4.0 + 5.0) / 3) and later == pytest.approx((2.0 + 2.2 + 2.4) / 3)
    assert np.isnan(profile_blocks.first_and_later([request([5.0], [True])])[1])


def test_profile_blocks_splits_the_host_time_by_its_clock():
    """profile_blocks.host_clock_split: per block staging (verify's entry to the launch) and reading (the launch's
    end to verify's exit) as means, the time between blocks as the median; a block not launched as one graph (two
    stamps) is left out; nan where there is nothing to split."""
    import profile_blocks

    stamps = [[0.000, 0.001, 0.003, 0.0035], [0.0045, 0.0065, 0.008, 0.009], [0.0, 0.1],
              [0.0095, 0.0105, 0.012, 0.0125], [0.0175, 0.0185, 0.020, 0.0205]]
    split = profile_blocks.host_clock_split(stamps)
    assert split["staging"] == pytest.approx((1 + 2 + 1 + 1) / 4)
    assert split["reading"] == pytest.approx((0.5 + 1 + 0.5 + 0.5) / 4)
    assert split["between"] == pytest.approx(1.0)  # the gaps 1.0, 0.5, 5.0 (ms)
    one = profile_blocks.host_clock_split([[0.0, 0.001, 0.002, 0.003]])
    assert one["staging"] == pytest.approx(1.0) and np.isnan(one["between"])
    assert all(np.isnan(v) for v in profile_blocks.host_clock_split([[0.0, 0.1]]).values())


def test_profile_blocks_kernel_table_counts_from_when_kernels_could_run():
    """profile_blocks.kernel_table on a profiler's record of two steps of a PDL chain (each kernel starts while the
    one before runs): per name, calls and ms per step as recorded and as they could run, busy time counted once;
    memory copies left out; the idle time before each (the 800 µs between the steps, before the second's first
    kernel)."""
    from types import SimpleNamespace

    import profile_blocks
    import pytest
    import torch

    def event(name, start, end):
        return SimpleNamespace(name=name, device_type=torch.autograd.DeviceType.CUDA,
                               time_range=SimpleNamespace(start=start, end=end))

    events = []
    for t in (0.0, 1000.0):  # two steps: gemv runs 0-100, norm 100-130 (recorded from 5), gemv 130-200 (from 10)
        events += [event("gemv", t, t + 100), event("norm", t + 5, t + 130), event("gemv", t + 10, t + 200),
                   event("Memcpy HtoD (Pinned -> Device)", t + 300, t + 900)]
    events.append(SimpleNamespace(name="host op", device_type=torch.autograd.DeviceType.CPU, time_range=None))
    text, per_step, busy = profile_blocks.kernel_table(SimpleNamespace(events=lambda: events), steps=2)
    assert per_step == 3 and busy == pytest.approx(0.2)
    rows = [line.split(" | ") for line in text.splitlines()[2:]]
    assert [r[0].strip("| ") for r in rows] == ["gemv", "norm"]
    assert rows[0][1:] == ["2.0", "0.290", "0.170", "85.0", "200.0 |"]
    assert rows[1][1:] == ["1.0", "0.125", "0.030", "30.0", "0.0 |"]


def test_profile_blocks_host_profile_ranks_the_host_functions_of_a_pass():
    """profile_blocks.host_profile on a real engine (olmoe-tiny on the CPU, the host block path, synthetic blocks):
    a markdown table of the functions with the most time of their own, per block: the engine's `_verify` runs
    once per block and holds at least the own time of everything it calls."""
    import dataclasses

    import profile_blocks

    from specmoe.engines import EngineConfig, build_engine
    from specmoe.models import load_model
    from specmoe.records import AcceptanceProfile, synthetic_blocks
    from specmoe.records.synthetic import SOURCES, synthetic_trace
    from specmoe.routing import Calibration
    from specmoe.speculation import SpeculativeConfig
    from specmoe.verifiers import selector_preset

    model, adapter = load_model("olmoe-tiny", seed=0)
    trace = synthetic_trace(SOURCES["olmoe-like"].replace(num_layers=adapter.num_moe_layers), tokens=64, seed=1)
    blocks = synthetic_blocks(trace, 3, AcceptanceProfile.geometric(0.6), seed=2, max_blocks=6)
    blocks = dataclasses.replace(blocks, tokens=blocks.tokens % adapter.vocab_size)
    calibration = Calibration.uniform(adapter.num_moe_layers, adapter.num_experts, adapter.vocab_size)
    engine = build_engine(model, None, calibration, EngineConfig(max_seq_len=64),
                          speculative=SpeculativeConfig(selector_preset("acceptmoe"), k=3, pool_size=8))
    engine.follow(blocks, first_position=4)  # as the script profiles: after a pass, with numba's functions compiled
    text = profile_blocks.host_profile(engine, blocks, 4, rows=200)
    lines = text.splitlines()
    assert lines[0] == "| function | calls per block | own µs per block | cumulative µs per block |"
    rows = [line.strip("| ").split(" | ") for line in lines[2:]]
    own = [float(r[2]) for r in rows]
    assert own == sorted(own, reverse=True) and own[0] > 0
    verify = [r for r in rows if r[0].startswith("speculative.py:") and r[0].endswith(" _verify")]
    assert len(verify) == 1 and float(verify[0][1]) == 1.0, rows[:5]
    assert float(verify[0][3]) >= float(verify[0][2]) > 0
    assert len(profile_blocks.host_profile(engine, blocks, 4).splitlines()) == 2 + 12


def test_profile_blocks_bytes_floor_counts_each_distinct_expert_once():
    """profile_blocks.bytes_floor on a real decoder (olmoe-tiny on the CPU) and hand-made selections: the distinct
    experts per layer averaged over layers and blocks, the dense bytes from `Decoder.bytes_per_token`, the block
    reading each distinct expert once and the step its K."""
    import profile_blocks
    import torch

    from specmoe.models.olmoe import OLMOE_CONFIGS, build_random_olmoe
    from specmoe.models.olmoe_decode import OlmoeDecoder
    from transformers import OlmoeConfig

    model = build_random_olmoe(OlmoeConfig(**{**OLMOE_CONFIGS["olmoe-micro"], "num_hidden_layers": 2}), 0,
                               torch.float32, "cpu")
    decoder = OlmoeDecoder.from_model(model, 64)
    # two blocks of D = 3 positions, L = 2 layers, K = 2: distinct per layer 2, 4 (first), 3, 2 (second)
    first = np.array([[[0, 1], [0, 1]], [[1, 0], [2, 3]], [[0, 1], [3, 2]]])
    second = np.array([[[5, 6], [7, 8]], [[6, 7], [8, 7]], [[5, 7], [7, 8]]])
    floors = profile_blocks.bytes_floor([first, second], decoder, 20, 2, 1000)
    dense = decoder.bytes_per_token(20)
    assert floors["distinct"] == 2.75 and dense > 0
    assert floors["block"] == dense + 2.75 * 2 * 1000 and floors["step"] == dense + 2 * 2 * 1000
    assert floors["ratio"] == floors["block"] / floors["step"] > 1


def test_bench_device_select_times_the_host_and_loads_another_kernel_version(tmp_path, capsys):
    """bench_device_select: the host's selection time from the case's blocks, another version of the kernel module
    loaded beside the current one (its helpers from a given device_cache.py), bad sizes refused in one line."""
    import bench_device_select as bench
    import pytest

    from specmoe.kernels import device_cache, device_select
    from specmoe.verifiers import ExpertPool, selector_preset

    layers, experts, top_k, pool_size, union, kind = bench.GEOMETRIES["olmoe-1b-7b"]
    z, alpha = bench.device_select_case(3, 2, 9, experts)
    warm = np.stack([np.arange(experts)] * 2)
    pool = ExpertPool(2, experts, top_k, pool_size, warm, union)
    assert bench.host_select_us(selector_preset("acceptmoe"), False, pool, z, alpha) > 0
    assert pool.block == 3  # every block's refill ran
    other = bench.load_module(device_select.__file__, device_cache.__file__)
    assert other is not device_select and other.DevicePool.__name__ == "DevicePool"
    assert bench.sys.modules["specmoe.kernels.device_cache"] is device_cache  # restored
    # exact selection at Qwen3.6's geometry: a block of 17 can miss more than the geometry's 64 union slots
    layers, experts, top_k, pool_size, union, kind = bench.GEOMETRIES["qwen3.6-35b-a3b"]
    slots = bench.union_slots("exact", union, 17, top_k, experts, pool_size)
    assert slots == min(17 * top_k, experts - pool_size) > union
    assert bench.union_slots("acceptmoe", union, 17, top_k, experts, pool_size) == union
    assert bench.union_slots("exact", union, 2, top_k, experts, pool_size) == union
    z, alpha = bench.device_select_case(2, 2, 17, experts)
    scoring = bench.scoring_of(kind, 2, experts)
    warm = np.stack([np.random.default_rng(layer).permutation(experts) for layer in range(2)])
    assert bench.host_select_us(selector_preset("exact"), scoring, ExpertPool(2, experts, top_k, pool_size, warm,
                                                                              slots), z, alpha) > 0
    for extra, message in ((["--positions", "0"], "--positions must be at least 1"),
                           (["--module", "old.py"], "--module takes LABEL=FILE[,CACHE]"),
                           (["--module", "a=x.py", "a=y.py"], "distinct labels"),
                           (["--warps", "3"], "invalid choice: 3")):
        with pytest.raises(SystemExit) as exit_:
            bench.main(["--out", str(tmp_path / "x.json")] + extra)
        assert exit_.value.code == 2 and message in capsys.readouterr().err
    # the selection on other warps (`--warps`): the pool's launches take them; other numbers are refused
    pool = ExpertPool(2, experts, top_k, pool_size, warm, union)
    assert device_select.DevicePool(pool, selector_preset("acceptmoe"), False, 9, "cpu").warps == \
        device_select.select_warps(experts)
    assert device_select.DevicePool(pool, selector_preset("acceptmoe"), False, 9, "cpu", warps=2).warps == 2
    with pytest.raises(ValueError, match="1, 2, 4 or 8 warps, got 3"):
        device_select.DevicePool(pool, selector_preset("acceptmoe"), False, 9, "cpu", warps=3)


def test_timeline_pass_on_the_cpu():
    """bench_spec_engine.timeline_pass on a real engine (olmoe-tiny on the CPU, synthetic blocks over the
    olmoe-like source): the instrumented pass's per-block parts add up to the block, drafting is the charged time,
    the per-token figures are per committed token, and the engine is left uninstrumented."""
    import dataclasses

    import bench_spec_engine
    import pytest

    from specmoe.engines import EngineConfig, build_engine
    from specmoe.models import load_model
    from specmoe.records import AcceptanceProfile, synthetic_blocks
    from specmoe.records.synthetic import SOURCES, synthetic_trace
    from specmoe.routing import Calibration
    from specmoe.speculation import SpeculativeConfig
    from specmoe.verifiers import selector_preset

    model, adapter = load_model("olmoe-tiny", seed=0)
    source = SOURCES["olmoe-like"].replace(num_layers=adapter.num_moe_layers)
    trace = synthetic_trace(source, tokens=64, seed=1)
    blocks = synthetic_blocks(trace, 3, AcceptanceProfile.geometric(0.6), seed=2, max_blocks=6)
    blocks = dataclasses.replace(blocks, tokens=blocks.tokens % adapter.vocab_size)  # only the embeddings read them
    calibration = Calibration.uniform(adapter.num_moe_layers, adapter.num_experts, adapter.vocab_size)
    engine = build_engine(model, None, calibration, EngineConfig(max_seq_len=64),
                          speculative=SpeculativeConfig(selector_preset("acceptmoe"), k=3, pool_size=8))
    plain = engine.follow(blocks, first_position=4, draft_cost_s=2e-3)
    line = bench_spec_engine.timeline_pass(engine, blocks, 4, draft_ms=2.0, results=plain)
    assert not engine.settings.instrument and line["verify"] == "host"
    assert line["draft"] == pytest.approx(2.0) and line["selection"] > 0
    parts = ("selection", "copy_issue", "copy_checks", "copy_wait", "compute")
    assert sum(line[p] for p in parts) == pytest.approx(line["step"], rel=1e-9)
    tau = blocks.tau
    assert line["per_token"]["draft"] == pytest.approx(2.0 / tau, rel=1e-6)
    # the target step the bench counts a block's compute in: the engine's all-resident default
    from specmoe.routing import preset

    target = build_engine(model, preset("exact_lru", adapter.num_experts, adapter.top_k), calibration,
                          EngineConfig(max_seq_len=64))
    step = bench_spec_engine.target_pass(target, np.arange(8) % adapter.vocab_size, 4)
    assert step["ms_per_token"] > 0 and step["routing"] == "host"  # the CPU: no device routing


_FAKE_BENCH = r'''
import argparse, json, os, pathlib, sys
ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--scale", type=float, default=1.0)
args = ap.parse_args()
tree = pathlib.Path.cwd()
log = tree.parent / "order.txt"
n = len(log.read_text().splitlines()) if log.exists() else 0
with open(log, "a") as f:
    f.write(tree.name + "\n")
if (tree / "fail").exists():
    print("the model does not fit", file=sys.stderr)
    sys.exit(3)
base = {"old": 2.0, "new": 1.0}[tree.name] * args.scale * (1 + 0.01 * (n % 3))  # a little drift per process
base *= float(os.environ.get("FAKE_SLOW", "1"))
table = {"all_resident": {"ms_mean": base, "copies_skipped_ms": base / 2, "policy": "exact"},
         "only_" + tree.name: {"ms_mean": 1.0}}
if os.environ.get("FAKE_LIST"):  # rows as a list, each named by its "key" (bench_spec_engine's table)
    table = [{"key": name, **row} for name, row in table.items()] + [{"ms_mean": 5.0}]
pathlib.Path(args.out, "bench_engine.json").write_text(json.dumps({"table": table}))
'''


def _trees(tmp_path):
    for name in ("old", "new"):
        (tmp_path / name / "scripts").mkdir(parents=True)
        (tmp_path / name / "scripts" / "bench_engine.py").write_text(_FAKE_BENCH)
    return tmp_path / "old", tmp_path / "new"


def test_ab_trees_alternates_the_trees_pairs_the_ratios_and_resumes(tmp_path, capsys):
    """scripts/ab_trees.py over two stand-in trees whose benchmark reports 2x and 1x (with drift): processes
    alternate old-new, new-old, ...; each row common to both sides gets old / new per field with a paired interval;
    the script's arguments reach it; a rerun reuses the finished processes; bad arguments and a failing process are
    named."""
    import pytest

    import ab_trees

    old, new = _trees(tmp_path)
    out = tmp_path / "ab"
    base = ["--old", str(old), "--new", str(new), "--out", str(out), "--pairs", "3"]
    assert ab_trees.main(base + ["--", "--scale", "3"]) == 0
    assert (tmp_path / "order.txt").read_text().split() == ["old", "new", "new", "old", "old", "new"]
    summary = json.loads((out / "ab_trees.json").read_text())
    assert summary["pairs"] == 3 and set(summary["ratios"]) == {"all_resident"}  # only_old / only_new left out
    r = summary["ratios"]["all_resident"]
    assert set(r) == {"ms_mean", "copies_skipped_ms"}  # "policy" is not a number
    assert r["ms_mean"]["low"] < 2.0 < r["ms_mean"]["high"] and abs(r["ms_mean"]["ratio"] - 2.0) < 0.05
    assert r["ms_mean"]["new_mean"] > 3.0  # --scale 3 reached the script
    assert "| all_resident | ms_mean |" in (out / "ab_trees.md").read_text()
    # a rerun finds every process's report: nothing runs again, the same summary
    assert ab_trees.main(base + ["--", "--scale", "3"]) == 0
    assert len((tmp_path / "order.txt").read_text().split()) == 6
    assert json.loads((out / "ab_trees.json").read_text())["ratios"] == summary["ratios"]
    with pytest.raises(SystemExit, match="other bench_args"):  # another comparison does not reuse these processes
        ab_trees.main(base + ["--", "--scale", "4"])

    # one tree, two environments: the old side's processes see FAKE_SLOW=3
    env_out = tmp_path / "ab_env"
    assert ab_trees.main(["--old", str(new), "--new", str(new), "--out", str(env_out), "--pairs", "2",
                          "--old-env", "FAKE_SLOW=3"]) == 0
    summary = json.loads((env_out / "ab_trees.json").read_text())
    assert summary["old_env"] == {"FAKE_SLOW": "3"} and summary["new_env"] == {}
    assert abs(summary["ratios"]["all_resident"]["ms_mean"]["ratio"] - 3.0) < 0.1
    assert "(FAKE_SLOW=3)" in (env_out / "ab_trees.md").read_text()
    with pytest.raises(SystemExit, match="other old_env"):
        ab_trees.main(["--old", str(new), "--new", str(new), "--out", str(env_out), "--pairs", "2",
                       "--old-env", "FAKE_SLOW=2"])

    # rows as a list, named by a field of theirs (a row without one left out)
    list_out = tmp_path / "ab_list"
    assert ab_trees.main(["--old", str(new), "--new", str(new), "--out", str(list_out), "--pairs", "2",
                          "--old-env", "FAKE_SLOW=2", "FAKE_LIST=1", "--new-env", "FAKE_LIST=1"]) == 0
    summary = json.loads((list_out / "ab_trees.json").read_text())
    assert set(summary["ratios"]) == {"all_resident", "only_new"}
    assert abs(summary["ratios"]["all_resident"]["ms_mean"]["ratio"] - 2.0) < 0.1

    (old / "fail").touch()
    with pytest.raises(RuntimeError, match="(?s)exit 3.*wrote no table .*the model does not fit"):
        ab_trees.main(["--old", str(old), "--new", str(new), "--out", str(tmp_path / "ab2"), "--pairs", "2"])
    for bad, message in ((["--pairs", "1"], "--pairs must be at least 2"),
                         (["--", "--out", "x"], "leave it out"),
                         (["--script", "scripts/missing.py"], "scripts/missing.py not found"),
                         (["--old-env", "FAKE_SLOW"], "NAME=VALUE pairs")):
        with pytest.raises(SystemExit):
            ab_trees.main(["--old", str(old), "--new", str(new), "--out", str(out)] + bad)
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ab_trees.main(["--old", str(new), "--new", str(new), "--out", str(out)])
    assert "nothing to compare" in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_kernel_registers_reports_every_launch_of_a_model(tmp_path, capsys):
    """kernel_registers on a named config's shapes, compiled for sm_90 here without a GPU: a row per grouped MoE
    candidate and block size, the block selection's launches and the cache step's, each with ptxas's registers
    (1-255) and spills; the rows also as json; a bad block size refused in one line."""
    import json

    import kernel_registers

    from specmoe.kernels import grouped_moe as gm

    out = tmp_path / "regs.json"
    kernel_registers.main(["--model", "olmoe-tiny", "--positions", "9", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert capsys.readouterr().out.count("\n| _") == len(rows)
    grouped = [r for r in rows if r["D"] == 9 and r["kernel"].startswith("_grouped")]
    assert len(grouped) == len(gm.GATE_UP_CANDIDATES) + len(gm.DOWN_CANDIDATES)
    assert [r["params"]["block_m"] for r in grouped] == [gm.default_block_m(9)] * len(grouped)
    assert {r["kernel"] for r in rows if r["D"] == 9} >= {"_own_kernel", "_demand_kernel", "_execute_kernel",
                                                          "_prefetch_kernel", "_use_kernel", "_refill_kernel"}
    assert {r["kernel"] for r in rows if r["kernel"].startswith("_cache_step")} == {
        "_cache_step_kernel (cache_prior, route)", "_cache_step_kernel (psr, route)",
        "_cache_step_kernel (psr, part 1)"}
    assert all(1 <= r["registers"] <= 255 and r["spill_stores"] >= 0 and r["stack"] >= 0 for r in rows)
    # the grouped candidates' products: the plain tiles at D = 9 (16 positions as M) on mma.sync, the swapped ones
    # (the weight rows as M) on Hopper's wgmma; the selection has no tile products
    assert {r["mma"] for r in grouped if not r["params"].get("swap", r["params"].get("swap2"))} == {"mma.sync"}
    assert {r["mma"] for r in grouped if r["params"].get("swap", r["params"].get("swap2"))} == {"wgmma"}
    assert next(r for r in rows if r["kernel"] == "_own_kernel")["mma"] == ""
    # each row's warps are its launch's: the selection's select_warps(E), the refill's own 4, a candidate's own
    from specmoe.kernels.device_select import select_warps

    own = next(r for r in rows if r["kernel"] == "_own_kernel")
    refill = next(r for r in rows if r["kernel"] == "_refill_kernel")
    assert own["warps"] == select_warps(own["params"]["E"]) and refill["warps"] == 4
    assert [r["warps"] for r in grouped] == [c["warps"] for c in gm.GATE_UP_CANDIDATES] + \
        [c["warps2"] for c in gm.DOWN_CANDIDATES]
    with pytest.raises(SystemExit) as exit_:
        kernel_registers.main(["--positions", "0"])
    assert exit_.value.code == 2 and "--positions must be at least 1" in capsys.readouterr().err


def test_bench_gdn_kernels_takes_a_named_configs_shapes_and_refuses_without_cuda(tmp_path, capsys):
    """bench_gdn_kernels: a named config's Gated DeltaNet shapes (Qwen3.6's 30 layers of 16 key and 32 value heads
    of 128, convolution width 4) and each layer's own inputs, another version of gdn.py loaded from a file beside
    the current one, bad arguments and a config without Gated DeltaNet layers refused in one line (exit 2); without
    CUDA it stops in one line (exit 1, no traceback)."""
    import subprocess

    import bench_gdn_kernels as bench
    import torch

    from specmoe.kernels import gdn

    shapes = bench.gdn_shapes("qwen3.6-35b-a3b")
    assert shapes == {"heads": (16, 32, 128, 128), "width": 4, "layers": 30}
    with pytest.raises(ValueError, match="no Gated DeltaNet layers"):
        bench.gdn_shapes("olmoe-1b-7b")
    (layer,) = bench.layer_inputs(bench.gdn_shapes("qwen3.5-moe-tiny"), 3, 1, torch.bfloat16, "cpu")
    proj, state, conv_in = layer["prologue"][0], layer["prologue"][4], layer["prologue"][5]
    assert proj.shape[0] == 3 and conv_in.shape == (state.shape[0], state.shape[1] + 3)
    assert layer["history"].shape == (3,) + layer["recurrence"][5].shape
    other = bench.load_module(gdn.__file__)
    assert other is not gdn and other.gdn_prologue_triton is not gdn.gdn_prologue_triton
    out = ["--out", str(tmp_path / "x.json")]
    for extra, message in ((["--positions", "0"], "--positions, --layers, --repeats and --rounds must be at least 1"),
                           (["--module", "old.py"], "--module takes LABEL=FILE"),
                           (["--module", "a=" + gdn.__file__, "a=" + gdn.__file__], "distinct labels"),
                           (["--module", "a=" + str(tmp_path / "nope.py")], "nope.py: no such file"),
                           (["--model", "olmoe-1b-7b"], "olmoe-1b-7b has no Gated DeltaNet layers"),
                           (["--model", "nope"], "unknown named config 'nope'"),
                           (["--kernels", "prolog"], "invalid choice: 'prolog'")):
        with pytest.raises(SystemExit) as exit_:
            bench.main(out + extra)
        assert exit_.value.code == 2 and message in capsys.readouterr().err
    if not torch.cuda.is_available():
        script = Path(__file__).resolve().parents[1] / "scripts" / "bench_gdn_kernels.py"
        env = {**os.environ, "PYTHONPATH": str(script.parents[1])}
        done = subprocess.run([sys.executable, str(script)] + out, capture_output=True, text=True, env=env)
        assert done.returncode == 1 and done.stderr.strip().splitlines() == [
            "bench_gdn_kernels.py times CUDA graphs of Triton kernels: it needs a CUDA device and Triton"], done.stderr
    assert not (tmp_path / "x.json").exists()
