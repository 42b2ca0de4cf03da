"""Regression tests of issue 9 (hardening): bad files, arguments and values are clear errors before any numba
kernel runs; the numbers in the test names are the issue's items."""

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from specmoe.files import write_safetensors
from specmoe.routing import (Calibration, CalibrationBuilder, CalibrationError, LogicalCache, PolicyConfig,
                             RouterScoring,
                             PolicyError, TokenPrior, preset, replay)
from specmoe.records import Trace, TraceError

L, E, K, V, T = 2, 8, 2, 10, 6  # a small geometry for hand-made files
ROOT = Path(__file__).resolve().parents[1]


def good_arrays() -> dict:
    """The tensors of a valid calibration file of geometry L, E, V (every token routed to experts 1 and 3)."""
    dense = np.zeros((L, V, E))
    dense[:, :, [1, 3]] = 0.5
    prior = TokenPrior.from_dense(dense)
    return {"warm_ranking": np.tile(np.arange(E), (L, 1)), "delta": np.full(L, 2.0), "prior_indptr": prior.indptr,
            "prior_experts": prior.experts, "prior_values": prior.values}


def write_calibration(path, provenance='{"model": "hand-made"}', drop=(), **changes) -> Path:
    """A calibration file written without any check, with tensors replaced by `changes` or dropped."""
    arrays = {**good_arrays(), **changes}
    meta = {"format": "specmoe-calibration", "version": "1", "provenance": provenance}
    return write_safetensors(path, {k: v for k, v in arrays.items() if k not in drop}, meta)


def logits(seed=0, shape=(T, L, E)):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def good_trace(**changes) -> Trace:
    fields = dict(router_logits=logits(0), pregate_logits=logits(1), token_ids=np.arange(T) % V,
                  sequence_starts=np.array([0, 3]), top_k=K, vocab_size=V, model="hand-made")
    return Trace(**{**fields, **changes})


def good_calibration() -> Calibration:
    a = good_arrays()
    return Calibration(a["warm_ranking"], TokenPrior(a["prior_indptr"], a["prior_experts"], a["prior_values"]),
                       a["delta"], {"model": "hand-made"})


def cache():
    return LogicalCache(preset("psr", 4, K), good_calibration(), L, E)


def run_cli(*argv, cwd=ROOT):
    """`python3 -m specmoe ARGV` in a subprocess: (exit status, stderr lines)."""
    done = subprocess.run([sys.executable, "-m", "specmoe", *map(str, argv)], cwd=cwd, capture_output=True,
                          text=True, timeout=300)
    return done.returncode, done.stderr.strip().splitlines()


# -- 1: calibration files with bad values ---------------------------------------------------------------
BAD_CALIBRATIONS = {
    "warm ranking entry >= E": (dict(warm_ranking=np.array([[1000, *range(1, E)]] * L)), "outside [0, 8)"),
    "prior offsets past the data": (dict(prior_indptr=good_arrays()["prior_indptr"] + 7), "prior_indptr"),
    "prior expert ids >= E": (dict(prior_experts=np.tile(np.array([1, 9], np.int32), L * V)), "outside [0, 8)"),
}


@pytest.mark.parametrize("name", BAD_CALIBRATIONS)
def test_1_bad_calibration_values_are_refused_at_load(tmp_path, name):
    changes, message = BAD_CALIBRATIONS[name]
    path = write_calibration(tmp_path / "cal.safetensors", **changes)
    with pytest.raises(CalibrationError, match=re.escape(message)) as info:
        Calibration.load(path)
    assert str(path) in str(info.value)


def test_1_replay_command_with_bad_calibrations_exits_2_not_139(tmp_path, capsys):
    from specmoe.cli import main

    trace = good_trace().save(tmp_path / "trace.safetensors")
    for name, (changes, message) in BAD_CALIBRATIONS.items():
        cal = write_calibration(tmp_path / f"{len(name)}.safetensors", **changes)
        argv = ["replay", "--trace", trace, "--calibration", cal, "-C", 4]
        if name == "warm ranking entry >= E":  # the reproduction, in its own process (it was exit 139)
            code, err = run_cli(*argv)
        else:
            code, err = main(list(map(str, argv))), capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and message in err[0] and str(cal) in err[0], (name, code, err)
    assert main(["replay", "--trace", str(trace), "--calibration", str(write_calibration(tmp_path / "ok.st")),
                 "-C", "4", "--out", str(tmp_path / "replay")]) == 0


