"""Qwen3.5-MoE's decode path for the engines (the `Decoder` protocol of `specmoe.models.decoder`): everything but
the routed experts, over static per-sequence state, for D positions per step (transformers' `qwen3_5_moe_text`
and the text part of `qwen3_5_moe`, e.g. Qwen3.6-35B-A3B).

The weights are transformers' (taken from a Qwen3_5MoeForCausalLM, or read from a checkpoint without the routed
experts); rounding points follow transformers' modules where the arithmetic is the same, so that all-resident
exact decoding matches it (tested in float32). Only the torch path exists (CPU, and the GPU without its Triton
kernels): the Gated DeltaNet runs as a plain recurrence, position by position.

Layers. Every decoder layer is an MoE layer (MoE layer l = decoder layer l). Its token mixer is, by the config's
`layer_types`, either
- Gated DeltaNet ("linear_attention"): in_proj_qkv -> short causal depthwise convolution (width K, silu) over the
  layer's convolution state (the last K - 1 inputs) -> q, k, v; beta = sigmoid(in_proj_b), decay
  g = -exp(A_log) * softplus(in_proj_a + dt_bias); q and k L2-normed and repeated over the value heads, q scaled
  by d_k^-1/2; per position, in float32 (as the reference keeps it), the recurrent state S [heads, d_k, d_v]
  decays by exp(g), takes the delta-rule update S += k (beta (v - k S)) and gives the output q S; then the gated
  RMSNorm (weight w, times silu(in_proj_z)) per head and out_proj; or
- gated full attention ("full_attention"): q_proj gives the query and a per-channel output gate; zero-centred
  RMSNorms on q and k per head; rotary embedding on the first partial_rotary_factor of each head (text
  positions: transformers' multimodal rope is the plain one there); SDPA over the static KV cache with the causal
  step mask; the output times sigmoid(gate), o_proj.
Every RMSNorm but the Gated DeltaNet's is zero-centred: scale 1 + w.

Launches. attention_router(step, l): (l = 0: token embedding, causal mask) layer l's token mixer, its MoE input
(post-attention RMSNorm), router l and the pre-gate router l + 1 on it in one [2E, H] product (the engine's
[z | g] rows, as OLMoE's), then the shared expert scaled by its sigmoid gate, added to the residual (resident; the
engine may run `moe` several times per layer); moe(step, l, slot_buf): the routed experts over the expert store's
[gate | up | down] rows (`specmoe.kernels.slot_moe`) at the host's slots and weights, added to the residual, and
nothing else; head(step): final norm, LM head, greedy tokens.

State and rollback. The KV cache of the attention layers is indexed by position (rejected rows are overwritten by
the next step). The Gated DeltaNet state is not: each layer has a live convolution state [C, K - 1] and
recurrent state [NV, d_k, d_v] (float32), and every step of D positions keeps, in its own static buffers, its
convolution input (the previous state followed by the D new inputs, [C, K - 1 + D], from which the state after
any position is a window) and the recurrent state after each position ([D, NV, d_k, d_v]). A step leaves the live
state after its last position; rollback(step, committed) restores the one after position committed - 1. `reset`
zeroes the live state (a new sequence).

Feature capture (`capture_features`): as OLMoE's, layer l's state at the start of launch l + 1, the last layer's
after the final norm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specmoe.geometry import Geometry
from specmoe.kernels import causal_step_mask, decode_attention, norm_rope, slot_moe

from .adapter import ModelSourceError
from .decoder import DecodeStep, FeatureCapture, checkpoint_source, model_source, residual_work, torch_kernels
from .qwen3_5_moe import Qwen35MoeAdapter

L2NORM_EPS = 1e-6  # the reference's l2norm of q and k in the gated delta rule


def _check_config(config) -> None:
    """ModelSourceError naming the config field for what this decoder does not implement."""
    if config.hidden_act != "silu":
        raise ModelSourceError(f"the Qwen3.5-MoE decoder implements hidden_act 'silu' only, got {config.hidden_act!r}")
    if getattr(config, "attention_bias", False):
        raise ModelSourceError("the Qwen3.5-MoE decoder implements attention_bias=False only")
    kinds = set(config.layer_types[:config.num_hidden_layers])
    if not kinds <= {"linear_attention", "full_attention"}:
        raise ModelSourceError(f"the Qwen3.5-MoE decoder knows layer_types linear_attention and full_attention, "
                               f"got {sorted(kinds)}")
    if config.linear_num_value_heads % config.linear_num_key_heads:
        raise ModelSourceError("linear_num_value_heads must be a multiple of linear_num_key_heads")


def zero_centred_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Qwen3_5MoeRMSNorm over the last dimension: normalised in float32, scaled by 1 + w, then
    rounded to x's dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).to(x.dtype)


def gated_rmsnorm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Gated DeltaNet's output norm over the last dimension: w * norm(x) (rounded to x's dtype first), times
    silu(gate) in float32, rounded to x's dtype."""
    h = x.float()
    h = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (h * F.silu(gate.float())).to(x.dtype)


