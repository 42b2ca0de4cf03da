"""The command line as a researcher meets it: fast help (no heavy imports at parse time), one line and exit
status 130 on Ctrl-C, and `specmoe run --set KEY=VALUE` overrides."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from specmoe.cli import main

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
    assert {"run", "report", "sd", "demo", "calibrate", "trace", "replay", "replay-sd", "compare"} <= set(
        result["commands"])
    assert result["loaded"] == []


def _interrupt(*args, **kwargs):
    raise KeyboardInterrupt


@pytest.mark.parametrize("argv, module, name", [
    (["run", str(ROOT / "experiments" / "quickstart.toml")], "specmoe.experiments.run", "run_experiment"),
    (["report", "runs/nowhere"], "specmoe.experiments.report", "read_table"),
    (["demo"], "specmoe.experiments.demo", "run_demo"),
    (["sd"], "specmoe.experiments.sd", "run_sd"),
])
def test_ctrl_c_is_one_line_and_exit_130(argv, module, name, monkeypatch, capsys):
    import importlib

    monkeypatch.setattr(importlib.import_module(module), name, _interrupt)
    assert main(argv) == 130
    captured = capsys.readouterr()
    assert captured.err == f"specmoe {argv[0]}: interrupted\n"


MICRO = """
name = "micro"
mode = "generation"
rounds = 1
[model]
source = "olmoe-micro"
[calibration]
windows = 2
length = 16
[workload]
source = "selfgen"
count = 2
length = 6
new_tokens = 4
[ar]
capacity = 16
policies = ["exact_lru", "psr"]
"""


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
