"""DeepSeek-V3's decode path for the engines (the `Decoder` protocol of `specmoe.models.decoder`): everything but
the routed experts, over a static latent KV cache, for D positions per step (Moonlight-16B-A3B and other
models of transformers' `deepseek_v3` type with the default rotary embedding).

The weights are transformers' (taken from a DeepseekV3ForCausalLM, or read from a checkpoint without the
routed experts); rounding points follow transformers' modules where the arithmetic is the same, so that
all-resident exact decoding matches it (float32: to rounding; see "Rounding" for bf16).

Layers and launches. The engine routes the MoE layers l = 0 .. L - 1 (decoder layers `moe_layer_ids`; the
first `first_k_dense_replace` decoder layers have a dense MLP) and calls attention_router(step, l),
moe(step, l) for each, then head(step). The dense layers run inside those launches:
- attention_router(step, l): (l = 0: token embedding, causal mask) the dense decoder layers between MoE layer
  l - 1 and MoE layer l, entirely (attention and dense MLP; for l = 0: the first first_k_dense_replace
  layers), then MoE layer l's attention, its MoE input (post-attention RMSNorm) and, on it, router l and the
  pre-gate router l + 1 in one float32 [2E, H] product (transformers computes the router in float32): the
  engine's [z | g] rows, as OLMoE's; then the shared experts (resident, ungated) on the MoE input, added to
  the residual;
- moe(step, l, slot_buf): the routed experts over the slot buffer at the host's slot ids and execution weights
  (the expert store's [gate | up | down] rows: `specmoe.kernels.slot_moe`, Triton or torch, per position; the
  grouped Triton kernel for steps of D > 1, as OLMoE's), added to the residual, and nothing
  else (the engine may run it several times per layer, each time with other positions' weights nonzero);
- head(step): any dense layers after the last MoE layer (none in DeepSeek-V3), final norm, LM head, greedy
  tokens.
For Moonlight (27 layers, first_k_dense_replace 1): attention_router(step, 0) runs the embedding, decoder
layer 0 whole and decoder layer 1's attention and routers; MoE layer l is decoder layer l + 1.

The dense parts on fused kernels (`use_kernels` with the Triton backend, after a check against the torch ops at
the decoder's shapes, `checks.check_mla_kernels`; `kernels["dense"]` says which ran): every RMSNorm one launch
(`norm_rope.rmsnorm_triton`; the post-attention norm with the output projection's residual add), the attention's
prologue one launch (`mla.mla_prologue_triton`: the latent norm, both rotations, the cache rows and the queries;
about thirty torch launches otherwise), the SwiGLU product of the dense MLPs and shared experts one launch
(`norm_rope.gate_mul_triton`), the float32 router product written straight into the step's logits rows; every
dense projection (the attention's, the dense and shared MLPs', routers and head) goes through the decoder's linear
layers (`specmoe.kernels.gemv.Linears`: at one position the GEMV kernel, its launch tuned per weight shape; a
projection with a bias, and every step of several positions, on F.linear). The torch path (CPU, or a failed
check) runs the same arithmetic as torch ops.

MLA at decode (`specmoe.kernels.mla`): the cache keeps, per decoder layer and position, the normed latent c
(kv_lora_rank) and the rotated key part k_pe (qk_rope_head_dim) in one [S, R + P] row block; queries are
absorbed (q_nope through kv_b_proj's key rows into latent space), every head attends the one latent head,
and the latent output leaves through kv_b_proj's value rows, then o_proj. The attention itself is
`split_kv_latent_attention` (Triton, reads positions 0 .. pos + i only, one 576-wide row per position for
Moonlight) on CUDA, or `mla_decode_attention` (torch SDPA over the masked cache; the CPU path and the reference);
`use_kernels` chooses, after a self-check on the device. The prologue before it (`mla.mla_prologue_torch`, or
its kernel) writes the step's cache rows and queries. Query: q_proj, or q_a_proj ->
RMSNorm -> q_b_proj where q_lora_rank is set (DeepSeek-V3; Moonlight has none). Rotary: transformers' default
rope over qk_rope_head_dim, interleaved pairs where `rope_interleave` (its default); other rope types (yarn,
which DeepSeek-V3 itself uses) are refused, naming the config field. Softmax scale: qk_head_dim^-1/2.

Rounding (bf16): transformers expands the cache to per-head keys and values (kv_b_proj's outputs rounded)
and adds the routed sum, then the shared experts, to the residual; here the absorbed query q_lat is rounded
instead, and the shared experts are added to the residual before the routed experts (slot_moe's float32 sum
rounded once with the residual). Exact agreement is tested in float32.

Feature capture (`capture_features`) names decoder layers (transformers' hidden_states[j + 1], the dense
ones included): a dense layer's state is written after its MLP, a MoE layer's at the start of the next
launch (before it changes the residual stream), the last decoder layer's after the final norm.

Router scoring (`deepseek_v3_scoring`): the adapter's (sigmoid scores, the per-layer selection bias
e_score_correction_bias, group-limited choice, norm_topk_prob renormalisation and routed_scaling_factor).
"""