# -- 2: the logical cache's arguments -------------------------------------------------------------------
def test_2_logical_cache_refuses_bad_layers_and_lengths():
    c = cache()
    z = np.zeros(E)
    for bad in (E + 1, K - 1):
        with pytest.raises(ValueError, match=f"router_logits must be 1-D of length {E}"):
            c.select(0, np.zeros(bad), 0)
    for layer in (L, -1):
        with pytest.raises(ValueError, match=rf"layer {layer} is outside \[0, {L}\)"):
            c.select(layer, z, 0)
        with pytest.raises(ValueError, match="outside"):
            c.insert_predicted(layer, z, 0)
        with pytest.raises(ValueError, match="outside"):
            c.run_span(layer, np.zeros((3, E)), None, np.zeros(3, dtype=np.int64))
        with pytest.raises(ValueError, match="outside"):
            c.resident(layer)
    with pytest.raises(ValueError, match=f"pregate_logits must be 1-D of length {E}"):
        c.insert_predicted(1, np.zeros(3000), 0)
    with pytest.raises(ValueError, match="budget"):
        c.insert_predicted(1, z, 0, budget=-1)
    with pytest.raises(ValueError, match="token ids of layer 0 must hold 3 positions, got 2"):
        c.run_span(0, np.zeros((3, E)), None, np.zeros(2, dtype=np.int64))
    with pytest.raises(ValueError, match=r"valid .* must be \[3\]"):
        c.run_span(0, np.zeros((3, E)), None, np.zeros(3, dtype=np.int64), np.ones(2, dtype=bool))
    with pytest.raises(ValueError, match=rf"slot_of: layer -1 is outside \[0, {L}\)"):
        c.slot_of(-1, [0])
    with pytest.raises(ValueError, match="unused_at"):
        c.reset(unused_at=np.zeros((4, L + 1), dtype=np.int64))
    assert c.totals()["steps"] == 0  # nothing ran


def test_2_engine_route_checks_its_buffers():
    c = cache()
    z = np.zeros(E, np.float32)
    buffers = dict(logits_out=np.zeros(E, np.float32), selected=np.zeros(K, np.int64), slots=np.zeros(K, np.int32),
                   weights=np.zeros(K, np.float32))
    assert c.route(0, z, 0, RouterScoring(renormalise=True), **buffers) >= 0
    for name, short in [("logits_out", np.zeros(E - 1, np.float32)), ("selected", np.zeros(K + 1, np.int64)),
                        ("weights", np.zeros(1, np.float32))]:
        with pytest.raises(ValueError, match=f"route: {name} must be 1-D"):
            c.route(1, z, 0, RouterScoring(renormalise=True), **{**buffers, name: short})
    with pytest.raises(ValueError, match="layer 2 is outside"):
        c.route(L, z, 0, RouterScoring(renormalise=True), **buffers)
    with pytest.raises(ValueError, match="router_logits"):
        c.route(1, np.zeros(3000, np.float32), 0, RouterScoring(renormalise=True), **buffers)


# -- 3: one calibration check against a model, shared -------------------------------------------------------
def test_3_patch_model_checks_the_calibration_with_calibration_check(monkeypatch):
    from specmoe.harness import patch_model
    from specmoe.models import load_model

    model, adapter = load_model("olmoe-micro")
    calls = []

    def spy(self, num_layers, num_experts, vocab_size=None, fingerprint=None):
        calls.append((num_layers, num_experts, vocab_size, fingerprint))
        raise CalibrationError("refused")

    cal = Calibration.uniform(adapter.num_moe_layers, adapter.num_experts, adapter.vocab_size)
    cal.provenance["fingerprint"] = "f" * 64
    monkeypatch.setattr(Calibration, "check", spy)
    with pytest.raises(CalibrationError, match="refused"):
        patch_model(model, adapter, preset("exact_lru", 16, adapter.top_k), cal)
    assert calls == [(adapter.num_moe_layers, adapter.num_experts, adapter.vocab_size, adapter.fingerprint(model))]


def test_3_calibration_check_names_vocabulary_and_fingerprint():
    cal = Calibration.uniform(L, E, 8192, 1.0, "other")
    cal.provenance["fingerprint"] = "a" * 64
    with pytest.raises(CalibrationError, match="vocabulary 8192, the model has 512; router fingerprint"):
        cal.check(L, E, 512, "b" * 64)


# -- 4: silent wrong results ---------------------------------------------------------------------------------
@pytest.mark.parametrize("delta,message", [
    ([np.nan, 1.0], "delta .* must be finite"), ([-1.0, 1.0], r"entry \[0\] is -1.0"), ([np.inf, 1.0], "finite"),
])
def test_4_bad_delta_is_refused(tmp_path, delta, message):
    with pytest.raises(CalibrationError, match=message):
        Calibration.load(write_calibration(tmp_path / "c.st", delta=np.array(delta)))


