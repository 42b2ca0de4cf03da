"""Qwen3.5-MoE (transformers' Qwen3_5MoeForCausalLM, e.g. Qwen3.6-35B-A3B): adapter, routed router, named
configs, seeded weights.

Every decoder layer is an MoE layer (the config has no dense layers: no `mlp_only_layers` nor
`decoder_sparse_step`); the token mixers alternate by `layer_types`: three of every four layers are Gated
DeltaNet ("linear_attention": a short causal convolution and a gated delta-rule recurrent state per layer),
every fourth is gated full attention. The router (`Qwen3_5MoeTopKRouter`) computes logits z = W h, the
float32 softmax over the E experts, chooses the top-K of it and always renormalises the K probabilities to
sum to one (there is no `norm_topk_prob` switch), cast back to the logits' dtype. The routed experts are added
to one shared expert (an MLP of width `shared_expert_intermediate_size`) scaled per token by its gate,
sigmoid(w_g . h) (`mlp.shared_expert_gate`, a [1, H] linear map of the MoE input).

The routed router is a subclass of transformers' class that asks the routing context for the selection, as
OLMoE's and DeepSeek-V3's are. The Gated DeltaNet layers run in transformers' torch reference on the CPU, also
where `flash-linear-attention` or `causal-conv1d` is installed (`gdn_kernels_on_cuda_only`): those packages'
kernels run on CUDA tensors only, and transformers binds them for every device when it imports.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
from torch import nn
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTopKRouter

from .adapter import ModelSourceError, MoEAdapter, routed_forward
from .checkpoint import FP8_QUANTIZATION
from .olmoe import init_random_weights, layer_weight_std

# Qwen3.6-35B-A3B as the architecture's description gives it: 40 layers, three of every four Gated DeltaNet and
# every fourth gated full attention (full_attention_interval 4), 256 experts, top-8, expert width 512, one shared
# expert of width 512. Everything else is Qwen3_5MoeTextConfig's default (transformers 5.23, whose defaults
# describe Qwen3.5-35B-A3B): vocabulary 248320, hidden size 2048, 16 query heads and 2 KV heads of dimension 256
# with a quarter of it rotary (rope theta 10000), Gated DeltaNet with 16 key heads and 32 value heads of
# dimension 128 and a convolution of width 4, RMSNorm eps 1e-6, 32768 positions, untied embeddings, silu, and
# no bos/eos/pad token ids.
QWEN36_35B_A3B = dict(
    num_hidden_layers=40, full_attention_interval=4, num_experts=256, num_experts_per_tok=8,
    moe_intermediate_size=512, shared_expert_intermediate_size=512)

# A tiny model of the same shape: 4 layers (3 Gated DeltaNet, then 1 full attention), 16 experts, top-4.
_TINY = dict(
    vocab_size=512, hidden_size=64, num_hidden_layers=4, full_attention_interval=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=16, num_experts_per_tok=4,
    moe_intermediate_size=32, shared_expert_intermediate_size=32, max_position_embeddings=2048, rms_norm_eps=1e-6,
    tie_word_embeddings=False, bos_token_id=None, pad_token_id=1, eos_token_id=511)

# The FP8 variants declare block-wise FP8 weights (quantization_config, as the shipped FP8 checkpoints): their
# random routed experts are rounded to FP8 values (`checkpoint.round_experts_to_fp8`) and the expert store keeps
# them in FP8. The tiny one has a hidden size and expert width of two 128-blocks each, the second partial.
QWEN3_5_MOE_CONFIGS: dict[str, dict] = {
    "qwen3.6-35b-a3b": QWEN36_35B_A3B,
    "qwen3.6-35b-a3b-fp8": {**QWEN36_35B_A3B, "quantization_config": FP8_QUANTIZATION},
    "qwen3.5-moe-tiny": _TINY,
    "qwen3.5-moe-tiny-fp8": {**_TINY, "hidden_size": 192, "moe_intermediate_size": 160,
                             "quantization_config": FP8_QUANTIZATION},
}


class SharedExpert(nn.Module):
    """One layer's shared expert as the MoE block adds it: sigmoid(gate(h)) * mlp(h) for MoE inputs h [N, H].
    A view of the model's own modules (`Qwen35MoeAdapter.shared_experts`), not part of the model."""

    def __init__(self, mlp: nn.Module, gate: nn.Linear):
        super().__init__()
        self.mlp, self.gate = mlp, gate

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.gate(hidden)) * self.mlp(hidden)