from __future__ import annotations

import torch

from specmoe.geometry import Geometry
from specmoe.kernels import (causal_step_mask, check_kernel_choice, check_tune, checks, make_split_kv_workspace,
                             norm_rope, triton_available)
from specmoe.kernels.gemv import Linears
from specmoe.kernels.mla import mla_decode_attention, mla_prologue_torch, mla_prologue_triton
from specmoe.kernels.split_kv import split_kv_latent_attention
from specmoe.routing import RouterScoring

from .adapter import ModelSourceError
from .decoder import (DecodeStep, FeatureCapture, Sourced, add_grouped_workspace, finish_head, residual_work,
                      routed_moe, use_dense_kernels, use_slot_moe, verified)

LATENT_NORM_EPS = 1e-6  # transformers' DeepseekV3RMSNorm default: q_a_layernorm and kv_a_layernorm use it


def moe_layer_ids(config) -> tuple[int, ...]:
    """The decoder layers with an MoE MLP: every layer from first_k_dense_replace on."""
    first = int(getattr(config, "first_k_dense_replace", 0) or 0)
    return tuple(range(first, config.num_hidden_layers))


def deepseek_v3_scoring(config, weight) -> RouterScoring:
    """The router's rule for the engines' routing step: the adapter's (`DeepseekV3Adapter.router_scoring`: sigmoid,
    the per-MoE-layer selection bias, groups, norm_topk_prob, routed_scaling_factor). weight(name) -> tensor by
    transformers' names (the bias buffers)."""
    from .deepseek_v3 import DeepseekV3Adapter

    return DeepseekV3Adapter.from_config(config).router_scoring(weight)


def _check_config(config) -> None:
    """ModelSourceError naming the config field for what this decoder does not implement."""
    rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise ModelSourceError(f"the DeepSeek-V3 decoder implements the default rotary embedding only; the config's "
                               f"rope_parameters (rope_scaling) has rope_type {kind!r}")
    if config.hidden_act != "silu":
        raise ModelSourceError(f"the DeepSeek-V3 decoder implements hidden_act 'silu' only, got {config.hidden_act!r}")
    if not moe_layer_ids(config):
        raise ModelSourceError(f"this DeepSeek-V3 config has no MoE layers (first_k_dense_replace="
                               f"{config.first_k_dense_replace}, num_hidden_layers={config.num_hidden_layers})")


