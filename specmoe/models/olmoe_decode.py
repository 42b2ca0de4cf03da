"""OLMoE's decode path for the engines (the `Decoder` protocol of `specmoe.models.decoder`): everything but
the routed experts, over a static KV cache, for D positions per step.

The weights are transformers' (taken from an OlmoeForCausalLM, or read from a checkpoint without the
experts); rounding points follow transformers' modules so that all-resident exact decoding matches it.
Attention, router and pre-gate of a layer are one step function: RMSNorm, QKV, QK-norm + rotary + KV write,
attention, output projection + residual, post-attention RMSNorm (the MoE input), then router l and router
l+1 (the pre-gate) on that MoE input in one [2E, H] product.

Feature capture (`capture_features`, for drafters that read the target's hidden states, e.g. DFlash): the
hidden state after each named layer, for the step's D positions, lands in the step's `work["features"]`
[D, n * H] (in the order of the layer ids, as `extract_context_feature` concatenates them),
written inside the captured graphs: layer l's by graph A_{l+1} before it changes the residual stream, the last
layer's by the head graph after the final norm (transformers' hidden_states[L] is the normed last state).
"""

from __future__ import annotations

import torch

from specmoe.geometry import Geometry
from specmoe.kernels import (causal_step_mask, check_kernel_choice, check_tune, checks, decode_attention,
                             decode_attention_flash, load_flash_attn, load_fused_experts, make_split_kv_workspace,
                             norm_rope, split_kv_attention, triton_available)

from specmoe.kernels.gemv import Linears

from .decoder import (DecodeStep, FeatureCapture, Sourced, add_grouped_workspace, finish_head, residual_work,
                      routed_moe, split_kv_check, tune_slot_moe, use_dense_kernels, use_grouped_moe, verified)
from .olmoe import OlmoeAdapter


def _layer_keys(i: int) -> dict[str, str]:
    p = f"model.layers.{i}."
    return {"input_ln": p + "input_layernorm.weight", "q": p + "self_attn.q_proj.weight",
            "k": p + "self_attn.k_proj.weight", "v": p + "self_attn.v_proj.weight",
            "o": p + "self_attn.o_proj.weight", "q_norm": p + "self_attn.q_norm.weight",
            "k_norm": p + "self_attn.k_norm.weight", "post_ln": p + "post_attention_layernorm.weight",
            "router": p + "mlp.gate.weight"}


