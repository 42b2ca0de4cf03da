"""The lm-eval model (`specmoe.evaluation.lm_eval_model`) on the shipped family, offline: its methods against
the harness's own decoding under the same policy, the per-request reset, speculative decoding, and two whole
`specmoe eval` runs (run directories, lm-eval with logged samples) of two policies over a small local task,
compared by `specmoe compare`. Skipped where lm-eval (the `eval` extra) is not installed; that specmoe imports
without it is checked in tests/test_imports.py (a module-level skip here would skip that check too); the run
directory, `report` and `compare` of `specmoe eval` without lm-eval: tests/test_compare.py."""

import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


lm_eval = pytest.importorskip("lm_eval")
lm_eval_model = pytest.importorskip("specmoe.evaluation.lm_eval_model")
from lm_eval.api.instance import Instance  # noqa: E402

from specmoe.harness import collect_calibration, greedy_decode, patch_model, unpatch  # noqa: E402
from specmoe.routing import preset  # noqa: E402

SpecmoeLM = lm_eval_model.SpecmoeLM


@pytest.fixture(scope="module")
def calibration(family, family_text, tmp_path_factory):
    model, adapter = family
    windows = [torch.tensor(family_text[:64]), torch.tensor(family_text[64:128])]
    calibration = collect_calibration(model, adapter, windows, {"text": "family evaluation slice, 2 x 64 tokens"})
    return str(calibration.save(tmp_path_factory.mktemp("cal") / "cal.safetensors"))


@pytest.fixture(scope="module")
def docs(family):
    """Eight questions from the family's evaluation slice: a context of 40 tokens, its true 8-token
    continuation against another window's (multiple choice), and its next 12 tokens (generation)."""
    from transformers import AutoTokenizer

    from specmoe.assets import family_path

    tokenizer = AutoTokenizer.from_pretrained(str(family_path("target")), local_files_only=True)
    windows = json.loads((family_path().parent / "metrics.json").read_text())["slice"]["slice"]["token_ids"]
    result = []
    for i in range(8):
        window, other = windows[i % len(windows)], windows[(i + 1) % len(windows)]
        start = 64 * (i // len(windows))
        true, wrong = tokenizer.decode(window[start + 40:start + 48]), tokenizer.decode(other[start + 40:start + 48])
        result.append({"context": tokenizer.decode(window[start:start + 40]), "label": i % 2,
                       "choices": [true, wrong] if i % 2 == 0 else [wrong, true],
                       "target": tokenizer.decode(window[start + 40:start + 52])})
    return result


def _lm(family, calibration, **kwargs):
    model, _ = family
    return SpecmoeLM(pretrained=model, calibration=calibration, **kwargs)


def _requests(kind, args):
    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


def test_loglikelihood_equals_token_by_token_routing(family, calibration, docs):
    """One teacher-forced forward per request scores like decoding the continuation token by token under the
    same policy from a fresh logical state, whatever request came before."""
    model, adapter = family
    lm = _lm(family, calibration, policy="psr", capacity=16)
    pairs = [(d["context"], d["choices"][0]) for d in docs[:3]]
    scores = lm.loglikelihood(_requests("loglikelihood", pairs), disable_tqdm=True)
    alone = lm.loglikelihood(_requests("loglikelihood", pairs[2:]), disable_tqdm=True)
    assert alone[0] == scores[2]  # the state is reset per request
    context = patch_model(model, adapter, preset("psr", 16, adapter.top_k), lm.calibration)
    for (ctx, cont), (score, greedy) in zip(pairs, scores):
        ctx_ids = lm.tok_encode(ctx)
        cont_ids = lm.tok_encode(ctx + cont)[len(ctx_ids):]
        cache, total, argmax = None, 0.0, []
        from transformers import DynamicCache

        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            out = model(input_ids=torch.tensor([ctx_ids]), past_key_values=cache, use_cache=True)
            for token in cont_ids:
                logprobs = torch.log_softmax(out.logits[0, -1].float(), -1)
                total += float(logprobs[token])
                argmax.append(int(logprobs.argmax()))
                out = model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True)
        assert score == pytest.approx(total, abs=1e-3)
        assert greedy == (argmax == cont_ids)
    unpatch(model)
    assert context.totals()["tokens"] > 0


