"""The geometry of a model: the one record of its shapes that the decoders, the expert store, the kernels'
self-checks, the engines, the drafters and the experiment grid all read.

`Geometry` holds numbers only. What belongs to one architecture's arithmetic (norm eps, rotary theta,
clip_qkv) and where a model runs (dtype, device) stay with the architecture's decoder as plain attributes.
A dense model (the static AR drafter) is a Geometry with num_experts = top_k = 0 and no MoE layer ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def attention_shape(config) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim) of a transformers config's attention by the common names
    (num_attention_heads, num_key_value_heads, head_dim; a missing KV count is the heads', a missing head dim
    hidden_size / heads)."""
    heads = config.num_attention_heads
    return (heads, getattr(config, "num_key_value_heads", None) or heads,
            getattr(config, "head_dim", None) or config.hidden_size // heads)


@dataclass(frozen=True)
class Geometry:
    """A model's shapes (see the module docstring).

    num_layers: the layers the routing indexes, L: MoE layers of an MoE model (the MoE layer index l is the
    position in `layer_ids`), all decoder layers of a dense one. inter: one expert's intermediate size I (a
    dense model's MLP's). max_seq_len: positions S of a static KV cache, None where no cache is meant (a
    geometry read from a config or an adapter alone). num_heads / num_kv_heads / head_dim: the attention's,
    0 where not known (`of(adapter)`: an adapter knows the routing, not the attention). layer_ids: the decoder
    index of each MoE layer, in order (() for a dense model)."""

    num_layers: int  # L
    num_experts: int  # E (0: dense)
    top_k: int  # K (0: dense)
    vocab_size: int  # V
    hidden: int  # H
    inter: int  # I
    max_seq_len: int | None = None  # S
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    layer_ids: tuple[int, ...] = ()

    @property
    def dense(self) -> bool:
        return self.num_experts == 0

    @property
    def expert_width(self) -> int:
        """Elements of one expert row of the expert store: [gate (I x H) | up (I x H) | down (H x I)]."""
        return 3 * self.inter * self.hidden

    @classmethod
    def from_hf(cls, config, max_seq_len: int | None = None) -> "Geometry":
        """From a transformers config by its common names (num_hidden_layers, hidden_size, intermediate_size,
        num_attention_heads, num_key_value_heads, head_dim, vocab_size; num_experts and num_experts_per_tok,
        absent for a dense model). Every decoder layer is an MoE layer where there are experts (OLMoE);
        an architecture with dense layers among its MoE layers reads its layers through `of(adapter)`."""
        num_layers = config.num_hidden_layers
        num_experts = getattr(config, "num_experts", None) or 0
        return cls(num_layers, num_experts, (getattr(config, "num_experts_per_tok", None) or 0) if num_experts else 0,
                   config.vocab_size, config.hidden_size, config.intermediate_size,
                   None if max_seq_len is None else int(max_seq_len), *attention_shape(config),
                   tuple(range(num_layers)) if num_experts else ())

    @classmethod
    def of(cls, adapter, max_seq_len: int | None = None) -> "Geometry":
        """The routing geometry of a `specmoe.models` adapter (L MoE layers, their decoder indices, E, K, V,
        H, I); the attention's shapes are left 0."""
        return cls(adapter.num_moe_layers, adapter.num_experts, adapter.top_k, adapter.vocab_size,
                   adapter.hidden_size, adapter.moe_intermediate_size,
                   None if max_seq_len is None else int(max_seq_len), layer_ids=tuple(adapter.moe_layer_ids))


def tiled_layers(num_layers: int, source_layers: int) -> np.ndarray:
    """The source layer of each of `num_layers` layers when recordings of `source_layers` layers (a trace, a
    calibration, a router rule) stand for a deeper model: layer l reads layer l mod source_layers, the
    recorded stack repeated. A trained member of the model family is shallower than the full-size config whose
    timing follows its routing; each layer of the deep model then follows a real layer's routing sequence."""
    num_layers, source_layers = int(num_layers), int(source_layers)
    if source_layers < 1 or num_layers < source_layers:
        raise ValueError(f"cannot tile {source_layers} recorded layers over {num_layers} layers: a recording "
                         "stands only for a model with at least as many layers")
    return np.arange(num_layers) % source_layers