class OlmoeDecoder(Sourced, FeatureCapture):
    """OLMoE without the routed experts, over a static KV cache; see the module docstring."""

    state_rollback = None  # every state is indexed by position (`Decoder.state_rollback`)

    def __init__(self, config, weight, max_seq_len: int, device, dtype: torch.dtype):
        """config: a transformers OlmoeConfig; weight(name) -> tensor, for transformers' parameter names
        (from a model or a checkpoint)."""
        # the architecture's constants; its shapes are the geometry's
        self.rope_theta = float(norm_rope.default_rope_theta(config, "the OLMoE decoder"))
        self.eps, self.clip_qkv = float(config.rms_norm_eps), config.clip_qkv
        c = self.geometry = Geometry.from_hf(config, max_seq_len)
        self.device, self.dtype = torch.device(device), dtype
        self.scoring = OlmoeAdapter.from_config(config).router_scoring(weight)
        self.backend, self.attention, self.moe_params, self.notes = "torch", "sdpa", None, []
        self.flash_attn = self.fused_experts = None  # set by use_kernels once checked
        self.grouped_moe, self.grouped_params = False, {}  # the grouped MoE kernel for D > 1, its params per D
        self.launch: dict[str, dict] = {}  # launch parameters that run and their source, per kernel (use_kernels)
        self.linears, self.greedy_fused = Linears(), False  # one-row GEMMs and the greedy head (use_kernels)
        self._tuning = (False, None)  # (tune, slot buffer) for the grouped kernel's params of later steps
        w = lambda name: weight(name).to(device=self.device, dtype=dtype)  # noqa: E731 (no copy if already so)
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
        s, dev = self.geometry.max_seq_len, self.device
        self.k_cache = torch.zeros(c.num_layers, c.num_kv_heads, s, c.head_dim, dtype=dtype, device=dev)
        self.v_cache = torch.zeros_like(self.k_cache)
        self.positions = torch.arange(s, device=dev)
        self.cos, self.sin = norm_rope.rope_tables(c.head_dim, self.rope_theta, s, dev)
        self.scale = c.head_dim ** -0.5
        self._steps: dict[int, DecodeStep] = {}
        self.feature_layers, self._feature_slots = (), {}  # capture_features
        self._feature_layer_count = self.geometry.num_layers

    # -- kernels ---------------------------------------------------------------------------------------
    def use_kernels(self, backend: str, attention: str, moe: str, slot_buf: torch.Tensor, tune="auto") -> dict:
        """See `Decoder.use_kernels`. Launch parameters (`specmoe.kernels.tuning`): the slot MoE kernel's are
        chosen here, the grouped kernel's when a step of D > 1 positions is first made (`step`); `launch`
        (also in the returned dict) records which ran and whether from the cache, a fresh tune or the defaults."""
        check_kernel_choice(backend, attention, moe)
        tune = check_tune(tune)
        # a missing optional package is an ImportError here, before anything runs
        flash_attn = load_flash_attn() if attention == "flash_attn" else None
        fused_experts = load_fused_experts() if moe == "vllm" else None
        cuda = self.device.type == "cuda"
        g, on = self.geometry, (self.dtype, self.device)  # what the self-checks run with
        self.flash_attn = self.fused_experts = self.moe_params = None
        self.grouped_moe, self.attention, self.grouped_params = False, "sdpa", {}
        self.launch.clear()
        self._tuning = (tune, slot_buf)
        if attention == "split_kv" or (attention == "auto" and cuda and triton_available()):
            if verified(self, "split-KV attention", "SDPA", lambda: checks.check_attention(
                    g, "split-KV attention kernel", split_kv_check, *on)):
                self.attention = "split_kv"
        if flash_attn is not None and verified(self, "flash-attn's flash_attn_with_kvcache", "SDPA", lambda: (
                checks.check_attention(g, "flash_attn_with_kvcache", self._flash_check(flash_attn), *on))):
            self.flash_attn, self.attention = flash_attn, "flash_attn"
        if fused_experts is not None and verified(self, "vLLM's fused_experts", "the slot MoE kernel", lambda: (
                checks.check_fused_experts(g, slot_buf, fused_experts, *on))):
            self.fused_experts = fused_experts
        self.backend = "torch"
        if backend == "triton" or (backend == "auto" and cuda and triton_available()):
            # vLLM's kernel runs the MoE otherwise: the slot kernel is checked with its defaults, not tuned
            slot_tune = tune if self.fused_experts is None else False
            if verified(self, "Triton kernels", "torch fallback", lambda: self._tune_and_check(
                    slot_buf, slot_tune)):
                self.backend = "triton"
            else:
                self.moe_params = None
                self.launch.clear()
        use_dense_kernels(self, self.backend == "triton", tune)
        if self.backend == "triton" and self.fused_experts is None:
            use_grouped_moe(self, slot_buf)
        return {"backend": self.backend, "attention": self.attention,
                "moe": "slot" if self.fused_experts is None else "vllm", "launch": self.launch}

    def dense_weights(self) -> list[torch.Tensor]:
        """The dense projections' weights, one per distinct shape (query/key/value, output, router pair, head): the
        set `use_dense_kernels` chooses one-row launches for."""
        return [self.wqkv[0], self.wo[0], self.router_pair[0], self.lm_head]

    def _tune_and_check(self, slot_buf: torch.Tensor, tune) -> None:
        tune_slot_moe(self, slot_buf, tune, record=self.fused_experts is None)
        checks.check_triton(self.geometry, slot_buf, self.moe_params, self.eps, self.clip_qkv, self.dtype,
                            self.device)

    @staticmethod
    def _flash_check(flash_attn):
        return lambda q, k, v, seq_len, scale: decode_attention_flash(q, k, v, seq_len, scale, flash_attn)

    # -- buffers ---------------------------------------------------------------------------------------
    def step(self, num_positions: int) -> DecodeStep:
        if num_positions not in self._steps:
            c, d, dev, dt = self.geometry, num_positions, self.device, self.dtype
            step = DecodeStep.allocate(d, c, dev)
            residual_work(step, c, dt, self.feature_layers)
            step.work.update(q=torch.zeros(d, c.num_heads, c.head_dim, dtype=dt, device=dev),
                             att=torch.zeros(d, c.num_heads * c.head_dim, dtype=dt, device=dev),
                             seqlens=torch.zeros(1, dtype=torch.int32, device=dev))
            step.work["split_kv"] = make_split_kv_workspace(d, c.num_heads, c.head_dim, c.max_seq_len, dev,
                                                            num_kv_heads=c.num_kv_heads)
            add_grouped_workspace(self, step, d)
            self._steps[num_positions] = step
        return self._steps[num_positions]

    @property
    def layer_kinds(self) -> tuple[tuple[str, str], ...]:
        return (("attention", "moe"),) * self.geometry.num_layers

    def rollback(self, step: DecodeStep, committed: int) -> None:
        """Nothing to restore: the KV cache is indexed by position (the next step overwrites rejected rows)."""

    def randomize_cache(self, seed: int) -> None:
        generator = torch.Generator(device=self.device).manual_seed(int(seed))
        for cache in (self.k_cache, self.v_cache):
            cache.normal_(generator=generator)

    def reset(self) -> None:
        """Nothing to clear: a step masks every position it has not written (SDPA) or attends only up to its
        last position (flash-attn); positions count from the step's input."""

    # -- device steps (graph bodies) -------------------------------------------------------------------
    def _rmsnorm(self, x, weight, out, residual=None):
        """`norm_rope.rmsnorm` into out (after residual += x, with a residual), fused on the Triton backend."""
        return norm_rope.rmsnorm(self.backend == "triton", x, weight, self.eps, residual=residual, out=out)

    def attention_router(self, step: DecodeStep, layer: int, copy_out: bool = True) -> None:
        w, d = step.work, step.num_positions
        first = step.input_dev[d:]
        if layer == 0:
            step.input_dev.copy_(step.input_host, non_blocking=True)
            w["h"].copy_(self.embed.index_select(0, step.input_dev[:d]))
            if self.attention == "sdpa":
                causal_step_mask(self.positions, first, w["mask"])
            else:  # positions written, the step's own included
                w["seqlens"].copy_(first + d)
        else:
            self._write_features(step, layer - 1, w["h"])
        x = self._rmsnorm(w["h"], self.input_ln[layer], w["xn"])
        qkv = self.linears(x, self.wqkv[layer])
        prologue = norm_rope.qkv_prologue_triton if self.backend == "triton" else norm_rope.qkv_prologue_torch
        prologue(qkv, self.q_norm[layer], self.k_norm[layer], self.cos, self.sin, first, w["q"],
                 self.k_cache[layer], self.v_cache[layer], self.eps, self.clip_qkv)
        k_cache, v_cache = self.k_cache[layer], self.v_cache[layer]
        if self.attention == "split_kv":
            att = split_kv_attention(w["q"], k_cache, v_cache, w["seqlens"], self.scale, w["att"], w["split_kv"])
        elif self.attention == "flash_attn":
            att = decode_attention_flash(w["q"], k_cache, v_cache, w["seqlens"], self.scale, self.flash_attn)
        else:
            att = decode_attention(w["q"], k_cache, v_cache, w["mask"], self.scale)
        m = self._rmsnorm(self.linears(att, self.wo[layer]), self.post_ln[layer], w["moe_in"], residual=w["h"])
        self.linears(m, self.router_pair[layer], out32=step.logits_dev[layer])
        if copy_out:
            step.copy_out_logits(layer)

    def moe(self, step: DecodeStep, layer: int, slot_buf: torch.Tensor, copy_in: bool = True,
            late: tuple | None = None) -> None:
        routed_moe(self, step, layer, slot_buf, copy_in, self.fused_experts, late)

    def head(self, step: DecodeStep, copy_out: bool = True) -> None:
        x = self._rmsnorm(step.work["h"], self.final_norm, step.work["xn"])
        finish_head(self, step, self.geometry.num_layers - 1, x, copy_out)

    # -- accounting ------------------------------------------------------------------------------------
    def bytes_per_token(self, position: int) -> int:
        c = self.geometry
        item = self.embed.element_size()
        per_layer = sum(t.numel() for t in (self.wqkv[0], self.wo[0], self.router_pair[0], self.input_ln[0],
                                            self.post_ln[0], self.q_norm[0], self.k_norm[0])) * item
        attended = self.geometry.max_seq_len if self.attention == "sdpa" else position + 1  # SDPA reads it all
        kv = 2 * c.num_kv_heads * attended * c.head_dim * item
        return c.num_layers * (per_layer + kv) + (self.lm_head.numel() + c.hidden * 2) * item
