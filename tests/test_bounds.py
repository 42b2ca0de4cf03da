"""Sizes and integrity at the boundaries: every size is bounded (k, rounds, counts, grids, positions) and refused
in one line before any work; sizes computed from floats saturate; finished cells and input files are checked on
resume."""

import math
import re
import time

import numpy as np
import pytest

from specmoe.cli import main
from specmoe.records import AcceptanceProfile, BlockRecordError, BlockRecords, Blocks, BlockSourceError, blocks_from_records
from specmoe.replay import replay_rollback
from specmoe.routing import Calibration, PolicyError, preset
from specmoe.routing.calibration import CalibrationBuilder
from specmoe.verifiers import CommitRate, ExpertPool
from specmoe.limits import MAX_CELLS, MAX_DRAFTS
from specmoe.speculation import SpeculativeConfig
from specmoe.verifiers import selector_preset

from test_experiments import MICRO  # noqa: E402  (the micro config every experiment test runs)
SD = "\n[sd]\npool = 16\ndrafters = ['synthetic']\nselectors = ['exact']\n"


def one_line_error(capsys, argv, message):
    """`specmoe ARGV` exits 2 with one stderr line holding `message`."""
    assert main([str(a) for a in argv]) == 2, argv
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], (argv, err)
    return err[0]


# -- sizes are bounded, before any work ---------------------------------------------------------------------
def test_command_sizes_are_bounded_before_any_work(tmp_path, capsys):
    started = time.perf_counter()
    for argv, message in [
        (["sd", "--model", "olmoe-micro", "-k", 100000], f"argument -k: must be at most {MAX_DRAFTS}, got 100000"),
        (["sd", "--model", "olmoe-micro", "--prompt-length", 2 ** 63], "argument --prompt-length: must be at most"),
        (["sd", "--model", "olmoe-micro", "--drafters", "synthetic", "--prompt-length", 1000, "-k", 32],
         "workload.length + workload.new_tokens + sd.k = 1096 positions exceed the 1024 positions"),
        (["replay-sd", "--calibration", tmp_path / "none", "--trace", tmp_path / "none", "--tau", 3,
          "-k", 100000000000], f"-k must be in [1, {MAX_DRAFTS}], got 100000000000"),
    ]:
        one_line_error(capsys, argv + ["--out", tmp_path / "out"], message)
    assert time.perf_counter() - started < 60 and not (tmp_path / "out").exists()


@pytest.mark.parametrize("text, message", [
    (MICRO.replace("rounds = 2", "rounds = 9223372036854775807"), "rounds: expected an integer in [1, 1000]"),
    (MICRO + SD.replace("pool = 16", "pool = 16\nk = 9223372036854775807"), "sd.k: expected an integer in [1, 1024]"),
    (MICRO.replace("count = 2", "count = 1000000"), "workload.count: expected an integer in [1, 100000]"),
    (MICRO.replace("length = 6", "length = 1000").replace("new_tokens = 4", "new_tokens = 30"),
     "workload.new_tokens: workload.length + workload.new_tokens = 1030 positions exceed the 1024 positions"),
    (MICRO.replace("length = 6", "length = 1000") + SD.replace("pool = 16", "pool = 16\nk = 30"),
     "sd.k: workload.length + workload.new_tokens + sd.k = 1034 positions exceed the 1024"),
    (MICRO.replace("rounds = 2", "rounds = 1000").replace("[0.1, 0.3]", str([i / 1000 for i in range(101)])),
     f"rounds: 102 configurations x 1000 rounds = 102000 cells, more than the {MAX_CELLS}"),
])
def test_config_sizes_are_bounded_before_any_work(tmp_path, capsys, text, message):
    path = tmp_path / "x.toml"
    path.write_text(text)
    err = one_line_error(capsys, ["run", path, "--dry-run", "--out", tmp_path / "run"], message)
    assert str(path) in err and not (tmp_path / "run").exists()