def l2_normalise(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def gated_delta_rule(q, k, v, decay, beta, state, history) -> torch.Tensor:
    """The gated delta rule of D positions in order, float32: q, k [D, NV, dk] (normed and scaled), v [D, NV, dv],
    decay (log), beta [D, NV]; `state` [NV, dk, dv] is updated in place and copied into history[i] after
    position i. Returns the outputs [D, NV, dv]."""
    out = torch.empty_like(v)
    for i in range(q.shape[0]):
        state.mul_(decay[i].exp()[:, None, None])
        remembered = (state * k[i][:, :, None]).sum(dim=-2)  # [NV, dv]
        delta = (v[i] - remembered) * beta[i][:, None]
        state.add_(k[i][:, :, None] * delta[:, None, :])
        out[i] = (state * q[i][:, :, None]).sum(dim=-2)
        history[i].copy_(state)
    return out


class Qwen35MoeDecoder(FeatureCapture):
    """Qwen3.5-MoE (Gated DeltaNet and gated attention, gated shared expert) without the routed experts; see the
    module docstring."""

    def __init__(self, config, weight, max_seq_len: int, device, dtype: torch.dtype, prefix: str = "model."):
        """config: a transformers Qwen3_5MoeTextConfig (or an image-text config, by its text part); weight(name)
        -> tensor for transformers' names, the decoder layers' under `prefix` ("model." or, in the shipped
        image-text checkpoints, "model.language_model.")."""
        adapter = Qwen35MoeAdapter.from_config(config)
        config = config.get_text_config()
        _check_config(config)
        rope = dict(getattr(config, "rope_parameters", None) or {})
        self.rope_theta = float(norm_rope.default_rope_theta(config, "the Qwen3.5-MoE decoder", ModelSourceError))
        self.eps = float(config.rms_norm_eps)
        num_layers = config.num_hidden_layers
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.geometry = Geometry(num_layers, config.num_experts, config.num_experts_per_tok, config.vocab_size,
                                 config.hidden_size, config.moe_intermediate_size, int(max_seq_len),
                                 config.num_attention_heads, config.num_key_value_heads, head_dim,
                                 tuple(range(num_layers)))
        self.rotary_dim = int(head_dim * float(rope.get("partial_rotary_factor", 1.0)))
        self.device, self.dtype = torch.device(device), dtype
        self.scoring = adapter.router_scoring(weight)
        self.backend, self.attention, self.notes, self.launch = "torch", "sdpa", [], {}
        self.mixers = tuple("linear_attention" if t == "linear_attention" else "attention"
                            for t in config.layer_types[:num_layers])
        # Gated DeltaNet sizes
        self.nk, self.nv = int(config.linear_num_key_heads), int(config.linear_num_value_heads)
        self.dk, self.dv = int(config.linear_key_head_dim), int(config.linear_value_head_dim)
        self.conv_width = int(config.linear_conv_kernel_dim)
        self.conv_dim = 2 * self.nk * self.dk + self.nv * self.dv

        w = lambda name: weight(name).to(device=self.device, dtype=dtype)  # noqa: E731 (no copy if already so)
        self.embed = w(prefix + "embed_tokens.weight")
        self.lm_head = w("lm_head.weight")
        self.final_norm = w(prefix + "norm.weight")
        self.layers: list[dict[str, torch.Tensor]] = []
        for j in range(num_layers):
            p = f"{prefix}layers.{j}."
            mlp = p + "mlp."
            layer = {"input_ln": w(p + "input_layernorm.weight"), "post_ln": w(p + "post_attention_layernorm.weight"),
                     "gate_up": torch.cat([w(mlp + "shared_expert.gate_proj.weight"),
                                           w(mlp + "shared_expert.up_proj.weight")], dim=0),
                     "down": w(mlp + "shared_expert.down_proj.weight"),
                     "shared_gate": w(mlp + "shared_expert_gate.weight")}
            if self.mixers[j] == "linear_attention":
                a = p + "linear_attn."
                layer.update(in_proj=torch.cat([w(a + "in_proj_qkv.weight"), w(a + "in_proj_z.weight"),
                                                w(a + "in_proj_b.weight"), w(a + "in_proj_a.weight")], dim=0),
                             conv=w(a + "conv1d.weight").reshape(self.conv_dim, 1, self.conv_width),
                             A=-weight(a + "A_log").to(self.device).float().exp(), dt_bias=w(a + "dt_bias"),
                             norm=w(a + "norm.weight"), out=w(a + "out_proj.weight"))
            else:
                a = p + "self_attn."
                layer.update(qkv=torch.cat([w(a + "q_proj.weight"), w(a + "k_proj.weight"), w(a + "v_proj.weight")],
                                           dim=0),
                             q_norm=w(a + "q_norm.weight"), k_norm=w(a + "k_norm.weight"), o=w(a + "o_proj.weight"))
            self.layers.append(layer)
        routers = [w(f"{prefix}layers.{j}.mlp.gate.weight") for j in range(num_layers)]
        self.router_pair = [torch.cat([routers[i], routers[i + 1] if i + 1 < num_layers else
                                       torch.zeros_like(routers[i])], dim=0) for i in range(num_layers)]
        # static per-sequence state: KV caches of the attention layers, Gated DeltaNet states of the others
        s, dev, g = int(max_seq_len), self.device, self.geometry
        self.attention_layers = tuple(j for j in range(num_layers) if self.mixers[j] == "attention")
        self.linear_layers = tuple(j for j in range(num_layers) if self.mixers[j] == "linear_attention")
        self.cache_index = {j: i for i, j in enumerate(self.attention_layers)}
        self.state_index = {j: i for i, j in enumerate(self.linear_layers)}
        self.k_cache = torch.zeros(len(self.attention_layers), g.num_kv_heads, s, head_dim, dtype=dtype, device=dev)
        self.v_cache = torch.zeros_like(self.k_cache)
        self.conv_state = torch.zeros(len(self.linear_layers), self.conv_dim, self.conv_width - 1, dtype=dtype,
                                      device=dev)
        self.recurrent_state = torch.zeros(len(self.linear_layers), self.nv, self.dk, self.dv, dtype=torch.float32,
                                           device=dev)
        self.positions = torch.arange(s, device=dev)
        self.cos, self.sin = norm_rope.rope_tables(self.rotary_dim, self.rope_theta, s, dev)
        self.scale = head_dim ** -0.5
        self._steps: dict[int, DecodeStep] = {}
        self.feature_layers, self._feature_slots = (), {}  # capture_features
        self._feature_layer_count = num_layers

    @classmethod
    def from_model(cls, model, max_seq_len: int) -> "Qwen35MoeDecoder":
        """From a transformers Qwen3_5MoeForCausalLM, on its device and in its dtype."""
        config, weight, device, dtype = model_source(model)
        return cls(config, weight, max_seq_len, device, dtype)

    @classmethod
    def from_checkpoint(cls, path, max_seq_len: int, device, dtype: torch.dtype) -> "Qwen35MoeDecoder":
        """Read config.json and the weights but the routed experts of a local checkpoint (text or image-text)."""
        config, weight = checkpoint_source(path)
        prefix = Qwen35MoeAdapter.from_config(config).checkpoint_prefix

        def read(name):
            if name == "lm_head.weight" and config.get_text_config().tie_word_embeddings:
                name = prefix + "embed_tokens.weight"
            return weight(name)

        return cls(config, read, max_seq_len, device, dtype, prefix)

    # -- kernels ---------------------------------------------------------------------------------------
    def use_kernels(self, backend: str, attention: str, moe: str, slot_buf: torch.Tensor, tune="auto") -> dict:
        """See `Decoder.use_kernels`. Only the torch path exists for this architecture (the gated delta rule as a
        plain recurrence, attention through torch SDPA, the routed experts through `slot_moe`'s torch version):
        any other request is noted and torch used."""
        return torch_kernels(self, "Qwen3.5-MoE", backend, attention, moe, tune)

    # -- buffers ---------------------------------------------------------------------------------------
    def step(self, num_positions: int) -> DecodeStep:
        if num_positions not in self._steps:
            c, d, dev, dt = self.geometry, num_positions, self.device, self.dtype
            step = DecodeStep.allocate(d, c, dev)
            residual_work(step, c, dt, self.feature_layers)
            n = len(self.linear_layers)  # the Gated DeltaNet state after every position (`rollback`)
            step.work.update(conv_in=torch.zeros(n, self.conv_dim, self.conv_width - 1 + d, dtype=dt, device=dev),
                             recurrent=torch.zeros(n, d, self.nv, self.dk, self.dv, dtype=torch.float32, device=dev))
            self._steps[num_positions] = step
        return self._steps[num_positions]

    @property
    def layer_kinds(self) -> tuple[tuple[str, str], ...]:
        return tuple((mixer, "moe") for mixer in self.mixers)

    def rollback(self, step: DecodeStep, committed: int) -> None:
        """Restore every Gated DeltaNet layer's state to the one after position committed - 1 of `step` (the
        step keeps them all); the KV cache needs nothing (the next step overwrites rejected rows)."""
        if not 1 <= committed <= step.num_positions:
            raise ValueError(f"committed must be 1 .. {step.num_positions}, got {committed}")
        width = self.conv_width - 1
        self.conv_state.copy_(step.work["conv_in"][:, :, committed:committed + width])
        self.recurrent_state.copy_(step.work["recurrent"][:, committed - 1])

    def randomize_cache(self, seed: int) -> None:
        generator = torch.Generator(device=self.device).manual_seed(int(seed))
        for state in (self.k_cache, self.v_cache, self.conv_state, self.recurrent_state):
            state.normal_(generator=generator)
        self.recurrent_state.mul_(self.dk ** -0.5)

    def reset(self) -> None:
        """Zero the Gated DeltaNet state (the KV cache is masked by position)."""
        self.conv_state.zero_()
        self.recurrent_state.zero_()

    # -- device steps (graph bodies) -------------------------------------------------------------------
    def _linear_attention(self, step: DecodeStep, j: int, x: torch.Tensor) -> torch.Tensor:
        """Layer j's Gated DeltaNet on the normed input x [D, H] (its state advanced, each position's kept)."""
        w, lw, d, i = step.work, self.layers[j], step.num_positions, self.state_index[j]
        key_dim, value_dim = self.nk * self.dk, self.nv * self.dv
        qkv, z, b, a = F.linear(x, lw["in_proj"]).split([self.conv_dim, value_dim, self.nv, self.nv], dim=-1)
        conv_in = w["conv_in"][i]  # [C, K - 1 + D]: the state, then this step's inputs
        conv_in[:, :self.conv_width - 1].copy_(self.conv_state[i])
        conv_in[:, self.conv_width - 1:].copy_(qkv.t())
        self.conv_state[i].copy_(conv_in[:, d:])
        mixed = F.silu(F.conv1d(conv_in[None], lw["conv"], groups=self.conv_dim))[0].t()  # [D, C]
        q, k, v = mixed.split([key_dim, key_dim, value_dim], dim=-1)
        repeat = self.nv // self.nk
        q = l2_normalise(q.reshape(d, self.nk, self.dk).float()).repeat_interleave(repeat, dim=1) * self.dk ** -0.5
        k = l2_normalise(k.reshape(d, self.nk, self.dk).float()).repeat_interleave(repeat, dim=1)
        decay = lw["A"] * F.softplus(a.float() + lw["dt_bias"])
        out = gated_delta_rule(q, k, v.reshape(d, self.nv, self.dv).float(), decay, b.sigmoid().float(),
                               self.recurrent_state[i], w["recurrent"][i])
        out = gated_rmsnorm(out.to(x.dtype), z.reshape(d, self.nv, self.dv), lw["norm"], self.eps)
        return F.linear(out.reshape(d, value_dim), lw["out"])

    def _attention(self, step: DecodeStep, j: int, x: torch.Tensor) -> torch.Tensor:
        """Layer j's gated attention on the normed input x [D, H] (its KV rows written)."""
        w, lw, d, c, i = step.work, self.layers[j], step.num_positions, self.geometry, self.cache_index[j]
        nh, nkv, hd, rd = c.num_heads, c.num_kv_heads, c.head_dim, self.rotary_dim
        query_gate, k, v = F.linear(x, lw["qkv"]).split([2 * nh * hd, nkv * hd, nkv * hd], dim=-1)
        q, gate = query_gate.view(d, nh, 2 * hd).chunk(2, dim=-1)
        q = zero_centred_rmsnorm(q, lw["q_norm"], self.eps)
        k = zero_centred_rmsnorm(k.view(d, nkv, hd), lw["k_norm"], self.eps)
        positions = step.input_dev[d:] + torch.arange(d, device=self.device)
        cos = self.cos.index_select(0, positions).repeat(1, 2).to(x.dtype)[:, None]  # [D, 1, rd]
        sin = self.sin.index_select(0, positions).repeat(1, 2).to(x.dtype)[:, None]
        rotate = lambda t: torch.cat([t[..., :rd] * cos + norm_rope.rotate_half(t[..., :rd]) * sin,  # noqa: E731
                                      t[..., rd:]], dim=-1)
        q, k = rotate(q), rotate(k)
        self.k_cache[i].index_copy_(1, positions, k.transpose(0, 1))
        self.v_cache[i].index_copy_(1, positions, v.view(d, nkv, hd).transpose(0, 1))
        att = decode_attention(q.contiguous(), self.k_cache[i], self.v_cache[i], w["mask"], self.scale)
        return F.linear(att * torch.sigmoid(gate.reshape(d, nh * hd)), lw["o"])

    def attention_router(self, step: DecodeStep, layer: int, copy_out: bool = True) -> None:
        w, d, lw = step.work, step.num_positions, self.layers[layer]
        if layer == 0:
            step.input_dev.copy_(step.input_host, non_blocking=True)
            w["h"].copy_(self.embed.index_select(0, step.input_dev[:d]))
            causal_step_mask(self.positions, step.input_dev[d:], w["mask"])
        else:
            self._write_features(step, layer - 1, w["h"])
        x = w["xn"].copy_(zero_centred_rmsnorm(w["h"], lw["input_ln"], self.eps))
        mix = self._linear_attention if self.mixers[layer] == "linear_attention" else self._attention
        w["h"].add_(mix(step, layer, x))
        m = w["moe_in"].copy_(zero_centred_rmsnorm(w["h"], lw["post_ln"], self.eps))
        step.logits_dev[layer].copy_(F.linear(m, self.router_pair[layer]))
        if copy_out:
            step.copy_out_logits(layer)
        # the shared expert, resident and gated, here rather than in `moe` (which may run several times per layer)
        gate, up = F.linear(m, lw["gate_up"]).chunk(2, dim=-1)
        w["h"].add_(torch.sigmoid(F.linear(m, lw["shared_gate"])) * F.linear(F.silu(gate) * up, lw["down"]))

    def moe(self, step: DecodeStep, layer: int, slot_buf: torch.Tensor, copy_in: bool = True) -> None:
        c, w = self.geometry, step.work
        if copy_in:  # else the route rows were written on the device (`specmoe.kernels.device_routing`)
            step.route_dev[layer].copy_(step.route_host[layer], non_blocking=True)
        for i in range(step.num_positions):
            h = w["h"][i]
            slot_moe(w["moe_in"][i], h, slot_buf, step.route_dev[layer, i], w["act"], h, c.hidden, c.inter,
                     self.backend)

    def head(self, step: DecodeStep, copy_out: bool = True) -> None:
        x = step.work["xn"].copy_(zero_centred_rmsnorm(step.work["h"], self.final_norm, self.eps))
        self._write_features(step, self.geometry.num_layers - 1, x)
        step.out_logits.copy_(F.linear(x, self.lm_head))
        step.next_dev.copy_(step.out_logits.argmax(dim=-1))
        if copy_out:
            step.copy_out_next()

    # -- accounting ------------------------------------------------------------------------------------
    def bytes_per_token(self, position: int) -> int:
        """Weights read per step (every layer's token mixer, shared expert, router pair; the embedding row, final
        norm and LM head), the KV caches (SDPA reads all S positions) and the Gated DeltaNet state."""
        item = self.embed.element_size()
        layers = sum(t.numel() * t.element_size() for lw in self.layers for t in lw.values())
        routers = sum(t.numel() * t.element_size() for t in self.router_pair)
        state = sum(t.numel() * t.element_size() for t in (self.k_cache, self.v_cache, self.conv_state,
                                                           self.recurrent_state))
        return layers + routers + state + (self.lm_head.numel() + 2 * self.geometry.hidden) * item