class DeepseekV3Decoder(Sourced, FeatureCapture):
    """DeepSeek-V3 (MLA, dense first layers, shared experts) without the routed experts, over a static latent
    KV cache; see the module docstring."""

    state_rollback = None  # every state is indexed by position (`Decoder.state_rollback`)

    def __init__(self, config, weight, max_seq_len: int, device, dtype: torch.dtype):
        """config: a transformers DeepseekV3Config; weight(name) -> tensor, for transformers' parameter (and
        buffer) names (from a model or a checkpoint)."""
        _check_config(config)
        self.rope_theta = float(norm_rope.default_rope_theta(config, "the DeepSeek-V3 decoder", ModelSourceError))
        self.eps, self.interleaved = float(config.rms_norm_eps), bool(getattr(config, "rope_interleave", True))
        # MLA's sizes (the geometry's attention fields describe the latent head the cache is read as)
        self.q_lora_rank, self.kv_lora_rank = config.q_lora_rank, int(config.kv_lora_rank)
        self.nope_dim, self.rope_dim = int(config.qk_nope_head_dim), int(config.qk_rope_head_dim)
        self.v_head_dim = int(config.v_head_dim)
        self.num_decoder_layers = config.num_hidden_layers
        self.moe_layer_ids = moe_layer_ids(config)
        self.geometry = Geometry(len(self.moe_layer_ids), config.n_routed_experts, config.num_experts_per_tok,
                                 config.vocab_size, config.hidden_size, config.moe_intermediate_size, int(max_seq_len),
                                 config.num_attention_heads, 1, self.kv_lora_rank + self.rope_dim, self.moe_layer_ids)
        self.device, self.dtype = torch.device(device), dtype
        self.scoring = deepseek_v3_scoring(config, weight)
        self.backend, self.attention, self.notes, self.launch = "torch", "sdpa", [], {}
        self.linears, self.greedy_fused = Linears(), False  # one-row GEMMs and the greedy head (use_kernels)
        self.moe_params, self.grouped_moe, self.grouped_params = None, False, {}  # set by use_kernels
        self.fused = False  # the dense parts on the fused kernels (use_kernels)
        self._tuning = (False, None)  # (tune, slot buffer) for the grouped kernel's params of later steps
        # the dense decoder layers run before MoE layer l (dense_before[l]) and after the last one (dense_after)
        bounds = (-1,) + self.moe_layer_ids
        self.dense_before = [tuple(range(bounds[i] + 1, bounds[i + 1])) for i in range(len(self.moe_layer_ids))]
        self.dense_after = tuple(range(self.moe_layer_ids[-1] + 1, self.num_decoder_layers))

        w = lambda name: weight(name).to(device=self.device, dtype=dtype)  # noqa: E731 (no copy if already so)
        bias = (lambda name: w(name)) if config.attention_bias else (lambda name: None)
        self.embed = w("model.embed_tokens.weight")
        self.lm_head = w("lm_head.weight")
        self.final_norm = w("model.norm.weight")
        heads, latent = config.num_attention_heads, self.kv_lora_rank
        self.layers: list[dict[str, torch.Tensor | None]] = []
        for j in range(self.num_decoder_layers):
            p = f"model.layers.{j}."
            a = p + "self_attn."
            kv_b = w(a + "kv_b_proj.weight").view(heads, self.nope_dim + self.v_head_dim, latent)
            layer = {"input_ln": w(p + "input_layernorm.weight"), "post_ln": w(p + "post_attention_layernorm.weight"),
                     "kv_a": w(a + "kv_a_proj_with_mqa.weight"), "kv_a_bias": bias(a + "kv_a_proj_with_mqa.bias"),
                     "kv_a_ln": w(a + "kv_a_layernorm.weight"),
                     "w_uk": kv_b[:, :self.nope_dim].contiguous(),  # [NH, nope, R]: q_nope -> latent space
                     "w_uv": kv_b[:, self.nope_dim:].transpose(1, 2).contiguous(),  # [NH, R, v]: latent -> values
                     "o": w(a + "o_proj.weight"), "o_bias": bias(a + "o_proj.bias")}
            if self.q_lora_rank is None:
                layer["q"] = w(a + "q_proj.weight")
            else:
                layer.update(q_a=w(a + "q_a_proj.weight"), q_a_bias=bias(a + "q_a_proj.bias"),
                             q_a_ln=w(a + "q_a_layernorm.weight"), q_b=w(a + "q_b_proj.weight"))
            mlp = p + ("mlp.shared_experts." if j in self.moe_layer_ids else "mlp.")  # shared experts: one MLP
            layer["gate_up"] = torch.cat([w(mlp + "gate_proj.weight"), w(mlp + "up_proj.weight")], dim=0)
            layer["down"] = w(mlp + "down_proj.weight")
            self.layers.append(layer)
        routers = [weight(f"model.layers.{j}.mlp.gate.weight").to(device=self.device, dtype=torch.float32)
                   for j in self.moe_layer_ids]
        self.router_pair = [torch.cat([routers[i], routers[i + 1] if i + 1 < len(routers) else
                                       torch.zeros_like(routers[i])], dim=0) for i in range(len(routers))]
        s, dev = int(max_seq_len), self.device
        self.latent_cache = torch.zeros(self.num_decoder_layers, s, latent + self.rope_dim, dtype=dtype, device=dev)
        self.positions = torch.arange(s, device=dev)
        self.cos, self.sin = norm_rope.rope_tables(self.rope_dim, self.rope_theta, s, dev)
        self.scale = (self.nope_dim + self.rope_dim) ** -0.5
        self._steps: dict[int, DecodeStep] = {}
        self.feature_layers, self._feature_slots = (), {}  # capture_features (decoder layer ids)
        self._feature_layer_count = self.num_decoder_layers

    # -- kernels ---------------------------------------------------------------------------------------
    def use_kernels(self, backend: str, attention: str, moe: str, slot_buf: torch.Tensor, tune="auto") -> dict:
        """See `Decoder.use_kernels`; OLMoE's mechanism (`models.decoder.verified`, `use_slot_moe`,
        `use_grouped_moe`). attention: "split_kv" (MLA over the latent cache, `split_kv_latent_attention`; the
        default on CUDA with Triton) or "sdpa" (`mla_decode_attention`); backend "triton": the Triton slot MoE
        kernels over the store's [gate | up | down] rows (per token, and grouped for steps of D > 1), launch
        parameters tuned and cached as OLMoE's. Each is checked against its torch version on this device and
        falls back with a note; so are the fused dense kernels (module docstring), which the Triton backend
        asks for too ("dense": "fused" or "torch" in the returned dict). flash-attn and vLLM's experts are not
        implemented for this decoder (noted)."""
        check_kernel_choice(backend, attention, moe)
        tune = check_tune(tune)
        cuda, g = self.device.type == "cuda", self.geometry
        self.attention, self.backend, self.moe_params = "sdpa", "torch", None
        self.grouped_moe, self.grouped_params = False, {}
        self.launch.clear()
        self._tuning = (tune, slot_buf)
        if attention == "flash_attn":
            self.notes.append("attention 'flash_attn' is not implemented for the DeepSeek-V3 decoder (MLA); chosen "
                              "as for 'auto'")
        if moe == "vllm":
            self.notes.append("moe 'vllm' is not implemented for the DeepSeek-V3 decoder; the slot MoE kernels used")
        if attention == "split_kv" or (attention in ("auto", "flash_attn") and cuda and triton_available()):
            if verified(self, "split-KV latent attention (MLA)", "SDPA", lambda: checks.check_latent_attention(
                    g, self.kv_lora_rank, "split-KV latent attention kernel", self._split_kv_check, self.dtype,
                    self.device)):
                self.attention = "split_kv"
        self.fused = False
        if backend == "triton" or (backend == "auto" and cuda and triton_available()):
            self.fused = verified(self, "fused dense kernels (RMSNorm, MLA prologue, SwiGLU product)", "torch ops",
                                  self._check_fused)
            use_slot_moe(self, slot_buf, tune)
        use_dense_kernels(self, self.fused, tune)
        return {"backend": self.backend, "attention": self.attention, "moe": "slot", "launch": self.launch,
                "dense": "fused" if self.fused else "torch"}

    def dense_weights(self) -> list[torch.Tensor]:
        """Every dense projection's weight (attention, dense and shared-expert MLPs, routers, head), the set
        `use_dense_kernels` chooses one-row launches for (one per distinct shape)."""
        names = ("q", "q_a", "q_b", "kv_a", "o", "gate_up", "down")
        return [lw[n] for lw in self.layers for n in names if lw.get(n) is not None] + [self.router_pair[0],
                                                                                         self.lm_head]

    def _check_fused(self) -> None:
        g = self.geometry
        checks.check_mla_kernels(g.num_heads, self.kv_lora_rank, self.rope_dim, self.nope_dim, g.hidden,
                                 self.layers[self.moe_layer_ids[0]]["down"].shape[1], self.eps, LATENT_NORM_EPS,
                                 self.interleaved, self.dtype, self.device)

    def _latent_workspace(self, num_positions: int, device):
        """The split-KV workspace of a step (`make_split_kv_workspace` for the latent cache)."""
        return make_split_kv_workspace(num_positions, self.geometry.num_heads, self.kv_lora_rank,
                                       self.geometry.max_seq_len, device, num_kv_heads=1, rope_dim=self.rope_dim)

    def _split_kv_check(self, q, cache, seq_len, scale):
        out = torch.empty(*q.shape[:2], self.kv_lora_rank, dtype=q.dtype, device=q.device)
        return split_kv_latent_attention(q, cache, seq_len, scale, out, self._latent_workspace(q.shape[0], q.device))

    # -- buffers ---------------------------------------------------------------------------------------
    def step(self, num_positions: int) -> DecodeStep:
        if num_positions not in self._steps:
            c, d, dev, dt = self.geometry, num_positions, self.device, self.dtype
            step = DecodeStep.allocate(d, c, dev)
            residual_work(step, c, dt, self.feature_layers)
            step.work.update(att=torch.zeros(d, c.num_heads, self.kv_lora_rank, dtype=dt, device=dev),
                             query=torch.zeros(d, c.num_heads, c.head_dim, dtype=dt, device=dev),  # [q_lat | q_pe]
                             seqlens=torch.zeros(1, dtype=torch.int32, device=dev))
            try:  # shapes the split-KV kernel does not take (R or P not a power of two) keep SDPA
                step.work["split_kv"] = self._latent_workspace(d, dev)
            except ValueError:
                step.work["split_kv"] = None
            add_grouped_workspace(self, step, d)
            self._steps[num_positions] = step
        return self._steps[num_positions]

    @property
    def layer_kinds(self) -> tuple[tuple[str, str], ...]:
        moe = set(self.moe_layer_ids)
        return tuple(("attention", "moe" if j in moe else "dense_mlp") for j in range(self.num_decoder_layers))

    def rollback(self, step: DecodeStep, committed: int) -> None:
        """Nothing to restore: the latent cache is indexed by position (the next step overwrites rejected rows)."""

    def randomize_cache(self, seed: int) -> None:
        generator = torch.Generator(device=self.device).manual_seed(int(seed))
        self.latent_cache.normal_(generator=generator)

    def reset(self) -> None:
        """Nothing to clear: a step masks every position it has not written; positions count from its input."""

    # -- device steps (graph bodies) -------------------------------------------------------------------
    def _rmsnorm(self, x, weight, out=None, eps=None, residual=None):
        """`norm_rope.rmsnorm` (eps: the decoder's unless given), one launch on the fused path (`use_kernels`)."""
        return norm_rope.rmsnorm(self.fused, x, weight, self.eps if eps is None else eps, residual=residual, out=out)

    def _attention(self, step: DecodeStep, j: int) -> torch.Tensor:
        """Decoder layer j's MLA of the step's D positions (latent cache rows written): its output projection
        [D, H], not yet added to the residual."""
        w, lw, d = step.work, self.layers[j], step.num_positions
        heads = self.geometry.num_heads
        x = self._rmsnorm(w["h"], lw["input_ln"], w["xn"])
        if self.q_lora_rank is None:
            q = self.linears(x, lw["q"])
        else:
            q_a = self.linears(x, lw["q_a"], bias=lw["q_a_bias"])
            q = self.linears(self._rmsnorm(q_a, lw["q_a_ln"], eps=LATENT_NORM_EPS), lw["q_b"])
        q_nope, q_pe = q.view(d, heads, self.nope_dim + self.rope_dim).split([self.nope_dim, self.rope_dim], dim=-1)
        q_lat = torch.bmm(q_nope.transpose(0, 1), lw["w_uk"])  # [NH, D, R]
        prologue = mla_prologue_triton if self.fused else mla_prologue_torch
        cache = self.latent_cache[j]
        query = prologue(self.linears(x, lw["kv_a"], bias=lw["kv_a_bias"]), q_pe, q_lat, lw["kv_a_ln"], LATENT_NORM_EPS,
                         self.cos, self.sin, step.input_dev[d:], cache, w["query"], self.interleaved)
        if self.attention == "split_kv":
            out_lat = split_kv_latent_attention(query, cache, w["seqlens"], self.scale, w["att"], w["split_kv"])
        else:
            out_lat = mla_decode_attention(query, cache, w["mask"], self.scale, self.kv_lora_rank)  # [D, NH, R]
        out = torch.bmm(out_lat.transpose(0, 1), lw["w_uv"]).transpose(0, 1).reshape(d, heads * self.v_head_dim)
        return self.linears(out, lw["o"], bias=lw["o_bias"])

    def _mlp(self, x, gate_up, down):
        """A dense SwiGLU MLP (the dense layers' and the shared experts'): the gate and up rows in one product; on
        the fused path the activation and product in one launch (`norm_rope.swiglu`)."""
        return self.linears(norm_rope.swiglu(self.fused, self.linears(x, gate_up)), down)

    def _dense_layer(self, step: DecodeStep, j: int) -> None:
        """Decoder layer j with a dense MLP, entirely; its features where named."""
        w, lw = step.work, self.layers[j]
        x = self._rmsnorm(self._attention(step, j), lw["post_ln"], w["xn"], residual=w["h"])
        w["h"].add_(self._mlp(x, lw["gate_up"], lw["down"]))
        if j != self.num_decoder_layers - 1:  # the last layer's features: after the final norm (head)
            self._write_features(step, j, w["h"])

    def attention_router(self, step: DecodeStep, layer: int, copy_out: bool = True) -> None:
        w, d = step.work, step.num_positions
        if layer == 0:
            step.input_dev.copy_(step.input_host, non_blocking=True)
            w["h"].copy_(self.embed.index_select(0, step.input_dev[:d]))
            if self.attention == "split_kv":  # positions written, the step's own included
                w["seqlens"].copy_(step.input_dev[d:] + d)
            else:
                causal_step_mask(self.positions, step.input_dev[d:], w["mask"])
        else:
            self._write_features(step, self.moe_layer_ids[layer - 1], w["h"])
        for j in self.dense_before[layer]:
            self._dense_layer(step, j)
        j = self.moe_layer_ids[layer]
        m = self._rmsnorm(self._attention(step, j), self.layers[j]["post_ln"], w["moe_in"], residual=w["h"])
        self.linears(m.float(), self.router_pair[layer], out32=step.logits_dev[layer])  # float32, as transformers
        if copy_out:
            step.copy_out_logits(layer)
        # the shared experts, resident and ungated, here rather than in `moe`: the engine may run a layer's MoE in
        # several groups of positions (`Decoder.moe`), and they must be added once
        w["h"].add_(self._mlp(m, self.layers[j]["gate_up"], self.layers[j]["down"]))

    def moe(self, step: DecodeStep, layer: int, slot_buf: torch.Tensor, copy_in: bool = True,
            late: tuple | None = None) -> None:
        routed_moe(self, step, layer, slot_buf, copy_in, late=late)

    def head(self, step: DecodeStep, copy_out: bool = True) -> None:
        w, last = step.work, self.num_decoder_layers - 1
        if self.moe_layer_ids[-1] != last:
            self._write_features(step, self.moe_layer_ids[-1], w["h"])
        for j in self.dense_after:
            self._dense_layer(step, j)
        x = self._rmsnorm(w["h"], self.final_norm, w["xn"])
        finish_head(self, step, last, x, copy_out)

    # -- accounting ------------------------------------------------------------------------------------
    def bytes_per_token(self, position: int) -> int:
        """Weights read per step (every decoder layer's attention, dense MLPs, shared experts, float32 router
        pairs; the embedding row, final norm and LM head) and the latent cache: one row of R + P per decoder
        layer and attended position (split-KV reads positions 0 .. position, SDPA all S)."""
        item = self.embed.element_size()
        layers = sum(t.numel() * t.element_size() for lw in self.layers for t in lw.values() if t is not None)
        routers = sum(t.numel() * t.element_size() for t in self.router_pair)
        seq = self.geometry.max_seq_len
        attended = seq if self.attention == "sdpa" else min(position + 1, seq)
        cache = attended * (self.kv_lora_rank + self.rope_dim) * item * self.num_decoder_layers
        return layers + routers + cache + (self.lm_head.numel() + 2 * self.geometry.hidden) * item
