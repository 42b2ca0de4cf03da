"""The kernel and profiling scripts on the CPU: their argument checks and refusals without CUDA, the bookkeeping
each can run without a GPU (bench_device_cache's and bench_device_select's host steps, profile_blocks' tables,
the tuners' candidates), ab_trees' alternation of two trees, kernel_registers' report of every launch of a model
(compiled for sm_90 on the CPU)."""

import importlib.util
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

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
