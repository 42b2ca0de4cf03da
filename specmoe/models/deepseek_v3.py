"""DeepSeek-V3 (transformers' DeepseekV3ForCausalLM, e.g. Moonlight-16B-A3B): adapter, routed router, named
configs, seeded weights.

The router (`DeepseekV3TopkRouter`) computes logits z = W h in float32 and sigmoid scores s = sigmoid(z). It
chooses on the biased scores s + b_l (b_l = `e_score_correction_bias`, a learned per-layer selection bias
that steers the choice only), group-limited where n_group > 1 (a group scores the sum of its two best biased
scores, the topk_group best groups are kept, the top-K is taken inside them), and weights the executed
experts by the unbiased s, renormalised over the K when norm_topk_prob, times routed_scaling_factor. The
first `first_k_dense_replace` decoder layers have a dense MLP; every other layer is an MoE layer whose
routed experts are added to ungated shared experts (one MLP of n_shared_experts x moe_intermediate_size).

The routed router is a subclass of transformers' class that asks the routing context for the selection; the
routing core ranks the biased scores (`selection_scores`) with the groups of `router_scoring`.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from specmoe.routing import RouterScoring, router_fingerprint
from specmoe.routing.scoring import check_groups

from .adapter import ModelSourceError, MoEAdapter, routed_forward
from .olmoe import init_random_weights, layer_weight_std

_BIAS_STD = 0.1  # spread of the random selection bias (sigmoid scores lie in (0, 1))

# Moonlight-16B-A3B: the values of its config.json as the architecture's description gives them (27 layers,
# 1 dense, 64 routed experts, top-6, 2 shared experts of width 1408, one group, scaling 2.446, renormalised,
# latent 512 + rope 64, vocabulary 163840), hidden size 2048 (3 x 2048 x 1408 bf16 = 17.3 MB per expert),
# and its published transformer shape: dense width 11264, 16 heads (no query compression: q_lora_rank None,
# qk_nope_head_dim 128, v_head_dim 128), RMSNorm eps 1e-5, rope theta 50000, 8192 positions, bos/eos 163584/
# 163585. Everything else is DeepseekV3Config's default (rope_interleave True, no attention bias, silu).
MOONLIGHT = dict(
    vocab_size=163840, hidden_size=2048, intermediate_size=11264, moe_intermediate_size=1408, num_hidden_layers=27,
    num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2, n_routed_experts=64, num_experts_per_tok=6,
    routed_scaling_factor=2.446, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, v_head_dim=128,
    qk_nope_head_dim=128, n_group=1, topk_group=1, first_k_dense_replace=1, norm_topk_prob=True,
    max_position_embeddings=8192, rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
    bos_token_id=163584, eos_token_id=163585, tie_word_embeddings=False, num_mtp_layers=0)

# Tiny models of the same shape: 1 dense + 3 MoE layers of 16 experts, top-4, shared experts; the -groups one
# routes group-limited (4 groups of 4, 2 kept) and compresses queries (q_lora_rank) as DeepSeek-V3 does.
_TINY = dict(
    vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2, n_routed_experts=16, num_experts_per_tok=4,
    routed_scaling_factor=2.446, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8, v_head_dim=16,
    qk_nope_head_dim=16, n_group=1, topk_group=1, first_k_dense_replace=1, norm_topk_prob=True,
    max_position_embeddings=2048, rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    bos_token_id=None, pad_token_id=1, eos_token_id=511, tie_word_embeddings=False, num_mtp_layers=0)

DEEPSEEK_V3_CONFIGS: dict[str, dict] = {
    "moonlight-16b-a3b": MOONLIGHT,
    "deepseek-v3-tiny": _TINY,
    "deepseek-v3-tiny-groups": {**_TINY, "n_group": 4, "topk_group": 2, "q_lora_rank": 24, "n_shared_experts": 1},
}


def _bias_name(layer_id: int) -> str:
    return f"model.layers.{layer_id}.mlp.gate.e_score_correction_bias"


class RoutedDeepseekV3TopkRouter(DeepseekV3TopkRouter):
    """DeepSeek-V3's router whose top-K comes from the routing policy of a context (`specmoe.harness`).

    `specmoe_context` and `specmoe_layer` are set by `DeepseekV3Adapter.patch_routers`. Returns what the
    original returns: (router_logits [N, E] float32, weights [N, K] float32, selected experts [N, K] int64).
    Rows whose executed set is the model's own keep the original's weights and order: the same values, but
    the renormalising sum runs in the order of torch.topk's unsorted output, and float addition depends on
    the order, so this keeps exact routing bitwise equal to the model's own."""

    def forward(self, hidden_states):
        return routed_forward(self, super().forward, hidden_states, keep_own_order=True)