def test_api_sizes_are_bounded_and_integers():
    exact = selector_preset("exact")
    for kwargs, message in [({"k": 2.5}, "k (drafts per block) must be an integer, got 2.5"),
                            ({"k": math.nan}, "must be an integer, got nan"),
                            ({"k": MAX_DRAFTS + 1}, f"k (drafts per block) must be in [1, {MAX_DRAFTS}]"),
                            ({"max_new_tokens": math.nan}, "max_new_tokens must be an integer")]:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            SpeculativeConfig(exact, **kwargs)
    started = time.perf_counter()
    for tau, k in [(3, 100000000000), (3, 2 ** 63 - 1), (math.nan, 8)]:
        with pytest.raises(BlockSourceError):
            AcceptanceProfile.for_tau(tau, k)
    assert time.perf_counter() - started < 1
    assert AcceptanceProfile.for_tau(3, MAX_DRAFTS).values[0] == pytest.approx(2 / 3, abs=1e-6)
    with pytest.raises(BlockSourceError, match="finite non-negative counts"):
        AcceptanceProfile.histogram([math.nan, 1])


# -- finished cells are validated on resume -------------------------------------------------------------------
def test_bad_cell_files_are_named_and_measured_again(tmp_path):
    import json

    import pandas as pd

    from specmoe.experiments.config import load_config
    from specmoe.experiments.run import run_experiment
    from specmoe.rundir import RunDir

    path = tmp_path / "x.toml"
    path.write_text(MICRO.replace("rounds = 2", "rounds = 1").replace("[0.1, 0.3]", "[0.1, 0.2, 0.3, 0.4]"))
    config = load_config(path)
    out = tmp_path / "run"
    first, _ = run_experiment(config, out, progress=False, log=lambda text: None)
    assert len(first) == 5 and "digest" not in first.columns
    cells = RunDir(out).cell_path
    edited = json.loads(cells(4, 0).read_text())
    edited["copies_per_token"] += 1.0
    bad = {0: "garbage{", 1: cells(1, 0).read_text()[:40], 2: '{"foo": 1}', 3: "[1, 2, 3]", 4: json.dumps(edited)}
    for index, text in bad.items():
        cells(index, 0).write_text(text)
    (tmp_path / "stale").write_bytes((out / "results.parquet").read_bytes())
    dry = []
    run_experiment(config, out, dry_run=True, log=dry.append)
    assert len(dry) == 5 and all(cells(i, 0).is_file() for i in bad)  # named, not counted, nothing moved
    lines, ran = [], []
    table, manifest = run_experiment(config, out, progress=False, log=lines.append,
                                     on_cell=lambda row: ran.append(row["config"]))
    assert sorted(ran) == [0, 1, 2, 3, 4] and manifest["status"] == "complete"
    for index, reason in [(0, "not a readable JSON cell"), (1, "not a readable JSON cell"),
                          (2, "is not the cell of configuration 2"), (3, "holds a JSON list"),
                          (4, "its contents do not match the digest")]:
        assert any(line.startswith(f"{cells(index, 0)}: {reason}") for line in lines), (index, lines)
    assert RunDir(out, config.digest()).check_cells(lines.append) == {(i, 0) for i in range(5)}
    fresh = pd.read_parquet(out / "results.parquet")
    assert (fresh["copies_per_token"] == first["copies_per_token"]).all()  # the edit is gone, measured again


def test_another_runs_cell_is_not_taken(tmp_path):
    from specmoe.rundir import RunDir

    mine, other = RunDir(tmp_path, "a" * 16), RunDir(tmp_path, "b" * 16)
    other.write_cell({"config": 0, "round": 0, "copies_per_token": 1.5})
    assert other.cell_error(0, 0) is None
    assert "another run's" in mine.cell_error(0, 0)


# -- an empty grid is a config error naming the key -----------------------------------------------------------
REPLAY = """
mode = "replay"
[model]
source = "olmoe-micro"
[ar]
capacity = 16
policies = [{ preset = "psr", bonus = [0.1, 0.3] }]
[sd]
pool = 16
k = 4
selectors = ["exact"]
[replay]
tau = 2
"""


