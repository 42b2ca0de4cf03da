"""The DeepSeek-V3 decode path (MLA with the latent cache, dense first layer, shared experts, biased sigmoid
router) against transformers' DeepseekV3ForCausalLM on tiny seeded models, CPU, float32: exact routing over
every expert (slot = expert) gives transformers' logits for a prompt as one step of D positions and then
single-position steps; rollback by position; from_checkpoint equals from_model; the split-KV latent attention
in the decoder (its CPU path, and the Triton kernel in the interpreter)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from _interpreter import ROOT, run_in_interpreter
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from specmoe.models import ModelSourceError
from specmoe.models.deepseek_v3_decode import DeepseekV3Decoder
from specmoe.offload.store import ExpertStore

SEQ = 40


def tiny_config(q_lora_rank=None, rope_interleave=True, **overrides) -> DeepseekV3Config:
    kwargs = dict(vocab_size=96, hidden_size=48, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=4,
                  first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=12,
                  num_experts_per_tok=3, n_group=1, topk_group=1, n_shared_experts=1, routed_scaling_factor=2.446,
                  norm_topk_prob=True, kv_lora_rank=24, q_lora_rank=q_lora_rank, qk_rope_head_dim=8,
                  qk_nope_head_dim=12, v_head_dim=10, max_position_embeddings=128, rms_norm_eps=1e-6,
                  rope_parameters={"rope_type": "default", "rope_theta": 50000.0}, rope_interleave=rope_interleave,
                  tie_word_embeddings=False, num_nextn_predict_layers=0, pad_token_id=None, bos_token_id=None,
                  eos_token_id=None)
    kwargs.update(overrides)
    return DeepseekV3Config(**kwargs)


def build_model(config: DeepseekV3Config, seed: int = 0) -> DeepseekV3ForCausalLM:
    """Seeded weights scaled by fan-in, norm weights near one, a random nonzero selection bias."""
    torch.manual_seed(seed)
    config._attn_implementation = "eager"
    model = DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith("embed_tokens.weight"):
                param.copy_(torch.randn_like(param))
            elif name.endswith("mlp.gate.weight"):
                param.copy_(2.0 * torch.randn_like(param) / param.shape[-1] ** 0.5)
            else:
                param.copy_(torch.randn_like(param) / param.shape[-1] ** 0.5)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.3 * torch.randn_like(buf))
    model.set_experts_implementation("eager")
    return model


def expert_rows(model, layer_id: int) -> torch.Tensor:
    """The expert store's rows [E, W] = [gate | up | down] of one MoE layer (slot = expert)."""
    experts = model.model.layers[layer_id].mlp.experts
    num = experts.gate_up_proj.shape[0]
    return torch.cat([experts.gate_up_proj.reshape(num, -1), experts.down_proj.reshape(num, -1)], dim=1).detach()


def exact_route(config, z: torch.Tensor, bias: torch.Tensor):
    """transformers' DeepseekV3TopkRouter selection (one group) and weights, from the logits z [D, E]."""
    scores = z.sigmoid()
    selected = torch.topk(scores + bias, config.num_experts_per_tok, dim=-1).indices
    weights = scores.gather(1, selected)
    if config.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return selected, weights * config.routed_scaling_factor


def run_step(decoder, model, rows, tokens, position, routed=None):
    """One step of len(tokens) positions at `position` with exact routing; the step's logits [D, V]."""
    config, g = model.config, decoder.geometry
    step = decoder.step(len(tokens))
    step.set_input(tokens, position, g.max_seq_len)
    for layer, layer_id in enumerate(g.layer_ids):
        decoder.attention_router(step, layer)
        z = torch.from_numpy(step.router_logits(layer).copy())
        bias = model.model.layers[layer_id].mlp.gate.e_score_correction_bias
        selected, weights = exact_route(config, z, bias)
        if routed is not None:
            routed.append((selected, torch.topk(z.sigmoid(), config.num_experts_per_tok, dim=-1).indices))
        step.slots_np[layer] = selected.numpy()
        step.weights_np[layer] = weights.numpy()
        decoder.moe(step, layer, rows[layer])
    decoder.head(step)
    return step.out_logits.clone()


