"""The shipped small model family (specmoe/assets/family): size limits, offline loading, the recorded
held-out perplexities, the corpus split record and the acceptance measurement on CPU."""

import json

import numpy as np
import pytest
import torch
from _architecture_checks import assert_loop_agrees_with_the_walk

from specmoe.assets import FAMILY_MEMBERS, family_path
from specmoe.drafters.dflash_model import DFlashDraftModel
from specmoe.harness import record_trace
from specmoe.models import adapter_for
from specmoe.records import Trace
from specmoe_train.family import load_family, slice_metrics

FAMILY = family_path("target").parent
MiB = 1 << 20


@pytest.fixture(scope="module")
def metrics():
    return json.loads((FAMILY / "metrics.json").read_text())


@pytest.fixture(scope="module")
def family():
    return load_family(FAMILY, "cpu", torch.float32)


MEMBER_DIRS = {*FAMILY_MEMBERS, *(d for d in FAMILY_MEMBERS.values() if d)}


def test_the_family_fits_the_repository_limits():
    files = [p for p in FAMILY.rglob("*") if p.is_file()]
    assert all(p.stat().st_size < 16 * MiB for p in files), [p.name for p in files if p.stat().st_size >= 16 * MiB]
    in_members = lambda p: p.relative_to(FAMILY).parts[0] in MEMBER_DIRS or p.name.startswith("members_")  # noqa: E731
    assert sum(p.stat().st_size for p in files if not in_members(p)) <= 40_000_000
    member_weights = [p for p in files if in_members(p) and p.suffix == ".safetensors"]
    assert all(p.stat().st_size < 12 * MiB for p in member_weights)
    assert sum(p.stat().st_size for p in member_weights) <= 20_000_000


INSTALLED = [m for m in FAMILY_MEMBERS if (family_path(m) / "config.json").is_file()]


@pytest.mark.parametrize("member", INSTALLED or [pytest.param(None, marks=pytest.mark.skip("no member installed"))])
def test_an_installed_member_loads_by_name_and_gives_its_recorded_slice(member):
    """A member (family/<member>): loads through the registry, shares the family's tokenizer, and its float32
    perplexity on the fixed slice is what training recorded (bf16 on the GPU there, so loosely)."""
    from transformers import AutoTokenizer

    from specmoe.models import load_model
    from specmoe_train.members import load_member, member_slice_metrics

    record = json.loads((FAMILY / "members_metrics.json").read_text())["members"][member]
    model, adapter = load_model(f"family/{member}")
    assert model.config.model_type == ("deepseek_v3" if member == "deepseek_v3" else "qwen3_5_moe_text")
    tok = AutoTokenizer.from_pretrained(str(family_path(member)), local_files_only=True)
    assert tok.get_vocab() == AutoTokenizer.from_pretrained(str(FAMILY / "target"), local_files_only=True).get_vocab()
    tokens = np.array(json.loads((FAMILY / "metrics.json").read_text())["slice"]["slice"]["token_ids"])
    stream = np.zeros(record["slice"]["starts"][-1] + tokens.shape[1], dtype=np.int64)
    for start, row in zip(record["slice"]["starts"], tokens):
        stream[start:start + tokens.shape[1]] = row
    again = member_slice_metrics(*load_member(FAMILY, member), stream)
    for key in ("target_ppl", "dflash_ppl_mean_nll"):
        if key in record["slice"]:
            assert again[key] == pytest.approx(record["slice"][key], rel=0.05), key


def test_checkpoints_load_offline_from_the_package(family):
    from transformers import AutoTokenizer, OlmoeForCausalLM, OlmoForCausalLM

    target, ar, dflash = family
    assert isinstance(target, OlmoeForCausalLM) and isinstance(ar, OlmoForCausalLM)
    assert isinstance(dflash, DFlashDraftModel)
    c = target.config
    assert (c.num_hidden_layers, c.num_experts, c.num_experts_per_tok) == (16, 64, 8)  # OLMoE's routing geometry
    tok = AutoTokenizer.from_pretrained(str(FAMILY / "target"), local_files_only=True)
    assert len(tok) == c.vocab_size == ar.config.vocab_size == dflash.config.vocab_size
    assert dflash.mask_token_id == tok.mask_token_id and dflash.config.hidden_size == c.hidden_size
    assert all(0 <= i < c.num_hidden_layers for i in dflash.target_layer_ids) and dflash.block_size >= 17