@pytest.mark.parametrize("text, message", [
    (REPLAY.replace("[0.1, 0.3]", "[]"), "ar.policies[0].bonus: expected a value or a non-empty list of values"),
    (REPLAY.replace("tau = 2", "tau = 2\nmethods = []"), "replay.methods: expected a string or a non-empty list"),
    (REPLAY.replace('selectors = ["exact"]', 'selectors = [{ preset = "acceptmoe", gamma = [] }]'),
     "sd.selectors[0].gamma: expected a value or a non-empty list"),
    (REPLAY.replace("[ar]\ncapacity = 16\npolicies = [{ preset = \"psr\", bonus = [0.1, 0.3] }]", "")
     .replace("tau = 2", "tau = 2\nmethods = ['rollback']"), "replay.methods: the grid is empty"),
])
def test_an_empty_grid_names_its_key(tmp_path, capsys, text, message):
    path = tmp_path / "x.toml"
    path.write_text(text)
    one_line_error(capsys, ["run", path, "--dry-run", "--out", tmp_path / "run"], message)


# -- the contents of input files are part of the run's identity -----------------------------------------------
@pytest.mark.parametrize("key, section", [("calibration.file", "[calibration]\nfile = '{path}'\n"),
                                          ("workload.files[0]", "")])
def test_a_changed_input_file_is_another_run_named_on_resume(tmp_path, key, section):
    from specmoe.experiments.config import load_config
    from specmoe.experiments.run import run_experiment

    data = tmp_path / "input.bin"
    data.write_bytes(b"first contents")
    text = MICRO.replace("[calibration]\nwindows = 2\nlength = 16\n", section.format(path=data))
    if key.startswith("workload"):
        text = text.replace('source = "selfgen"', f"source = 'text'\nfiles = ['{data}']\ntokenizer = '{tmp_path}'")
    path = tmp_path / "x.toml"
    path.write_text(text)
    config, out = load_config(path), tmp_path / "run"
    with pytest.raises(Exception):  # not a calibration or no tokenizer: the set-up fails after the manifest
        run_experiment(config, out, progress=False, log=lambda line: None)
    assert config.inputs()[key]["path"] == str(data)
    digest = config.digest()
    data.write_bytes(b"other contents")
    changed = load_config(path)
    assert changed.digest() != digest
    with pytest.raises(ValueError, match=rf"was run with other contents of {re.escape(key)} = {re.escape(str(data))}"):
        run_experiment(changed, out, progress=False, log=lambda line: None)


# -- one writer per run directory -----------------------------------------------------------------------------
def test_a_second_writer_of_a_run_directory_is_refused(tmp_path):
    import json
    import os
    import socket
    import subprocess

    from specmoe.experiments.config import load_config
    from specmoe.experiments.run import run_experiment
    from specmoe.rundir import RunDir

    path = tmp_path / "x.toml"
    path.write_text(MICRO.replace("rounds = 2", "rounds = 1"))
    config, out = load_config(path), tmp_path / "run"
    with RunDir(out).lock():  # another writer, alive (this process)
        assert json.loads((out / "lock").read_text()) == {"pid": os.getpid(), "host": socket.gethostname()}
        with pytest.raises(ValueError, match=rf"is being written by pid {os.getpid()} on {socket.gethostname()}"):
            run_experiment(config, out, progress=False, log=lambda line: None)
    assert not (out / "lock").exists() and not (out / "cells").exists()
    gone = subprocess.Popen(["true"])
    gone.wait()  # a writer that died without releasing the lock: taken over
    (out / "lock").write_text(json.dumps({"pid": gone.pid, "host": socket.gethostname()}))
    table, manifest = run_experiment(config, out, progress=False, log=lambda line: None)
    assert manifest["status"] == "complete" and len(table) == 3 and not (out / "lock").exists()


# -- malformed values are one line, not a traceback ---------------------------------------------------------
@pytest.mark.parametrize("text, key", [
    (MICRO.replace('{preset = "psr", bonus = [0.1, 0.3]}', '{preset = ["psr"]}'), "ar.policies[1].preset"),
    (MICRO + SD.replace("['exact']", "[{preset = {name = 'exact'}}]"), "sd.selectors[0].preset"),
])
def test_a_preset_that_is_not_a_name_names_its_key(tmp_path, capsys, text, key):
    path = tmp_path / "x.toml"
    path.write_text(text)
    one_line_error(capsys, ["run", path, "--dry-run", "--out", tmp_path / "run"], key)


