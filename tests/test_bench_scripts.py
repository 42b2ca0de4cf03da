"""The engine benchmarks' bookkeeping on the CPU: bench_spec_engine's SD / AR ratios with a drafting time per
block and the per-request details its json keeps (without a model), its rows per --trace and its timeline pass
(olmoe-tiny, the timed passes stood in for); bench_engine's configuration check before a model is built, its
policy ratios and its windows at the first position. The kernel and profiling scripts: test_kernel_scripts.py."""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from spec_report import markdown, request_ratio, saved_details, summary_table  # noqa: E402

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
        ar_header = lines.index("| source | AR config | path | ms/token | compute-only ms/token | copies/token | "
                                "schedule floor ms (ms / floor) |")
        assert lines[ar_header + 2].startswith("| src | psr_C8 | device_policy | ")  # where the AR policy ran
        assert lines[ar_header + 2].endswith(" | - |")  # no floor without the row's per-layer copies
        assert lines[ar_header].count("|") == lines[ar_header + 2].count("|")
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

    def ar_pass(engine, feeds, first_position, floor_of=None, errors=None):
        calls.append(("ar", owner(engine), np.concatenate([f.router_logits for f in feeds])))
        # with floor_of, one demand copy per token and layer: never hidden, so each token's floor is the target
        # step plus 16 copies (olmoe-tiny's layers)
        copies = {"layer_copies": [(np.ones((3, 16), int), np.zeros((3, 16), int))]} if floor_of else {}
        return {"ms_per_token": 0.5, "copies_per_token": 2.0, "p99": 1.0, "request_ms": [0.5, 0.5],
                "request_tokens": [3, 3], **copies}

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
    # each AR row's schedule floor at the run's target step (0.25 ms) and copy time (0.1 ms): 0.25 + 16 x 0.1
    assert report["table"][0]["ar_exact_lru_C8_schedule_floor_ms"] == pytest.approx(1.85)
    assert "| synthetic_tau3_k4 | exact_lru_C8 | ? | 0.500 | 0.500 | 2.00 | 1.850 (0.27) |" in md

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
    # the row's schedule floor from its routing replayed per layer (which matched the run's copy counts: no error)
    row = report["table"]["C16_cache_prior_host_policy"]
    assert row["schedule_floor_ms"] >= report["table"]["all_resident"]["ms_mean"] - 1e-9
    assert row["over_schedule_floor"] == pytest.approx(row["ms_mean"] / row["schedule_floor_ms"])
    # only the engines the selected configuration needs (and all resident): no sweep, no other capacity or path
    assert set(report["engine_notes"]) == {str(max(skipped_c for skipped_c, _, _ in feeds)), "16_host_policy"}
    assert positions and set(positions) == {40}  # rounds, the instrumented and the copies-skipped passes
    assert randomized  # the context below the windows holds random keys and values
    # the compute-only pass follows the recorded routing where copies are skipped (C < E), and its own router with
    # every expert resident (a feed would route on the host there)
    skipped = {capacity: fed for capacity, skip, fed in feeds if skip}
    assert skipped == {16: True, max(skipped): False} and max(skipped) > 16, feeds


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
