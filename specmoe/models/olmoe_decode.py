"""Engine-side OLMoE for batch-1 decoding (gpt-fast style): everything but the routed experts, over a static
KV cache, as three step functions that the AR engine runs eagerly (CPU) or captures as CUDA graphs:

- `attention_router(l)`: (layer 0: token embedding) RMSNorm, QKV, QK-norm + rotary + KV write, attention
  (SDPA over the masked cache, or flash-attn's `flash_attn_with_kvcache` when the engine sets `flash_attn`),
  output projection + residual, post-attention RMSNorm (the MoE input), then the router of layer l and the
  pre-gate (router of layer l+1) on that MoE input in one [2E, H] product; the logits land in
  `logits_host[l]` = [z_l | g_{l+1}] (float32, pinned).
- `moe(l, slot_buf)`: copies the route row (slot ids + execution weights, written by the host) to the device
  and runs the slot-indexed MoE (ours, or vLLM's `fused_experts` when the engine sets `fused_experts`),
  adding the result to the residual stream.
- `head()`: final RMSNorm, LM head, greedy token into `next_token_host`.

The weights are transformers' (taken from an OlmoeForCausalLM, or read from a checkpoint without the
experts); rounding points follow transformers' modules so that all-resident exact decoding matches it.
Another architecture (DeepSeek-V3, Qwen3.5-MoE) provides a class with the same three steps and buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from specmoe.kernels import decode_attention, decode_attention_flash, slot_moe, slot_moe_vllm
from specmoe.kernels import norm_rope


@dataclass(frozen=True)
class DecodeConfig:
    """The shapes and constants of an OLMoE decoder (from a transformers OlmoeConfig)."""

    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    inter: int
    num_experts: int
    top_k: int
    vocab_size: int
    eps: float
    rope_theta: float
    clip_qkv: float | None
    norm_topk_prob: bool

    @classmethod
    def from_hf(cls, config) -> "DecodeConfig":
        rope = dict(getattr(config, "rope_parameters", None) or {})
        rope_type = rope.get("rope_type", "default")
        if rope_type != "default":
            raise ValueError(f"the OLMoE decoder supports default rotary embeddings only, got {rope_type!r}")
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
                   config.num_key_value_heads, head_dim, config.intermediate_size, config.num_experts,
                   config.num_experts_per_tok, config.vocab_size, float(config.rms_norm_eps), float(theta),
                   config.clip_qkv, bool(config.norm_topk_prob))


def _layer_keys(i: int) -> dict[str, str]:
    p = f"model.layers.{i}."
    return {"input_ln": p + "input_layernorm.weight", "q": p + "self_attn.q_proj.weight",
            "k": p + "self_attn.k_proj.weight", "v": p + "self_attn.v_proj.weight",
            "o": p + "self_attn.o_proj.weight", "q_norm": p + "self_attn.q_norm.weight",
            "k_norm": p + "self_attn.k_norm.weight", "post_ln": p + "post_attention_layernorm.weight",
            "router": p + "mlp.gate.weight"}


class OlmoeDecoder:
    """Batch-1 OLMoE decoder without the routed experts; see the module docstring."""

    def __init__(self, cfg: DecodeConfig, get, max_seq_len: int, device, dtype: torch.dtype,
                 backend: str = "torch"):
        """get(name) -> tensor, for transformers' parameter names (model or checkpoint)."""
        self.cfg, self.device, self.dtype, self.backend = cfg, torch.device(device), dtype, backend
        self.max_seq_len = max_seq_len
        self.moe_params: dict | None = None
        self.flash_attn = None  # flash_attn_with_kvcache, set by the engine for attention="flash_attn"
        self.fused_experts = None  # vLLM's fused_experts, set by the engine for moe="vllm"
        self.d2h_in_graph = True
        c = cfg
        w = lambda name: get(name).to(device=self.device, dtype=dtype)  # noqa: E731 (no copy if already so)
        self.embed = w("model.embed_tokens.weight")
        self.lm_head = w("lm_head.weight")
        self.final_norm = w("model.norm.weight")
        self.input_ln, self.wqkv, self.q_norm, self.k_norm, self.wo, self.post_ln, self.router_pair = \
            [], [], [], [], [], [], []
        routers = [w(_layer_keys(i)["router"]) for i in range(c.num_layers)]
        for i in range(c.num_layers):
            k = _layer_keys(i)
            self.input_ln.append(w(k["input_ln"]))
            self.wqkv.append(torch.cat([w(k["q"]), w(k["k"]), w(k["v"])], dim=0))
            self.q_norm.append(w(k["q_norm"]))
            self.k_norm.append(w(k["k_norm"]))
            self.wo.append(w(k["o"]))
            self.post_ln.append(w(k["post_ln"]))
            nxt = routers[i + 1] if i + 1 < c.num_layers else torch.zeros_like(routers[i])
            self.router_pair.append(torch.cat([routers[i], nxt], dim=0))
        self._allocate()

    @classmethod
    def from_hf(cls, model, max_seq_len: int, backend: str = "torch", dtype: torch.dtype | None = None,
                device=None) -> "OlmoeDecoder":
        params = dict(model.named_parameters())
        if "lm_head.weight" not in params:  # tied embeddings
            params["lm_head.weight"] = params["model.embed_tokens.weight"]
        first = params["model.embed_tokens.weight"]
        return cls(DecodeConfig.from_hf(model.config), lambda name: params[name].detach(), max_seq_len,
                   device or first.device, dtype or first.dtype, backend)

    @classmethod
    def from_checkpoint(cls, path, max_seq_len: int, device, dtype: torch.dtype,
                        backend: str = "torch") -> "OlmoeDecoder":
        """Read config.json and the non-expert weights of a local checkpoint (experts are not read)."""
        from transformers import AutoConfig

        from specmoe.offload import CheckpointReader

        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
        reader = CheckpointReader(path)

        def get(name):
            if name == "lm_head.weight" and name not in reader:
                name = "model.embed_tokens.weight"
            return reader.get(name)

        return cls(DecodeConfig.from_hf(config), get, max_seq_len, device, dtype, backend)

    def _allocate(self) -> None:
        c, dev, dt = self.cfg, self.device, self.dtype
        pin = dev.type == "cuda"
        s = self.max_seq_len
        self.tokpos_host = torch.zeros(2, dtype=torch.int64, pin_memory=pin)
        self.tokpos = torch.zeros(2, dtype=torch.int64, device=dev)
        self.h = torch.zeros(c.hidden, dtype=dt, device=dev)
        self.xn = torch.zeros(c.hidden, dtype=dt, device=dev)
        self.moe_in = torch.zeros(c.hidden, dtype=dt, device=dev)
        self.q = torch.zeros(c.num_heads, c.head_dim, dtype=dt, device=dev)
        self.k_cache = torch.zeros(c.num_layers, c.num_kv_heads, s, c.head_dim, dtype=dt, device=dev)
        self.v_cache = torch.zeros_like(self.k_cache)
        self.mask = torch.full((s,), torch.finfo(dt).min, dtype=dt, device=dev)
        self.cache_seqlens = torch.zeros(1, dtype=torch.int32, device=dev)  # flash-attn: positions written
        self.logits_dev = torch.zeros(c.num_layers, 2 * c.num_experts, dtype=torch.float32, device=dev)
        self.logits_host = torch.zeros(c.num_layers, 2 * c.num_experts, dtype=torch.float32, pin_memory=pin)
        self.route_dev = torch.zeros(c.num_layers, 2 * c.top_k, dtype=torch.int32, device=dev)
        self.route_host = torch.zeros(c.num_layers, 2 * c.top_k, dtype=torch.int32, pin_memory=pin)
        self.act = torch.zeros(c.top_k, c.inter, dtype=dt, device=dev)
        self.out_logits = torch.zeros(c.vocab_size, dtype=torch.float32, device=dev)
        self.next_token = torch.zeros(1, dtype=torch.int64, device=dev)
        self.next_token_host = torch.zeros(1, dtype=torch.int64, pin_memory=pin)
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.int64).float() / c.head_dim))
        freqs = torch.arange(s).float()[:, None] * inv_freq[None, :]  # as transformers: float32 positions
        self.cos = freqs.cos().to(dev).contiguous()
        self.sin = freqs.sin().to(dev).contiguous()
        self.scale = c.head_dim ** -0.5
        # numpy views of the pinned buffers the host reads and writes
        self.tokpos_np = self.tokpos_host.numpy()
        self.logits_np = self.logits_host.numpy()
        self.route_np = self.route_host.numpy()
        self.weights_np = self.route_np.view(np.float32)[:, c.top_k:]
        self.next_token_np = self.next_token_host.numpy()

    # -- host side -----------------------------------------------------------------------------------
    def reset(self) -> None:
        """A new sequence: no position is attended (the caches' contents are masked, not cleared; flash-attn
        attends positions 0..pos, set from the position at every step)."""
        self.mask.fill_(torch.finfo(self.dtype).min)

    def set_input(self, token: int, pos: int) -> None:
        if not 0 <= pos < self.max_seq_len:
            raise ValueError(f"position {pos} is outside the static KV cache of {self.max_seq_len} positions")
        self.tokpos_np[0] = token
        self.tokpos_np[1] = pos

    def copy_out_attention(self, layer: int) -> None:
        """The device-to-host copy of `attention_router`, for when it is not captured in the graph."""
        self.logits_host[layer].copy_(self.logits_dev[layer], non_blocking=True)

    def copy_out_head(self) -> None:
        self.next_token_host.copy_(self.next_token, non_blocking=True)

    # -- device steps (graph bodies) -----------------------------------------------------------------
    def _rmsnorm(self, x, weight, out):
        if self.backend == "triton":
            return norm_rope.rmsnorm_triton(x, weight, self.cfg.eps, out)
        return out.copy_(norm_rope.rmsnorm_torch(x, weight, self.cfg.eps))

    def attention_router(self, layer: int, copy_out: bool = True) -> None:
        c = self.cfg
        if layer == 0:
            self.tokpos.copy_(self.tokpos_host, non_blocking=True)
            self.h.copy_(self.embed.index_select(0, self.tokpos[:1]).view(-1))
            if self.flash_attn is None:
                self.mask.index_fill_(0, self.tokpos[1:], 0.0)
            else:
                self.cache_seqlens.copy_(self.tokpos[1:] + 1)
        x = self._rmsnorm(self.h, self.input_ln[layer], self.xn)
        qkv = F.linear(x, self.wqkv[layer])
        prologue = norm_rope.qkv_prologue_triton if self.backend == "triton" else norm_rope.qkv_prologue_torch
        prologue(qkv, self.q_norm[layer], self.k_norm[layer], self.cos, self.sin, self.tokpos[1:], self.q,
                 self.k_cache[layer], self.v_cache[layer], c.eps, c.clip_qkv)
        if self.flash_attn is None:
            att = decode_attention(self.q, self.k_cache[layer], self.v_cache[layer], self.mask, self.scale)
        else:
            att = decode_attention_flash(self.q, self.k_cache[layer], self.v_cache[layer], self.cache_seqlens,
                                         self.scale, self.flash_attn)
        self.h.add_(F.linear(att, self.wo[layer]))
        m = self._rmsnorm(self.h, self.post_ln[layer], self.moe_in)
        self.logits_dev[layer].copy_(F.linear(m, self.router_pair[layer]))
        if copy_out:
            self.copy_out_attention(layer)

    def moe(self, layer: int, slot_buf: torch.Tensor) -> None:
        c = self.cfg
        self.route_dev[layer].copy_(self.route_host[layer], non_blocking=True)
        if self.fused_experts is not None:
            slot_moe_vllm(self.moe_in, self.h, slot_buf, self.route_dev[layer], self.h, c.hidden, c.inter,
                          self.fused_experts)
            return
        slot_moe(self.moe_in, self.h, slot_buf, self.route_dev[layer], self.act, self.h, c.hidden, c.inter,
                 "triton" if self.backend == "triton" else "torch", self.moe_params)

    def head(self, copy_out: bool = True) -> None:
        x = self._rmsnorm(self.h, self.final_norm, self.xn)
        self.out_logits.copy_(F.linear(x, self.lm_head))
        self.next_token.copy_(self.out_logits.argmax().view(1))
        if copy_out:
            self.copy_out_head()

    # -- accounting ----------------------------------------------------------------------------------
    def bytes_per_token(self, pos: int) -> int:
        """Bytes of weights and KV cache one decode step reads, experts excluded (for the bandwidth floor)."""
        c = self.cfg
        item = self.h.element_size()
        per_layer = sum(t.numel() for t in (self.wqkv[0], self.wo[0], self.router_pair[0], self.input_ln[0],
                                            self.post_ln[0], self.q_norm[0], self.k_norm[0])) * item
        attended = self.max_seq_len if self.flash_attn is None else pos + 1  # SDPA reads the whole masked cache
        kv = 2 * c.num_kv_heads * attended * c.head_dim * item
        return c.num_layers * (per_layer + kv) + (self.lm_head.numel() + c.hidden * 2) * item
