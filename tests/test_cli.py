"""The `specmoe` command: the main job, calibrate, and clear errors for bad input."""

import json

import numpy as np
import pandas as pd
import pytest

from specmoe.cli import main
from specmoe.routing import Calibration, PolicyError, parse_policy


def run_demo(tmp_path, name):
    from specmoe.rundir import read_table

    out = tmp_path / name
    code = main(["demo", "--model", "olmoe-micro", "--windows", "2", "--length", "24", "--capacities", "16,8",
                 "--out", str(out), "--no-progress"])
    assert code == 0
    return read_table(out), json.loads((out / "manifest.json").read_text())


def test_demo_table_is_complete_deterministic_and_consistent(tmp_path, capsys):
    table, manifest = run_demo(tmp_path, "a")
    again, _ = run_demo(tmp_path, "b")
    figures = ["label", "C", "copies_per_token", "demand_per_token", "prefetch_per_token", "excess_nll", "nll"]
    pd.testing.assert_frame_equal(table[figures], again[figures])
    assert len(table) == 8 * 5 and set(table["C"]) == {16, 8} and manifest["kind"] == "run"  # 5 rounds, untimed:
    assert table.groupby("config")[figures[2:]].nunique().max().max() == 1  # every round repeats the first
    assert "psr(C=16" in capsys.readouterr().out
    kinds = table["policy"].str.extract(r"^(\w+)\(")[0]
    exact = table[kinds == "exact"]
    assert (exact["excess_nll"] == 0).all() and (exact["displaced_per_token_layer"] == 0).all()
    assert (exact["prefetch_per_token"] == 0).all()
    assert (table[kinds == "cache_prior"]["prefetch_per_token"] == 0).all()
    assert (table[kinds == "psr"]["prefetch_per_token"] > 0).all()
    assert np.allclose(table["copies_per_token"], table["demand_per_token"] + table["prefetch_per_token"])
    # the routing bonus reduces copies below exact routing's at each capacity
    for _, rows in table.groupby("C"):
        copies = dict(zip(rows["policy"].str.extract(r"^(\w+)\(")[0], rows["copies_per_token"]))
        assert copies["cache_prior"] < copies["exact"]
    assert manifest["geometry"]["num_experts"] == 64 and (table["tokens"] > 0).all()
    psr = table[(kinds == "psr") & (table["round"] == 0)].set_index("C")["policy"]  # the paper's bonus at each residency
    assert "lambda=0.25" in psr[16] and "lambda=0.25" in psr[8]


def test_calibrate_command_writes_a_calibration_of_the_model(tmp_path):
    out = tmp_path / "cal.safetensors"
    assert main(["calibrate", "--model", "olmoe-micro", "--selfgen", "2", "--length", "16", "--out", str(out)]) == 0
    cal = Calibration.load(out)
    assert cal.warm_ranking.shape == (16, 64) and cal.provenance["tokens"] == 32
    assert "sampled from the model" in cal.provenance["text"]
    tokens = tmp_path / "ids.npy"
    np.save(tokens, np.arange(100) % 128)
    assert main(["calibrate", "--model", "olmoe-micro", "--tokens", str(tokens), "--length", "20",
                 "--out", str(tmp_path / "cal2.safetensors")]) == 0
    assert Calibration.load(tmp_path / "cal2.safetensors").provenance["tokens"] == 100


@pytest.mark.parametrize("argv,message", [
    (["demo", "--model", "no/such/dir"], "no such path"),
    (["demo", "--model", "olmoe-micro", "--capacities", "65"], "C=65 must lie in [K=8, E=64]"),
    (["calibrate", "--model", "olmoe-micro", "--tokens", "missing.npy", "--out", "x.safetensors"], "no token file"),
])
def test_bad_input_is_one_line_and_exit_status_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


@pytest.fixture(scope="module")
def truncated_checkpoint(tmp_path_factory):
    from specmoe.models import load_model

    path = tmp_path_factory.mktemp("truncated") / "ckpt"
    load_model("olmoe-micro")[0].save_pretrained(path)
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    return path


def test_more_bad_input_is_one_line_and_exit_status_2(tmp_path, truncated_checkpoint, capsys):
    ids = tmp_path / "ids.npy"
    np.save(ids, np.array([0, 5, 100000, 7]))
    text = tmp_path / "t.txt"
    text.write_text("some text")
    cases = [
        (["calibrate", "--model", "olmoe-micro", "--selfgen", "0", "--out", "x.safetensors"],
         "argument --selfgen: must be at least 1, got 0"),
        (["calibrate", "--model", "olmoe-micro", "--tokens", str(ids), "--length", "4", "--out", "x.safetensors"],
         "token id 100000 is outside the model's vocabulary"),
        (["demo", "--model", str(truncated_checkpoint)], "cannot load the weights of checkpoint directory"),
        (["trace", "--model", "family", "--text", str(text), "--out", "x.safetensors", "--window", "0"],
         "argument --window: must be at least 1, got 0"),
        (["trace", "--model", "family", "--text", str(tmp_path / "none.txt"), "--out", "x.safetensors"],
         "no text file"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, (argv, err)


def test_policy_overrides():
    policy = parse_policy("psr", 16, 8, ["bonus=0.25", "window=4"])
    assert (policy.bonus, policy.window, policy.insert_budget) == (0.25, 4, 1)
    with pytest.raises(PolicyError, match="bad policy override 'lambda=0.2'"):
        parse_policy("psr", 16, 8, ["lambda=0.2"])
    with pytest.raises(PolicyError, match="window takes a int"):
        parse_policy("psr", 16, 8, ["window=wide"])


def test_trace_calibrate_replay_on_the_shipped_model(tmp_path, capsys):
    from specmoe.assets import family_path

    text = tmp_path / "held_out.txt"
    text.write_text("def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n" * 8)
    trace = tmp_path / "trace.safetensors"
    cal = tmp_path / "cal.safetensors"
    target = str(family_path("target"))
    assert main(["trace", "--model", target, "--text", str(text), "--out", str(trace)]) == 0
    assert main(["calibrate", "--model", target, "--text", str(text), "--length", "64", "--out", str(cal)]) == 0
    capsys.readouterr()
    assert main(["replay", "--trace", str(trace), "--calibration", str(cal), "--policy", "psr", "-C", "16",
                 "--set", "bonus=0.25", "--out", str(tmp_path / "replay")]) == 0
    out = capsys.readouterr().out
    assert "psr(C=16, lambda=0.25, n=1, A)" in out and "copies per token" in out
    assert main(["report", str(tmp_path / "replay")]) == 0  # a run directory of one cell
    assert "replay psr(C=16, lambda=0.25, n=1, A)" in capsys.readouterr().out
    other = tmp_path / "other.safetensors"
    assert main(["calibrate", "--model", "olmoe-micro", "--selfgen", "2", "--length", "16", "--out", str(other)]) == 0
    capsys.readouterr()
    assert main(["replay", "--trace", str(trace), "--calibration", str(other), "-C", "16"]) == 2
    assert "does not fit this model" in capsys.readouterr().err
