"""The AR engine's optional kernels, flash-attn's `flash_attn_with_kvcache` (attention="flash_attn") and vLLM's
`fused_experts` (moe="vllm"). Neither package can be installed on our machines, so the engine runs here on
stand-in modules put into sys.modules: plain-torch implementations of the packages' documented interfaces
(flash-attn 2.8.4, vLLM fused_moe.py at commit 13cb3e44; see specmoe/kernels/attention.py and moe.py) that
also assert the layouts, strides and dtypes the real functions check. These tests therefore show that the
engine calls the interfaces as documented and gets the default path's results through them; they do not show
that the real packages behave as documented. Model: `olmoe-tiny` in bfloat16 (flash-attn takes fp16/bf16 only)."""

import sys
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from specmoe.engines import EngineConfig, build_engine
from specmoe.engines.results import LogitFeed
from specmoe.models import load_model
from specmoe.offload import ExpertStore
from specmoe.routing import Calibration, preset

SEQ = 32


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """Stand-in for flash-attn 2.8.4's function of this name, for what the engine uses (no new k/v, rotary,
    paging, batch index, left padding, window, softcap, ALiBi or LSE): each query attends, per batch row b,
    to cache positions 0 .. cache_seqlens[b] - 1, and with causal=True query i of Q only up to position
    cache_seqlens[b] - Q + i (the causal mask aligned to the bottom right, as flash-attn documents for
    seqlen_q != seqlen_k); query head h reads KV head h // (NH / NKV)."""
    unused = (k, v, rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad, block_table, alibi_slopes)
    assert all(x is None for x in unused) and window_size == (-1, -1) and softcap == 0.0, "not in the stand-in"
    assert not return_softmax_lse, "not in the stand-in"
    assert q.dtype in (torch.float16, torch.bfloat16), "FlashAttention only support fp16 and bf16 data type"
    assert k_cache.dtype == q.dtype and v_cache.dtype == q.dtype, "query and key/value must have the same dtype"
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, \
        "Input tensor must have contiguous last dimension"
    batch, num_q, num_heads, head_dim = q.shape
    _, max_seq, num_kv, _ = k_cache.shape
    assert tuple(k_cache.shape) == tuple(v_cache.shape) == (batch, max_seq, num_kv, head_dim), "cache shape"
    assert head_dim <= 256 and num_heads % num_kv == 0, "head dim or head counts"
    # the real function also takes an int; the engine must pass a device tensor to capture in a CUDA graph
    assert isinstance(cache_seqlens, torch.Tensor), "the engine passes cache_seqlens as a tensor"
    assert cache_seqlens.dtype == torch.int32 and cache_seqlens.is_contiguous(), "seqlens_k must have dtype int32"
    assert tuple(cache_seqlens.shape) == (batch,) and cache_seqlens.device == q.device, "seqlens_k shape/device"
    flash_attn_with_kvcache.calls += 1
    scale = head_dim ** -0.5 if softmax_scale is None else softmax_scale
    group = num_heads // num_kv
    keys = k_cache.float().repeat_interleave(group, dim=2)  # [B, S, NH, HD]
    values = v_cache.float().repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bshd->bhqs", q.float(), keys) * scale
    last = cache_seqlens[:, None].long() - 1 - ((num_q - 1 - torch.arange(num_q, device=q.device)) if causal else 0)
    hidden = torch.arange(max_seq, device=q.device)[None, None, :] > last[..., None]  # [B, Q, S]
    scores = scores.masked_fill(hidden[:, None], float("-inf"))
    return torch.einsum("bhqs,bshd->bqhd", scores.softmax(-1), values).to(q.dtype)


def fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, inplace=False, activation="silu",
                  apply_router_weight_on_input=False, global_num_experts=-1, expert_map=None, quant_config=None,
                  allow_deep_gemm=False):
    """Stand-in for vLLM's fused_experts (fused_moe.py, commit 13cb3e44), unquantised SiLU experts only:
    out[m] = sum_j topk_weights[m, j] * w2[e] @ (silu(g) * u), [g; u] = w1[e] @ hidden_states[m],
    e = topk_ids[m, j]; w1 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I]. Rounded as the real one:
    both projections' outputs in the activation dtype, the routing weight applied to the float32 down
    projection before it is rounded."""
    assert not inplace and activation == "silu" and not apply_router_weight_on_input, "not in the stand-in"
    assert global_num_experts == -1 and expert_map is None and quant_config is None, "not in the stand-in"
    assert hidden_states.size(1) == w1.size(2), "Hidden size mismatch"
    assert topk_weights.size() == topk_ids.size(), "topk shape mismatch"
    assert hidden_states.is_contiguous(), "Hidden_states must be contiguous"
    assert w1.stride(-1) == 1 and w2.stride(-1) == 1, "Stride of last dimension must be 1"
    assert hidden_states.dtype in (torch.float32, torch.float16, torch.bfloat16)
    assert topk_weights.stride(1) == 1, "invoke_fused_moe_kernel: topk_weights.stride(1) == 1"
    num_experts, two_inter, hidden = w1.shape
    assert tuple(w2.shape) == (num_experts, hidden, two_inter // 2), "w2 shape"
    # what vLLM's own top-k (fused_topk) emits
    assert topk_ids.dtype == torch.int32 and topk_weights.dtype == torch.float32, "topk dtypes"
    fused_experts.calls += 1
    dt = hidden_states.dtype
    ids = topk_ids.long()
    gate_up = torch.einsum("mjnh,mh->mjn", w1[ids].float(), hidden_states.float()).to(dt).float()
    gate, up = gate_up.chunk(2, dim=-1)
    act = (F.silu(gate) * up).to(dt).float()
    down = torch.einsum("mjhi,mji->mjh", w2[ids].float(), act) * topk_weights[..., None]
    return down.to(dt).float().sum(1).to(dt)


@pytest.fixture
def stand_ins(monkeypatch):
    """Put the stand-in modules where the engine imports the real packages from."""
    flash_attn_with_kvcache.calls = fused_experts.calls = 0
    flash = types.ModuleType("flash_attn")
    flash.flash_attn_with_kvcache = flash_attn_with_kvcache
    monkeypatch.setitem(sys.modules, "flash_attn", flash)
    names = ["vllm", "vllm.model_executor", "vllm.model_executor.layers", "vllm.model_executor.layers.fused_moe"]
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules[names[-1]].fused_experts = fused_experts
    return flash, sys.modules[names[-1]]


def _tiny(dtype, device="cpu"):
    model, adapter = load_model("olmoe-tiny", seed=0, dtype=dtype, device=device)
    return model, adapter, ExpertStore.from_model(model, adapter)


@pytest.fixture(scope="module")
def tiny_bf16():
    return _tiny(torch.bfloat16)


def _engine(tiny, **config):
    """Exact routing with C = 16 of 64 slots, so that slot ids differ from expert ids."""
    model, adapter, store = tiny
    cal = Calibration.uniform(adapter.num_moe_layers, adapter.num_experts, adapter.vocab_size)
    return build_engine(model, preset("exact_lru", 16, adapter.top_k), cal,
                        EngineConfig(max_seq_len=SEQ, **config), store=store)


def _tokens(tiny, n=20):
    return np.random.default_rng(2).integers(0, tiny[1].vocab_size, n)


def _check_in_use(engine, config):
    assert not any("unusable" in note for note in engine.notes), engine.notes
    assert (engine.decoder.flash_attn is not None) == (config.get("attention") == "flash_attn")
    assert (engine.decoder.fused_experts is not None) == (config.get("moe") == "vllm")


def _assert_close(run, ref, max_rel):
    """Logits within max_rel (relative L2 per position), and the same greedy token wherever the reference's
    margin exceeds the numerical noise at that position (bfloat16 rounds differently on the two paths)."""
    rel = np.linalg.norm(run.logits - ref.logits, axis=1) / np.linalg.norm(ref.logits, axis=1)
    assert rel.max() < max_rel, rel
    noise = np.abs(run.logits - ref.logits).max(axis=1)
    mine = run.logits.argmax(axis=1)
    margin = ref.logits.max(axis=1) - ref.logits[np.arange(len(mine)), mine]
    assert np.all(margin <= 2 * noise), (margin, noise)


def _check_default_results(tiny, config):
    """The engine on the stand-ins of `config` decodes like the default engine: following the default run's
    routing (trace), and routing on its own logits (bfloat16 ties may then pick other experts)."""
    tokens = _tokens(tiny)
    ref = _engine(tiny).teacher_forced(tokens, return_logits=True)
    engine = _engine(tiny, **config)
    _check_in_use(engine, config)
    calls = flash_attn_with_kvcache.calls, fused_experts.calls
    traced = engine.teacher_forced(tokens, feed=LogitFeed.of(ref, with_tokens=False), return_logits=True)
    assert {key: traced.info[key] for key in config} == config
    if not engine.cuda:  # eager steps: one call per layer and token (in CUDA graphs only capture calls)
        layer_steps = len(tokens) * engine.num_layers
        assert flash_attn_with_kvcache.calls - calls[0] == (layer_steps if "attention" in config else 0)
        assert fused_experts.calls - calls[1] == (layer_steps if "moe" in config else 0)
    np.testing.assert_array_equal(traced.selected, ref.selected)
    _assert_close(traced, ref, 0.05)
    _assert_close(engine.teacher_forced(tokens, return_logits=True), ref, 0.1)


@pytest.mark.parametrize("config", [dict(attention="flash_attn"), dict(moe="vllm"),
                                    dict(attention="flash_attn", moe="vllm")])
def test_stand_ins_give_the_default_results(stand_ins, tiny_bf16, config):
    _check_default_results(tiny_bf16, config)
    if "attention" in config:  # only the written positions are read
        decoder = _engine(tiny_bf16, **config).decoder
        assert decoder.bytes_per_token(3) < _engine(tiny_bf16).decoder.bytes_per_token(3)


def test_vllm_stand_in_in_float32_decodes_exactly_like_the_slot_kernel(stand_ins):
    tiny = _tiny(torch.float32)
    tokens = _tokens(tiny)
    ref_engine, engine = _engine(tiny), _engine(tiny, moe="vllm")
    _check_in_use(engine, dict(moe="vllm"))
    ref, run = (e.teacher_forced(tokens, return_logits=True) for e in (ref_engine, engine))
    np.testing.assert_array_equal(run.selected, ref.selected)
    np.testing.assert_allclose(run.logits, ref.logits, rtol=0, atol=1e-5)
    assert engine.generate(tokens[:5], 10).generated == ref_engine.generate(tokens[:5], 10).generated


@pytest.mark.gpu
def test_stand_ins_in_cuda_graphs(stand_ins):
    tiny = _tiny(torch.bfloat16, "cuda")
    config = dict(attention="flash_attn", moe="vllm")
    assert _engine(tiny, **config).graphs is not None
    _check_default_results(tiny, config)


def test_a_disagreeing_kernel_is_not_used(stand_ins, tiny_bf16, monkeypatch):
    monkeypatch.setattr(stand_ins[1], "fused_experts", lambda x, *args, **kwargs: torch.zeros_like(x))
    engine = _engine(tiny_bf16, moe="vllm")
    assert engine.decoder.fused_experts is None
    assert any("vLLM's fused_experts unusable (RuntimeError: fused_experts differs" in n for n in engine.notes)
    tokens = _tokens(tiny_bf16)
    ref = _engine(tiny_bf16).teacher_forced(tokens, return_logits=True)
    run = engine.teacher_forced(tokens, return_logits=True)
    np.testing.assert_array_equal(run.logits, ref.logits)
    assert run.info["moe"] == "slot"


def test_flash_attn_on_a_float32_model_falls_back_to_sdpa(stand_ins):
    engine = _engine(_tiny(torch.float32), attention="flash_attn")
    assert engine.decoder.flash_attn is None
    assert any("flash_attn_with_kvcache unusable (AssertionError: FlashAttention only support fp16 and bf16"
               in note for note in engine.notes), engine.notes


@pytest.mark.parametrize("config,module,message", [
    (dict(attention="flash_attn"), "flash_attn", r"attention='flash_attn' needs the flash-attn package.*"
                                                 r"pip install 'specmoe\[flash-attn\]'"),
    (dict(moe="vllm"), "vllm.model_executor.layers.fused_moe", r"moe='vllm' needs the vllm package.*pip install 'specmoe\[vllm\]'")])
def test_a_missing_package_is_a_clear_error(tiny_bf16, monkeypatch, config, module, message):
    monkeypatch.setitem(sys.modules, module, None)  # not importable, whatever is installed
    with pytest.raises(ImportError, match=message):
        _engine(tiny_bf16, **config)


def test_bad_kernel_settings(stand_ins, tiny_bf16):
    with pytest.raises(ValueError, match="attention must be one of"):
        EngineConfig(attention="flash")
    with pytest.raises(ValueError, match="moe must be one of"):
        EngineConfig(moe="fused")
    with pytest.raises(ValueError, match="not a run setting"):
        _engine(tiny_bf16).configure(attention="flash_attn")
