"""Routing traces: recording under exact routing, the file format round trip, geometry checks, replay and
the `specmoe trace` command."""

import argparse

import numpy as np
import pytest
import torch
from transformers import OlmoeConfig, OlmoeForCausalLM

from specmoe.experiments.trace import add_parser as add_trace_parser
from specmoe.harness import record_trace
from specmoe.models import adapter_for
from specmoe.records import Trace, TraceError
from specmoe.routing import CalibrationBuilder, preset, replay

L, E, K, V, H = 3, 8, 2, 64, 32


@pytest.fixture(scope="module")
def model():
    config = OlmoeConfig(vocab_size=V, hidden_size=H, intermediate_size=16, num_hidden_layers=L, num_attention_heads=2,
                         num_experts=E, num_experts_per_tok=K, eos_token_id=0, pad_token_id=1, bos_token_id=0)
    torch.manual_seed(0)
    return OlmoeForCausalLM(config).eval()


@pytest.fixture(scope="module")
def sequences():
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(2, V, (n,), generator=gen) for n in (7, 12, 12, 5)]


@pytest.fixture(scope="module")
def trace(model, sequences):
    return record_trace(model, sequences, model_source="tiny-random", batch_size=2)


def test_recorded_logits_are_the_models_router_and_pregate(model, sequences, trace):
    assert trace.router_logits.shape == (36, L, E) and trace.geometry == {
        "num_layers": L, "num_experts": E, "top_k": K, "vocab_size": V}
    assert trace.sequence_starts.tolist() == [0, 7, 19, 31]
    assert np.array_equal(trace.token_ids, torch.cat(sequences).numpy())
    for (lo, hi), seq in zip(trace.sequences(), sequences):
        moe_inputs = []
        hooks = [layer.mlp.register_forward_pre_hook(lambda m, a: moe_inputs.append(a[0][0]))
                 for layer in model.model.layers]
        with torch.no_grad():
            out = model(input_ids=seq[None], output_router_logits=True)
        for h in hooks:
            h.remove()
        for layer in range(L):
            np.testing.assert_allclose(trace.router_logits[lo:hi, layer], out.router_logits[layer].numpy(),
                                       rtol=1e-5, atol=1e-5)
            gate = model.model.layers[layer].mlp.gate.weight  # row 0: router 0 on the last layer's input
            pregate = (moe_inputs[layer - 1] @ gate.T).detach().numpy()
            np.testing.assert_allclose(trace.pregate_logits[lo:hi, layer], pregate, rtol=1e-5, atol=1e-5)


def test_batched_recording_equals_one_sequence_at_a_time(model, sequences, trace):
    single = record_trace(model, sequences, batch_size=1)
    np.testing.assert_allclose(single.router_logits, trace.router_logits, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(single.pregate_logits, trace.pregate_logits, rtol=1e-5, atol=1e-6)


def test_a_saved_trace_round_trips_exactly(trace, model, tmp_path):
    path = trace.save(tmp_path / "t.safetensors")
    back = Trace.load(path, num_layers=L, num_experts=E, top_k=K, vocab_size=V, fingerprint=adapter_for(model.config).fingerprint(model))
    for name in ("router_logits", "pregate_logits", "token_ids", "sequence_starts"):
        a, b = getattr(trace, name), getattr(back, name)
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), name
    assert (back.top_k, back.vocab_size, back.model, back.fingerprint) == (K, V, "tiny-random", trace.fingerprint)
    assert back.info == trace.info and len(trace.fingerprint) == 64


def test_a_trace_of_another_geometry_is_refused_clearly(trace, tmp_path):
    path = trace.save(tmp_path / "t.safetensors")
    with pytest.raises(TraceError, match=r"num_layers 3 \(expected 16\).*num_experts 8 \(expected 64\)"):
        Trace.load(path, num_layers=16, num_experts=64, top_k=K)
    with pytest.raises(TraceError, match=r"top_k 2 \(expected 8\)"):
        Trace.load(path, top_k=8)
    with pytest.raises(TraceError, match="router fingerprint"):
        Trace.load(path, fingerprint="0" * 64)
    (tmp_path / "bad.safetensors").write_bytes(b"not a trace")
    with pytest.raises(TraceError, match="not a readable"):
        Trace.load(tmp_path / "bad.safetensors")
    with pytest.raises(TraceError, match="sequence_starts"):
        Trace(trace.router_logits, trace.pregate_logits, trace.token_ids, np.array([1]), top_k=K, vocab_size=V)


