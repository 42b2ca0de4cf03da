"""`specmoe compare` on lm-eval sample files written here: pairing by doc_id, the test chosen per metric, Holm
over the table, what is left out and why, the command's files and errors. The expected numbers come from
specmoe.stats on the paired vectors built here (specmoe.stats itself is checked against scipy/statsmodels in
test_stats.py)."""

import json

import numpy as np
import pytest

from specmoe import stats
from specmoe.cli import main
from specmoe.evaluation.compare import compare_runs, sample_files


def _write_run(directory, task, records, date="2026-12-01T10-00-00.000001"):
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"samples_{task}_{date}.jsonl"
    lines = []
    for doc_id, values in records.items():
        record = {"doc_id": doc_id, "doc": {"q": doc_id}, "target": "x", "arguments": {}, "resps": [["y"]],
                  "filtered_resps": ["y"], "filter": "none", "metrics": sorted(values),
                  "doc_hash": f"h{doc_id}", "prompt_hash": "p", "target_hash": "t", **values}
        lines.append(json.dumps(record))
    path.write_text("\n".join(lines) + "\n")
    return path


def _two_runs(tmp_path, seed=0):
    """Runs A and B of task `qa` (acc 0/1, a continuous score, IFEval-like item lists and a corpus-level
    pair) and task `other` (acc), with the vectors they hold."""
    rng = np.random.default_rng(seed)
    n = 60
    acc_a = (rng.random(n) < 0.7).astype(int)
    acc_b = np.where(rng.random(n) < 0.7, acc_a, (rng.random(n) < 0.4).astype(int))
    score_a, score_b = rng.random(n), rng.random(n) * 0.8
    sizes = rng.integers(1, 4, n)
    items_a = [list(rng.random(s) < 0.8) for s in sizes]
    items_b = [list(rng.random(s) < 0.6) for s in sizes]
    order = rng.permutation(n)  # B's file lists the questions in another order
    run_a, run_b = tmp_path / "a" / "model", tmp_path / "b" / "model"
    _write_run(run_a, "qa", {i: {"acc": int(acc_a[i]), "score": float(score_a[i]),
                                 "inst": [bool(x) for x in items_a[i]], "bleu": ["ref", "pred"]} for i in range(n)})
    _write_run(run_b, "qa", {int(i): {"acc": int(acc_b[i]), "score": float(score_b[i]),
                                      "inst": [bool(x) for x in items_b[i]], "bleu": ["ref", "pred"]} for i in order})
    other_a, other_b = np.ones(20, int), np.r_[np.zeros(8, int), np.ones(12, int)]
    _write_run(run_a, "other", {i: {"acc": int(other_a[i])} for i in range(20)})
    _write_run(run_b, "other", {i: {"acc": int(other_b[i])} for i in range(20)})
    return tmp_path / "a", tmp_path / "b", dict(acc=(acc_a, acc_b), score=(score_a, score_b),
                                                inst=(items_a, items_b), other=(other_a, other_b))


def test_compare_pairs_by_doc_id_and_picks_the_test(tmp_path):
    run_a, run_b, data = _two_runs(tmp_path)
    rows, notes = compare_runs(run_a, run_b, resamples=5000, seed=1)
    by = {(r.task, r.metric): r for r in rows}
    assert set(by) == {("qa", "acc"), ("qa", "score"), ("qa", "inst"), ("other", "acc")}
    assert any("bleu" in note and "not scores" in note for note in notes)

    acc = by["qa", "acc"]
    reference = stats.mcnemar_exact(*data["acc"])
    assert acc.p == pytest.approx(reference.p_value) and acc.n == 60
    assert acc.test == f"McNemar {reference.only_a}/{reference.only_b}"
    assert (acc.a, acc.b) == pytest.approx((data["acc"][0].mean(), data["acc"][1].mean()))
    assert acc.se == pytest.approx(stats.paired_difference(*data["acc"]).se)

    score = by["qa", "score"]
    d = data["score"][0] - data["score"][1]
    assert score.test == "sign flip" and score.p == stats.sign_flip_test(d, n_resamples=5000, seed=1).p_value
    assert score.difference == pytest.approx(d.mean())

    inst = by["qa", "inst"]
    items_a, items_b = data["inst"]
    flat_a, flat_b = np.concatenate(items_a).astype(float), np.concatenate(items_b).astype(float)
    clusters = np.repeat(np.arange(60), [len(x) for x in items_a])
    assert inst.items == flat_a.size and inst.n == 60
    assert (inst.a, inst.b) == pytest.approx((flat_a.mean(), flat_b.mean()))  # pooled over items, as lm-eval
    assert inst.p == stats.sign_flip_test(flat_a - flat_b, clusters, n_resamples=5000, seed=1).p_value
    assert inst.se == pytest.approx(stats.paired_difference(flat_a, flat_b, clusters).se)

    assert by["other", "acc"].p == pytest.approx(2 * 0.5 ** 8)
    adjusted = stats.holm([r.p for r in rows])
    assert [r.p_holm for r in rows] == pytest.approx(adjusted.tolist())