def test_4_duplicated_warm_ranking_and_dense_prior_of_another_e():
    ranking = np.tile(np.arange(E), (L, 1))
    ranking[1, 5] = 0
    with pytest.raises(CalibrationError, match="warm ranking of layer 1 lists expert 0 more than once"):
        Calibration(ranking, np.zeros((L, V, E)), np.ones(L))
    with pytest.raises(CalibrationError, match="dense token prior has 9 experts per layer, the warm ranking 8"):
        Calibration(np.tile(np.arange(E), (L, 1)), np.zeros((L, V, E + 1)), np.ones(L))
    with pytest.raises(CalibrationError, match="frequencies"):
        Calibration(np.tile(np.arange(E), (L, 1)), np.full((L, V, E), 2.0), np.ones(L))
    with pytest.raises(CalibrationError, match="warm ranking must hold integers"):
        Calibration(np.tile(np.arange(E), (L, 1)) + 0.5, np.zeros((L, V, E)), np.ones(L))


def test_4_token_prior_rows_must_list_experts_once():
    arrays = good_arrays()
    experts = arrays["prior_experts"].copy()
    experts[1] = experts[0]  # token 0 of layer 0: expert 1 twice
    with pytest.raises(CalibrationError, match="layer 0, token 0 lists expert 1 twice"):
        TokenPrior(arrays["prior_indptr"], experts, arrays["prior_values"])


@pytest.mark.parametrize("tokens,message", [
    (np.array([0, 1, 2, 3, 4, 10_000_000]), "outside"), (np.array([0, 1, 2, 3, 4, -5]), "outside"),
    (np.array([0, 1, 2, 3, 4, np.nan]), "must hold integers"), (np.arange(T) + 0.0, "must hold integers"),
])
def test_4_bad_token_ids_are_refused_by_replay_and_traces(tokens, message):
    cal = good_calibration()
    with pytest.raises(ValueError, match=message):
        replay(preset("psr", 4, K), logits(0), logits(1), tokens, cal)
    with pytest.raises(TraceError, match=message):
        good_trace(token_ids=tokens)
    # -1 (an unknown token, as the harness records for inputs_embeds) stays valid for replay
    replay(preset("psr", 4, K), logits(0), logits(1), np.full(T, -1), cal)


def test_4_non_finite_pregate_and_float_sequence_starts_are_refused():
    cal = good_calibration()
    for bad in (np.nan, np.inf):
        g = logits(1)
        g[2, 1, 3] = bad
        with pytest.raises(ValueError, match=r"pre-gate logits .* finite.*entry \[2, 0, 3\]"):
            replay(preset("psr", 4, K), logits(0), g, None, cal)
        with pytest.raises(TraceError, match="pre-gate logits"):
            good_trace(pregate_logits=g)
    g = logits(1)
    g[:, 0] = np.nan  # layer 0 has no pre-gate: ignored
    replay(preset("psr", 4, K), logits(0), g, None, cal)
    with pytest.raises(ValueError, match="sequence_starts must hold integers"):
        replay(preset("psr", 4, K), logits(0), logits(1), None, cal, sequence_starts=[0.0, 2.5])
    with pytest.raises(TraceError, match="sequence_starts must hold integers"):
        good_trace(sequence_starts=np.array([0.0, 3.0]))


def test_4_calibration_builder_refuses_non_finite_logits_and_bad_tokens():
    builder = CalibrationBuilder(L, E, V, K)
    z = logits(0)
    z[1, 1, 2] = np.nan
    with pytest.raises(CalibrationError, match=r"router logits must be finite .*entry \[1, 1, 2\]"):
        builder.add(z, np.arange(T))
    with pytest.raises(CalibrationError, match="token ids must hold integers"):
        builder.add(logits(0), np.arange(T) + 0.0)
    with pytest.raises(CalibrationError, match="outside"):
        builder.add(logits(0), np.arange(T) + V)
    assert builder.tokens == 0


@pytest.mark.parametrize("bonus", [np.inf, np.nan, True, "0.3"])
def test_4_bonus_must_be_a_finite_number(bonus):
    with pytest.raises(PolicyError, match="bonus"):
        PolicyConfig(kind="psr", capacity=4, top_k=2, bonus=bonus, insert_budget=1)


