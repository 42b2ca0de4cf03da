"""The harness's speculative loop: exact selection reproduces AR greedy decoding, caches after a rejection,
bad input, determinism, block records and the `specmoe sd` command."""


import numpy as np
import pytest
import torch

from specmoe.records import BlockRecordError, BlockRecords
from specmoe.cli import main
from specmoe.drafters import DrafterConfig, DrafterError, build_drafter
from specmoe.drafters.dflash_model import extract_context_feature
from specmoe.experiments.measure import block_token_ms
from specmoe.harness import exact_routing, greedy_decode, speculative_generate
from specmoe.speculation import SpeculativeConfig, summarize
from specmoe.verifiers import SelectorError, selector_preset

NEW = 20


@pytest.fixture(scope="module")
def prompt(family_text):
    return torch.tensor(family_text[:40])


@pytest.fixture(scope="module")
def reference(family, prompt):
    with exact_routing(family[0]):
        return greedy_decode(family[0], prompt, NEW)[0]


def config(selector="exact", **kw):
    return SpeculativeConfig(selector_preset(selector), **{"k": 6, "pool_size": 32, "max_new_tokens": NEW, **kw})


class Spy:
    """A drafter wrapper that checks the loop's rollback: the target's KV cache at the start of every
    verification holds the committed positions before the root as a fresh exact prefill of them does, and
    after every rejection the drafter proposes from the same cache as a fresh drafter on the committed
    prefix (given the target's features of a fresh prefill)."""

    def __init__(self, inner, build, target, k):
        self.inner, self.build, self.target, self.k = inner, build, target, k
        self.name, self.target_layer_ids = inner.name, inner.target_layer_ids
        self.vocab_size, self.hidden_size = inner.vocab_size, inner.hidden_size
        self.max_drafts, self.fixed_cost_s = inner.max_drafts, inner.fixed_cost_s
        self.rejected, self.drafter_checks, self.target_checks = False, 0, 0
        self.expected = self.snapshot = None
        self.hook = target.register_forward_pre_hook(self._snapshot, with_kwargs=True)

    def _snapshot(self, module, args, kwargs):
        if kwargs.get("input_ids") is not None and kwargs["input_ids"].shape[1] == self.k + 1:  # a verification
            self.snapshot = [layer.keys.clone() for layer in kwargs["past_key_values"].layers]

    def check_target(self):
        if self.expected is not None:
            for a, b in zip(self.snapshot, self.expected, strict=True):
                torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
            self.target_checks += 1

    def reset(self, prompt, features=None):
        self.inner.reset(prompt, features)

    def propose(self, k):
        self.check_target()
        committed = list(self.inner.tokens)
        with torch.no_grad(), exact_routing(self.target):
            out = self.target(input_ids=torch.tensor([committed[:-1]]), use_cache=True, output_hidden_states=True)
        self.expected = [layer.keys for layer in out.past_key_values.layers]
        drafts, confidences = self.inner.propose(k)
        if self.rejected and hasattr(self.inner, "cache"):  # the synthetic drafter keeps no cache
            features = None
            if self.target_layer_ids:
                features = extract_context_feature(out.hidden_states, list(self.target_layer_ids))[0]
            fresh = self.build()
            fresh.reset(torch.tensor(committed), features)
            again, again_conf = fresh.propose(k)
            assert again.tolist() == drafts.tolist()
            np.testing.assert_allclose(again_conf, confidences, rtol=1e-4)
            for a, b in zip(self.inner.cache.layers, fresh.cache.layers, strict=True):
                torch.testing.assert_close(a.keys, b.keys, atol=1e-4, rtol=1e-4)
            self.drafter_checks += 1
        self.drafts = drafts
        return drafts, confidences

    def commit(self, accepted, bonus_token, features=None):
        self.rejected = accepted < len(self.drafts)
        self.inner.commit(accepted, bonus_token, features)


