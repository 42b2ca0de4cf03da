"""The family's corpus split, tokenizer, training loop (a few CPU steps on a tiny config), the DFlash format
and the acceptance measurements."""

import json
import math
import sysconfig
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from specmoe.drafters.dflash_model import (DFlashDraftModel, block_attention_mask, block_input_ids,
                                           block_position_ids, build_target_layer_ids, dflash_config)
from specmoe_train.configs import FAMILY_PRESETS, StageConfig
from specmoe_train.corpus import (PARTS, BatchSampler, CorpusError, Source, build_corpus, load_corpus, make_split,
                                   read_part)
from specmoe_train.evaluate import acceptance_tau, routing_locality, tau_from_runs
from specmoe_train.train import lr_at


def _write_sources(root: Path, files: int = 120) -> list[Source]:
    """`files` small Python files cut from stdlib modules (text we did not write)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = "".join((stdlib / name).read_text() for name in ("textwrap.py", "shlex.py", "fnmatch.py", "glob.py"))
    chunk = len(text) // files
    src = root / "src"
    src.mkdir()
    for i in range(files):
        (src / f"mod_{i:03d}.py").write_text(text[i * chunk:(i + 1) * chunk])
    return [Source("sample", src, "*.py")]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    build_corpus(root / "built", sources=_write_sources(root), vocab_size=400)
    return root / "built"


def test_split_is_by_file_disjoint_and_deterministic(tmp_path):
    sources = _write_sources(tmp_path)
    split = make_split(sources)
    parts = {f["path"]: f["part"] for f in split["files"]}
    assert len(parts) == 120 and set(parts.values()) == set(PARTS)
    assert make_split(sources) == split  # deterministic
    texts = {p: read_part(split, p) for p in PARTS}
    assert sum(len(t) for t in texts.values()) == 120
    # the files found through --root (here the same place), and a root the split does not list named
    assert read_part(split, "train", {"sample": sources[0].root}) == texts["train"]
    with pytest.raises(CorpusError, match="does not list; its sources: sample"):
        read_part(split, "train", {"python-doc": tmp_path})
    # a file that changed after the split was recorded is refused
    changed = next(f for f in split["files"] if f["part"] == "evaluation")
    (sources[0].root / changed["path"]).write_text("changed")
    with pytest.raises(CorpusError, match="sha256"):
        read_part(split, "evaluation")


def test_corpus_streams_and_sampler_are_reproducible(corpus):
    streams = load_corpus(corpus)
    split = json.loads((corpus / "split.json").read_text())
    assert all(streams[p].dtype == np.uint16 and streams[p].size == split["tokens"][p]["tokens"] for p in PARTS)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(corpus / "tokenizer"), local_files_only=True)
    assert tok.mask_token == "<|mask|>" and tok.eos_token_id == streams["train"][-1]
    a, b = BatchSampler(streams["train"], 3, 16, seed=5), BatchSampler(streams["train"], 3, 16, seed=5)
    batches = [a.next() for _ in range(4)]
    assert all(np.array_equal(x, b.next()) for x in batches)
    assert batches[0].shape == (3, 17)
    assert not np.array_equal(BatchSampler(streams["train"], 3, 16, seed=6).next(), batches[0])


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    stage = StageConfig(steps=100, lr=1.0, warmup=10, min_lr_ratio=0.1)
    assert lr_at(0, 100, stage) == pytest.approx(0.1) and lr_at(9, 100, stage) == pytest.approx(1.0)
    assert lr_at(10, 100, stage) == pytest.approx(1.0) and lr_at(100, 100, stage) == pytest.approx(0.1)
    assert all(lr_at(s, 100, stage) >= lr_at(s + 1, 100, stage) for s in range(10, 100))


def _tiny(steps=25):
    fc = FAMILY_PRESETS["tiny"]
    stage = replace(fc.target, steps=steps, log_every=1, lr=1e-2, warmup=3)
    return replace(fc, target=stage, drafters=stage, eval_every=steps)


def test_a_few_cpu_steps_decrease_every_loss(corpus):
    from transformers import AutoTokenizer

    from specmoe_train.family import build_models
    from specmoe_train.train import train_drafters, train_target

    torch.manual_seed(0)
    fc = _tiny()
    streams = load_corpus(corpus)
    tok = AutoTokenizer.from_pretrained(str(corpus / "tokenizer"), local_files_only=True)
    target, ar, dflash = build_models(fc, tok, torch.device("cpu"), torch.float32)
    rec = train_target(target, streams["train"], fc, torch.device("cpu"), log=lambda m: None,
                       heldout=streams["evaluation"])
    ce = [r["ce"] for r in rec["rows"]]
    assert rec["steps"] == 25 and np.mean(ce[-5:]) < np.mean(ce[:5]) - 0.5
    assert all(math.isfinite(r["aux_loss"]) and r["aux_loss"] > 0 for r in rec["rows"])
    assert rec["rows"][-1]["heldout_ce"] is not None
    rec = train_drafters(target, ar, dflash, streams["train"], fc, torch.device("cpu"), log=lambda m: None)
    for key in ("ar_loss", "dflash_loss"):
        values = [r[key] for r in rec["rows"]]
        assert np.mean(values[-5:]) < np.mean(values[:5]), key


def test_a_refused_delta_rule_kernel_trains_through_the_reference_and_is_restored(corpus, monkeypatch):
    """A Gated DeltaNet kernel that raises in training (as fla 0.6 does on Hopper under Triton < 3.7.1): the
    target trains through transformers' torch delta rule instead, the record says so, and the modeling module's
    function is the refusing one again afterwards."""
    import sys

    from transformers import AutoTokenizer

    from specmoe_train.configs import MEMBER_PRESETS
    from specmoe_train.members import build_member
    from specmoe_train.train import train_target

    tok = AutoTokenizer.from_pretrained(str(corpus / "tokenizer"), local_files_only=True)
    target, _ = build_member(MEMBER_PRESETS["tiny"]["qwen3_5_moe"], tok, torch.device("cpu"), torch.float32)
    module = sys.modules[type(target).__module__]
    reference = module.torch_chunk_gated_delta_rule.__wrapped__
    calls = []

    def refusing(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("this kernel refuses here")

    refusing.__wrapped__ = reference
    monkeypatch.setattr(module, "torch_chunk_gated_delta_rule", refusing)
    fc = _tiny(steps=3)
    logs = []
    rec = train_target(target, load_corpus(corpus)["train"], fc, torch.device("cpu"), log=logs.append)
    assert calls and rec["steps"] == 3 and all(math.isfinite(r["ce"]) for r in rec["rows"])
    assert rec["gated_delta_rule"].startswith("transformers' torch reference")
    assert any("Gated DeltaNet through" in line for line in logs)
    assert module.torch_chunk_gated_delta_rule is refusing


def _check_crosscheck(crosscheck: dict, key: str) -> None:
    """The harness's speculative loop (incremental decoding) against the teacher-forced walk over the greedy
    continuation (`family.tau_crosscheck`). The two commit different tokens only where the target's top two
    logits tie within float32 rounding (the passes sum in different orders, about 1e-6 relative); the seeded
    tiny models have no such tie, so the tokens must be identical and every block's accepted length must agree.
    A platform whose float32 sums find a tie fails here, naming the check, instead of skipping it."""
    check = crosscheck[key]
    assert "error" not in crosscheck, crosscheck
    assert check["prompts_with_identical_tokens"] == crosscheck["prompts"], (key, check)
    assert check["blocks"] > 0 and check["blocks_agreeing"] == check["blocks"], (key, check)


def test_the_tiny_family_trains_saves_and_measures_end_to_end(corpus, tmp_path):
    from specmoe_train.family import EVAL_SETTINGS, load_family, slice_metrics
    from specmoe_train.family import run_family

    metrics = run_family(corpus, tmp_path / "family", "tiny", device="cpu", log=lambda m: None)
    names = {p.name for p in (tmp_path / "family").iterdir()}
    assert {"target", "ar_drafter", "dflash_drafter", "metrics.json", "curves.csv", "split.json"} <= names
    assert metrics["training"]["target"]["steps"] == FAMILY_PRESETS["tiny"].target.steps
    ev = metrics["evaluation"]
    assert "error" not in ev["perplexity"] and "error" not in ev["tau"] and "error" not in ev["locality"]
    for k in EVAL_SETTINGS["tiny"]["ks"]:
        for drafter in ("ar_drafter", "dflash_drafter"):
            tau = ev["tau"][f"k{k}"][drafter]["tau"]
            assert 1.0 <= tau <= k + 1
            _check_crosscheck(ev["tau"]["crosscheck"], f"k{k}_{drafter}")
    # the recorded slice perplexities are what the saved checkpoints give
    streams = load_corpus(corpus)
    again = slice_metrics(*load_family(tmp_path / "family"), streams["evaluation"])
    for key in ("target_ppl", "ar_drafter_ppl", "dflash_ppl_mean_nll"):
        assert again[key] == pytest.approx(metrics["slice"][key], rel=1e-4)


def test_tiny_members_train_save_pack_install_and_load_everywhere(corpus, tmp_path, monkeypatch):
    """The members' pipeline end to end on the CPU: train (DeepSeek-V3 with the bias update, Qwen3.5-MoE and its
    DFlash drafter), save, measure, pack, install next to a family, then load by name through the model
    registry, the engines' checkpoint reader and the drafters' defaults."""
    import specmoe.assets
    from specmoe.drafters import DrafterConfig, DrafterError, build_drafter
    from specmoe.engines import EngineConfig, build_engine_from_checkpoint
    from specmoe.models import ModelSourceError, load_model, resolve_source
    from specmoe.routing import Calibration, preset
    from specmoe_train.configs import MEMBER_PRESETS
    from specmoe_train.family import run_family
    from specmoe_train.members import load_member, member_slice_metrics, run_members
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_family", Path(__file__).parents[1] / "scripts" / "train_family.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    train_family = script.main

    family = tmp_path / "family"
    run_family(corpus, family, "tiny", device="cpu", log=lambda m: None)  # the AR drafter of this tokenizer
    metrics = run_members(corpus, tmp_path / "members", family / "ar_drafter", "tiny", device="cpu",
                          log=lambda m: None)
    ds, qw = metrics["members"]["deepseek_v3"], metrics["members"]["qwen3_5_moe"]
    assert ds["training"]["target"]["steps"] == MEMBER_PRESETS["tiny"]["deepseek_v3"].train.target.steps
    balance = ds["training"]["target"]["bias_balance"]
    assert any(lo < 0 < hi for lo, hi in zip(balance["bias_min"], balance["bias_max"]))  # the update moved them
    assert qw["training"]["dflash_drafter"]["steps"] > 0 and set(qw["bytes"]) == {"qwen3_5_moe", "qwen3_5_moe_dflash"}
    for m in (ds, qw):
        assert all("error" not in m["evaluation"][key] for key in ("perplexity", "tau", "locality"))
        assert 1.0 <= m["evaluation"]["tau"]["k4"]["ar_drafter"]["tau"] <= 5
    assert "dflash_drafter" in qw["evaluation"]["tau"]["k4"] and "dflash_drafter" not in ds["evaluation"]["tau"]["k4"]
    for m in (ds, qw):  # the harness's loop cross-checks both (the Qwen member's Gated DeltaNet state rolled back)
        check = m["evaluation"]["tau"]["crosscheck"]
        assert "error" not in check and check["prompts"] == 1
        for key in (key for key in check if key.startswith("k")):
            _check_crosscheck(check, key)
    again = member_slice_metrics(*load_member(tmp_path / "members", "qwen3_5_moe"), load_corpus(corpus)["evaluation"])
    assert again["target_ppl"] == pytest.approx(qw["slice"]["target_ppl"], rel=1e-4)
    assert again["dflash_ppl_mean_nll"] == pytest.approx(qw["slice"]["dflash_ppl_mean_nll"], rel=1e-4)
    bias = load_member(tmp_path / "members", "deepseek_v3")[0].model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.dtype == torch.float32 and bias.abs().max() > 0

    train_family(["pack", "--family", str(tmp_path / "members"), "--out", str(tmp_path / "packed")])
    assert len(list((tmp_path / "packed").iterdir())) <= 8
    train_family(["install", "--packed", str(tmp_path / "packed"), "--family", str(family)])
    assert (family / "members_metrics.json").is_file() and (family / "target" / "config.json").is_file()
    monkeypatch.setattr(specmoe.assets, "FAMILY", family)

    model, adapter = load_model("family/deepseek_v3")
    assert model.config.model_type == "deepseek_v3" and adapter.num_experts == 8
    with pytest.raises(ModelSourceError, match="family/deepseek_v3, family/qwen3_5_moe"):
        load_model("family/mixtral")
    qwen, qwen_adapter = load_model("family/qwen3_5_moe")
    from specmoe.experiments.config import load_config
    from specmoe.experiments.grid import grid_model

    toml = (Path(__file__).parents[1] / "experiments" / "quickstart.toml").read_text()
    (tmp_path / "q.toml").write_text(toml.replace('source = "family"', 'source = "family/qwen3_5_moe"', 1))
    assert grid_model(load_config(tmp_path / "q.toml")).source == str(family / "qwen3_5_moe")
    assert type(build_drafter(DrafterConfig("dflash", runtime="hf"), qwen).model.config).__name__ == "Qwen3Config"
    assert build_drafter(DrafterConfig("dflash", runtime="hf"), qwen).model.target_layer_ids == [0, 1, 2, 3]
    build_drafter(DrafterConfig("ar", runtime="hf"), qwen)
    with pytest.raises(DrafterError, match="no DFlash drafter"):
        build_drafter(DrafterConfig("dflash"), model)
    tokens = load_corpus(corpus)["evaluation"][:20].astype(np.int64)
    for m, a, name in ((model, adapter, "family/deepseek_v3"), (qwen, qwen_adapter, "family/qwen3_5_moe")):
        engine = build_engine_from_checkpoint(resolve_source(name), preset("exact_lru", a.num_experts, a.top_k),
                                              Calibration.uniform(a.num_moe_layers, a.num_experts, a.vocab_size),
                                              EngineConfig(max_seq_len=64), dtype=torch.float32)
        with torch.no_grad():
            ref = m(torch.as_tensor(tokens)[None]).logits[0].float().numpy()
        result = engine.teacher_forced(tokens, prompt_len=8, return_logits=True)
        assert np.abs(result.logits - ref).max() <= 1e-4 * np.abs(ref).max(), name


@pytest.mark.gpu
def test_tiny_members_train_on_cuda_with_grouped_mm_experts(corpus, tmp_path):
    """The device path of the members' training: bf16 models, grouped_mm experts where transformers has them
    (DeepSeek-V3, Qwen3.5-MoE), flash-linear-attention's Gated DeltaNet where `fla` imports; every measurement
    runs."""
    from specmoe_train.family import run_family
    from specmoe_train.members import run_members

    run_family(corpus, tmp_path / "family", "tiny", device="cuda", log=lambda m: None)
    metrics = run_members(corpus, tmp_path / "members", tmp_path / "family" / "ar_drafter", "tiny", device="cuda",
                          log=print)
    for name, m in metrics["members"].items():
        assert m["training"]["target"]["experts_implementation"] == "grouped_mm", name
        assert all("error" not in m["evaluation"][key] for key in ("perplexity", "tau", "locality")), name
        assert "error" not in m["slice"], name


# -- DFlash format -----------------------------------------------------------------------------------

def test_target_layer_ids_follow_dflash_rule():
    assert build_target_layer_ids(24, 1) == [12]
    assert build_target_layer_ids(64, 2) == [1, 61]
    assert build_target_layer_ids(16, 3) == [1, 7, 13]
    ids = build_target_layer_ids(36, 5)
    assert ids[0] == 1 and ids[-1] == 33 and ids == sorted(ids)


def _tiny_dflash(block=5):
    from transformers import OlmoeConfig

    target = OlmoeConfig(vocab_size=64, hidden_size=32, intermediate_size=8, num_hidden_layers=6,
                         num_attention_heads=2, num_experts=8, num_experts_per_tok=2, eos_token_id=0, pad_token_id=1)
    torch.manual_seed(0)
    return DFlashDraftModel(dflash_config(target, 2, block, 63, 48, num_attention_heads=2,
                                          num_key_value_heads=1)).eval()


def test_dflash_checkpoint_has_the_published_format(tmp_path):
    model = _tiny_dflash()
    names = set(model.state_dict())
    per_layer = {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                 "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
                 "post_attention_layernorm.weight"}
    assert names == {f"layers.{i}.{n}" for i in range(2) for n in per_layer} | {
        "norm.weight", "fc.weight", "hidden_norm.weight"}
    assert model.fc.weight.shape == (32, 2 * 32)  # two target layers' hidden states
    model.save_pretrained(str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["architectures"] == ["DFlashDraftModel"]
    assert config["block_size"] == 5 and config["num_target_layers"] == 6
    assert config["dflash_config"] == {"target_layer_ids": [1, 3], "mask_token_id": 63}
    loaded = DFlashDraftModel.from_pretrained(str(tmp_path)).eval()
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in model.state_dict().items())
    assert loaded.target_layer_ids == [1, 3] and loaded.block_size == 5 and loaded.mask_token_id == 63


def test_many_blocks_in_one_pass_equal_one_block_at_a_time():
    from transformers import DynamicCache

    model = _tiny_dflash()
    torch.manual_seed(1)
    ctx_len, block = 12, 5
    context = torch.randn(1, ctx_len, 64)
    embed = torch.nn.Embedding(64, 32)
    ids = torch.randint(0, 60, (1, ctx_len + block))
    anchors = torch.tensor([[3, 7, 12]])
    blocks = block_input_ids(ids, anchors, block, 63)
    assert blocks[0, :5].tolist() == [ids[0, 3].item(), 63, 63, 63, 63]
    together = model(block_position_ids(anchors, ctx_len, block), embed(blocks), context,
                     attention_mask=block_attention_mask(anchors, ctx_len, block))
    for n, a in enumerate(anchors[0].tolist()):
        alone = model(torch.cat([torch.arange(a), torch.arange(a, a + block)])[None],
                      embed(blocks[:, n * block:(n + 1) * block]), context[:, :a])
        torch.testing.assert_close(alone, together[:, n * block:(n + 1) * block], atol=1e-5, rtol=1e-5)
    # with a cache: the context arrives in two parts, the block's own keys are dropped in between
    cache, a = DynamicCache(), 12
    model(torch.cat([torch.arange(6), torch.arange(a, a + block)])[None], embed(blocks[:, 10:]), context[:, :6],
          past_key_values=cache)
    cache.crop(-block)  # keep the 6 context positions
    cached = model(torch.cat([torch.arange(6, a), torch.arange(a, a + block)])[None], embed(blocks[:, 10:]),
                   context[:, 6:a], past_key_values=cache)
    torch.testing.assert_close(cached, together[:, 10:], atol=1e-5, rtol=1e-5)


# -- acceptance walk and locality ----------------------------------------------------------------------

def test_acceptance_walk_counts_committed_tokens_per_verification():
    # drafts accepted: 2 at root 4, then 0 at root 7, then 3 (capped) at root 8
    accept = {4: 2, 7: 0, 8: 5}
    walk = acceptance_tau(lambda c: accept.get(c, 0), 4, 14, 3)
    assert walk["verifications"] == 3 and walk["committed"] == 3 + 1 + 4
    assert walk["accepted_hist"].tolist() == [1, 0, 1, 1]
    # AR flags: match at positions 4, 5 (two drafts accepted), miss at 6, ...
    flags = np.zeros((1, 19), dtype=bool)
    flags[0, [4, 5]] = True
    res = tau_from_runs(flags, None, 4, 3)
    assert res["accepted_hist"][2] == 1 and res["tau"] == pytest.approx(res["committed"] / res["verifications"])
    # by hand: 20 positions, roots while root + 3 <= 19: root 4 accepts 2 (commits 3), root 7 accepts 0, then
    # roots 8 .. 16 accept 0 each: 11 verifications committing 3 + 1 + 9 = 13 tokens
    assert (res["verifications"], res["committed"], res["accepted_hist"]) == (11, 13, [10, 0, 1, 0])


def test_locality_of_a_synthetic_trace():
    from specmoe.records import Trace

    t, layers, experts, k = 6, 2, 8, 2
    z = np.zeros((t, layers, experts), dtype=np.float32)
    for i in range(t):
        z[i, 0, [0, 1]] = 5.0  # layer 0 always routes to {0, 1}: full reuse
        z[i, 1, [2 * (i % 4), 2 * (i % 4) + 1]] = 5.0  # layer 1 never reuses
    g = np.zeros_like(z)
    g[:, 1] = z[:, 1]  # a perfect pre-gate
    trace = Trace(z, g, np.arange(t), np.array([0, 3]), top_k=k, vocab_size=10)
    loc = routing_locality(trace, unions=(2,))
    assert loc["reuse_consecutive"]["per_layer"] == [1.0, 0.0]
    assert loc["pregate_recall"]["per_layer"] == [None, 1.0]
    assert loc["union_experts"]["w2_per_layer"] == [2.0, 4.0]


def test_a_directory_without_the_family_is_a_clear_error(tmp_path):
    from specmoe.models import ModelSourceError
    from specmoe_train.family import load_family

    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text("{}")
    with pytest.raises(ModelSourceError, match="no ar_drafter, dflash_drafter checkpoint"):
        load_family(tmp_path)


def test_runtime_never_imports_the_training_package():
    """specmoe_train imports specmoe; nothing under specmoe/ imports specmoe_train (the runtime reads only the
    shipped assets)."""
    import ast

    import specmoe

    offenders = []
    for path in Path(specmoe.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] == "specmoe_train"]
    assert not offenders, offenders