# -- 5: bad files are one clear error naming the file ---------------------------------------------------------
def test_5_missing_tensor_and_bad_metadata_name_the_file(tmp_path):
    with pytest.raises(CalibrationError, match=r"c1.st lacks the tensor\(s\) delta"):
        Calibration.load(write_calibration(tmp_path / "c1.st", drop=("delta",)))
    with pytest.raises(CalibrationError, match="c2.st: calibration provenance must be a dict"):
        Calibration.load(write_calibration(tmp_path / "c2.st", provenance="[1, 2]"))
    with pytest.raises(CalibrationError, match="c3.st: the provenance metadata is not valid JSON"):
        Calibration.load(write_calibration(tmp_path / "c3.st", provenance="{model"))
    with pytest.raises(CalibrationError, match="provenance records num_experts 64, the arrays have 8"):
        Calibration.load(write_calibration(tmp_path / "c4.st", provenance='{"num_experts": 64}'))
    path = good_trace().save(tmp_path / "t.st")
    from safetensors.numpy import load_file, save_file
    from safetensors import safe_open

    with safe_open(str(path), "numpy") as f:
        meta = f.metadata()
    save_file(load_file(str(path)), str(path), metadata={**meta, "info": "{not json"})
    with pytest.raises(TraceError, match="t.st: the info metadata is not valid JSON"):
        Trace.load(path)


# -- 10: numpy integers are integers ----------------------------------------------------------------------------
def test_10_policy_accepts_numpy_integers():
    policy = PolicyConfig(kind="psr", capacity=np.int64(16), top_k=np.int32(8), bonus=np.float32(0.25),
                          insert_budget=np.int64(1))
    assert type(policy.capacity) is int and policy.capacity == 16 and policy.bonus == 0.25
    assert json.dumps(dataclasses.asdict(policy))  # plain Python values


# -- 6: a run's result files are one unit; temporary names are unique --------------------------------------------
def test_6_run_dir_is_replaced_as_a_whole(tmp_path, monkeypatch):
    from specmoe.files import write_run_dir

    out = tmp_path / "runs" / "demo"
    write_run_dir(out, {"results.csv": "a\n1\n", "results.json": '{"run": 1}'})
    write_run_dir(out, {"results.csv": "a\n2\n", "results.json": '{"run": 2}'})
    assert sorted(os.listdir(out)) == ["results.csv", "results.json"]
    assert (out / "results.csv").read_text() == "a\n2\n" and json.loads((out / "results.json").read_text())["run"] == 2

    write_text = Path.write_text

    def disk_full_at_json(path, text, *args, **kwargs):
        if path.name == "results.json":
            raise OSError("disk full")
        return write_text(path, text, *args, **kwargs)

    with monkeypatch.context() as patch:  # a failure between the two files leaves the earlier run as it was
        patch.setattr(Path, "write_text", disk_full_at_json)
        with pytest.raises(OSError, match="disk full"):
            write_run_dir(out, {"results.csv": "a\n3\n", "results.json": "{}"})
    assert (out / "results.csv").read_text() == "a\n2\n"
    assert sorted(os.listdir(out.parent)) == ["demo"]  # no temporary left behind
    (out / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="notes.txt"):
        write_run_dir(out, {"results.csv": "", "results.json": ""})
    assert (out / "notes.txt").read_text() == "mine"


def test_6_concurrent_writers_of_one_path_do_not_collide(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from specmoe.files import write_run_dir, write_text_atomic

    def one(i):
        write_text_atomic(tmp_path / "table.csv", f"run {i}\n")
        write_run_dir(tmp_path / "run", {"results.csv": f"{i}", "results.json": json.dumps(i)})

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(16)))
    assert sorted(os.listdir(tmp_path)) == ["run", "table.csv"]
    run = tmp_path / "run"
    assert (run / "results.csv").read_text() == str(json.loads((run / "results.json").read_text()))


# -- 5, 7, 8, 9: the command line -------------------------------------------------------------------------------
def one_line_error(capsys, argv, message):
    """Run `specmoe ARGV` in this process; assert exit status 2 and one stderr line holding `message`."""
    from specmoe.cli import main

    assert main([str(a) for a in argv]) == 2, argv
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], (argv, err)


