"""The ``ar`` drafter on a static KV cache: a dense OLMo / OLMo-2 causal LM as its own decoder, one CUDA graph
per drafted token (the engine's runtime for the AR drafter; `hf_autoregressive` is the transformers one).

Why our own decode step rather than transformers' model over its StaticCache: the StaticCache API is not
the same in the transformers releases we run (5.17 on the GPU machine writes at a `cache_position` the
caller passes; 5.23 keeps a device counter in the cache and takes no position), and a CUDA graph needs every
position and length read from a device tensor, which the mask and rotary code of either release does not
promise. The step below is a few dozen lines over transformers' weights (gpt-fast's style) and captures
the same way in both; its rounding points follow transformers' modules (norms in float32, rotary in float32
for OLMo / OLMo-2), so in float32 on the CPU it drafts what `HFAutoregressiveDrafter` drafts.

Architectures (`config.model_type`): ``olmo`` (non-parametric LayerNorm before attention and MLP, optional
clip_qkv; OLMo-1B-0724 and the family's drafter) and ``olmo2`` (RMSNorm after attention and MLP, QK-norm
over all heads). Anything else is a DrafterError naming what is missing.

Kernels (`backend`, checked at build time as the target's decoders do): the layers run on the target decoders'
fused Triton kernels (`specmoe.kernels.norm_rope`: OLMo's LayerNorm fused with the residual add before it,
OLMo-2's post-norms fused with the residual add after them, the attention prologue with QK-norm, clip, rotary
embedding and KV write in one launch, the SwiGLU product; the split-KV attention; `kernels.greedy` for the
greedy token and its probability in one pass over the logits) or on their torch references, which are the
same functions' torch versions (`norm_rope.rmsnorm` and `swiglu`, `static.prologue`, `greedy`). Projections
are cuBLAS GEMMs.

Drafting (`StaticARDrafter`, the `Drafter` protocol): the committed tokens live in a device buffer; one
graph step reads its input token at the device position `pos` (the committed token there, or the draft
the previous step wrote), writes the KV rows of `pos`, and writes the greedy token after it and the
drafter's probability of that token at `pos + 1`, then advances `pos`. `propose(k)` feeds the one or two
committed tokens the cache lacks and k - 1 drafts: (1 or 2) + k - 1 replays, one host synchronisation at the
end. `commit` only moves lengths (rollback by position: the KV rows of rejected drafts are overwritten by
the next block before anything attends to them). The prompt is prefilled by chunked eager forwards.
"""

from __future__ import annotations

import numpy as np
import torch

from specmoe.geometry import Geometry
from specmoe.kernels import checks, norm_rope
from specmoe.kernels.gemv import Linears
from specmoe.kernels.norm_rope import rope_tables
from specmoe.speculation import advance, prompt_tokens

from . import static
from .base import DrafterError
from .hf_autoregressive import check_vocabulary
from .static import Launcher, WrittenAttention, chunk_attention, default_rope_theta, pinned_pair, sync

ARCHITECTURES = ("olmo", "olmo2")
PREFILL_CHUNK = 256  # positions per eager prefill forward


def dense_constants(config) -> tuple[str, float, float, float | None]:
    """The architecture constants of a dense OLMo / OLMo-2 model (its transformers config): (kind, norm eps,
    rotary theta, clip_qkv); DrafterError naming what this decoder cannot run."""
    kind = getattr(config, "model_type", None)
    problems = []
    if kind not in ARCHITECTURES:
        problems.append(f"model_type {kind!r} (supported: {', '.join(ARCHITECTURES)})")
    if getattr(config, "attention_bias", False):
        problems.append("attention biases")
    if getattr(config, "hidden_act", "silu") != "silu":
        problems.append(f"activation {config.hidden_act!r} (SiLU only)")
    try:
        theta = default_rope_theta(config)
    except DrafterError as exc:
        problems.append(str(exc))
        theta = 0.0
    if problems:
        raise DrafterError("the static-cache AR drafter cannot run this model: " + "; ".join(problems)
                           + " (DrafterConfig(runtime='hf') runs it through transformers)")
    eps = 1e-5 if kind == "olmo" else float(config.rms_norm_eps)  # OlmoLayerNorm's eps is fixed
    return kind, eps, theta, getattr(config, "clip_qkv", None)