@dataclass(frozen=True)
class DeepseekV3Adapter(MoEAdapter):
    """Adapter of DeepseekV3ForCausalLM: MoE layers from `first_k_dense_replace` on; `mlp.gate` is the router
    (weight and selection bias), `mlp.experts` the fused routed experts, `mlp.shared_experts` the shared ones."""

    router_class = DeepseekV3TopkRouter
    routed_router_class = RoutedDeepseekV3TopkRouter

    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    n_shared_experts: int = 0

    @classmethod
    def from_config(cls, config: DeepseekV3Config) -> "DeepseekV3Adapter":
        experts, top_k = getattr(config, "n_routed_experts", 0), getattr(config, "num_experts_per_tok", 0)
        first = config.first_k_dense_replace or 0
        if not experts or not top_k or first >= config.num_hidden_layers:
            raise ModelSourceError(f"this DeepSeek-V3 config has no MoE layers (n_routed_experts={experts}, "
                                   f"first_k_dense_replace={first} of {config.num_hidden_layers} layers)")
        try:
            n_group, topk_group = check_groups(config.n_group or 1, config.topk_group or 1, experts, top_k)
        except ValueError as exc:
            raise ModelSourceError(f"DeepSeek-V3 config: {exc}") from exc
        layer_ids = tuple(range(first, config.num_hidden_layers))
        return cls(model_type="deepseek_v3", num_moe_layers=len(layer_ids), num_experts=experts, top_k=top_k,
                   vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                   moe_intermediate_size=config.moe_intermediate_size, norm_topk_prob=bool(config.norm_topk_prob),
                   moe_layer_ids=layer_ids, routed_scaling_factor=float(config.routed_scaling_factor),
                   n_group=n_group, topk_group=topk_group, n_shared_experts=int(config.n_shared_experts or 0))

    @property
    def groups(self) -> tuple[int, int]:
        return (self.n_group, self.topk_group)

    # -- where things are ---------------------------------------------------------------------------
    def shared_experts(self, model: nn.Module, layer: int) -> nn.Module | None:
        """The shared experts of MoE layer `layer`: one MLP (gate/up/down) of n_shared_experts x the expert
        width, added ungated to every token."""
        return self.moe_blocks(model)[layer].shared_experts

    def router_weights(self, model: nn.Module) -> list[np.ndarray]:
        """Per MoE layer, the router weight [E, H] with the selection bias appended as a column ([E, H + 1],
        float32): the bias decides the choice, so it belongs to the router's fingerprint."""
        return [np.concatenate([r.weight.detach().to("cpu", torch.float32).numpy(),
                                r.e_score_correction_bias.detach().to("cpu", torch.float32).numpy()[:, None]], axis=1)
                for r in self.routers(model)]

    def fingerprint(self, model: nn.Module) -> str:
        return router_fingerprint(self.router_weights(model))

    def checkpoint_fingerprint(self, reader) -> str:
        def matrix(layer_id: int) -> np.ndarray:
            weight = reader.get(f"model.layers.{layer_id}.mlp.gate.weight").float().numpy()
            return np.concatenate([weight, reader.get(_bias_name(layer_id)).float().numpy()[:, None]], axis=1)

        return router_fingerprint([matrix(i) for i in self.moe_layer_ids])

    # -- routing arithmetic -------------------------------------------------------------------------
    def router_logits(self, router: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return DeepseekV3TopkRouter.forward(router, hidden)[0]

    def selection_scores(self, router_logits: torch.Tensor, layer: int,
                         router: nn.Module | None = None) -> torch.Tensor:
        """sigmoid(z) + b_l in float32, as the router computes what it chooses on (b_l: `router`'s bias)."""
        if router is None:
            raise ValueError("DeepSeek-V3's selection scores need the layer's router (its selection bias)")
        return router_logits.float().sigmoid() + router.e_score_correction_bias

    def execution_weights(self, router_logits: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
        # the router's arithmetic: float32 sigmoid at the selection, sum + 1e-20 when renormalising, scaled
        weights = router_logits.float().sigmoid().gather(-1, selected)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor

    def router_scoring(self, weight=None) -> RouterScoring:
        """Sigmoid scores, the per-layer selection bias read with `weight(name)` (transformers' parameter
        names), renormalisation, the routed scaling factor and the expert groups."""
        if weight is None:
            raise ValueError("DeepSeek-V3's router scoring needs weight(name) to read the selection bias")
        bias = np.stack([weight(_bias_name(i)).detach().to("cpu", torch.float32).numpy() for i in self.moe_layer_ids])
        return RouterScoring("sigmoid", renormalise=self.norm_topk_prob, scale=self.routed_scaling_factor, bias=bias,
                             n_group=self.n_group, topk_group=self.topk_group)


def _weight_std(name: str, shape: tuple[int, ...]) -> float | None:
    """DeepSeek-V3's random-init rule: OLMoE's (`olmoe.layer_weight_std`) over MLA's projections and the dense and
    shared experts' MLPs."""
    return layer_weight_std(name, shape, into=("q_proj.weight", "q_a_proj.weight", "q_b_proj.weight",
                                               "kv_a_proj_with_mqa.weight", "kv_b_proj.weight", "gate_proj.weight",
                                               "up_proj.weight", "experts.gate_up_proj"),
                            out=("o_proj.weight", "down_proj.weight", "experts.down_proj"))


def build_random_deepseek_v3(config: DeepseekV3Config, seed: int, dtype: torch.dtype, device,
                             generator: torch.Generator | None = None) -> DeepseekV3ForCausalLM:
    """A DeepseekV3ForCausalLM of `config` with seeded random weights (`init_random_weights` with this
    architecture's rules) and a random nonzero selection bias per MoE layer (normal, std 0.1, rounded to
    bfloat16 values; drawn from (seed, the bias's name)): a zero bias would hide every place that forgets it."""
    from transformers.initialization import no_init_weights

    with no_init_weights(), torch.device(device):
        model = DeepseekV3ForCausalLM._from_config(config, dtype=dtype)
    init_random_weights(model, seed, generator, std_of=_weight_std)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                gen = torch.Generator().manual_seed((int(seed) * 0x9E3779B1 + zlib.crc32(name.encode())) % 2**62)
                values = torch.randn(tuple(buffer.shape), generator=gen, dtype=torch.float32) * _BIAS_STD
                buffer.copy_(values.to(torch.bfloat16))
    return model