def test_run_directories_that_hold_no_run_are_named(tmp_path, capsys):
    import json

    import pandas as pd

    from specmoe.rundir import MANIFEST, RESULTS

    config = tmp_path / "x.toml"
    config.write_text(MICRO)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / MANIFEST).write_text("[]")
    pd.DataFrame({"config": [0], "round": [0], "label": ["a"], "kind": ["ar"]}).to_parquet(bad / RESULTS)
    one_line_error(capsys, ["run", config, "--dry-run", "--out", bad], "is not a manifest (a JSON object, got list)")
    one_line_error(capsys, ["report", bad], "is not a manifest (a JSON object, got list)")
    empty = tmp_path / "empty"  # a run stopped before its first cell, or a grid with no cells
    empty.mkdir()
    (empty / MANIFEST).write_text(json.dumps({"name": "x"}))
    pd.DataFrame().to_parquet(empty / RESULTS)
    one_line_error(capsys, ["report", empty], "holds no finished cell (no column config, round, label, kind)")
    pd.DataFrame({c: pd.Series(dtype=t) for c, t in [("config", int), ("round", int), ("label", str),
                                                        ("kind", str)]}).to_parquet(empty / RESULTS)
    one_line_error(capsys, ["report", empty], "holds no finished cell (no rows)")
    assert not (bad / "report").exists() and not (empty / "report").exists()


def test_a_cell_with_no_fields_is_named_and_measured_again(tmp_path):
    from specmoe.rundir import RunDir

    run = RunDir(tmp_path, "a" * 16)
    run.write_cell({"config": 0, "round": 0, "copies_per_token": 1.5})
    run.cell_path(0, 0).write_text("{}")
    lines = []
    assert run.check_cells(lines.append, move=False) == set()
    assert len(lines) == 1 and lines[0].startswith(str(run.cell_path(0, 0)))


def test_block_records_whose_geometry_is_not_an_object_are_named(tmp_path):
    import numpy as np

    from specmoe.files import read_safetensors, write_safetensors
    from specmoe.records import BlockRecordError, BlockRecords
    from test_replay_sd import make_records

    path = tmp_path / "blocks.safetensors"
    make_records(np.random.default_rng(0)).save(path)
    meta, arrays = read_safetensors(path, BlockRecordError, "block record")
    write_safetensors(path, arrays, {**meta, "geometry": "[]"})
    with pytest.raises(BlockRecordError, match="geometry metadata must be a JSON object, got '\\[\\]'"):
        BlockRecords.load(path)


def test_command_numbers_out_of_range_are_named(tmp_path, capsys):
    import numpy as np

    from test_replay_sd import random_calibration

    calibration = tmp_path / "cal.safetensors"
    random_calibration(np.random.default_rng(0)).save(calibration)
    replay = ["replay-sd", "--calibration", calibration, "--trace", tmp_path / "none", "--tau", 3, "-k", 2, "-C", 4,
              "--out", tmp_path / "out"]
    one_line_error(capsys, replay + ["--budgets", "1e20"], "--budgets must be in [0, 12], got 100000000000000000000")
    one_line_error(capsys, replay + ["--budgets", "inf"], "--budgets must be integers, got 'inf'")
    one_line_error(capsys, ["sd", "--model", "olmoe-micro", "--threads", -1], "argument --threads: must be at least 1")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("field, value, message", [
    ("doc_id", [1], "doc_id must be an integer or a string, got [1]"),
    ("doc_id", {"a": 1}, "doc_id must be an integer or a string, got {'a': 1}"),
    ("acc", 10 ** 400, "acc = 10000000000000000000... is no score"),
])
def test_compare_samples_of_the_wrong_type_are_named(tmp_path, capsys, field, value, message):
    import json

    from test_compare import _write_run

    runs = []
    for name in ("a", "b"):
        path = _write_run(tmp_path / name / "model", "qa", {0: {"acc": 1}, 1: {"acc": 0}})
        runs.append(tmp_path / name)
    record = json.loads(path.read_text().splitlines()[0])
    record[field] = value
    path.write_text(json.dumps(record) + "\n")
    err = one_line_error(capsys, ["compare", *runs, "--out", tmp_path / "table.md"], message)
    assert f"{path}, line 1" in err


