"""specmoe.drafters: configuration, fit with the target, rollback to the committed prefix, the synthetic profile."""

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from specmoe.drafters import (DRAFTERS, DFlashDrafter, DrafterConfig, DrafterError, HFAutoregressiveDrafter,
                              SyntheticDrafter, build_drafter, check_drafter_fits)
from specmoe.drafters.dflash_model import DFlashDraftModel, dflash_config, extract_context_feature
from specmoe.geometry import Geometry
from specmoe.models import load_model
from specmoe.assets import family_path


@pytest.fixture(scope="module")
def target():
    model, _ = load_model(str(family_path("target")))
    return model


@pytest.fixture(scope="module")
def prompt():
    slice_ = json.loads((family_path().parent / "metrics.json").read_text())["slice"]["slice"]
    return torch.tensor(slice_["token_ids"][2][:40])


def test_config_refuses_bad_input():
    for bad in (dict(name="medusa"), dict(name="synthetic", acceptance=1.5), dict(name="synthetic", cost_s=-1.0),
                dict(name="synthetic", commit_probs=(0.5, 0.9)), dict(name="synthetic", commit_probs=())):
        with pytest.raises(DrafterError):
            DrafterConfig(**bad)
    assert DrafterConfig("synthetic", commit_probs=[1, 0.5]).commit_probs == (1.0, 0.5)


def test_a_drafter_that_does_not_fit_the_target_is_refused(target, tmp_path):
    from transformers import OlmoConfig, OlmoForCausalLM

    other = OlmoForCausalLM(OlmoConfig(vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                       num_attention_heads=2, pad_token_id=1, eos_token_id=0, bos_token_id=0))
    other.save_pretrained(tmp_path / "ar")
    with pytest.raises(DrafterError, match="vocabulary"):
        build_drafter(DrafterConfig("ar", path=str(tmp_path / "ar")), target)
    with pytest.raises(DrafterError, match="no ar drafter checkpoint"):
        build_drafter(DrafterConfig("ar", path=str(tmp_path / "missing")), target)
    config = dict(num_layers=1, block_size=5, mask_token_id=2, intermediate_size=16, num_attention_heads=2)
    deep = DFlashDraftModel(dflash_config(target.config, target_layer_ids=[20], **config))
    with pytest.raises(DrafterError, match="target_layer_ids"):
        DFlashDrafter(deep, target)
    narrow, _ = load_model("olmoe-micro")  # hidden size 32, vocabulary 128
    with pytest.raises(DrafterError, match="hidden size"):
        DFlashDrafter(DFlashDraftModel(dflash_config(narrow.config, **config)), target)


def test_the_table_lists_every_drafter_and_a_new_one_is_an_entry(monkeypatch):
    from specmoe.drafters import build

    assert build.DRAFTERS is DRAFTERS
    assert list(DRAFTERS) == ["ar", "dflash", "synthetic"] and all(callable(b) for b in DRAFTERS.values())
    with pytest.raises(DrafterError, match="unknown drafter 'medusa'; expected one of ar, dflash, synthetic"):
        DrafterConfig("medusa")
    built = []
    monkeypatch.setitem(build.DRAFTERS, "toy", lambda config, target: built.append(config.name) or "a toy drafter")
    assert build_drafter(DrafterConfig("toy"), _FakeTarget()) == "a toy drafter" and built == ["toy"]


def _geometry(model, **changes):
    """What `check_drafter_fits` reads of a target (its decoder's geometry)."""
    return replace(Geometry.from_hf(model.config), **changes)


@pytest.mark.parametrize("name,runtime", [("ar", "hf"), ("ar", "static"), ("dflash", "hf"), ("dflash", "static"),
                                          ("synthetic", "auto")])
def test_every_drafter_declares_its_sizes_and_a_wrong_one_is_refused_naming_both(target, name, runtime):
    drafter = build_drafter(DrafterConfig(name, runtime=runtime, max_seq_len=64), target)
    hidden = target.config.hidden_size if drafter.target_layer_ids else None
    assert (drafter.vocab_size, drafter.hidden_size) == (target.config.vocab_size, hidden)
    check_drafter_fits(drafter, _geometry(target))
    vocab = target.config.vocab_size + 3
    with pytest.raises(DrafterError, match=rf"the {name} drafter does not fit the target: vocabulary "
                                           rf"{drafter.vocab_size} \(target {vocab}\)"):
        check_drafter_fits(drafter, _geometry(target, vocab_size=vocab))
    if hidden is None:  # reads no target features: any hidden size fits
        check_drafter_fits(drafter, _geometry(target, hidden=7))
    else:
        with pytest.raises(DrafterError, match=rf"hidden size {hidden} \(target {hidden * 2}\)"):
            check_drafter_fits(drafter, _geometry(target, hidden=hidden * 2))


def _cache_tensors(cache):
    return [t for layer in cache.layers for t in (layer.keys, layer.values)]