def test_compare_metrics_pools_and_unpaired_questions(tmp_path):
    run_a, run_b, data = _two_runs(tmp_path)
    # a third task pooled with `other`, and a question B did not score
    _write_run(run_a / "model", "other_extra", {0: {"acc": 1}, 1: {"acc": 0}, 2: {"acc": 1}})
    _write_run(run_b / "model", "other_extra", {0: {"acc": 0}, 1: {"acc": 0}})
    rows, notes = compare_runs(run_a, run_b, metrics=("acc",), pools={"others": "other*"})
    assert {(r.task, r.metric) for r in rows} == {("qa", "acc"), ("others", "acc")}
    pooled = next(r for r in rows if r.task == "others")
    a = np.r_[data["other"][0], 1, 0]
    b = np.r_[data["other"][1], 0, 0]
    assert pooled.n == 22 and pooled.p == pytest.approx(stats.mcnemar_exact(a, b).p_value)
    assert any("1 questions scored in one run only" in note for note in notes)


def test_compare_refuses_different_documents_and_ambiguous_runs(tmp_path):
    run_a, run_b, _ = _two_runs(tmp_path)
    path = next((run_b / "model").glob("samples_other_*.jsonl"))
    lines = path.read_text().splitlines()
    record = json.loads(lines[0])
    record["doc_hash"] = "changed"
    path.write_text("\n".join([json.dumps(record)] + lines[1:]) + "\n")
    with pytest.raises(ValueError, match="different documents"):
        compare_runs(run_a, run_b)
    _write_run(run_a / "model", "qa", {0: {"acc": 1}}, date="2026-12-02T10-00-00.000001")
    with pytest.raises(ValueError, match="two sample files of task qa"):
        sample_files(run_a)
    with pytest.raises(FileNotFoundError, match="no run"):
        sample_files(tmp_path / "missing")


def test_compare_command_prints_and_writes_the_table(tmp_path, capsys):
    run_a, run_b, data = _two_runs(tmp_path)
    out = tmp_path / "report" / "table.md"
    assert main(["compare", str(run_a), str(run_b), "--out", str(out), "--resamples", "2000"]) == 0
    printed = capsys.readouterr().out
    text = out.read_text()
    assert text in printed
    assert "| task | metric | filter | n | A | B | A − B | se | test | p | p (Holm) |" in text
    assert "| other | acc | none | 20 | 100.0 | 60.0 | **+40.0** |" in text  # p = 2^-7 survives Holm over 4
    assert "Mean difference over the 4 rows" in text and "Note: qa bleu (none): left out" in text
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert len(rows) == 4 and {row["metric"] for row in rows} == {"acc", "score", "inst"}
    # errors: one line on stderr, exit status 2
    assert main(["compare", str(run_a), str(tmp_path / "nothing"), "--out", str(out)]) == 2
    assert "no run at" in capsys.readouterr().err
    assert main(["compare", str(run_a), str(run_b), "--out", str(tmp_path)]) == 2
    assert "is an existing directory" in capsys.readouterr().err
    assert main(["compare", str(run_a), str(run_b), "--metrics", "nope", "--out", str(out)]) == 2
    assert "no task, filter and metric in common" in capsys.readouterr().err