# -- nothing is half-written: arguments and output paths are checked first ---------------------------------
def test_report_checks_its_arguments_first_and_replaces_the_report_whole(tmp_path, capsys):
    from test_report import run_dir

    run = run_dir(tmp_path)
    assert main(["report", str(run)]) == 0
    report = run / "report"
    before = {p.name: p.read_bytes() for p in report.iterdir()}
    assert set(before) == {"report.md", "frontier.png", "latency_cdf.png", "copies.png"}
    capsys.readouterr()
    one_line_error(capsys, ["report", run, "--baseline", 99], "--baseline 99: no configuration # 99")
    assert {p.name: p.read_bytes() for p in report.iterdir()} == before  # untouched
    fresh = tmp_path / "fresh"
    one_line_error(capsys, ["report", run, "--baseline", 99, "--out", fresh], "--baseline 99")
    assert not fresh.exists()
    assert main(["report", str(run), "--baseline", "1"]) == 0
    assert "against #1 SD exact" in (report / "report.md").read_text()
    assert [p.name for p in run.iterdir() if ".tmp-" in p.name or ".old-" in p.name] == []
    (report / "notes.txt").write_text("mine")  # a directory holding other files is not replaced
    capsys.readouterr()
    one_line_error(capsys, ["report", run], "report directory")
    assert (report / "notes.txt").read_text() == "mine"


def test_output_paths_are_checked_before_the_computation(tmp_path, capsys):
    import numpy as np

    from test_replay_sd import random_calibration

    calibration = tmp_path / "cal.safetensors"
    random_calibration(np.random.default_rng(0)).save(calibration)
    taken = tmp_path / "file"
    taken.write_text("x")
    started = time.perf_counter()
    one_line_error(capsys, ["replay-sd", "--calibration", calibration, "--trace", tmp_path / "none", "--tau", 3,
                            "-k", 2, "-C", 4, "--out", taken], f"run directory {taken} is an existing file")
    one_line_error(capsys, ["sd", "--model", "olmoe-micro", "--records", "--out", taken],
                   f"run directory {taken} is an existing file")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "blocks").write_text("x")
    one_line_error(capsys, ["sd", "--model", "olmoe-micro", "--records", "--out", tmp_path / "out"],
                   f"run directory {tmp_path / 'out'} holds files but no manifest.json")
    assert time.perf_counter() - started < 30 and taken.read_text() == "x"
# -- the Python API: values are checked where they enter ------------------------------------------------------
def _records(**change):
    """Two blocks of one request (k = 2, L = 1, E = 4, K = 2, V = 10), with `change` replacing arrays."""
    rng = np.random.default_rng(0)
    arrays = {"request": np.zeros(2, np.int64), "root_position": np.array([5, 7]), "tokens": rng.integers(0, 10, (2, 3)),
              "confidences": np.full((2, 2), 0.5, np.float32), "accepted": np.array([1, 0]),
              "bonus": np.array([3, 4]), "router_logits": rng.normal(size=(2, 3, 1, 4)).astype(np.float32),
              "pregate_logits": rng.normal(size=(2, 3, 1, 4)).astype(np.float32),
              "selected": np.zeros((2, 3, 1, 2), np.int64)}
    arrays.update(change)
    return BlockRecords(arrays, top_k=2, vocab_size=10)


def test_blocks_and_block_records_are_checked_where_they_enter():
    records = _records()
    replay_rollback(preset("psr", 3, 2), blocks_from_records(records),
                    Calibration(np.array([[0, 1, 2, 3]]), np.zeros((1, 10, 4)), np.array([1.0]), {}))
    nan = records.arrays["router_logits"].copy()
    nan[1, 2, 0, 3] = np.nan
    with pytest.raises(BlockRecordError, match=r"router logits must be finite.*entry \[1, 2, 0, 3\] is nan"):
        _records(router_logits=nan)
    blocks = blocks_from_records(records)
    with pytest.raises(BlockSourceError, match=r"router logits must be finite.*is nan"):
        Blocks(nan.reshape(6, 1, 4), blocks.pregate_logits, blocks.tokens, blocks.rows, blocks.accepted,
               blocks.request, blocks.confidences, 2)
    with pytest.raises(BlockSourceError, match="top_k must be an integer, got 2.5"):
        Blocks(blocks.router_logits, blocks.pregate_logits, blocks.tokens, blocks.rows, blocks.accepted,
               blocks.request, blocks.confidences, 2.5)
    tokens = records.arrays["tokens"].copy()
    tokens[1, 2] = 10  # a rejected position's draft
    with pytest.raises(BlockRecordError, match=r"tokens: entry \[1, 2\] is 10, outside \[0, 10\)"):
        _records(tokens=tokens)
    with pytest.raises(BlockRecordError, match="root_position of block 1 is 9.*must be 7"):
        _records(root_position=np.array([5, 9]))
    with pytest.raises(BlockRecordError, match=r"root_position: entry \[0\] is -3"):
        _records(root_position=np.array([-3, -1]))