class RoutedQwen35MoeTopKRouter(Qwen3_5MoeTopKRouter):
    """Qwen3.5-MoE's router whose top-K comes from the routing policy of a context (`specmoe.harness`).

    `specmoe_context` and `specmoe_layer` are set by `Qwen35MoeAdapter.patch_routers`. Returns what the original
    returns: (router_logits [N, E], weights [N, K] in the logits' dtype, selected experts [N, K] int64). Rows
    whose executed set is the model's own keep the original's weights and order (the renormalising sum depends
    on the order of its terms), so exact routing stays bitwise equal to the model's own."""

    def forward(self, hidden_states):
        return routed_forward(self, super().forward, hidden_states, keep_own_order=True)


# transformers' module-level Gated DeltaNet functions that it binds to an optional package's kernel at import
GDN_FUNCTIONS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                 "causal_conv1d_update")


def gdn_kernels_on_cuda_only(module=None) -> None:
    """Make transformers' Gated DeltaNet functions in `module` (default: the Qwen3.5-MoE modeling module) run the
    optional package's kernel (flash-linear-attention, causal-conv1d) on CUDA tensors and transformers' own torch
    version on any other device. transformers picks the package's kernel for every call once the package imports,
    and those kernels are Triton or CUDA code: without this a CPU forward (the harness, `make_bench_trace.py`) of
    a Qwen3.5-MoE model fails on a machine with the package installed. Once per module (later swaps of these
    names, e.g. `specmoe_train.train.reference_delta_rule`, are kept); each function's `__wrapped__` stays the
    torch version, as transformers' own wrapper has it."""
    if module is None:
        from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as module
    if getattr(module, "_specmoe_gdn_by_device", False):
        return
    for name in GDN_FUNCTIONS:
        kernel = getattr(module, name, None)
        reference = getattr(kernel, "__wrapped__", None)
        if reference is None:
            continue
        takes = inspect.signature(reference).parameters
        any_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in takes.values())

        @functools.wraps(reference)
        def by_device(*args, _kernel=kernel, _reference=reference, _takes=takes, _any=any_keyword, **kwargs):
            first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
            if first is not None and first.is_cuda:
                return _kernel(*args, **kwargs)
            return _reference(*args, **(kwargs if _any else {k: v for k, v in kwargs.items() if k in _takes}))

        setattr(module, name, by_device)
    module._specmoe_gdn_by_device = True