@pytest.mark.parametrize("name", ["ar", "dflash", "synthetic"])
def test_exact_selection_is_ar_greedy_decoding_and_rollback_restores_both_caches(family, prompt, reference, name):
    model, adapter = family
    drafter_config = DrafterConfig(name, acceptance=0.7)
    spy = Spy(build_drafter(drafter_config, model), lambda: build_drafter(drafter_config, model), model, 6)
    try:
        result = speculative_generate(model, adapter, spy, prompt, config())
        spy.check_target()
    finally:
        spy.hook.remove()
    assert result.tokens.tolist() == reference.tolist()
    assert spy.target_checks == result.verifications and min(result.accepted) < 6
    assert spy.drafter_checks > 0 or name == "synthetic"  # the drafter's state after a rejection was compared
    s = result.summary()
    assert s["committed"] == NEW and s["verifications"] == result.verifications
    # tau: the tokens the blocks committed (all but the prefill's first) per verification, the last block cut
    assert s["tau"] == pytest.approx((NEW - 1) / result.verifications)
    assert sum(np.asarray(result.accepted) + 1) >= NEW - 1
    assert sum(s["accepted_hist"]) == result.verifications and s["displaced_per_token_layer"] == 0
    assert s["kl"] < 1e-6 and abs(s["excess_nll"]) < 1e-5 and s["copies_per_token"] > 0
    assert result.roots[0] == prompt.numel()  # the first root is the first new token, decoded by the prefill


def test_block_selection_cuts_copies_is_deterministic_and_records_its_blocks(family, prompt, tmp_path):
    model, adapter = family
    drafter = build_drafter(DrafterConfig("ar"), model)
    runs = [speculative_generate(model, adapter, drafter, prompt, config("confidence_top1"), record=True)
            for _ in range(2)]
    exact = speculative_generate(model, adapter, drafter, prompt, config(), divergence=False)
    a, b = runs
    assert a.tokens.tolist() == b.tokens.tolist() and a.accepted == b.accepted and a.copies == b.copies
    for name in ("pool_mask", "slot", "recency", "copies", "moves"):
        assert np.array_equal(getattr(a.pool, name), getattr(b.pool, name)), name
    assert a.copies < exact.copies and a.summary()["displaced_per_token_layer"] > 0 and a.divergence["kl"] >= 0
    # per-block times: a block's drafting + verification, their sum the request's; token_ms one value a token
    assert len(a.block_s) == a.verifications and sum(a.block_s) == pytest.approx(a.draft_s + a.verify_s)
    token_ms = block_token_ms(a.accepted, 1e3 * np.asarray(a.block_s))
    assert len(token_ms) == sum(n + 1 for n in a.accepted) and len(set(token_ms)) > 1
    assert sum(token_ms) == pytest.approx(1e3 * sum(a.block_s))
    pooled = summarize([a, exact])
    assert pooled["committed"] == 2 * NEW and pooled["verifications"] == a.verifications + exact.verifications

    blocks = a.blocks
    assert len(blocks) == a.verifications
    records = BlockRecords.from_requests([blocks, b.blocks[:1]], top_k=8, vocab_size=adapter.vocab_size, model="family",
                                       fingerprint=adapter.fingerprint(model),
                                       selector=config("confidence_top1").selector.to_dict(),
                                       drafter="ar", pool_size=32)
    back = BlockRecords.load(records.save(tmp_path / "blocks.safetensors"), num_layers=16, num_experts=64, top_k=8,
                             fingerprint=adapter.fingerprint(model))
    assert back.arrays["request"].tolist() == [0] * len(blocks) + [1]
    arr = {name: values[:-1] for name, values in back.arrays.items()}  # request 0
    assert arr["router_logits"].shape == (a.verifications, 7, 16, 64) and arr["selected"].shape[-1] == 8
    assert back.geometry["k"] == 6 and back.pool_size == 32 and back.selector["kind"] == "confidence_top1"
    assert arr["root_position"].tolist() == a.roots and arr["accepted"].tolist() == a.accepted
    committed = np.concatenate([np.append(t[1:1 + n], bonus) for t, n, bonus in
                                zip(arr["tokens"], arr["accepted"], arr["bonus"])])
    assert committed[:NEW - 1].tolist() == a.tokens[1:].tolist()  # the first new token is the prefill's
    assert np.all(arr["pregate_logits"][:, :, 0] == 0) and np.any(arr["pregate_logits"][:, :, 1] != 0)
    # the executed experts of the root are its own top-8 (the root always keeps them)
    own = np.argsort(-arr["router_logits"][:, 0], axis=-1, kind="stable")[..., :8]
    assert np.array_equal(np.sort(own, -1), np.sort(arr["selected"][:, 0], -1))
    with pytest.raises(BlockRecordError, match="does not fit"):
        BlockRecords.load(tmp_path / "blocks.safetensors", num_experts=32)
    with pytest.raises(BlockRecordError, match="not a specmoe block record"):
        from specmoe.harness import record_trace

        BlockRecords.load(record_trace(model, [prompt[:8]]).save(tmp_path / "trace.safetensors"))
    with pytest.raises(BlockRecordError, match="no block record file"):
        BlockRecords.load(tmp_path / "missing.safetensors")