def _assert_same_state(drafter, fresh, k):
    """Both propose the same drafts from caches holding the same positions."""
    drafts, confidences = drafter.propose(k)
    again, again_conf = fresh.propose(k)
    assert drafts.tolist() == again.tolist()
    np.testing.assert_allclose(confidences, again_conf, rtol=1e-4)
    for a, b in zip(_cache_tensors(drafter.cache), _cache_tensors(fresh.cache), strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("accepted", [2, 6])
def test_ar_drafter_after_a_verification_equals_a_fresh_one_on_the_committed_prefix(target, prompt, accepted):
    drafter = build_drafter(DrafterConfig("ar"), target)
    assert isinstance(drafter, HFAutoregressiveDrafter) and drafter.target_layer_ids == ()
    drafter.reset(prompt)
    drafts, confidences = drafter.propose(6)
    assert drafts.shape == (6,) and np.all((confidences > 0) & (confidences <= 1))
    bonus = (int(drafts[accepted]) + 1) % 8192 if accepted < 6 else 5  # a rejection, or every draft accepted
    drafter.commit(accepted, bonus)
    assert drafter.tokens == prompt.tolist() + drafts[:accepted].tolist() + [bonus]
    fresh = build_drafter(DrafterConfig("ar"), target)
    fresh.reset(torch.tensor(drafter.tokens))
    _assert_same_state(drafter, fresh, 6)
    with pytest.raises(ValueError):
        drafter.commit(7, 0)


def test_dflash_drafter_after_a_verification_equals_a_fresh_one_on_the_committed_prefix(target, prompt):
    drafter = build_drafter(DrafterConfig("dflash"), target)
    assert isinstance(drafter, DFlashDrafter) and drafter.max_drafts == 16 and drafter.target_layer_ids == (1, 7, 13)

    def features(tokens):  # the target's features at every position of `tokens` (exact routing)
        with torch.no_grad():
            out = target(input_ids=torch.tensor([tokens]), output_hidden_states=True)
        return extract_context_feature(out.hidden_states, list(drafter.target_layer_ids))[0]

    with pytest.raises(ValueError, match="features"):
        drafter.reset(prompt, None)
    drafter.reset(prompt, features(prompt.tolist())[:-1])
    drafts, _ = drafter.propose(8)
    assert drafter.cache.get_seq_length() == prompt.numel() - 1  # the block's keys are cropped off
    committed = prompt.tolist() + drafts[:3].tolist() + [int(drafts[3]) ^ 1]
    every = features(committed)
    drafter.commit(3, committed[-1], every[prompt.numel() - 1:-1])  # the root and the 3 accepted drafts
    fresh = build_drafter(DrafterConfig("dflash"), target)
    fresh.reset(torch.tensor(committed), every[:-1])
    _assert_same_state(drafter, fresh, 8)
    with pytest.raises(DrafterError):
        drafter.propose(17)


def _counting(prefix, n):
    """A stand-in for exact routing's continuation: the next n integers after the last token, mod 50."""
    return [(prefix[-1] + 1 + i) % 50 for i in range(n)]


def test_synthetic_drafter_follows_its_acceptance_profile():
    drafter = SyntheticDrafter(_counting, 50, acceptance=0.6, seed=3)
    drafter.reset(torch.tensor([7]))
    right = []
    for _ in range(3000):
        drafts, confidences = drafter.propose(4)
        reference = [(drafter.tokens[-1] + 1 + i) % 50 for i in range(4)]
        right.append([int(d) == r for d, r in zip(drafts, reference)])
        np.testing.assert_allclose(confidences, 0.6)
        drafter.commit(0, reference[0])  # stay on the reference
    right = np.array(right)
    leading = np.cumprod(right, axis=1).astype(bool)
    assert np.array_equal(right, leading)  # only a leading run is right; every other draft is wrong
    np.testing.assert_allclose(right.mean(0), 0.6 ** np.arange(1, 5), atol=0.03)

    table = SyntheticDrafter(_counting, 50, commit_probs=(1.0, 0.5), seed=0)
    table.reset(torch.tensor([1, 2]))
    drafts, confidences = table.propose(3)
    assert int(drafts[0]) == 3 and int(drafts[2]) != 5
    np.testing.assert_allclose(confidences, [1.0, 0.5, 0.0])


def test_synthetic_drafter_is_seeded_and_follows_the_committed_sequence():
    calls = []

    def continuation(prefix, n):
        calls.append(list(prefix))
        return _counting(prefix, n)

    runs = []
    for _ in range(2):
        drafter = SyntheticDrafter(continuation, 50, acceptance=0.5, seed=11)
        drafter.reset(torch.tensor([4, 9]))
        runs.append(drafter.propose(6)[0].tolist())
    assert runs[0] == runs[1]
    drafter.commit(0, 40)  # the target committed a token off the reference: recompute it from there
    drafter.propose(2)
    assert calls[-1] == [4, 9, 40]
    config = DrafterConfig("synthetic", acceptance=0.5, seed=11, cost_s=0.25)
    assert build_drafter(config, _FakeTarget()).fixed_cost_s == 0.25


class _FakeTarget:
    """Just enough of a model for building the synthetic drafter (it only reads the vocabulary size)."""

    class config:
        vocab_size = 50