def test_5_unwritable_outputs_are_refused_before_anything_runs(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("some text")
    existing_file = tmp_path / "file"
    existing_file.write_text("x")
    cases = [  # `--model no/such/dir` shows that the output is checked first
        (["calibrate", "--model", "no/such/dir", "--selfgen", 1, "--out", tmp_path], "is an existing directory"),
        (["calibrate", "--model", "no/such/dir", "--selfgen", 1, "--out", existing_file / "c.st"],
         "is not a directory"),
        (["demo", "--model", "no/such/dir", "--out", existing_file], "is an existing file"),
        (["trace", "--text", text, "--out", tmp_path], "is an existing directory"),
    ]
    if Path("/sys").is_dir():  # read-only even for root
        cases.append((["calibrate", "--model", "no/such/dir", "--selfgen", 1, "--out", "/sys/c.st"],
                      "cannot create files in /sys"))
    if os.geteuid() != 0:
        read_only = tmp_path / "read-only"
        read_only.mkdir(mode=0o555)
        cases.append((["demo", "--model", "no/such/dir", "--out", read_only / "demo"], "cannot create files in"))
    for argv, message in cases:
        one_line_error(capsys, argv, message)
    assert sorted(os.listdir(tmp_path)) == sorted(["t.txt", "file"] + (["read-only"] if os.geteuid() else []))


def test_5_bad_values_of_arguments_are_one_line(tmp_path, capsys):
    for argv, message in [
        (["demo", "--threads", -1], "argument --threads: must be at least 1, got -1"),
        (["demo", "--capacities", "32,x"], "argument --capacities: expected an integer, got 'x'"),
        (["replay", "--trace", "t", "--calibration", "c", "-C", 0], "argument --capacity/-C: must be at least 1"),
        (["frob"], "invalid choice: 'frob'"),
        (["replay", "--trace", tmp_path / "none.st", "--calibration", "c", "-C", 4], "no calibration file at c"),
    ]:
        one_line_error(capsys, argv, message)


def test_7_window_counts_threads_and_text_encoding(tmp_path, capsys):
    from specmoe.experiments.calibrate import token_windows

    ids = tmp_path / "ids.npy"
    np.save(ids, np.arange(100))
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\xe9 au lait".encode("latin-1"))
    cases = [
        (["calibrate", "--model", "olmoe-micro", "--tokens", ids, "--windows", 0, "--out", tmp_path / "c.st"],
         "argument --windows: must be at least 1, got 0"),
        (["calibrate", "--model", "olmoe-micro", "--tokens", ids, "--windows", -1, "--out", tmp_path / "c.st"],
         "argument --windows: must be at least 1, got -1"),
        (["demo", "--threads", 0], "argument --threads: must be at least 1, got 0"),
        (["calibrate", "--model", "no/such/dir", "--text", latin1, "--out", tmp_path / "c.st"],
         f"text file {latin1} is not UTF-8 text (byte 0xe9 at offset 3)"),
        (["trace", "--model", "family", "--text", latin1, "--out", tmp_path / "t.st"],
         f"text file {latin1} is not UTF-8 text (byte 0xe9 at offset 3)"),
    ]
    for argv, message in cases:
        one_line_error(capsys, argv, message)
    with pytest.raises(ValueError, match="window limit"):
        token_windows(np.arange(100), 10, 0)
    assert len(token_windows(np.arange(100), 10, None)) == 10


@pytest.mark.parametrize("content,message", [
    (np.arange(12).reshape(3, 4), "1-D array of integer token ids, got a int64 array of shape (3, 4)"),
    (np.arange(12) + 0.5, "got a float64 array"),
])
def test_4_token_files_must_be_1d_integers(tmp_path, capsys, content, message):
    ids = tmp_path / "ids.npy"
    np.save(ids, content)
    one_line_error(capsys, ["calibrate", "--model", "no/such/dir", "--tokens", ids, "--out", tmp_path / "c.st"],
                   message)


def test_8_values_that_depend_on_the_model_fail_before_sampling(tmp_path, capsys):
    one_line_error(capsys, ["demo", "--model", "olmoe-micro", "--length", 100000, "--out", tmp_path / "d"],
                   "workload.length = 100000 positions exceed the 1024 positions of olmoe-micro")
    one_line_error(capsys, ["demo", "--model", "olmoe-micro", "--length", 1], "argument --length: must be at least 2")
    one_line_error(capsys, ["demo", "--model", "olmoe-micro", "--windows", 0], "argument --windows: must be at least 1")
    assert not (tmp_path / "d").exists()


def test_9_specmoe_with_options_only_is_the_quickstart_run(tmp_path, capsys):
    from specmoe.cli import main

    out = tmp_path / "quickstart"
    assert main(["--dry-run", "--out", str(out)]) == 0  # `specmoe [options]` = `specmoe run quickstart.toml [options]`
    assert "AR psr(C=32, lambda=0.3, n=1, A)" in capsys.readouterr().out and not out.exists()
    one_line_error(capsys, ["--capacities", "8"], "unrecognized arguments: --capacities 8")  # demo's: `specmoe demo`