class DenseDecoder:
    """A dense OLMo / OLMo-2 causal LM over a static KV cache [L, NKV, S, HD]: weights of a transformers
    model, `forward(ids, first, attend)` for D positions from the device position `first`, `greedy(x, ...)`.
    Its shapes are `geometry` (num_experts = 0); kind, eps, rope_theta and clip_qkv are its architecture's;
    `fused`: the layers run on the fused kernels (set by `use_kernels`; False: the torch references)."""

    def __init__(self, model, max_seq_len: int):
        self.kind, self.eps, self.rope_theta, self.clip_qkv = dense_constants(model.config)
        c = self.geometry = Geometry.from_hf(model.config, max_seq_len)
        params = {name: p.detach() for name, p in model.named_parameters()}
        if "lm_head.weight" not in params:  # tied embeddings
            params["lm_head.weight"] = params["model.embed_tokens.weight"]
        self.embed, self.lm_head = params["model.embed_tokens.weight"], params["lm_head.weight"]
        self.device, self.dtype = self.embed.device, self.embed.dtype
        if c.max_seq_len < 2:
            raise DrafterError(f"the drafter's static cache needs at least 2 positions, got {max_seq_len}")
        self.final_norm = params.get("model.norm.weight")
        self.layers = []
        for i in range(c.num_layers):
            p = lambda name, i=i: params[f"model.layers.{i}.{name}.weight"]  # noqa: E731
            layer = {"wqkv": torch.cat([p("self_attn.q_proj"), p("self_attn.k_proj"), p("self_attn.v_proj")]),
                     "wo": p("self_attn.o_proj"), "gate_up": torch.cat([p("mlp.gate_proj"), p("mlp.up_proj")]),
                     "down": p("mlp.down_proj")}
            if self.kind == "olmo2":
                layer.update(q_norm=p("self_attn.q_norm"), k_norm=p("self_attn.k_norm"),
                             post_attn=p("post_attention_layernorm"), post_ff=p("post_feedforward_layernorm"))
            self.layers.append(layer)
        shape = (c.num_layers, c.num_kv_heads, c.max_seq_len, c.head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros_like(self.k_cache)
        self.cos, self.sin = rope_tables(c.head_dim, self.rope_theta, c.max_seq_len, self.device)
        self.fused = False
        self.style = "layer" if self.kind == "olmo" else "olmo2"  # the norms' (`norm_rope.NORM_STYLES`)
        self.linears, self.launch = Linears(), {}  # one-row GEMMs: the GEMV kernel or cuBLAS per shape (use_kernels)

    def use_kernels(self, owner, backend: str) -> None:
        """Run the layers on the fused kernels where `backend` asks for them and they pass their check at this
        model's shapes on its device (`static.choose_kernels`; owner.notes says which)."""
        c = self.geometry
        self.fused = static.choose_kernels(owner, backend, lambda: checks.check_drafter_kernels(
            c.hidden, c.inter, (c.num_heads, c.num_kv_heads, c.head_dim), self.lm_head.shape[0], self.eps,
            self.style, dict(style="olmo2", rope_f32=True), self.clip_qkv, self.dtype, self.device,
            post_norm=self.kind == "olmo2", qk_norm=self.kind == "olmo2"))
        self.linears.clear()
        if self.fused:
            layer = self.layers[0]
            self.linears.choose([layer["wqkv"], layer["wo"], layer["gate_up"], layer["down"], self.lm_head], "auto",
                                owner.notes, self.launch, checks.check_gemv)

    def _layer(self, i: int, h: torch.Tensor, x: torch.Tensor, first: torch.Tensor, attend) -> torch.Tensor:
        """Layer i over the residual stream h [D, H] (updated in place) and x, its input (OLMo: h normed; OLMo-2:
        h); returns the next layer's input (OLMo: the next norm of h, which is also the final norm)."""
        c, w, fused, eps = self.geometry, self.layers[i], self.fused, self.eps
        q = torch.empty(h.shape[0], c.num_heads, c.head_dim, dtype=self.dtype, device=self.device)
        lin = self.linears
        static.prologue(fused, lin(x, w["wqkv"]), w.get("q_norm"), w.get("k_norm"), self.cos, self.sin, first,
                        q, self.k_cache[i], self.v_cache[i], eps, self.clip_qkv, style="olmo2", rope_f32=True)
        o = lin(attend(q, i), w["wo"])
        if self.kind == "olmo":
            x = norm_rope.rmsnorm(fused, o, None, eps, "layer", residual=h)  # h += o, normed
        else:
            x = static.add_norm(fused, h, o, w["post_attn"], eps, "olmo2")
        m = lin(norm_rope.swiglu(fused, lin(x, w["gate_up"])), w["down"])
        if self.kind == "olmo":
            return norm_rope.rmsnorm(fused, m, None, eps, "layer", residual=h)
        return static.add_norm(fused, h, m, w["post_ff"], eps, "olmo2")

    def forward(self, ids: torch.Tensor, first: torch.Tensor, attend) -> torch.Tensor:
        """The final norm's output [D, H] for tokens ids [D] at positions first [1] + 0 .. D - 1 (their KV rows
        written); attend(q [D, NH, HD], layer) -> [D, NH * HD] over the cache."""
        h = self.embed.index_select(0, ids)
        x = norm_rope.rmsnorm(self.fused, h, None, self.eps, "layer") if self.kind == "olmo" else h
        for i in range(self.geometry.num_layers):
            x = self._layer(i, h, x, first, attend)
        if self.kind == "olmo2":
            x = norm_rope.rmsnorm(self.fused, h, self.final_norm, self.eps, "olmo2")
        return x

    def prefill(self, ids: torch.Tensor, start: int) -> None:
        """Eager forwards over ids [n] at positions start .. start + n - 1, PREFILL_CHUNK at a time (KV rows only)."""
        for a in range(0, ids.shape[0], PREFILL_CHUNK):
            chunk = ids[a:a + PREFILL_CHUNK]
            first = torch.tensor([start + a], device=self.device)
            self.forward(chunk, first, lambda q, i, s=start + a: chunk_attention(q, self.k_cache[i],
                                                                                 self.v_cache[i], s))

    def greedy(self, x: torch.Tensor, tokens: torch.Tensor, probs: torch.Tensor, index: torch.Tensor) -> None:
        """Greedy tokens of the final norm's output x [D, H] and the drafter's probability of each (float32),
        into tokens / probs at rows index [1] + 0 .. D - 1."""
        static.greedy(self.fused, self.linears(x, self.lm_head), tokens, probs, index)


class StaticARDrafter:
    """The ``ar`` drafter over `DenseDecoder`: one CUDA graph per drafted token on a GPU, the same step
    eagerly on the CPU (module docstring). max_seq_len: positions of the static cache (prompt, new tokens
    and one block's drafts); backend: the layers' kernels ("auto": fused on CUDA, checked first; module docstring)."""

    name = "ar"
    runtime = "static"
    target_layer_ids: tuple[int, ...] = ()
    hidden_size = None  # reads no target features (vocab_size: set from the model)
    max_drafts = None
    fixed_cost_s = None

    def __init__(self, model, target, max_seq_len: int = 4096, cuda_graphs: bool = True, attention: str = "auto",
                 backend: str = "auto"):
        check_vocabulary(model, target)
        self.vocab_size = model.config.vocab_size
        dec = self.decoder = DenseDecoder(model, max_seq_len)
        c, dev = dec.geometry, dec.device
        s = c.max_seq_len
        self.max_seq_len, self.device = s, dev
        self.attention = WrittenAttention(1, c.num_heads, c.num_kv_heads, c.head_dim, s, True, dec.dtype, dev)
        self.notes = [self.attention.choose(attention)]
        dec.use_kernels(self, backend)
        self.ctrl_host, self.ctrl_dev = pinned_pair(2, torch.int64, dev)  # [pos, number of committed tokens]
        self.seq_host, self.seq_dev = pinned_pair(s, torch.int64, dev)  # committed tokens by position
        self.out_tok = torch.zeros(s + 1, dtype=torch.int64, device=dev)  # greedy token after position p - 1, at p
        self.out_conf = torch.zeros(s + 1, dtype=torch.float32, device=dev)
        self.tok_host, _ = pinned_pair(s, torch.int64, dev)
        self.conf_host, _ = pinned_pair(s, torch.float32, dev)
        self.tokens: list[int] = []
        self.cached = 0  # committed positions whose KV rows are in the cache
        self.uploaded = 0  # committed tokens copied to seq_dev
        self._drafts: list[int] = []
        self._step = Launcher(self._draft_step, dev, cuda_graphs, self._neutral)
        self.notes.append("one CUDA graph per drafted token" if self._step.graph is not None else "eager steps")

    def _neutral(self) -> None:
        self.ctrl_dev.zero_()

    def _attend(self, q: torch.Tensor, layer: int) -> torch.Tensor:
        return self.attention(q, self.decoder.k_cache[layer], self.decoder.v_cache[layer], self._written)

    def _draft_step(self) -> None:
        """One token at the device position pos (graph body): its KV rows, the greedy token after it and its
        probability at pos + 1, then pos += 1."""
        pos, committed = self.ctrl_dev[0:1], self.ctrl_dev[1:2]
        token = torch.where(pos < committed, self.seq_dev.index_select(0, pos), self.out_tok.index_select(0, pos))
        self._written = pos + 1
        x = self.decoder.forward(token, pos, self._attend)
        self.decoder.greedy(x, self.out_tok, self.out_conf, self._written)
        pos.add_(1)

    @torch.no_grad()
    def reset(self, prompt: torch.Tensor, features=None) -> None:
        tokens = prompt_tokens(prompt)
        n = len(tokens)
        if n + 1 > self.max_seq_len:
            raise DrafterError(f"a prompt of {n} tokens does not fit the drafter's static cache of "
                               f"{self.max_seq_len} positions (DrafterConfig.max_seq_len)")
        self.tokens, self._drafts = tokens, []
        self.seq_host[:n] = torch.tensor(tokens)
        self.seq_dev[:n].copy_(self.seq_host[:n], non_blocking=True)
        self.uploaded = n
        if n > 1:
            self.decoder.prefill(self.seq_dev[:n - 1], 0)
        self.cached = n - 1

    @torch.no_grad()
    def propose(self, k: int) -> tuple[torch.Tensor, np.ndarray]:
        n = len(self.tokens)
        if k < 1:
            raise DrafterError(f"k must be >= 1, got {k}")
        if n + k > self.max_seq_len:
            raise DrafterError(f"{n} committed tokens and {k} drafts do not fit the drafter's static cache of "
                               f"{self.max_seq_len} positions (DrafterConfig.max_seq_len)")
        if self.uploaded < n:
            self.seq_dev[self.uploaded:n].copy_(self.seq_host[self.uploaded:n], non_blocking=True)
            self.uploaded = n
        self.ctrl_host[0], self.ctrl_host[1] = self.cached, n
        self.ctrl_dev.copy_(self.ctrl_host, non_blocking=True)
        for _ in range(n - self.cached + k - 1):
            self._step()
        self.tok_host[:k].copy_(self.out_tok[n:n + k], non_blocking=True)
        self.conf_host[:k].copy_(self.out_conf[n:n + k], non_blocking=True)
        sync(self.device)
        self.cached = n + k - 1
        drafts = self.tok_host[:k].clone()
        self._drafts = drafts.tolist()
        return drafts, self.conf_host[:k].double().numpy()

    def commit(self, accepted: int, bonus_token: int, features=None) -> None:
        n = len(self.tokens)
        self.tokens = advance(self.tokens, self._drafts, accepted, bonus_token)
        self.seq_host[n:len(self.tokens)] = torch.tensor(self.tokens[n:])  # uploaded at the next propose
        self.cached = min(self.cached, len(self.tokens) - 1)
        self._drafts = []