# -- `specmoe eval` run directories (lm-eval replaced by a fake: these tests need no lm-eval) --------------------
def _fake_lm_eval(source, calls):
    """A stand-in for `specmoe.evaluation.run.start_lm_eval` that 'evaluates' a task by copying its samples file
    from the lm-eval output `source` and returns lm-eval's results dict for it (acc: the mean, as lm-eval)."""
    from specmoe.evaluation.compare import read_samples

    def start(model_args, options):
        files = sample_files(source)

        def evaluate(task, out_dir):
            calls.append(task)
            records = read_samples(files[task])
            (out_dir / "model").mkdir(parents=True)
            (out_dir / "model" / files[task].name).write_text(files[task].read_text())
            acc = float(np.mean([r["acc"] for r in records]))
            return {"results": {task: {"alias": task, "acc,none": acc, "acc_stderr,none": 0.01}},
                    "n-samples": {task: {"original": len(records), "effective": len(records)}},
                    "versions": {task: 1.0}, "higher_is_better": {task: {"acc": True}}, "configs": {task: {}}}

        return evaluate, lambda: {"seconds": 0.5, "copies": 1.25, "tokens": 10}

    return start


def test_eval_writes_a_run_directory_that_report_and_compare_read(tmp_path, monkeypatch, capsys):
    """`specmoe eval` into a run directory (one cell per task, resumable, lm-eval's sample files inside),
    `specmoe report` of it (the per-task table), and `specmoe compare` of two of them, equal to comparing the
    lm-eval outputs they hold."""
    from specmoe.evaluation import run as evaluation
    from specmoe.rundir import RunDir, read_table

    source_a, source_b, _ = _two_runs(tmp_path / "source")
    calls = []
    runs = {}
    for name, source, args in (("a", source_a, ["policy=psr", "capacity=16,bonus=0.3"]),
                               ("b", source_b, ["policy=exact_lru"])):
        monkeypatch.setattr(evaluation, "start_lm_eval", _fake_lm_eval(source, calls))
        out = tmp_path / f"eval_{name}"
        argv = ["eval", "--tasks", "qa,other", "--model-args", *args, "--out", str(out), "--no-progress"]
        assert main([*argv, "--max-cells", "1"]) == 0
        assert read_table(out).label.tolist() == ["qa"]
        (out / "lm_eval" / "c0001.partial").mkdir()  # a task interrupted part-way: run again from scratch
        assert main(argv) == 0  # resumes: only the second task runs
        runs[name] = out
    assert calls == ["qa", "other", "qa", "other"]
    manifest = RunDir(runs["a"]).manifest()
    assert manifest["kind"] == "eval" and manifest["status"] == "complete" and len(manifest["invocations"]) == 2
    assert manifest["config"]["model_args"] == {"policy": "psr", "capacity": 16, "bonus": 0.3}
    assert manifest["description"] == "lm-eval: policy=psr capacity=16 bonus=0.3"
    assert sorted(p.name for p in (runs["a"] / "lm_eval").iterdir()) == ["c0000", "c0001"]
    table = read_table(runs["a"])
    assert table.kind.tolist() == ["lm_eval", "lm_eval"] and json.loads(table.routing[0])["copies"] == 1.25

    capsys.readouterr()
    assert main(["report", str(runs["a"])]) == 0
    report = (runs["a"] / "report" / "report.md").read_text()
    assert "| qa | acc | none |" in report and "| other | acc | none | 1.0000 | 0.0100 | 20 | yes |" in report
    assert "policy=psr capacity=16 bonus=0.3" in report and "## Cost per task" in report

    out = tmp_path / "compare.md"
    assert main(["compare", str(runs["a"]), str(runs["b"]), "--out", str(out), "--resamples", "2000"]) == 0
    text = out.read_text()
    assert "(lm-eval: policy=psr capacity=16 bonus=0.3)" in text
    assert main(["compare", str(source_a), str(source_b), "--out", str(tmp_path / "plain.md"),
                 "--resamples", "2000"]) == 0
    assert json.loads(out.with_suffix(".json").read_text())["rows"] == \
        json.loads((tmp_path / "plain.json").read_text())["rows"]
    assert main(["eval", "--tasks", "qa", "--model-args", "policy", "--out", str(tmp_path / "bad")]) == 2
    assert "expected KEY=VALUE" in capsys.readouterr().err
