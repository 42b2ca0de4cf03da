"""The command line as a researcher meets it: fast help (no heavy imports at parse time), one line and exit
status 130 on Ctrl-C, and `specmoe run --set KEY=VALUE` overrides."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from specmoe.cli import main
from test_experiments import MICRO as EXPERIMENT_MICRO  # the micro config of the experiment tests

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "scipy", "pandas", "numba")

HELP_PROBE = """
import contextlib, io, json, sys
from specmoe.cli import build_parser, main

commands = sorted(build_parser()._subparsers._group_actions[0].choices)
for argv in [["--help"], *[[c, "--help"] for c in commands]]:
    with contextlib.redirect_stdout(io.StringIO()) as out:
        try:
            main(argv)
        except SystemExit as exc:
            assert exc.code == 0, (argv, exc.code)
    assert "usage:" in out.getvalue(), argv
print(json.dumps({"commands": commands, "loaded": [m for m in %r if m in sys.modules]}))
""" % (HEAVY,)


def test_help_of_every_command_imports_no_heavy_module():
    done = subprocess.run([sys.executable, "-c", HELP_PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert {"run", "report", "sd", "demo", "calibrate", "trace", "replay", "replay-sd", "compare", "eval"} <= set(
        result["commands"])
    assert result["loaded"] == []


def _interrupt(*args, **kwargs):
    raise KeyboardInterrupt


@pytest.mark.parametrize("argv, module, name", [
    (["run", str(ROOT / "experiments" / "quickstart.toml")], "specmoe.experiments.run", "run_experiment"),
    (["report", "runs/nowhere"], "specmoe.experiments.report", "read_table"),
    (["demo"], "specmoe.experiments.run", "run_experiment"),
    (["sd"], "specmoe.experiments.run", "run_experiment"),
])
def test_ctrl_c_is_one_line_and_exit_130(argv, module, name, monkeypatch, capsys):
    import importlib

    monkeypatch.setattr(importlib.import_module(module), name, _interrupt)
    assert main(argv) == 130
    captured = capsys.readouterr()
    assert captured.err == f"specmoe {argv[0]}: interrupted\n"


MICRO = EXPERIMENT_MICRO.replace("rounds = 2", "rounds = 1").replace('{preset = "psr", bonus = [0.1, 0.3]}', '"psr"')


def test_ctrl_c_in_a_run_keeps_finished_cells_and_says_how_to_resume(tmp_path, monkeypatch, capsys):
    from specmoe.experiments.measure import Session

    measure = Session.measure
    calls = []

    def killed_in_the_second_cell(self, c, round_):
        calls.append(c.index)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return measure(self, c, round_)

    config, out = tmp_path / "micro.toml", tmp_path / "run"
    config.write_text(MICRO)
    monkeypatch.setattr(Session, "measure", killed_in_the_second_cell)
    assert main(["run", str(config), "--out", str(out), "--no-progress"]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"specmoe run: interrupted; 1 of 2 cells done, kept in {out}; run the same command to "
                       "resume")
    assert len(list((out / "cells").iterdir())) == 1
    monkeypatch.setattr(Session, "measure", measure)
    assert main(["run", str(config), "--out", str(out), "--no-progress"]) == 0
    assert json.loads((out / "manifest.json").read_text())["status"] == "complete"


QUICKSTART = ROOT / "experiments" / "quickstart.toml"


def test_a_copied_config_refused_by_its_run_directory_says_what_to_do(tmp_path, capsys):
    out = tmp_path / "quickstart"
    out.mkdir()
    (out / "manifest.json").write_text(json.dumps({"digest": "0123456789abcdef"}))  # the original's run
    copy = tmp_path / "mine.toml"
    copy.write_text(QUICKSTART.read_text().replace('drafters = ["ar", "dflash"]', 'drafters = ["synthetic"]'))
    assert main(["run", str(copy), "--dry-run", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "holds a run of another config" in err
    assert f"change `name` in {copy}" in err and "pass --out DIR" in err


def test_set_overrides_keys_before_the_checks_and_makes_another_run(tmp_path, capsys):
    from specmoe.experiments.config import load_config
    from specmoe.experiments.run import default_run_dir

    sets = ['sd.drafters=["synthetic"]', "rounds=2", "model.source=family"]
    plain, overridden = load_config(QUICKSTART), load_config(QUICKSTART, sets)
    assert overridden.sd.drafters == ("synthetic",) and overridden.rounds == 2 and overridden.overrides == tuple(sets)
    assert overridden.resolved()["rounds"] == 2 and overridden.digest() != plain.digest()
    assert load_config(QUICKSTART, ["rounds=5"]).digest() == plain.digest()  # the same values: the same run
    assert default_run_dir(plain).name == "quickstart"
    assert default_run_dir(overridden).name == f"quickstart-{overridden.digest()}"

    argv = ["--dry-run", "--out", str(tmp_path / "r")]
    assert main([*argv, "--set", 'sd.drafters=["synthetic"]', "--set", "rounds=2"]) == 0
    out = capsys.readouterr().out
    assert "SD synthetic + exact, k=8, P=32" in out and "dflash" not in out and "2 rounds" in out
    assert main([*argv, "--set", 'sd.drafters=["synthetic"]', "rounds=2"]) == 0  # several after one --set
    assert capsys.readouterr().out == out
    for bad, message in [("sd.drafterz=1", "sd.drafterz: unknown key"), ("rounds=0", "rounds: expected an integer"),
                         ("rounds", "expected KEY=VALUE"), ('sd.drafters=["medusa"]', "sd.drafters: expected some")]:
        assert main([*argv, "--set", bad]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, err


def test_set_overrides_are_recorded_in_the_manifest(tmp_path, capsys):
    from specmoe.experiments.config import load_config

    config, out = tmp_path / "micro.toml", tmp_path / "run"
    config.write_text(MICRO)
    sets = ['ar.policies=["exact_lru"]']
    assert main(["run", str(config), "--out", str(out), "--no-progress", "--set", sets[0]]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["overrides"] == sets and manifest["cells_total"] == 1
    assert manifest["config"]["ar"]["policies"] == [{"preset": "exact_lru", "overrides": []}]
    assert manifest["digest"] == load_config(config, sets).digest() != load_config(config).digest()
    assert main(["run", str(config), "--out", str(out), "--no-progress"]) == 2  # without them: another run
    assert "holds a run of another config" in capsys.readouterr().err


class _Loaded(Exception):
    """Raised by the stand-in loader: the command got as far as loading its model."""


def test_every_command_resolves_a_model_name_alike(tmp_path, monkeypatch, capsys):
    import specmoe.models
    from specmoe.experiments.grid import model_source
    from specmoe.models import resolve_source

    family = resolve_source("family")
    seen = []

    def load_model(source, **kwargs):
        seen.append(resolve_source(source))  # what load_model itself would load
        raise _Loaded

    monkeypatch.setattr(specmoe.models, "load_model", load_model)
    text = tmp_path / "held_out.txt"
    text.write_text("a held-out text\n")
    for argv in (["calibrate", "--model", "family", "--selfgen", "1", "--out", str(tmp_path / "c.safetensors")],
                 ["demo", "--model", "family", "--out", str(tmp_path / "demo")],
                 ["sd", "--model", "family", "--threads", str(__import__("torch").get_num_threads()),
                  "--out", str(tmp_path / "sd")],
                 ["trace", "--model", "family", "--text", str(text), "--out", str(tmp_path / "t.safetensors")]):
        with pytest.raises(_Loaded):
            main(argv)
        assert seen.pop() == family, argv[0]
    assert model_source("family") == family  # `specmoe run`: [model] source

    # calibrate --text also reads the model's tokenizer: the same directory
    import types

    import specmoe.experiments.calibrate as calibrate

    def text_tokens(texts, tokenizer_dir):
        seen.append(tokenizer_dir)
        raise _Loaded

    monkeypatch.setattr(specmoe.models, "load_model", lambda source, **kw: (
        seen.append(resolve_source(source)) or types.SimpleNamespace(config=types.SimpleNamespace()), None))
    monkeypatch.setattr(calibrate, "text_tokens", text_tokens)
    with pytest.raises(_Loaded):
        main(["calibrate", "--model", "family", "--text", str(text), "--out", str(tmp_path / "c.safetensors")])
    assert seen[-2:] == [family, family]
    assert main(["run", str(QUICKSTART), "--dry-run", "--set", "model.source=family", "--out", str(tmp_path / "r")]) == 0
    assert "model family (L=16, E=64, K=8)" in capsys.readouterr().out


def test_a_hub_id_resolves_from_the_local_hub_cache_only(tmp_path, monkeypatch, capsys):
    from specmoe.models import ModelSourceError, load_model, resolve_source

    model, _ = load_model("olmoe-micro", seed=0)
    snapshot = tmp_path / "hub" / "models--acme--micro-moe" / "snapshots" / "0123abcd"
    model.save_pretrained(snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0123abcd")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_source("acme/micro-moe") == str(snapshot)
    loaded, adapter = load_model("acme/micro-moe")
    assert adapter.num_experts == 64 and torch_equal(loaded, model)
    # every command takes it: `specmoe run`'s [model] source (and so sd and demo), here without loading weights
    assert main(["demo", "--model", "acme/micro-moe", "--dry-run", "--out", str(tmp_path / "d")]) == 0
    assert "model acme/micro-moe (L=16, E=64, K=8)" in capsys.readouterr().out
    with pytest.raises(ModelSourceError, match="not a checkpoint directory, a named config nor a model in the local "
                                               "Hugging Face hub cache"):
        resolve_source("acme/not-cached")
    assert main(["demo", "--model", "acme/not-cached", "--dry-run", "--out", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'acme/not-cached' is not a checkpoint directory" in err[0] and "does not download" in err[0]


def torch_equal(a, b) -> bool:
    import torch

    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