def test_replay_runs_on_a_loaded_trace(trace, tmp_path):
    back = Trace.load(trace.save(tmp_path / "t.safetensors"), num_layers=L, num_experts=E)
    builder = CalibrationBuilder(L, E, V, K)
    for lo, hi in back.sequences():
        builder.add(back.router_logits[lo:hi], back.token_ids[lo:hi])
    calibration = builder.finish({"model": back.model, "fingerprint": back.fingerprint})
    calibration.check(back.num_layers, back.num_experts, back.vocab_size, back.fingerprint)
    for name in ("exact_lru", "psr", "spec_exec"):
        policy = preset(name, capacity=4, top_k=K)
        ours = replay(policy, back.router_logits, back.pregate_logits, back.token_ids, calibration,
                      sequence_starts=back.sequence_starts)
        theirs = replay(policy, trace.router_logits, trace.pregate_logits, trace.token_ids, calibration,
                        sequence_starts=trace.sequence_starts)
        assert ours.selected.shape == (back.num_tokens, L, K)
        assert np.array_equal(ours.selected, theirs.selected) and np.array_equal(ours.copies, theirs.copies)
    exact = replay(preset("exact_lru", capacity=4, top_k=K), back.router_logits, None, back.token_ids, calibration,
                   sequence_starts=back.sequence_starts)
    own_top = np.argsort(-back.router_logits, axis=-1, kind="stable")[..., :K]
    assert np.array_equal(np.sort(exact.selected, -1), np.sort(own_top, -1))  # exact routing is the router's


def test_the_trace_command_writes_a_loadable_trace(model, tmp_path):
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {chr(ord("a") + i): i + 2 for i in range(26)} | {"<|endoftext|>": 0, "<|pad|>": 1, " ": 28}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|pad|>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    ckpt = tmp_path / "ckpt"
    model.save_pretrained(str(ckpt))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>").save_pretrained(str(ckpt))
    (tmp_path / "text.txt").write_text("the quick brown fox jumps over the lazy dog " * 3)
    parser = argparse.ArgumentParser()
    add_trace_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["trace", "--model", str(ckpt), "--text", str(tmp_path / "text.txt"),
                              "--out", str(tmp_path / "out.safetensors"), "--window", "40"])
    assert args.func(args) == 0
    trace = Trace.load(tmp_path / "out.safetensors", num_layers=L, num_experts=E, top_k=K)
    assert trace.num_tokens == 132 and trace.sequence_starts.tolist() == [0, 40, 80, 120]
    assert trace.model == str(ckpt) and trace.info["text"] == str(tmp_path / "text.txt")


def test_trace_without_geometry_metadata_is_a_clear_error(tmp_path, trace):
    from specmoe.files import read_safetensors, write_safetensors

    path = trace.save(tmp_path / "t.safetensors")
    meta, arrays = read_safetensors(path, TraceError, "trace")
    del meta["geometry"]
    write_safetensors(tmp_path / "bad.safetensors", arrays, meta)
    with pytest.raises(TraceError, match="no valid geometry metadata"):
        Trace.load(tmp_path / "bad.safetensors")


def test_a_tiled_trace_repeats_the_recorded_layers_and_their_decisions(trace):
    """A trace stands for a deeper model by repeating its layers; each repeat's first layer is predicted from
    the last layer's input (row 0). Per-layer caches are independent, so a policy decides in layer l + L exactly
    as in layer l, except in each repeat's first layer (L, 2L), which has a pre-gate where layer 0 has none."""
    deep = trace.tiled(2 * L + 1)
    assert deep.num_layers == 2 * L + 1 and deep.info["tiled_from_layers"] == L
    for layer in range(2 * L + 1):
        assert np.array_equal(deep.router_logits[:, layer], trace.router_logits[:, layer % L])
    assert np.array_equal(deep.pregate_logits[:, L], trace.pregate_logits[:, 0])
    builder = CalibrationBuilder(L, E, V, K)
    builder.add(trace.router_logits.astype(np.float64), trace.token_ids)
    calibration = builder.finish({"model": "tiny-random"})
    deep_calibration = calibration.tiled(2 * L + 1)
    assert np.array_equal(deep_calibration.delta, np.tile(calibration.delta, 3)[: 2 * L + 1])
    for token in (2, 5):
        assert np.array_equal(deep_calibration.token_prior.row(L + 1, token, E), calibration.token_prior.row(1, token, E))
    for name in ("exact_lru", "psr"):
        kwargs = dict(bonus=0.3, insert_budget=1) if name == "psr" else {}
        policy = preset(name, 4, K, **kwargs)
        shallow = replay(policy, trace.router_logits, trace.pregate_logits, trace.token_ids, calibration,
                         trace.sequence_starts)
        tiled = replay(policy, deep.router_logits, deep.pregate_logits, deep.token_ids, deep_calibration,
                       deep.sequence_starts)
        for layer in range(2 * L + 1):
            same = np.array_equal(tiled.selected[:, layer], shallow.selected[:, layer % L]) and np.array_equal(
                tiled.copies[:, layer], shallow.copies[:, layer % L])
            assert same == (name == "exact_lru" or layer % L != 0 or layer == 0), (name, layer)
    with pytest.raises(ValueError, match="at least as many layers"):
        trace.tiled(L - 1)
    old = Trace(trace.router_logits, np.where(np.arange(L)[None, :, None] == 0, 0.0, trace.pregate_logits),
                trace.token_ids, trace.sequence_starts, K, V)
    with pytest.raises(TraceError, match="record it again"):
        old.tiled(2 * L)