def test_loglikelihood_rolling_scores_every_token_once(family, calibration, docs):
    text = docs[0]["context"] + docs[0]["target"]
    lm = _lm(family, calibration, policy="psr", capacity=16)
    whole = lm.loglikelihood_rolling(_requests("loglikelihood_rolling", [(text,)]), disable_tqdm=True)[0]
    assert whole == pytest.approx(lm.loglikelihood(_requests("loglikelihood", [("", text)]), disable_tqdm=True)[0][0])
    short = _lm(family, calibration, policy="psr", capacity=16, max_length=16)
    windows = short.loglikelihood_rolling(_requests("loglikelihood_rolling", [(text,)]), disable_tqdm=True)[0]
    assert whole < 0 and windows < 0 and windows != pytest.approx(whole)  # less context per token


def test_generate_until_equals_the_harness_greedy_decode(family, calibration, docs):
    model, adapter = family
    lm = _lm(family, calibration, policy="cache_prior", capacity=16, bonus=0.5)
    assert lm.policy.bonus == 0.5
    gen = {"until": ["\n"], "max_gen_toks": 12, "do_sample": False}
    texts = lm.generate_until(_requests("generate_until", [(d["context"], gen) for d in docs[:3]]))
    assert lm.generate_until(_requests("generate_until", [(docs[2]["context"], gen)])) == texts[2:]
    summary = lm.routing_summary()
    assert summary["tokens"] > 0 and summary["copies"] > 0
    patch_model(model, adapter, preset("cache_prior", 16, adapter.top_k, bonus=0.5), lm.calibration)
    for d, text in zip(docs[:3], texts):
        new, _ = greedy_decode(model, lm.tok_encode(d["context"]), 12, stop_tokens=(lm.eot_token_id,))
        assert text == lm.tok_decode(new.tolist()).split("\n")[0]
    unpatch(model)
    with pytest.raises(ValueError, match="greedily"):
        lm.generate_until(_requests("generate_until", [("x", {"do_sample": True, "temperature": 1.0})]))


def test_speculative_mode_generates_like_exact_routing(family, calibration, docs):
    """With the exact selector the speculative loop's text is AR greedy decoding under exact routing."""
    gen = {"until": ["\n\n"], "max_gen_toks": 16}
    args = [(d["context"], gen) for d in docs[:2]]
    exact = _lm(family, calibration).generate_until(_requests("generate_until", args))
    speculative = _lm(family, calibration, selector="exact", drafter="ar", k=4, pool=32)
    assert speculative.generate_until(_requests("generate_until", args)) == exact
    summary = speculative.routing_summary()
    assert summary["requests"] == 2 and summary["tau"] >= 1.0
    lossy = _lm(family, calibration, selector="acceptmoe", drafter="ar", k=4, pool=16)
    assert all(isinstance(t, str) for t in lossy.generate_until(_requests("generate_until", args)))
    with pytest.raises(ValueError, match="routing policy"):
        speculative.loglikelihood(_requests("loglikelihood", [("a", " b")]), disable_tqdm=True)


def test_bad_model_arguments(family, calibration):
    with pytest.raises(ValueError, match="needs capacity"):
        _lm(family, calibration, policy="psr")
    with pytest.raises(ValueError, match="bad policy override"):
        _lm(family, calibration, policy="psr", capacity=16, nonsense=1)
    with pytest.raises(ValueError, match="batch 1"):
        _lm(family, calibration, batch_size=8)
    with pytest.raises(ValueError, match="alternatives"):
        _lm(family, calibration, selector="exact", policy="psr", capacity=16)


