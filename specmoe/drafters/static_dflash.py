"""The ``dflash`` drafter on a static KV cache: one CUDA graph per block (the engine's runtime for DFlash;
`dflash` is the transformers-module one, which this reproduces).

State: per drafter layer a KV cache [NKV, S, HD] whose positions 0 .. c - 1 hold the committed context (the
target's features projected by ``fc`` / ``hidden_norm``, then each layer's k/v projections, per-head
k-norm and rotary embedding), and a device buffer of up to ``block_size`` pending feature rows the cache
has not seen yet (the root and accepted drafts of the last block, which the target computed while
verifying them).

One block (the graph body, every input read from device buffers): the pending rows' keys and values are
written at positions c, c + 1, ... (the buffer always has block_size rows; rows past the pending ones land
at positions >= the anchor and are overwritten by the block's own rows below, before anything reads them),
then the block (the anchor token and block_size - 1 mask tokens, embedded with the target's embeddings) runs
through the layers attending without a causal mask to every position 0 .. anchor + block_size - 1, its own
keys and values written at anchor .. anchor + block_size - 1 (the next block overwrites them: the
transformers drafter crops them off instead); the target's LM head gives the greedy draft and the
drafter's probability of it at each of the block's positions 1 .. block_size - 1. `propose(k)` replays the
graph once and synchronises once; `commit` appends the committed positions' features to the pending buffer
(a device-to-device copy, no synchronisation). The prompt's features are written by eager chunks at `reset`.

Kernels (`backend`, as `static_ar`'s): the layers' norms (fused with the residual add before them), the
attention prologue (per-head q/k norms, rotary embedding, KV write; for the context rows keys and values only),
the SwiGLU product and the greedy head run on the target decoders' fused kernels or their torch references;
the block's attention (non-causal over the context and the block) is the split-KV kernel (`WrittenAttention`).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from specmoe.kernels import checks, norm_rope
from specmoe.kernels.norm_rope import rope_tables
from specmoe.speculation import advance, prompt_tokens

from . import static
from .base import DrafterError
from .dflash import check_fits_target
from .static import Launcher, WrittenAttention, default_rope_theta, pinned_pair, sync

CONTEXT_CHUNK = 512  # feature rows per eager write at reset


class StaticDFlashDrafter:
    """Block drafting with a `DFlashDraftModel`'s weights and the target's embedding and LM head over a static
    cache of `max_seq_len` positions (module docstring); backend: the layers' kernels ("auto": fused on CUDA,
    checked first)."""

    name = "dflash"
    runtime = "static"
    fixed_cost_s = None

    def __init__(self, model, target, max_seq_len: int = 4096, cuda_graphs: bool = True, attention: str = "auto",
                 backend: str = "auto"):
        check_fits_target(model, target)
        config = model.config
        layer_types = getattr(config, "layer_types", None) or []
        problems = []
        if any(t != "full_attention" for t in layer_types):
            problems.append("sliding-window layers")
        try:
            theta = default_rope_theta(config)
        except DrafterError as exc:
            problems.append(str(exc))
        if getattr(config, "hidden_act", "silu") != "silu":
            problems.append(f"activation {config.hidden_act!r} (SiLU only)")
        if problems:
            raise DrafterError("the static-cache DFlash drafter cannot run this model: " + "; ".join(problems)
                               + " (DrafterConfig(runtime='hf') runs it through transformers)")
        self.target_layer_ids = tuple(int(i) for i in model.target_layer_ids)
        self.block_size = int(model.block_size)
        self.max_drafts = self.block_size - 1
        self.mask_token_id = int(model.mask_token_id)
        self.hidden_size, self.vocab_size = config.hidden_size, config.vocab_size
        self.feature_width = len(self.target_layer_ids) * config.hidden_size
        self.embed = target.get_input_embeddings().weight.detach()
        head = target.get_output_embeddings()
        self.lm_head = head.weight.detach()
        self.lm_head_bias = None if getattr(head, "bias", None) is None else head.bias.detach()
        self.eps = float(config.rms_norm_eps)
        params = {name: p.detach() for name, p in model.named_parameters()}
        self.device, self.dtype = self.embed.device, params["fc.weight"].dtype
        if self.embed.dtype != self.dtype:
            raise DrafterError(f"the DFlash drafter is {self.dtype}, the target's embeddings {self.embed.dtype}")
        self.fc, self.hidden_norm, self.norm = params["fc.weight"], params["hidden_norm.weight"], params["norm.weight"]
        attn0 = model.layers[0].self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = attn0.num_heads, attn0.num_kv_heads, attn0.head_dim
        self.layers = []
        for i in range(config.num_hidden_layers):
            p = lambda name, i=i: params.get(f"layers.{i}.{name}")  # noqa: E731
            qkv = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
            wqkv = torch.cat([p(f"{name}.weight") for name in qkv])
            bqkv = None if p("self_attn.q_proj.bias") is None else torch.cat([p(f"{name}.bias") for name in qkv])
            q_rows = self.num_heads * self.head_dim
            self.layers.append({  # q, k, v in one product for the block; k, v (a view) for the context rows
                "wqkv": wqkv, "bqkv": bqkv, "wkv": wqkv[q_rows:], "bkv": None if bqkv is None else bqkv[q_rows:],
                "wo": p("self_attn.o_proj.weight"), "bo": p("self_attn.o_proj.bias"),
                "q_norm": p("self_attn.q_norm.weight"), "k_norm": p("self_attn.k_norm.weight"),
                "input_ln": p("input_layernorm.weight"), "post_ln": p("post_attention_layernorm.weight"),
                "gate_up": torch.cat([p("mlp.gate_proj.weight"), p("mlp.up_proj.weight")]),
                "down": p("mlp.down_proj.weight")})
        s, dev, b = int(max_seq_len), self.device, self.block_size
        if s < b:
            raise DrafterError(f"the drafter's static cache ({s} positions) is shorter than one block ({b})")
        self.max_seq_len = s
        shape = (len(self.layers), self.num_kv_heads, s, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=dev)
        self.v_cache = torch.zeros_like(self.k_cache)
        self.cos, self.sin = rope_tables(self.head_dim, theta, s, dev)
        self.attention = WrittenAttention(b, self.num_heads, self.num_kv_heads, self.head_dim, s, False,
                                          self.dtype, dev)
        self.notes = [self.attention.choose(attention)]
        self.fused = static.choose_kernels(self, backend, lambda: checks.check_drafter_kernels(
            self.hidden_size, config.intermediate_size, (self.num_heads, self.num_kv_heads, self.head_dim),
            self.lm_head.shape[0], self.eps, "olmoe", dict(head_norm=True), None, self.dtype, dev,
            positions=(1, b), kv_only=True))
        self.ctrl_host, self.ctrl_dev = pinned_pair(3, torch.int64, dev)  # [context length, anchor, anchor token]
        self.pending_dev = torch.zeros(b, self.feature_width, dtype=self.dtype, device=dev)
        self.block_ids = torch.full((b,), self.mask_token_id, dtype=torch.int64, device=dev)
        self.out_tok = torch.zeros(b - 1, dtype=torch.int64, device=dev)
        self.out_conf = torch.zeros(b - 1, dtype=torch.float32, device=dev)
        self.tok_host, _ = pinned_pair(b - 1, torch.int64, dev)
        self.conf_host, _ = pinned_pair(b - 1, torch.float32, dev)
        self.tokens: list[int] = []
        self.context = 0  # positions of committed context in the cache
        self.pending = 0  # feature rows in pending_dev
        self._drafts: list[int] = []
        self._block = Launcher(self._block_step, dev, cuda_graphs, self._neutral)
        self.notes.append("one CUDA graph per block" if self._block.graph is not None else "eager blocks")

    # -- device steps ----------------------------------------------------------------------------------
    def _neutral(self) -> None:
        self.ctrl_dev.copy_(torch.tensor([0, 0, self.mask_token_id], device=self.device))

    def _write_context(self, features: torch.Tensor, first: torch.Tensor) -> None:
        """Keys and values of context feature rows [n, n_layers * H] at positions first [1] + 0 .. n - 1, in every
        layer (the prologue without query heads)."""
        ctx = norm_rope.rmsnorm(self.fused, F.linear(features, self.fc), self.hidden_norm, self.eps, "olmoe")
        q = torch.empty(ctx.shape[0], 0, self.head_dim, dtype=self.dtype, device=self.device)
        for i, w in enumerate(self.layers):
            self._prologue(i, F.linear(ctx, w["wkv"], w["bkv"]), first, q)

    def _prologue(self, i: int, qkv: torch.Tensor, first: torch.Tensor, q: torch.Tensor) -> None:
        w = self.layers[i]
        static.prologue(self.fused, qkv, w["q_norm"], w["k_norm"], self.cos, self.sin, first, q, self.k_cache[i],
                        self.v_cache[i], self.eps, None, head_norm=True)

    def _block_step(self) -> None:
        """The graph body: pending context rows, then the block's forward and greedy drafts (module docstring)."""
        b, fused, eps = self.block_size, self.fused, self.eps
        context, anchor, token = self.ctrl_dev[0:1], self.ctrl_dev[1:2], self.ctrl_dev[2:3]
        self._write_context(self.pending_dev, context)
        written = anchor + b
        hidden = self.embed.index_select(0, torch.cat([token, self.block_ids[1:]]))
        x = norm_rope.rmsnorm(fused, hidden, self.layers[0]["input_ln"], eps, "olmoe")
        for i, w in enumerate(self.layers):
            q = torch.empty(b, self.num_heads, self.head_dim, dtype=self.dtype, device=self.device)
            self._prologue(i, F.linear(x, w["wqkv"], w["bqkv"]), anchor, q)
            att = self.attention(q, self.k_cache[i], self.v_cache[i], written)
            x = norm_rope.rmsnorm(fused, F.linear(att, w["wo"], w["bo"]), w["post_ln"], eps, "olmoe", residual=hidden)
            m = F.linear(norm_rope.swiglu(fused, F.linear(x, w["gate_up"])), w["down"])
            following = self.layers[i + 1]["input_ln"] if i + 1 < len(self.layers) else self.norm
            # the next layer's input, or the final norm
            x = norm_rope.rmsnorm(fused, m, following, eps, "olmoe", residual=hidden)
        static.greedy(fused, F.linear(x[1:], self.lm_head, self.lm_head_bias), self.out_tok, self.out_conf)

    def _position(self, p: int) -> torch.Tensor:
        return torch.tensor([p], device=self.device)

    # -- the Drafter protocol --------------------------------------------------------------------------
    def _take_features(self, features, expected: int) -> torch.Tensor:
        if features is None and expected == 0:  # a one-token prompt: nothing before the first anchor
            features = torch.zeros(0, self.feature_width)
        if features is None or tuple(features.shape) != (expected, self.feature_width):
            got = None if features is None else tuple(features.shape)
            raise ValueError(f"the DFlash drafter needs the target's features [{expected}, {self.feature_width}], "
                             f"got {got}")
        return features.to(self.device, self.dtype)

    @torch.no_grad()
    def _flush(self) -> None:
        """Write the pending rows into the cache eagerly (only when more are committed than a block holds)."""
        if self.pending:
            self._write_context(self.pending_dev[:self.pending], self._position(self.context))
            self.context += self.pending
            self.pending = 0

    @torch.no_grad()
    def reset(self, prompt: torch.Tensor, features: torch.Tensor | None = None) -> None:
        tokens = prompt_tokens(prompt)
        if len(tokens) - 1 + self.block_size > self.max_seq_len:
            raise DrafterError(f"a prompt of {len(tokens)} tokens and a block of {self.block_size} do not fit the "
                               f"drafter's static cache of {self.max_seq_len} positions (DrafterConfig.max_seq_len)")
        features = self._take_features(features, len(tokens) - 1)
        self.tokens, self._drafts, self.context, self.pending = tokens, [], 0, 0
        for a in range(0, features.shape[0], CONTEXT_CHUNK):
            rows = features[a:a + CONTEXT_CHUNK]
            self._write_context(rows, self._position(a))
        self.context = features.shape[0]

    @torch.no_grad()
    def propose(self, k: int) -> tuple[torch.Tensor, np.ndarray]:
        if not 1 <= k <= self.max_drafts:
            raise DrafterError(f"the DFlash drafter drafts 1..{self.max_drafts} tokens per pass, asked for {k}")
        anchor = len(self.tokens) - 1
        if self.context + self.pending != anchor:
            raise RuntimeError(f"DFlash context of {self.context} + {self.pending} positions before an anchor at "
                               f"{anchor}")
        if anchor + self.block_size > self.max_seq_len:
            raise DrafterError(f"a block at position {anchor} does not fit the drafter's static cache of "
                               f"{self.max_seq_len} positions (DrafterConfig.max_seq_len)")
        self.ctrl_host[0], self.ctrl_host[1], self.ctrl_host[2] = self.context, anchor, self.tokens[-1]
        self.ctrl_dev.copy_(self.ctrl_host, non_blocking=True)
        self._block()
        self.tok_host.copy_(self.out_tok, non_blocking=True)
        self.conf_host.copy_(self.out_conf, non_blocking=True)
        sync(self.device)
        self.context, self.pending = anchor, 0
        drafts = self.tok_host[:k].clone()
        self._drafts = drafts.tolist()
        return drafts, self.conf_host[:k].double().numpy()

    @torch.no_grad()
    def commit(self, accepted: int, bonus_token: int, features: torch.Tensor | None = None) -> None:
        rows = self._take_features(features, accepted + 1)  # before any state changes
        self.tokens = advance(self.tokens, self._drafts, accepted, bonus_token)
        if self.pending + rows.shape[0] > self.block_size:
            self._flush()
        self.pending_dev[self.pending:self.pending + rows.shape[0]].copy_(rows, non_blocking=True)
        self.pending += rows.shape[0]
        self._drafts = []
