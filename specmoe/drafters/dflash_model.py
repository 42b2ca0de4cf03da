"""A DFlash block-diffusion drafter, in the checkpoint format of the public `dflash` package (z-lab).

DFlash (Chen et al., 2026) drafts a whole block in one forward pass. The block is the last committed token
(the anchor) followed by ``block_size - 1`` mask tokens, embedded with the *target's* input embeddings; each
drafter layer attends from the block to the keys and values of [context features, block], without a causal
mask inside the block. The context features are the target's hidden states after the layers
``target_layer_ids`` at every position before the anchor, concatenated and projected by ``fc`` and
``hidden_norm``. The drafter's last hidden states go through the *target's* LM head; the block position j
(1 <= j < block_size) proposes the token j places after the anchor, so one pass proposes up to
``block_size - 1`` drafts.

Format (what a published DFlash checkpoint holds, so one loads with `DFlashDraftModel.from_pretrained`):
- config: a Qwen3 config (model_type "qwen3", architectures ["DFlashDraftModel"]) with ``block_size``,
  ``num_target_layers`` and ``dflash_config = {"target_layer_ids": [...], "mask_token_id": id}``;
- weights: ``layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``layers.{i}.self_attn.{q,k}_norm.weight``
  (per-head RMSNorm), ``layers.{i}.mlp.{gate,up,down}_proj.weight``,
  ``layers.{i}.{input,post_attention}_layernorm.weight``, ``norm.weight``, ``fc.weight``,
  ``hidden_norm.weight``; no embedding and no LM head (both are the target's).
Only the first-generation DFlash format is covered (not DFlash2's convolutions and candidate selector).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (Qwen3MLP, Qwen3PreTrainedModel, Qwen3RMSNorm,
                                                      Qwen3RotaryEmbedding)

from specmoe.models import extract_context_feature  # noqa: F401  (what DFlash training reads its features with)


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's default choice of target layers: one per drafter layer, evenly spaced from layer 1 to layer
    num_target_layers - 3 (the middle layer for a one-layer drafter)."""
    if num_draft_layers < 1:
        raise ValueError(f"a drafter needs at least one layer, got {num_draft_layers}")
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    first, last = 1, num_target_layers - 3
    return [int(round(first + i * (last - first) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def dflash_config(target_config, num_layers: int, block_size: int, mask_token_id: int,
                  intermediate_size: int, num_attention_heads: int, num_key_value_heads: int | None = None,
                  target_layer_ids: list[int] | None = None, rope_parameters: dict | None = None) -> Qwen3Config:
    """A DFlash drafter config for `target_config`: the hidden size, vocabulary, RoPE (unless `rope_parameters`
    gives the drafter's own) and norm epsilon are the target's (the drafter reads the target's embeddings and
    writes into its LM head)."""
    hidden = target_config.hidden_size
    if hidden % num_attention_heads:
        raise ValueError(f"hidden size {hidden} is not divisible by {num_attention_heads} heads")
    layer_ids = target_layer_ids or build_target_layer_ids(target_config.num_hidden_layers, num_layers)
    config = Qwen3Config(
        vocab_size=target_config.vocab_size, hidden_size=hidden, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads or num_attention_heads, head_dim=hidden // num_attention_heads,
        max_position_embeddings=target_config.max_position_embeddings, rms_norm_eps=target_config.rms_norm_eps,
        rope_parameters=dict(rope_parameters or target_config.rope_parameters), tie_word_embeddings=False, use_cache=False,
        block_size=block_size, num_target_layers=target_config.num_hidden_layers,
        dflash_config={"target_layer_ids": list(layer_ids), "mask_token_id": int(mask_token_id)},
    )
    config.architectures = ["DFlashDraftModel"]
    return config


def _draft_setting(config, name, default=None):
    """A DFlash setting: from config.dflash_config first, then the config itself."""
    return (getattr(config, "dflash_config", None) or {}).get(name, getattr(config, name, default))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply RoPE to x [B, heads, T, D] with cos/sin [B, T, D] (the half-split convention of Qwen/Llama)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class DFlashAttention(nn.Module):
    """Queries from the block, keys and values from [context features, block]; per-head q/k RMSNorm."""

    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        layer_types = getattr(config, "layer_types", None)
        sliding = bool(layer_types) and layer_types[layer_idx] == "sliding_attention"
        self.sliding_window = config.sliding_window if sliding else None

    def forward(self, hidden: torch.Tensor, context: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attention_mask: torch.Tensor | None = None, past_key_values=None) -> torch.Tensor:
        batch, q_len, _ = hidden.shape
        kv_input = torch.cat([context, hidden], dim=1)
        kv_len = kv_input.shape[1]
        q = self.q_norm(self.q_proj(hidden).view(batch, q_len, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(kv_input).view(batch, kv_len, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(kv_input).view(batch, kv_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = _rotate(q, cos[:, -q_len:], sin[:, -q_len:])
        k = _rotate(k, cos, sin)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        if attention_mask is None and self.sliding_window is not None:
            query_pos = torch.arange(k.shape[2] - q_len, k.shape[2], device=q.device)[:, None]
            key_pos = torch.arange(k.shape[2], device=q.device)[None, :]
            attention_mask = ((query_pos - key_pos).abs() < self.sliding_window)[None, None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, scale=self.head_dim ** -0.5,
                                             enable_gqa=self.num_kv_heads != self.num_heads)
        return self.o_proj(out.transpose(1, 2).reshape(batch, q_len, -1))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden, context, cos, sin, attention_mask=None, past_key_values=None):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), context, cos, sin, attention_mask,
                                         past_key_values)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DFlashDraftModel(Qwen3PreTrainedModel):
    """The drafter. `forward` maps block embeddings and context features to hidden states [B, Q, H]; the
    target's LM head turns them into draft logits."""

    config_class = Qwen3Config
    _no_split_modules = ["DFlashDecoderLayer"]

    def __init__(self, config: Qwen3Config):
        super().__init__(config)
        self.target_layer_ids = _draft_setting(config, "target_layer_ids")
        if not self.target_layer_ids:
            raise ValueError("a DFlash config must set dflash_config.target_layer_ids")
        self.block_size = int(_draft_setting(config, "block_size", 16))
        self.mask_token_id = _draft_setting(config, "mask_token_id")
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.fc = nn.Linear(len(self.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_init()

    def forward(self, position_ids: torch.LongTensor, noise_embedding: torch.Tensor,
                target_hidden: torch.Tensor, attention_mask: torch.Tensor | None = None,
                past_key_values=None) -> torch.Tensor:
        """position_ids [B, C+Q]: positions of the C context features then of the Q block tokens;
        noise_embedding [B, Q, H]: target embeddings of the block; target_hidden [B, C, n*H]: context
        features; attention_mask: optional boolean [B or 1, 1, Q, keys] (True = attend), None = every block
        token sees every key. With `past_key_values` (a transformers Cache) keys and values are appended
        to it (crop it to the committed length afterwards)."""
        context = self.hidden_norm(self.fc(target_hidden))
        cos, sin = self.rotary_emb(noise_embedding, position_ids)
        hidden = noise_embedding
        for layer in self.layers:
            hidden = layer(hidden, context, cos, sin, attention_mask, past_key_values)
        return self.norm(hidden)


def block_attention_mask(anchors: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """Mask for many blocks drafted in one pass over one sequence's context (training and evaluation):
    anchors [B, N] -> boolean [B, 1, N*block, context_len + N*block]. Block n's tokens see the context
    features at positions < anchors[:, n] and all tokens of block n, nothing else."""
    batch, n = anchors.shape
    device = anchors.device
    q_block = torch.arange(n * block_size, device=device) // block_size  # block of each query
    ctx_visible = torch.arange(context_len, device=device)[None, None, :] < anchors[:, q_block, None]
    noise_visible = (q_block[:, None] == q_block[None, :]).expand(batch, -1, -1)
    return torch.cat([ctx_visible, noise_visible], dim=2)[:, None]


def block_position_ids(anchors: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """Positions [B, context_len + N*block] for `block_attention_mask`: 0..C-1, then a_n..a_n+block-1."""
    batch, n = anchors.shape
    offsets = torch.arange(block_size, device=anchors.device)
    blocks = (anchors[:, :, None] + offsets).reshape(batch, n * block_size)
    ctx = torch.arange(context_len, device=anchors.device).expand(batch, -1)
    return torch.cat([ctx, blocks], dim=1)


def block_input_ids(token_ids: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int):
    """Block tokens [B, N*block]: each anchor's token followed by block_size - 1 mask tokens."""
    anchor_tokens = token_ids.gather(1, anchors)
    blocks = torch.full((*anchors.shape, block_size), mask_token_id, dtype=token_ids.dtype, device=token_ids.device)
    blocks[:, :, 0] = anchor_tokens
    return blocks.reshape(anchors.shape[0], -1)


def block_targets(token_ids: torch.Tensor, anchors: torch.Tensor, block_size: int):
    """The positions each block drafts, anchor + 1 .. anchor + block_size - 1 ([B, N, block_size - 1]), and
    the tokens of `token_ids` [B, T] there: (positions, labels)."""
    positions = anchors[:, :, None] + torch.arange(1, block_size, device=anchors.device)
    return positions, token_ids.gather(1, positions.flatten(1)).view_as(positions)