@dataclass(frozen=True)
class Qwen35MoeAdapter(MoEAdapter):
    """Adapter of Qwen3_5MoeForCausalLM: every decoder layer is MoE; `mlp.gate` is the router, `mlp.experts`
    the fused routed experts, `mlp.shared_expert` and `mlp.shared_expert_gate` the gated shared expert.
    `layer_types`: each decoder layer's token mixer ("linear_attention" or "full_attention").
    `checkpoint_prefix`: where the decoder layers' tensors are in a checkpoint: "model." in the text model's
    (model_type qwen3_5_moe_text, as Qwen3_5MoeForCausalLM.save_pretrained writes), "model.language_model." in
    the shipped image-text model's (model_type qwen3_5_moe, whose text_config is the text model's; transformers
    loads its text part into Qwen3_5MoeForCausalLM)."""

    layer_types: tuple[str, ...] = ()
    shared_expert_intermediate_size: int = 0
    checkpoint_prefix: str = "model."
    router_class = Qwen3_5MoeTopKRouter
    routed_router_class = RoutedQwen35MoeTopKRouter

    @classmethod
    def from_config(cls, config) -> "Qwen35MoeAdapter":
        """From a Qwen3_5MoeTextConfig, or a Qwen3_5MoeConfig (image-text) by its text_config. Makes the
        modeling module's Gated DeltaNet kernels CUDA-only (`gdn_kernels_on_cuda_only`)."""
        gdn_kernels_on_cuda_only()
        model_type = config.model_type
        prefix = "model.language_model." if model_type == "qwen3_5_moe" else "model."
        config = config.get_text_config()
        experts, top_k = getattr(config, "num_experts", 0), getattr(config, "num_experts_per_tok", 0)
        if not experts or not top_k:
            raise ModelSourceError(f"this Qwen3.5-MoE config has no MoE layers (num_experts={experts}, "
                                   f"num_experts_per_tok={top_k})")
        layers = config.num_hidden_layers
        return cls(model_type=model_type, num_moe_layers=layers, num_experts=experts, top_k=top_k,
                   vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                   moe_intermediate_size=config.moe_intermediate_size, norm_topk_prob=True,
                   moe_layer_ids=tuple(range(layers)), layer_types=tuple(config.layer_types[:layers]),
                   shared_expert_intermediate_size=int(config.shared_expert_intermediate_size),
                   checkpoint_prefix=prefix)

    # -- where things are ---------------------------------------------------------------------------
    def shared_experts(self, model: nn.Module, layer: int) -> nn.Module:
        """The shared expert of MoE layer `layer` with its gate: a module whose output on MoE inputs [N, H] is
        what the block adds to the routed experts' sum (sigmoid(shared_expert_gate(h)) * shared_expert(h))."""
        block = self.moe_blocks(model)[layer]
        return SharedExpert(block.shared_expert, block.shared_expert_gate)

    def router_weight_name(self, layer: int) -> str:
        return f"{self.checkpoint_prefix}layers.{self.moe_layer_ids[layer]}.mlp.gate.weight"

    def checkpoint_experts(self) -> str:
        return self.checkpoint_prefix + "layers.{layer}.mlp.experts"

    # -- routing arithmetic -------------------------------------------------------------------------
    def router_logits(self, router: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return Qwen3_5MoeTopKRouter.forward(router, hidden)[0]

    def execution_weights(self, router_logits: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
        # the router's arithmetic: float32 softmax, gathered at the selection, renormalised, cast back
        weights = torch.softmax(router_logits, dim=-1, dtype=torch.float).gather(-1, selected)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(router_logits.dtype)

    # router_scoring: the base class's softmax RouterScoring, renormalised (norm_topk_prob is always True)

    # -- harness hook --------------------------------------------------------------------------------
def _weight_std(name: str, shape: tuple[int, ...]) -> float | None:
    """Standard deviation of the random init of Qwen3.5-MoE parameter `name` (None: ones), by the rules of
    OLMoE's (`olmoe._weight_std`: embeddings dominate the residual stream, router logits spread about 2,
    projections into a layer 1/sqrt(fan-in), out of it half that). The zero-centred RMSNorms (scale 1 + w) get
    small random w (0.1), so that a decoder that forgets the 1 + or the w differs; the gated RMSNorm of the
    Gated DeltaNet (scale w) gets ones. The shared expert's gate spreads its logits about 2, so that
    sigmoid(gate) differs clearly from token to token and from 1; the decay parameters A_log and dt_bias are
    standard normal (decay rates exp(A_log) * softplus(a + dt_bias) of order 1)."""
    if name.endswith("linear_attn.norm.weight"):
        return None
    if name.endswith(("norm.weight", "layernorm.weight")):
        return 0.1
    if name.endswith(("A_log", "dt_bias")):
        return 1.0
    return layer_weight_std(name, shape, routers=("mlp.gate.weight", "shared_expert_gate.weight"),
                            into=("q_proj.weight", "k_proj.weight", "v_proj.weight", "in_proj_qkv.weight",
                                  "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight", "conv1d.weight",
                                  "gate_proj.weight", "up_proj.weight", "experts.gate_up_proj"),
                            out=("o_proj.weight", "out_proj.weight", "down_proj.weight", "experts.down_proj"))


def build_random_qwen3_5_moe(config: Qwen3_5MoeTextConfig, seed: int, dtype: torch.dtype, device,
                             generator: torch.Generator | None = None) -> Qwen3_5MoeForCausalLM:
    """A Qwen3_5MoeForCausalLM of `config` (a text config, or an image-text one's text part) with seeded random
    weights (`init_random_weights` with this architecture's rules)."""
    from transformers.initialization import no_init_weights

    with no_init_weights(), torch.device(device):
        model = Qwen3_5MoeForCausalLM._from_config(config.get_text_config(), dtype=dtype)
    init_random_weights(model, seed, generator, std_of=_weight_std)
    return model