def test_pool_and_commit_rate_arguments_name_themselves():
    warm = np.tile(np.arange(8), (2, 1))
    pool = ExpertPool(2, 8, 2, 4, warm)
    for call in (lambda: pool.resident(-1), lambda: pool.use(-1, [[0, 1]]), lambda: pool.use(16, [[0, 1]]),
                 lambda: pool.slot_table(2)):
        with pytest.raises(ValueError, match=r"layer must be in \[0, 1\], got (-1|16|2)"):
            call()
    with pytest.raises(ValueError, match="selected must hold integer expert ids, got dtype float64"):
        pool.use(0, [[0.7, 1.2]])
    with pytest.raises(ValueError, match="pool_size \\(P\\) must be an integer, got 32.5"):
        ExpertPool(2, 8, 2, 32.5, warm)
    with pytest.raises(ValueError, match=r"top_k must be in \[1, 8\], got 0"):
        ExpertPool(2, 8, 0, 4, warm)
    with pytest.raises(ValueError, match=r"top_k must be in \[1, 8\], got 0"):
        CalibrationBuilder(2, 8, 10, 0)
    with pytest.raises(ValueError, match="accepted_length must be an integer, got 1.5"):
        CommitRate().update(1.5, 3)
    with pytest.raises(ValueError, match="k \\(drafts of the block\\) must be an integer, got 3.0"):
        CommitRate().update(1, 3.0)


# -- messages name the culprit ----------------------------------------------------------------------------------
@pytest.mark.parametrize("text, message", [
    (MICRO.replace('name = "micro"', 'name = "caf\xe9"').encode("latin-1"), "x.toml: not UTF-8 text (byte 12 is 0xe9)"),
    (MICRO.replace('rounds = 2', 'rounds = 2\ndevice = "cuda:abc"'), "device: expected 'cpu', 'cuda' or 'cuda:N', got 'cuda:abc'"),
    (MICRO.replace('"exact_lru"', '{preset = "psr", window = 9223372036854775807}'),
     "ar.policies[0]: psr with {'window': 9223372036854775807}: window must be <= 65536"),
    (MICRO.replace('rounds = 2', 'rounds = 2\nengine = "engine"').replace("[ar]\ncapacity = 16\n", "")
     .replace('policies = ["exact_lru", {preset = "psr", bonus = [0.1, 0.3]}]', "")
     + SD + '[run_settings]\ncache_mode = "physical"\n',
     "run_settings.cache_mode: the grid is empty: the speculative engine runs only with cache_mode 'logical'"),
], ids=["not-utf8", "device", "window", "cache-mode"])
def test_config_errors_name_the_file_and_key(tmp_path, capsys, text, message):
    path = tmp_path / "x.toml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    one_line_error(capsys, ["run", path, "--dry-run", "--out", tmp_path / "run"], message)


def test_command_errors_name_the_argument_or_file(tmp_path, capsys):
    one_line_error(capsys, ["replay-sd", "--calibration", tmp_path / "none", "--trace", tmp_path / "none",
                            "--tau", 3, "--seed", -1, "--out", tmp_path / "out"], "argument --seed: must be at least 0")
    samples = tmp_path / "samples_qa_2026.jsonl"
    samples.write_bytes('{"doc_id": 0, "acc": 1, "note": "caf\xe9"}\n'.encode("latin-1"))
    one_line_error(capsys, ["compare", samples, samples, "--out", tmp_path / "t.md"],
                   f"{samples}: not UTF-8 text (byte 36 is 0xe9)")
    with pytest.raises(PolicyError, match="window must be <= 65536, got 9223372036854775807"):
        preset("psr", 32, 8, window=2 ** 63 - 1)
