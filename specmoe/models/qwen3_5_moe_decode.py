"""Qwen3.5-MoE's decode path for the engines (the `Decoder` protocol of `specmoe.models.decoder`): everything but
the routed experts, over static per-sequence state, for D positions per step (transformers' `qwen3_5_moe_text`
and the text part of `qwen3_5_moe`, e.g. Qwen3.6-35B-A3B).

The weights are transformers' (taken from a Qwen3_5MoeForCausalLM, or read from a checkpoint without the routed
experts); rounding points follow transformers' modules where the arithmetic is the same, so that all-resident
exact decoding matches it (tested in float32).

Kernels (`use_kernels`, as OLMoE's: each checked against its torch version on the device, a failure noted and the
torch path used): on CUDA the gated attention runs the split-KV kernel (`specmoe.kernels.split_kv`), the routed
experts the slot MoE Triton kernels (per token; grouped for D > 1), and the Gated DeltaNet's recurrence our Triton
kernel (`specmoe.kernels.gdn`), else fla's kernels where the optional `fla` is installed; `notes` and the returned
"gdn" say which ran. With the triton backend, the Gated DeltaNet's prologue (short convolution, q/k norms, decay
and beta into the step's buffers) and its gated RMSNorm run as one Triton launch each (`gdn_fused`), so that its
token mixer is five launches (in_proj, prologue, recurrence, gated norm, out_proj); the zero-centred norms (the
post-attention one with the residual add), the gated attention's prologue (q/k norms, partial rotary, KV write,
one launch), the output gate and the shared expert's SwiGLU product and gated residual add are one launch each
(`fused`, `specmoe.kernels.norm_rope`). Every projection (in_proj and out_proj, the attention's, the shared
expert's, routers and head) goes through the decoder's linear layers (`specmoe.kernels.gemv.Linears`: at one
position the GEMV kernel, its launch tuned per weight shape, elsewhere F.linear); the router writes its float32
logits rows there (the bf16-rounded logits as transformers' router rounds them, in the GEMV's pass; a float32
model's GEMM straight into the rows). On the CPU everything is torch: the recurrence position by position. A step
has static shapes and reads no host value, so each layer's launch captures into a CUDA graph; a prompt chunk runs
through the same steps.

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
recurrent state [NV, d_k, d_v] (float32), advanced in place by every step. A step of D positions keeps, in its
own static buffers, its convolution input (the previous state followed by the D new inputs, [C, K - 1 + D], from
which the state after any position is a window) and its recurrence's inputs; for D > 1, by the rollback mode
(`set_gdn`, GDN_ROLLBACKS), either the recurrent state after each position ([D, NV, d_k, d_v], "history") or
the one at its start ("recompute"). rollback(step, committed) restores the state after position committed - 1:
a copy, or a rerun of the committed positions from the start state. `reset` zeroes the live state (a new
sequence).

Feature capture (`capture_features`): as OLMoE's, layer l's state at the start of launch l + 1, the last layer's
after the final norm.
"""

from __future__ import annotations

import torch

from specmoe.geometry import Geometry
from specmoe.kernels import (causal_step_mask, check_kernel_choice, check_tune, checks, decode_attention,
                             make_split_kv_workspace, norm_rope, split_kv_attention, triton_available)
from specmoe.kernels.gemv import Linears, padded_rows
from specmoe.kernels.gdn import (fla_missing, gated_rmsnorm, gated_rmsnorm_triton, gdn_prologue_torch,
                                 gdn_prologue_triton, gdn_recurrence, load_fla)

from .adapter import ModelSourceError
from .decoder import (DecodeStep, FeatureCapture, Sourced, add_grouped_workspace, checkpoint_source, finish_head,
                      residual_work, routed_moe, split_kv_check, use_dense_kernels, use_slot_moe, verified)
from .qwen3_5_moe import Qwen35MoeAdapter