def test_heldout_perplexity_matches_the_record(family, metrics):
    """Recompute the fixed evaluation slice recorded at training time (float32 here, on the GPU there)."""
    tokens = np.array(metrics["slice"]["slice"]["token_ids"])
    assert tokens.shape == (metrics["slice"]["slice"]["windows"], metrics["slice"]["slice"]["length"])
    # slice_metrics takes the windows at the recorded starts of a stream; give it a stream holding just them
    length = tokens.shape[1]
    stream = np.zeros(metrics["slice"]["slice"]["starts"][-1] + length, dtype=np.int64)
    for start, row in zip(metrics["slice"]["slice"]["starts"], tokens):
        stream[start:start + length] = row
    again = slice_metrics(*family, stream)
    for key in ("target_ppl", "ar_drafter_ppl", "dflash_ppl_mean_nll"):
        assert again[key] == pytest.approx(metrics["slice"][key], rel=0.01), key


def test_the_record_holds_every_measurement(metrics):
    ev = metrics["evaluation"]
    for model in ("target", "ar_drafter"):
        assert ev["perplexity"][model]["ppl"] > 1 and ev["perplexity"][model]["tokens"] > 100_000
    assert len(ev["perplexity"]["dflash_drafter"]["ppl_by_position"]) == metrics["config"]["block_size"] - 1
    for k in (8, 16):
        for drafter in ("ar_drafter", "dflash_drafter"):
            assert 1 <= ev["tau"][f"k{k}"][drafter]["tau"] <= k + 1
    loc = ev["locality"]
    assert len(loc["reuse_consecutive"]["per_layer"]) == 16 and loc["pregate_recall"]["per_layer"][0] is None
    steps = metrics["training"]["target"]["steps"], metrics["training"]["drafters"]["steps"]
    assert f"--target-steps {steps[0]} --drafter-steps {steps[1]}" in metrics["reproduce"]
    assert (FAMILY / "curves.csv").read_text().startswith("model,step,tokens")


def test_the_split_record_keeps_the_parts_apart(metrics):
    split = json.loads((FAMILY / "split.json").read_text())
    parts = {}
    for f in split["files"]:
        assert len(f["sha256"]) == 64
        parts.setdefault((f["source"], f["path"]), set()).add(f["part"])
    assert all(len(p) == 1 for p in parts.values())
    for part in ("train", "calibration", "evaluation"):
        assert split["summary"][part]["files"] == sum(f["part"] == part for f in split["files"]) > 0
        assert split["tokens"][part]["sha256"] == metrics["corpus"][part]["sha256"]


def test_the_speculative_loop_and_the_teacher_forced_walk_agree_on_cpu(family, metrics):
    target, ar, dflash = family
    prompt = torch.tensor(metrics["slice"]["slice"]["token_ids"][1][:48])
    assert_loop_agrees_with_the_walk(target, ar, dflash, prompt, new=24, k=8)


def test_a_trace_of_the_shipped_target(family, tmp_path, metrics):
    target = family[0]
    rows = [torch.tensor(r[:64]) for r in metrics["slice"]["slice"]["token_ids"][:2]]
    trace = record_trace(target, rows, model_source="family")
    back = Trace.load(trace.save(tmp_path / "family.safetensors"), num_layers=16, num_experts=64, top_k=8,
                      vocab_size=target.config.vocab_size, fingerprint=adapter_for(target.config).fingerprint(target))
    assert back.num_tokens == 128 and back.sequence_starts.tolist() == [0, 64]
    top = np.argsort(-back.router_logits, axis=-1, kind="stable")[..., :8]
    pre = np.argsort(-back.pregate_logits[:, 1:], axis=-1, kind="stable")[..., :8]
    recall = np.mean([len(set(a) & set(b)) / 8 for a, b in zip(pre.reshape(-1, 8), top[:, 1:].reshape(-1, 8))])
    assert recall > 8 / 64  # the pre-gate predicts the next layer far better than chance