@pytest.fixture(scope="module", params=[None, 16], ids=["q_proj", "q_lora"])
def tiny(request):
    model = build_model(tiny_config(q_lora_rank=request.param))
    rows = [expert_rows(model, j) for j in range(model.config.first_k_dense_replace, model.config.num_hidden_layers)]
    tokens = torch.randint(0, model.config.vocab_size, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        out = model(torch.tensor([tokens]), output_hidden_states=True)
    return model, rows, tokens, out.logits[0], out.hidden_states


def test_layout_geometry_and_scoring(tiny):
    model, *_ = tiny
    config = model.config
    decoder = DeepseekV3Decoder.from_model(model, SEQ)
    g = decoder.geometry
    assert (g.num_layers, g.num_experts, g.top_k, g.inter, g.layer_ids) == (3, 12, 3, 16, (1, 2, 3))
    assert decoder.layer_kinds == (("attention", "dense_mlp"),) + (("attention", "moe"),) * 3
    assert decoder.latent_cache.shape == (4, SEQ, config.kv_lora_rank + config.qk_rope_head_dim)
    s = decoder.scoring
    assert (s.kind, s.renormalise, s.scale) == ("sigmoid", True, pytest.approx(2.446))
    bias = torch.stack([model.model.layers[j].mlp.gate.e_score_correction_bias for j in (1, 2, 3)])
    assert s.bias.shape == (3, 12) and torch.equal(torch.from_numpy(s.bias).float(), bias) and bias.abs().min() > 0
    assert decoder.use_kernels("auto", "auto", "slot", rows_dummy := torch.zeros(12, g.expert_width)) == {
        "backend": "torch", "attention": "sdpa", "moe": "slot", "launch": {}, "dense": "torch"}
    # R = 24, P = 8 are not shapes of the split-KV kernel, and Triton's kernels need CUDA (outside the interpreter):
    # all fall back, noted
    used = decoder.use_kernels("triton", "split_kv", "slot", rows_dummy)
    assert (used["backend"], used["attention"], used["dense"]) == ("torch", "sdpa", "torch")
    assert not decoder.fused
    assert any(n.startswith("split-KV latent attention (MLA) unusable") for n in decoder.notes)
    assert any(n.startswith("Triton slot MoE kernel unusable") for n in decoder.notes)
    assert any(n.startswith("fused dense kernels (RMSNorm, MLA prologue, SwiGLU product) unusable")
               for n in decoder.notes)
    decoder.use_kernels("torch", "flash_attn", "vllm", rows_dummy)
    assert sum("not implemented" in note for note in decoder.notes) == 2
    assert decoder.bytes_per_token(0) > 0


def test_prompt_step_then_single_steps_give_transformers_logits(tiny):
    model, rows, tokens, expected, hidden = tiny
    decoder = DeepseekV3Decoder.from_model(model, SEQ)
    decoder.capture_features([0, 1, 3])
    prompt = 12
    routed = []
    logits = [run_step(decoder, model, rows, tokens[:prompt], 0, routed)]
    features = [decoder.features(decoder.step(prompt)).clone()]
    for pos in range(prompt, len(tokens)):  # the latent cache of the earlier positions is reused
        logits.append(run_step(decoder, model, rows, tokens[pos:pos + 1], pos, routed))
        features.append(decoder.features(decoder.step(1)).clone())
    torch.testing.assert_close(torch.cat(logits), expected, atol=1e-4, rtol=1e-4)
    # the selection bias matters: it changes the choice somewhere (a zero bias would hide bugs)
    assert any(not torch.equal(sel.sort().values, plain.sort().values) for sel, plain in routed)
    want = torch.cat([hidden[1][0], hidden[2][0], hidden[4][0]], dim=-1)  # after layers 0 (dense), 1, 3 (normed)
    torch.testing.assert_close(torch.cat(features), want, atol=1e-4, rtol=1e-4)


def test_router_logits_are_transformers(tiny):
    model, rows, tokens, _, _ = tiny
    decoder = DeepseekV3Decoder.from_model(model, SEQ)
    captured = {}
    hooks = [model.model.layers[j].mlp.gate.register_forward_hook(
        lambda mod, args, out, j=j: captured.__setitem__(j, out[0])) for j in (1, 2, 3)]
    try:
        with torch.no_grad():
            model(torch.tensor([tokens[:8]]))
    finally:
        for hook in hooks:
            hook.remove()
    run_step(decoder, model, rows, tokens[:8], 0)
    step = decoder.step(8)
    for layer, j in enumerate((1, 2, 3)):
        torch.testing.assert_close(torch.from_numpy(step.router_logits(layer).copy()), captured[j], atol=1e-5,
                                   rtol=1e-5)
        if layer:  # the pre-gate: router l on layer l - 1's MoE input
            assert step.pregate_logits(layer).shape == (8, 12)


def test_rollback_by_position(tiny):
    """A verification step of 4 positions of which only the first is kept: the next step, at the position
    after it, computes as if the rejected positions had never been written."""
    model, rows, tokens, expected, _ = tiny
    decoder = DeepseekV3Decoder.from_model(model, SEQ)
    run_step(decoder, model, rows, tokens[:10], 0)
    block = [tokens[10], 5, 17, 33]  # the root, then drafts the target rejects
    out = run_step(decoder, model, rows, block, 10)
    torch.testing.assert_close(out[0], expected[10], atol=1e-4, rtol=1e-4)
    decoder.rollback(decoder.step(4), 1)
    for pos in (11, 12):
        out = run_step(decoder, model, rows, tokens[pos:pos + 1], pos)
        torch.testing.assert_close(out[0], expected[pos], atol=1e-4, rtol=1e-4)
    decoder.reset()  # a new sequence from position 0 over the old cache contents
    torch.testing.assert_close(run_step(decoder, model, rows, tokens[:6], 0), expected[:6], atol=1e-4, rtol=1e-4)


def test_from_checkpoint_without_experts_equals_from_model(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    model, rows, tokens, _, _ = tiny
    model.save_pretrained(tmp_path)
    geometry = DeepseekV3Decoder.from_model(model, SEQ).geometry
    # save_pretrained writes Moonlight's per-expert layout: the expert store reads it into the test's rows
    store = ExpertStore.from_checkpoint(tmp_path, geometry, dtype=torch.float32, pin=False)
    assert all(torch.equal(a, b) for a, b in zip(store.layers, rows))
    weights = {}
    for file in tmp_path.glob("*.safetensors"):
        weights.update(load_file(file))
        file.unlink()
    for index in tmp_path.glob("*.index.json"):
        index.unlink()
    assert any(".mlp.experts." in key for key in weights)
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in weights
    save_file({k: v.contiguous() for k, v in weights.items() if ".mlp.experts." not in k},
              str(tmp_path / "model.safetensors"))
    loaded = DeepseekV3Decoder.from_checkpoint(tmp_path, SEQ, "cpu", torch.float32)
    direct = DeepseekV3Decoder.from_model(model, SEQ)
    assert loaded.geometry == direct.geometry and loaded.scoring == direct.scoring
    assert (loaded.scoring.bias == direct.scoring.bias).all()
    for a, b in zip(loaded.layers, direct.layers):
        assert a.keys() == b.keys() and all(x is None and y is None or torch.equal(x, y)
                                            for x, y in zip(a.values(), b.values()))
    assert torch.equal(run_step(loaded, model, rows, tokens[:7], 0), run_step(direct, model, rows, tokens[:7], 0))


@pytest.mark.parametrize("interleave", [True, False])
def test_rope_layouts_and_randomized_cache(interleave):
    model = build_model(tiny_config(rope_interleave=interleave, num_hidden_layers=3, n_shared_experts=2), seed=1)
    rows = [expert_rows(model, j) for j in (1, 2)]
    tokens = list(range(3, 12))
    with torch.no_grad():
        expected = model(torch.tensor([tokens])).logits[0]
    decoder = DeepseekV3Decoder.from_model(model, SEQ)
    decoder.randomize_cache(7)  # positions not yet written are masked: no effect on a sequence from 0
    out = torch.cat([run_step(decoder, model, rows, tokens[:5], 0)] +
                    [run_step(decoder, model, rows, [t], 5 + i) for i, t in enumerate(tokens[5:])])
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_refuses_what_it_does_not_implement():
    model = build_model(tiny_config(num_hidden_layers=2))
    params = {**dict(model.named_buffers()), **dict(model.named_parameters())}
    weight = params.__getitem__
    yarn = tiny_config(num_hidden_layers=2, rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0,
                                                             "original_max_position_embeddings": 32})
    with pytest.raises(ModelSourceError, match="rope_type 'yarn'"):
        DeepseekV3Decoder(yarn, weight, SEQ, "cpu", torch.float32)
    grouped = tiny_config(num_hidden_layers=2, n_group=4, topk_group=2)  # group-limited choice: the adapter's
    assert DeepseekV3Decoder(grouped, weight, SEQ, "cpu", torch.float32).scoring.groups == (4, 2)
    decoder = DeepseekV3Decoder.from_model(model, SEQ)
    with pytest.raises(ValueError, match="outside"):
        decoder.capture_features([2])


def test_bfloat16_is_as_close_to_float32_as_transformers_bfloat16():
    """bf16 rounds at other points than transformers (absorbed queries, shared experts first: module
    docstring); its distance to the float32 model is of the size of transformers' own bf16 distance."""
    config = tiny_config(q_lora_rank=16)
    model = build_model(config).to(torch.bfloat16)
    exact = build_model(config)
    exact.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    rows = [expert_rows(model, j) for j in (1, 2, 3)]
    tokens = list(range(5, 25))
    with torch.no_grad():
        reference, theirs = exact(torch.tensor([tokens])).logits[0], model(torch.tensor([tokens])).logits[0].float()
    decoder = DeepseekV3Decoder.from_model(model, SEQ)
    assert decoder.dtype == torch.bfloat16 and decoder.router_pair[0].dtype == torch.float32
    ours = torch.cat([run_step(decoder, model, rows, tokens[:10], 0)] +
                     [run_step(decoder, model, rows, [t], 10 + i) for i, t in enumerate(tokens[10:])])

    def error(logits):
        return ((logits - reference).abs().amax(-1) / reference.abs().amax(-1)).median().item()

    assert error(ours) < max(2 * error(theirs), 0.02)


_SPLIT_KV_DECODER = r"""
import sys, torch
sys.path.insert(0, "tests")
from test_deepseek_v3_decode import build_model, expert_rows, run_step, tiny_config
from specmoe.models.deepseek_v3_decode import DeepseekV3Decoder
model = build_model(tiny_config(kv_lora_rank=32, qk_rope_head_dim=16, **CONFIG))
rows = [expert_rows(model, j) for j in (1, 2, 3)]
tokens = torch.randint(0, 96, (11,), generator=torch.Generator().manual_seed(4)).tolist()
with torch.no_grad():
    expected = model(torch.tensor([tokens])).logits[0]
decoder = DeepseekV3Decoder.from_model(model, 40)
used = decoder.use_kernels(BACKEND, "split_kv", "slot", rows[0])
assert used["attention"] == "split_kv", decoder.notes
assert used["dense"] == ("fused" if BACKEND == "triton" else "torch"), decoder.notes
called = set()
if BACKEND == "triton":  # every projection without a bias on a GEMV launch at one position (forced; CPU: cuBLAS)
    import specmoe.kernels.gemv as gemv
    decoder.linears.params = {(*w.shape, w.dtype): gemv.GEMV_CANDIDATES[4] for w in decoder.dense_weights()}
    kernel = gemv.gemv_triton
    gemv.gemv_triton = lambda x, w, *a, **k: called.add(tuple(w.shape)) or kernel(x, w, *a, **k)
logits = [run_step(decoder, model, rows, tokens[:8], 0)]
logits += [run_step(decoder, model, rows, tokens[p:p + 1], p) for p in range(8, 11)]
torch.testing.assert_close(torch.cat(logits), expected, atol=1e-4, rtol=1e-4)
if BACKEND == "triton":  # q_a, kv_a and o have biases in this config: F.linear
    lw = decoder.layers[1]
    gemv_weights = (lw["q_b"], lw["gate_up"], lw["down"], decoder.layers[0]["gate_up"], decoder.layers[0]["down"],
                    decoder.router_pair[0], decoder.lm_head)
    assert called == {tuple(w.shape) for w in gemv_weights}, called
assert decoder.bytes_per_token(3) < decoder.bytes_per_token(30)  # split-KV reads the written positions only
print("split-KV decoder ok")
"""


@pytest.mark.parametrize("interpreted, backend", [(False, "torch"), (True, "torch"), (True, "triton")],
                         ids=["cpu", "interpreter", "interpreter-fused"])
def test_split_kv_latent_attention_in_the_decoder_gives_transformers_logits(interpreted, backend):
    """attention='split_kv' (R = 32, P = 16): the step's seq_len plumbing on the CPU path, and the Triton kernel
    itself in Triton's interpreter; with backend 'triton' the dense parts on the fused kernels too (the RMSNorm with
    its residual add, the MLA prologue, the SwiGLU product) and the slot MoE kernel, all in the interpreter, on a
    config with the query's low-rank path, attention biases and the halves rope layout."""
    config = dict(q_lora_rank=16, attention_bias=True, rope_interleave=False) if backend == "triton" else {}
    script = f"BACKEND = {backend!r}\nCONFIG = {config!r}\n" + _SPLIT_KV_DECODER
    if interpreted:
        pytest.importorskip("triton")
        done = run_in_interpreter(script)
    else:
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              cwd=ROOT, env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "split-KV decoder ok" in done.stdout