_TASK = """\
task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {cache}
test_split: test
doc_to_text: "{{{{context}}}}"
"""
_MC = """\
output_type: multiple_choice
target_delimiter: ""
doc_to_choice: "{{choices}}"
doc_to_target: label
metric_list:
  - metric: acc
"""
_GEN = """\
output_type: generate_until
doc_to_target: target
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 12
  do_sample: false
process_results: !function utils.process_results
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
  - metric: char_overlap
    aggregation: mean
    higher_is_better: true
  - metric: char_hits
    aggregation: !function utils.flat_mean
    higher_is_better: true
"""
_UTILS = '''\
def process_results(doc, results):
    """exact match of the first line, the share of its characters matched in place, and per character."""
    text, target = results[0], doc["target"].split("\\n")[0]
    hits = [a == b for a, b in zip(text, target)] + [False] * max(0, len(target) - len(text))
    return {"exact_match": float(text == target), "char_overlap": sum(hits) / max(len(target), 1),
            "char_hits": hits or [False]}


def flat_mean(items):
    flat = [x for item in items for x in item]
    return sum(flat) / len(flat)
'''


@pytest.fixture
def task_dir(docs, tmp_path):
    """A directory of two local tasks over `docs`: tiny_mc (multiple choice) and tiny_gen (generation)."""
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    data = tasks / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    for name, body in (("tiny_mc", _MC), ("tiny_gen", _GEN)):
        (tasks / f"{name}.yaml").write_text(_TASK.format(name=name, data=data, cache=tmp_path / "hf") + body)
    (tasks / "utils.py").write_text(_UTILS)
    return tasks


def test_eval_runs_two_policies_into_run_directories_then_compare(task_dir, calibration, tmp_path, capsys):
    """`specmoe eval` end to end on a local task (multiple choice and generation), offline: each run a run
    directory holding lm-eval's results and logged samples; `specmoe compare` pairs the two run directories and
    reports lm-eval's own scores as A and B; `specmoe report` shows them per task."""
    from specmoe.cli import main
    from specmoe.rundir import RunDir, read_table

    scores = {}
    for run, args in (("exact", []), ("cache_prior", ["policy=cache_prior", "capacity=16", "bonus=1.0"])):
        out = tmp_path / run
        assert main(["eval", "--tasks", "tiny_mc,tiny_gen", "--include-path", str(task_dir), "--bootstrap-iters",
                     "0", "--no-progress", "--out", str(out), "--model-args", f"calibration={calibration}",
                     "threads=1", *args]) == 0
        table = read_table(out)
        assert table.label.tolist() == ["tiny_mc", "tiny_gen"]
        scores[run] = {task: figures for cell in table.results for task, figures in json.loads(cell).items()}
        routing = json.loads(table.routing[0])
        assert routing["tokens"] > 0 and (routing["copies"] > 0) == (run == "cache_prior")
        manifest = RunDir(out).manifest()
        assert manifest["kind"] == "eval" and manifest["status"] == "complete"
        assert set(manifest["inputs"]) == {"calibration", "include_path/docs.jsonl", "include_path/tiny_gen.yaml",
                                           "include_path/tiny_mc.yaml", "include_path/utils.py"}
        assert len(list((out / "lm_eval").rglob("samples_tiny_*.jsonl"))) == 2
    capsys.readouterr()
    assert main(["report", str(tmp_path / "cache_prior")]) == 0
    report = (tmp_path / "cache_prior" / "report" / "report.md").read_text()
    acc = scores["cache_prior"]["tiny_mc"]["acc,none"]
    assert f"| tiny_mc | acc | none | {acc:.4f} |" in report

    out = tmp_path / "compare.md"
    assert main(["compare", str(tmp_path / "cache_prior"), str(tmp_path / "exact"), "--out", str(out)]) == 0
    rows = {(r["task"], r["metric"]): r for r in json.loads(out.with_suffix(".json").read_text())["rows"]}
    assert set(rows) == {("tiny_mc", "acc"), ("tiny_gen", "exact_match"), ("tiny_gen", "char_overlap"),
                         ("tiny_gen", "char_hits")}
    for (task, metric), row in rows.items():
        assert row["n"] == 8
        assert row["a"] == pytest.approx(scores["cache_prior"][task][f"{metric},none"])
        assert row["b"] == pytest.approx(scores["exact"][task][f"{metric},none"])
    assert rows["tiny_mc", "acc"]["test"].startswith("McNemar")
    assert rows["tiny_gen", "char_overlap"]["test"] == "sign flip"
    assert rows["tiny_gen", "char_hits"]["test"] == "sign flip by question"
    assert "| tiny_mc | acc | none | 8 |" in capsys.readouterr().out