GDN_KERNEL_CHOICES = ("auto", "fla", "triton", "torch")  # "auto": fla where installed and checked, else ours
# How a verification block's Gated DeltaNet state is rolled back (`Qwen35MoeDecoder.set_gdn`):
# "history": the step keeps the state after every position (one more store per position and layer) and rollback
# copies the committed one; "recompute": the step keeps the state at its start and its inputs, and rollback
# reruns the committed positions' recurrence from it (only when a draft was rejected).
# scripts/bench_gdn_rollback.py measures both.
# The shared expert's fused input weight [2 I + 1, H] gets zero rows up to a multiple of this: with 2 I + 1 rows
# (1025 at Qwen3.6) a block's output rows are not 16-byte aligned and cuBLAS fell back to an sm_75 kernel at D = 17
# on the H200 (9.9 µs per layer for 4 MB of weights; BENCHMARKS.md, 2026-12-04). The padding's outputs are unused.
SHARED_IN_ROWS = 8
GDN_ROLLBACKS = ("history", "recompute")
DEFAULT_GDN_ROLLBACK = "history"


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


class Qwen35MoeDecoder(Sourced, FeatureCapture):
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
        self.linears, self.greedy_fused = Linears(), False  # one-row GEMMs and the greedy head (use_kernels)
        # the Triton norm, prologue and gate kernels (`use_kernels`)
        self.fused = False
        self.moe_params, self.grouped_moe, self.grouped_params = None, False, {}  # as OLMoE's (`use_kernels`)
        self._tuning = (False, None)  # (tune, slot buffer) for the grouped kernel's params of later steps
        # the Gated DeltaNet's recurrence (`specmoe.kernels.gdn`): what was asked, what runs; rollback mode
        self.gdn_choice, self.gdn_kernel, self.fla = "auto", "torch", None
        self.gdn_fused = {"prologue": False, "norm": False}  # the prologue and the gated norm as one launch each
        self.gdn_rollback = DEFAULT_GDN_ROLLBACK
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
            # the shared expert's input projections in one product: [gate; up; its sigmoid gate's row; zero rows to
            # a multiple of 8 (`SHARED_IN_ROWS`)]
            gate_up_rows = [w(mlp + "shared_expert.gate_proj.weight"), w(mlp + "shared_expert.up_proj.weight"),
                            w(mlp + "shared_expert_gate.weight")]
            layer = {"input_ln": w(p + "input_layernorm.weight"), "post_ln": w(p + "post_attention_layernorm.weight"),
                     "shared_in": padded_rows(torch.cat(gate_up_rows, dim=0), SHARED_IN_ROWS),
                     "down": w(mlp + "shared_expert.down_proj.weight")}
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
        """See `Decoder.use_kernels`; the same choices, self-checks and fallbacks as OLMoE's: attention through
        the split-KV kernel, the routed experts through the slot MoE Triton kernels (per token, and grouped for
        D > 1) with tuned launch parameters; the Gated DeltaNet's recurrence through our Triton kernel, else fla's
        kernels where installed (`specmoe.kernels.gdn`; `set_gdn` narrows the choice); with the triton backend the
        Gated DeltaNet's prologue and gated RMSNorm (`gdn_fused`), the fused norm, prologue and gate kernels
        (`fused`), the projections on the one-row linear layers (`use_dense_kernels`); each checked against torch
        on this device. The returned dict adds "gdn": the recurrence's kernel.
        flash-attn and vLLM's experts are not implemented here: noted, split-KV / slot used."""
        check_kernel_choice(backend, attention, moe)
        tune = check_tune(tune)
        for what, asked, used in (("attention", attention, "split_kv or sdpa"), ("moe", moe, "slot")):
            if asked in ("flash_attn", "vllm"):
                self.notes.append(f"{what} {asked!r} is not implemented for the Qwen3.5-MoE decoder; {used} used")
        triton_ok = self.device.type == "cuda" and triton_available()
        g, on = self.geometry, (self.dtype, self.device)
        self.moe_params, self.grouped_moe, self.grouped_params, self.attention = None, False, {}, "sdpa"
        self.gdn_kernel, self.backend, self.fused = "torch", "torch", False
        self.gdn_fused = {"prologue": False, "norm": False}
        self.launch.clear()
        self._tuning = (tune, slot_buf)
        if attention == "split_kv" or (attention == "auto" and triton_ok):
            if verified(self, "split-KV attention", "SDPA", lambda: checks.check_attention(
                    g, "split-KV attention kernel", split_kv_check, *on)):
                self.attention = "split_kv"
        triton_asked = backend == "triton" or (backend == "auto" and triton_ok)
        if triton_asked and use_slot_moe(self, slot_buf, tune):
            self._choose_gdn_kernel()
            self._choose_gdn_fusion()
        elif self.gdn_choice not in ("auto", "torch"):
            self.notes.append(f"Gated DeltaNet kernel {self.gdn_choice!r} needs the triton backend; torch used")
        if triton_asked:
            shared_inter = self.layers[0]["down"].shape[1]
            self.fused = verified(self, "Triton zero-centred norm, attention prologue and gate kernels",
                                  "their torch versions", lambda: checks.check_zero_centred_kernels(
                                      g, self.rotary_dim, shared_inter, self.eps, *on))
        use_dense_kernels(self, self.fused, tune)
        self.notes.append(f"Gated DeltaNet recurrence: {self.gdn_kernel}, rollback by {self.gdn_rollback}")
        return {"backend": self.backend, "attention": self.attention, "moe": "slot", "launch": self.launch,
                "gdn": self.gdn_kernel}

    def _choose_gdn_kernel(self) -> None:
        """Our Triton kernel ("auto" / "triton"), else fla's kernels where installed ("auto" / "fla"), each checked
        against the torch recurrence at this layer's heads for D = 1, 16 and 64; else torch. Ours comes first: it
        keeps every position's state in the one launch that verification needs for rollback, where fla's fused
        kernel returns only the last state and runs once per position (on an H200 at Qwen3.6's shapes, a block of
        16 with rollback: 0.72 ms against fla's 4.19 over the 30 layers, `scripts/bench_gdn_rollback.py`)."""
        heads, dev = (self.nk, self.nv, self.dk, self.dv), self.device
        if self.gdn_choice in ("auto", "triton") and verified(
                self, "Triton gated delta rule kernel", "fla's kernels or the torch recurrence",
                lambda: checks.check_gdn("triton", heads, dev, positions=(1, 16, 64))):
            self.gdn_kernel = "triton"
            return
        if self.gdn_choice not in ("auto", "fla"):
            return
        self.fla = load_fla()
        if self.fla is None:
            self.notes.append(fla_missing())
        elif verified(self, "fla's gated delta rule kernels (fused recurrent, chunked)", "the torch recurrence",
                      lambda: checks.check_gdn("fla", heads, dev, self.fla, positions=(1, 16, 64))):
            self.gdn_kernel = "fla"

    def _choose_gdn_fusion(self) -> None:
        """The Gated DeltaNet's prologue and its gated RMSNorm as one Triton launch each (`specmoe.kernels.gdn`),
        each checked against its torch version at this layer's heads and dtype on this device; else torch."""
        heads, on = (self.nk, self.nv, self.dk, self.dv), (self.dtype, self.device)
        self.gdn_fused["prologue"] = verified(self, "Triton Gated DeltaNet prologue kernel", "torch", lambda: (
            checks.check_gdn_prologue(heads, self.conv_width, *on)))
        self.gdn_fused["norm"] = verified(self, "Triton gated RMSNorm kernel", "torch", lambda: (
            checks.check_gated_rmsnorm(heads, self.eps, *on)))

    def set_gdn(self, kernel: str | None = None, rollback: str | None = None) -> None:
        """The Gated DeltaNet's settings: `kernel` (GDN_KERNEL_CHOICES; applied by the next `use_kernels`) and
        `rollback` (GDN_ROLLBACKS, see there). A change of rollback mode drops the steps made so far (their
        buffers differ): make the runners again."""
        if kernel is not None:
            if kernel not in GDN_KERNEL_CHOICES:
                raise ValueError(f"the Gated DeltaNet kernel must be one of {GDN_KERNEL_CHOICES}, got {kernel!r}")
            self.gdn_choice = kernel
        if rollback is not None:
            if rollback not in GDN_ROLLBACKS:
                raise ValueError(f"the Gated DeltaNet rollback must be one of {GDN_ROLLBACKS}, got {rollback!r}")
            if rollback != self.gdn_rollback:
                self._steps.clear()
            self.gdn_rollback = rollback

    @property
    def state_rollback(self) -> str:
        """`Decoder.state_rollback`: the Gated DeltaNet's rollback mode (GDN_ROLLBACKS)."""
        return self.gdn_rollback

    def set_state_rollback(self, mode: str) -> None:
        self.set_gdn(rollback=mode)

    # -- buffers ---------------------------------------------------------------------------------------
    def step(self, num_positions: int) -> DecodeStep:
        if num_positions not in self._steps:
            c, d, dev, dt = self.geometry, num_positions, self.device, self.dtype
            step = DecodeStep.allocate(d, c, dev)
            residual_work(step, c, dt, self.feature_layers)
            n, f32 = len(self.linear_layers), dict(dtype=torch.float32, device=dev)
            nk, nv, dk, dv = self.nk, self.nv, self.dk, self.dv
            # the Gated DeltaNet: convolution input (state, then the D inputs), the recurrence's inputs and output
            step.work.update(conv_in=torch.zeros(n, self.conv_dim, self.conv_width - 1 + d, dtype=dt, device=dev),
                             gdn_q=torch.zeros(n, d, nk, dk, **f32), gdn_k=torch.zeros(n, d, nk, dk, **f32),
                             gdn_v=torch.zeros(n, d, nv, dv, **f32), gdn_decay=torch.zeros(n, d, nv, **f32),
                             gdn_beta=torch.zeros(n, d, nv, **f32), gdn_out=torch.zeros(d, nv, dv, **f32))
            if d > 1:  # what `rollback` resumes from: every position's state, or the state at the step's start
                shape = (n, d, nv, dk, dv) if self.gdn_rollback == "history" else (n, nv, dk, dv)
                step.work["recurrent" if self.gdn_rollback == "history" else "start"] = torch.zeros(shape, **f32)
            # the attention layers: the query, the written length, the split-KV kernel's scratch
            step.work.update(shared_act=torch.zeros(d, self.layers[0]["down"].shape[1], dtype=dt, device=dev),
                             q=torch.zeros(d, c.num_heads, c.head_dim, dtype=dt, device=dev),
                             att=torch.zeros(d, c.num_heads * c.head_dim, dtype=dt, device=dev),
                             seqlens=torch.zeros(1, dtype=torch.int32, device=dev))
            if self.attention_layers:
                step.work["split_kv"] = make_split_kv_workspace(d, c.num_heads, c.head_dim, c.max_seq_len, dev,
                                                                num_kv_heads=c.num_kv_heads)
            add_grouped_workspace(self, step, d)
            self._steps[num_positions] = step
        return self._steps[num_positions]

    @property
    def layer_kinds(self) -> tuple[tuple[str, str], ...]:
        return tuple((mixer, "moe") for mixer in self.mixers)

    def rollback(self, step: DecodeStep, committed: int) -> None:
        """Restore every Gated DeltaNet layer's state to the one after position committed - 1 of `step`: the
        convolution state is a window of the step's convolution input; the recurrent state is the kept one
        ("history") or recomputed from the step's start over the committed positions ("recompute"; eager, one
        recurrence per layer). Nothing to do when every position is committed; the KV cache needs nothing (the
        next step overwrites rejected rows)."""
        if not 1 <= committed <= step.num_positions:
            raise ValueError(f"committed must be 1 .. {step.num_positions}, got {committed}")
        if committed == step.num_positions:
            return
        w, width = step.work, self.conv_width - 1
        self.conv_state.copy_(w["conv_in"][:, :, committed:committed + width])
        if "recurrent" in w:
            self.recurrent_state.copy_(w["recurrent"][:, committed - 1])
            return
        self.recurrent_state.copy_(w["start"])
        n = committed
        for i in range(len(self.linear_layers)):
            gdn_recurrence(w["gdn_q"][i, :n], w["gdn_k"][i, :n], w["gdn_v"][i, :n], w["gdn_decay"][i, :n],
                           w["gdn_beta"][i, :n], self.recurrent_state[i], None, w["gdn_out"][:n], self.gdn_kernel,
                           self.fla)

    def randomize_cache(self, seed: int) -> None:
        generator = torch.Generator(device=self.device).manual_seed(int(seed))
        for state in (self.k_cache, self.v_cache, self.conv_state, self.recurrent_state):
            state.normal_(generator=generator)
        self.recurrent_state.mul_(self.dk ** -0.5)

    def reset(self) -> None:
        """Zero the Gated DeltaNet state (the KV cache is masked by position)."""
        self.conv_state.zero_()
        self.recurrent_state.zero_()

    def dense_weights(self) -> list[torch.Tensor]:
        """Every dense projection's weight (Gated DeltaNet and attention in and out, the shared expert, routers,
        head), the set `use_dense_kernels` chooses one-row launches for (one per distinct shape)."""
        names = ("in_proj", "out", "qkv", "o", "shared_in", "down")
        return [lw[n] for lw in self.layers for n in names if n in lw] + [self.router_pair[0], self.lm_head]

    # -- device steps (graph bodies) -------------------------------------------------------------------
    def _linear_attention(self, step: DecodeStep, j: int, x: torch.Tensor) -> torch.Tensor:
        """Layer j's Gated DeltaNet on the normed input x [D, H] (its state advanced, each position's kept): in_proj,
        the prologue (convolution over the state, norms, decay and beta into the step's buffers; `gdn_fused`: one
        Triton launch), the recurrence, the gated RMSNorm (`gdn_fused`: one launch), out_proj."""
        w, lw, d, i = step.work, self.layers[j], step.num_positions, self.state_index[j]
        value_dim = self.nv * self.dv
        proj = self.linears(x, lw["in_proj"])  # [D, C + value_dim + 2 NV]: qkv, z, b, a
        q, k, v, decay, beta = (w[name][i] for name in ("gdn_q", "gdn_k", "gdn_v", "gdn_decay", "gdn_beta"))
        prologue = gdn_prologue_triton if self.gdn_fused["prologue"] else gdn_prologue_torch
        prologue(proj, lw["conv"], lw["A"], lw["dt_bias"], self.conv_state[i], w["conv_in"][i], q, k, v, decay, beta)
        state = self.recurrent_state[i]
        if "start" in w:  # "recompute": the state this step starts from
            w["start"][i].copy_(state)
        history = w["recurrent"][i] if "recurrent" in w else None
        out = gdn_recurrence(q, k, v, decay, beta, state, history, w["gdn_out"], self.gdn_kernel, self.fla)
        z = proj[:, self.conv_dim:self.conv_dim + value_dim].view(d, self.nv, self.dv)
        if self.gdn_fused["norm"]:
            out = gated_rmsnorm_triton(out, z, lw["norm"], self.eps)
        else:
            out = gated_rmsnorm(out.to(x.dtype), z, lw["norm"], self.eps)
        return self.linears(out.reshape(d, value_dim), lw["out"])

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor,
              residual: torch.Tensor | None = None) -> torch.Tensor:
        """out = the zero-centred RMSNorm of x (after residual += x, with a residual; `norm_rope.rmsnorm`, one
        launch on the fused path)."""
        return norm_rope.rmsnorm(self.fused, x, weight, self.eps, "zero_centred", residual=residual, out=out)

    def _gate_mul(self, g, x, out, act, residual=None) -> torch.Tensor:
        fn = norm_rope.gate_mul_triton if self.fused else norm_rope.gate_mul_torch
        return fn(g, x, out, act, residual)

    def _attention(self, step: DecodeStep, j: int, x: torch.Tensor) -> torch.Tensor:
        """Layer j's gated attention on the normed input x [D, H] (its KV rows written)."""
        w, lw, d, c, i = step.work, self.layers[j], step.num_positions, self.geometry, self.cache_index[j]
        nh, hd = c.num_heads, c.head_dim
        qkv = self.linears(x, lw["qkv"])  # per head [q | gate], then k, v
        prologue = norm_rope.qkv_prologue_triton if self.fused else norm_rope.qkv_prologue_torch
        prologue(qkv, lw["q_norm"], lw["k_norm"], self.cos, self.sin, step.input_dev[d:], w["q"], self.k_cache[i],
                 self.v_cache[i], self.eps, None, zero_centred=True, head_norm=True, gated=True)
        if self.attention == "split_kv":
            att = split_kv_attention(w["q"], self.k_cache[i], self.v_cache[i], w["seqlens"], self.scale, w["att"],
                                     w["split_kv"])
        else:
            att = decode_attention(w["q"], self.k_cache[i], self.v_cache[i], w["mask"], self.scale)
        gate = qkv[:, :2 * nh * hd].view(d, nh, 2 * hd)[..., hd:]
        return self.linears(self._gate_mul(gate, att, att, "sigmoid"), lw["o"])

    def attention_router(self, step: DecodeStep, layer: int, copy_out: bool = True) -> None:
        w, d, lw = step.work, step.num_positions, self.layers[layer]
        if layer == 0:
            step.input_dev.copy_(step.input_host, non_blocking=True)
            w["h"].copy_(self.embed.index_select(0, step.input_dev[:d]))
            if self.attention == "sdpa":
                causal_step_mask(self.positions, step.input_dev[d:], w["mask"])
            else:  # positions written, the step's own included
                w["seqlens"].copy_(step.input_dev[d:] + d)
        else:
            self._write_features(step, layer - 1, w["h"])
        x = self._norm(w["h"], lw["input_ln"], w["xn"])
        mix = self._linear_attention if self.mixers[layer] == "linear_attention" else self._attention
        m = self._norm(mix(step, layer, x), lw["post_ln"], w["moe_in"], residual=w["h"])
        self.linears(m, self.router_pair[layer], out32=step.logits_dev[layer])  # bf16: rounded, as transformers'
        if copy_out:
            step.copy_out_logits(layer)
        # the shared expert, resident and gated, here rather than in `moe` (which may run several times per layer)
        inter = lw["down"].shape[1]
        gate_up = self.linears(m, lw["shared_in"])  # [D, 2 I + 1 + padding]: gate, up, the logit of its sigmoid gate
        act = self._gate_mul(gate_up[:, :inter], gate_up[:, inter:2 * inter], w["shared_act"], "silu")
        self._gate_mul(gate_up[:, 2 * inter:2 * inter + 1], self.linears(act, lw["down"]), w["h"], "sigmoid",
                       residual=w["h"])

    def moe(self, step: DecodeStep, layer: int, slot_buf: torch.Tensor, copy_in: bool = True,
            late: tuple | None = None) -> None:
        routed_moe(self, step, layer, slot_buf, copy_in, late=late)

    def head(self, step: DecodeStep, copy_out: bool = True) -> None:
        x = self._norm(step.work["h"], self.final_norm, step.work["xn"])
        finish_head(self, step, self.geometry.num_layers - 1, x, copy_out)

    # -- accounting ------------------------------------------------------------------------------------
    def bytes_per_token(self, position: int) -> int:
        """Weights read per step (every layer's token mixer, shared expert, router pair; the embedding row, final
        norm and LM head), the KV caches (SDPA reads all S positions, split-KV the written ones) and the Gated
        DeltaNet state."""
        item = self.embed.element_size()
        layers = sum(t.numel() * t.element_size() for lw in self.layers for t in lw.values())
        routers = sum(t.numel() * t.element_size() for t in self.router_pair)
        state = sum(t.numel() * t.element_size() for t in (self.conv_state, self.recurrent_state))
        attended = self.geometry.max_seq_len if self.attention == "sdpa" else position + 1
        kv = 2 * self.k_cache[:, :, :attended].numel() * item
        return layers + routers + state + kv + (self.lm_head.numel() + 2 * self.geometry.hidden) * item