def test_bad_input_is_refused(family, prompt):
    model, adapter = family
    drafter = build_drafter(DrafterConfig("ar"), model)
    with pytest.raises(ValueError, match="k"):
        config(k=0)
    for pool_size in (65, 4):  # P > E, P < K
        with pytest.raises(ValueError, match="K <= P <= E"):
            speculative_generate(model, adapter, drafter, prompt, config(pool_size=pool_size))
    with pytest.raises(ValueError, match="at most 16"):
        speculative_generate(model, adapter, build_drafter(DrafterConfig("dflash"), model), prompt, config(k=17))
    with pytest.raises(SelectorError):
        selector_preset("oracle")
    with pytest.raises(DrafterError):
        DrafterConfig("medusa")
    assert getattr(model, "specmoe_context", None) is None  # a refused run leaves the model unpatched


def test_stop_tokens_end_a_request(family, prompt, reference):
    model, adapter = family
    stop = int(reference[5])
    result = speculative_generate(model, adapter, build_drafter(DrafterConfig("ar"), model), prompt,
                                  config(stop_tokens=(stop,)))
    first = reference.tolist().index(stop)
    assert result.tokens.tolist() == reference[:first + 1].tolist()
    assert result.logprobs.shape == (first + 1, adapter.vocab_size)


def test_a_stop_callback_ends_the_request_after_its_block(family, prompt, reference):
    model, adapter = family
    seen = []

    def stop(new):
        seen.append(len(new))
        return len(new) >= 5

    result = speculative_generate(model, adapter, build_drafter(DrafterConfig("ar"), model), prompt, config(),
                                  divergence=False, stop=stop)
    n = len(result.tokens)
    assert seen[0] == 1  # called after the first new token (the prefill's), then after every block
    assert 5 <= n < NEW and seen[-1] == n and all(x < 5 for x in seen[:-1])
    assert result.tokens.tolist() == reference[:n].tolist()


def test_sd_command_prints_the_table_and_refuses_bad_input(tmp_path, capsys):
    from specmoe.rundir import read_table

    out = tmp_path / "sd"
    small = ["--prompts", "1", "--prompt-length", "24", "--new-tokens", "8", "--calibration-windows", "2",
             "--calibration-length", "16", "-k", "4"]
    assert main(["sd", *small, "--drafters", "ar", "--selectors", "exact,acceptmoe", "--records",
                 "--out", str(out), "--set", "rounds=1"]) == 0  # the shipped config's 5 rounds cut to 1
    table = read_table(out)
    assert len(table) == 3 and table["policy"].iloc[0].startswith("psr(C=32") and list(table["kind"]) == ["ar", "sd", "sd"]
    assert table["kl"].iloc[1] < 1e-6 and (table["copies_per_token"] > 0).all()
    printed = capsys.readouterr().out
    assert "tau" in printed and "copies/token" in printed
    assert BlockRecords.load(out / "blocks" / "blocks_c0002_ar_acceptmoe.safetensors").num_blocks > 0
    assert main(["report", str(out)]) == 0 and (out / "report" / "report.md").is_file()
    for bad in (["--drafters", "medusa"], ["--selectors", "oracle"], ["-k", "0"], ["-P", "65"], ["-P", "4"],
                ["--prompts", "99"], ["--drafters", "dflash", "-k", "17"],
                ["--model", "olmoe-micro"]):  # the family's AR drafter has another vocabulary
        assert main(["sd", *small, *bad, "--out", str(tmp_path / "bad")]) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1].startswith("specmoe sd: error:")


def test_tau_counts_a_cut_block_for_the_tokens_it_kept():
    """tau = committed / verifications (`specmoe.speculation.tau`): two blocks of k = 3 accepting 3 each under
    max_new_tokens 7 commit the prefill's token, 4, then 2 of 4: 6 block tokens over 2 verifications."""
    from specmoe.speculation import summarize, tau

    counts = {"requests": 1, "verifications": 2, "block_tokens": 8, "block_committed": 6, "committed": 7,
              "accepted_hist": np.array([0, 0, 0, 2]), "copies": 0, "moves": 0, "displaced": 0.0, "num_layers": 1,
              "draft_s": 0.0, "verify_s": 0.0, "prefill_s": 0.0, "kl_sum": 0.0, "excess_nll_sum": 0.0, "positions": 0}
    assert summarize([counts])["tau"] == 3.0 and tau(6, 2) == 3.0 and np.isnan(tau(0, 0))
