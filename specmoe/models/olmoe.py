"""OLMoE (transformers' OlmoeForCausalLM): adapter, routed router subclass, named configs, seeded weights.

OLMoE has a softmax router (`OlmoeTopKRouter`: logits = W h, top-K of softmax(z), weights not renormalised,
norm_topk_prob=False), no shared experts, and every decoder layer is an MoE layer. The routed router is a
subclass of transformers' own class: it computes the logits by calling the original forward and replaces
only the selection (from the routing context) and the weights (the same softmax gathered at the selection),
so the exact policy leaves the model's outputs bitwise unchanged.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
from torch import nn
from transformers import OlmoeConfig, OlmoeForCausalLM
from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter

from .adapter import ModelSourceError, MoEAdapter, routed_forward

# Routing geometry of OLMoE-1B-7B shared by every named config: 16 MoE layers of 64 experts, top-8.
_ROUTING = dict(num_hidden_layers=16, num_experts=64, num_experts_per_tok=8, norm_topk_prob=False)
_COMMON = dict(hidden_act="silu", rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
               attention_bias=False, clip_qkv=None, tie_word_embeddings=False, bos_token_id=None)

# Named configs: keyword arguments of OlmoeConfig. OLMoE-1B-7B's expert intermediate size is 1024
# (OlmoeConfig()'s default of 2048 is not OLMoE-1B-7B); the small ones keep its routing geometry.
OLMOE_CONFIGS: dict[str, dict] = {
    "olmoe-1b-7b": dict(**_ROUTING, **_COMMON, vocab_size=50304, hidden_size=2048, intermediate_size=1024,
                        num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=4096,
                        pad_token_id=1, eos_token_id=50279),
    "olmoe-tiny": dict(**_ROUTING, **_COMMON, vocab_size=512, hidden_size=64, intermediate_size=32,
                       num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=2048,
                       pad_token_id=1, eos_token_id=511),
    "olmoe-micro": dict(**_ROUTING, **_COMMON, vocab_size=128, hidden_size=32, intermediate_size=16,
                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=1024,
                        pad_token_id=1, eos_token_id=127),
}


class RoutedOlmoeTopKRouter(OlmoeTopKRouter):
    """OLMoE's router whose top-K comes from the routing policy of a context (`specmoe.harness`).

    The instance attributes `specmoe_context` and `specmoe_layer` (the MoE layer index) are set by
    `OlmoeAdapter.patch_routers`; all policy state lives in the context. Returns what the original returns:
    (router_logits [N, E], weights [N, K] in the logits' dtype, selected experts [N, K] int64, best first).
    """

    def forward(self, hidden_states):
        return routed_forward(self, super().forward, hidden_states, keep_own_order=False)


@dataclass(frozen=True)
class OlmoeAdapter(MoEAdapter):
    """Adapter of OlmoeForCausalLM: every decoder layer is MoE; `mlp.gate` is the router."""

    router_class = OlmoeTopKRouter
    routed_router_class = RoutedOlmoeTopKRouter

    @classmethod
    def from_config(cls, config: OlmoeConfig) -> "OlmoeAdapter":
        if not getattr(config, "num_experts", 0) or not getattr(config, "num_experts_per_tok", 0):
            raise ModelSourceError(f"this OLMoE config has no MoE layers (num_experts={config.num_experts})")
        return cls(model_type="olmoe", num_moe_layers=config.num_hidden_layers, num_experts=config.num_experts,
                   top_k=config.num_experts_per_tok, vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                   moe_intermediate_size=config.intermediate_size, norm_topk_prob=bool(config.norm_topk_prob),
                   moe_layer_ids=tuple(range(config.num_hidden_layers)))

    def router_logits(self, router: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return OlmoeTopKRouter.forward(router, hidden)[0]

    def execution_weights(self, router_logits: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
        # the same arithmetic as OlmoeTopKRouter: float32 softmax, gather, optional renormalisation, cast back
        weights = torch.softmax(router_logits, dim=-1, dtype=torch.float).gather(-1, selected)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(router_logits.dtype)


def build_random_olmoe(config: OlmoeConfig, seed: int, dtype: torch.dtype, device,
                       generator: torch.Generator | None = None) -> OlmoeForCausalLM:
    """An OlmoeForCausalLM of `config` with seeded random weights (see `init_random_weights`)."""
    from transformers.initialization import no_init_weights

    with no_init_weights(), torch.device(device):
        model = OlmoeForCausalLM._from_config(config, dtype=dtype)
    init_random_weights(model, seed, generator)
    return model


def layer_weight_std(name: str, shape: tuple[int, ...], into: tuple[str, ...], out: tuple[str, ...],
                     routers: tuple[str, ...] = ("mlp.gate.weight",)) -> float | None:
    """Standard deviation of the random init of parameter `name` (None: ones, for norm weights), for an
    architecture whose projections into a layer's residual branch end with `into`, out of it with `out`, and
    whose router weights end with `routers`.

    Chosen so that routing behaves like a trained model's in the ways the policies care about: token
    embeddings dominate a residual stream that each layer changes by a fraction (so the router of layer l
    on layer l-1's MoE input, the pre-gate, predicts layer l's choice, and routing depends on the token);
    router logits have a spread of about 2 (routing is neither uniform nor one-hot); next-token
    distributions are peaked enough that sampled text is not uniform noise. Projections into a layer get
    1/sqrt(fan-in), out of it half that."""
    fan_in = shape[-1]
    if name.endswith("norm.weight"):
        return None
    if name.endswith("embed_tokens.weight"):
        return 1.0
    if name.endswith("lm_head.weight"):
        return 2.5 / math.sqrt(fan_in)
    if name.endswith(routers):
        return 2.0 / math.sqrt(fan_in)
    if name.endswith(into):
        return 1.0 / math.sqrt(fan_in)
    if name.endswith(out):
        return 0.5 / math.sqrt(fan_in)
    raise ValueError(f"no random init rule for parameter {name!r}")


def _weight_std(name: str, shape: tuple[int, ...]) -> float | None:
    """OLMoE's random-init rule (`layer_weight_std`)."""
    return layer_weight_std(name, shape, into=("q_proj.weight", "k_proj.weight", "v_proj.weight",
                                               "experts.gate_up_proj"), out=("o_proj.weight", "experts.down_proj"))


def init_random_weights(model: nn.Module, seed: int, generator: torch.Generator | None = None,
                        std_of=_weight_std) -> None:
    """Fill every parameter with seeded normal values (ones for norms), rounded to bfloat16 values.

    Each parameter draws from its own CPU generator seeded by (seed, parameter name), so the weights do not
    depend on the device, the dtype or the order of parameters; rounding to bfloat16 (the dtype of the
    released checkpoints) makes the float32 and bfloat16 copies of a named model the same model, with the
    same router fingerprint. With `generator`, every parameter draws in turn from that one generator on its
    device instead: seconds on a GPU for OLMoE-1B-7B where the CPU draws take about a minute, but other
    weights (and `seed` is unused: seed the generator). `std_of(name, shape)` gives each parameter's standard
    deviation (None: ones); OLMoE's rules by default."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            std = std_of(name, tuple(param.shape))
            if std is None:
                param.fill_(1.0)
                continue
            gen = generator or \
                torch.Generator().manual_seed((int(seed) * 0x9E3779B1 + zlib.crc32(name.encode())) % 2**62)
            values = torch.randn(tuple(param.shape), generator=gen, device=gen.device, dtype=torch.float32)
            param.copy_(values.mul_(std).to(torch.bfloat16))
