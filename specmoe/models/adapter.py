"""What the rest of specmoe needs to know about one MoE architecture, in one object: the adapter.

An adapter is made from a transformers config (`adapter_for`) and answers, for a model of that config:
the routing geometry (L MoE layers, E experts, top-K, vocabulary), where the MoE blocks, routers and expert
weights are, how the router's logits and the policy's selection scores are computed, how execution weights
follow from the logits and a selection, and how to swap the routers for ones that ask a routing context
(`specmoe.harness`) for the selection. Architectures subclass `MoEAdapter` and fill in the abstract parts:
OLMoE (softmax router, no shared experts) in `olmoe.py`; DeepSeek-V3 (sigmoid router with bias, shared
experts) and Qwen3.5-MoE follow the same shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from torch import nn

from specmoe.routing import RouterScoring, router_fingerprint


def router_weight_arrays(routers) -> list[np.ndarray]:
    """Router modules' weight matrices [E, H] as float32 numpy arrays (input of `router_fingerprint`)."""
    return [router.weight.detach().to("cpu", torch.float32).numpy() for router in routers]


def routers_fingerprint(routers) -> str:
    """`router_fingerprint` of router modules: the one way calibrations and traces identify a model's routers."""
    return router_fingerprint(router_weight_arrays(routers))


class ModelSourceError(ValueError):
    """A model source that cannot be loaded: missing directory, no weights, no MoE layers, unknown name."""


@dataclass(frozen=True)
class MoEAdapter:
    """Routing geometry and access paths of one MoE model (one instance per config).

    moe_layer_ids: the decoder layer index of each MoE layer, in order; the MoE layer index l used by the
    routing code is the position in this tuple. norm_topk_prob: whether the model's own router renormalises
    the top-K weights to sum to one.
    """

    model_type: str
    num_moe_layers: int
    num_experts: int
    top_k: int
    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    moe_layer_ids: tuple[int, ...]

    # -- where things are (architecture-specific) ---------------------------------------------------
    def base_model(self, model: nn.Module) -> nn.Module:
        """The decoder stack (the module that takes input_ids and attention_mask), e.g. model.model."""
        return model.model

    def moe_blocks(self, model: nn.Module) -> list[nn.Module]:
        """The MoE block of each MoE layer, in MoE layer order."""
        layers = self.base_model(model).layers
        return [layers[i].mlp for i in self.moe_layer_ids]

    def routers(self, model: nn.Module) -> list[nn.Module]:
        """The router module of each MoE layer."""
        return [block.gate for block in self.moe_blocks(model)]

    def router_weights(self, model: nn.Module) -> list[np.ndarray]:
        """Router weight matrices [E, H] as float32 numpy arrays (input of `router_fingerprint`)."""
        return router_weight_arrays(self.routers(model))

    def fingerprint(self, model: nn.Module) -> str:
        """The router fingerprint of `model` (what a calibration file is checked against)."""
        return routers_fingerprint(self.routers(model))

    def router_weight_name(self, layer: int) -> str:
        """The checkpoint name of MoE layer `layer`'s router weight [E, H] (for fingerprints read from files)."""
        return f"model.layers.{self.moe_layer_ids[layer]}.mlp.gate.weight"

    def checkpoint_experts(self) -> str:
        """Where a checkpoint holds the routed experts of decoder layer {layer} (`ExpertStore.from_checkpoint`'s
        prefix)."""
        return "model.layers.{layer}.mlp.experts"

    def checkpoint_fingerprint(self, reader) -> str:
        """`fingerprint` of the model in a checkpoint directory, read tensor by tensor with `reader` (a
        `CheckpointReader`) without building the model."""
        return router_fingerprint([reader.get(self.router_weight_name(layer)).float().numpy()
                                   for layer in range(self.num_moe_layers)])

    def experts(self, model: nn.Module, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The stacked expert weights of MoE layer `layer`: gate_up_proj [E, 2I, H], down_proj [E, H, I]."""
        experts = self.moe_blocks(model)[layer].experts
        return experts.gate_up_proj, experts.down_proj

    def shared_experts(self, model: nn.Module, layer: int) -> nn.Module | None:
        """The always-executed shared expert(s) of a layer (None where the architecture has none)."""
        return None

    # -- routing arithmetic -------------------------------------------------------------------------
    def router_logits(self, router: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, E] of `router` for MoE inputs `hidden` [N, H], computed as the router itself does
        (used for the pre-gate: router l on layer l-1's MoE input)."""
        raise NotImplementedError

    def selection_scores(self, router_logits: torch.Tensor, layer: int,
                         router: nn.Module | None = None) -> torch.Tensor:
        """What the routing policy ranks (and adds the bonus to): the logits for softmax routers; for
        sigmoid routers with a bias (DeepSeek-V3) sigmoid(z) + bias, the bias read from `router` (the router
        module of MoE layer `layer`, which sigmoid routers with a bias require)."""
        return router_logits

    @property
    def groups(self) -> tuple[int, int]:
        """(n_group, topk_group) of the router's group-limited choice ((1, 1): none): what the routing core
        takes as `groups` (`LogicalCache`, `replay`, `CalibrationBuilder`)."""
        return (1, 1)

    def execution_weights(self, router_logits: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
        """Weights [N, K] of the executed experts `selected` [N, K]: the unmodified router probabilities
        gathered at the selection, renormalised only where the model's own router renormalises."""
        raise NotImplementedError

    def router_scoring(self, weight=None) -> RouterScoring:
        """The same two rules (selection scores, execution weights) for the engines' numba routing step.
        `weight(name) -> tensor` reads a parameter by transformers' name, for routers whose rule has
        learned parts (DeepSeek-V3's selection bias); softmax routers need none."""
        return RouterScoring("softmax", renormalise=self.norm_topk_prob)

    # -- harness hook --------------------------------------------------------------------------------
    # the model's router class and its subclass that asks a routing context for the selection (set by each
    # architecture's adapter; the harness hook below swaps one for the other)
    router_class: ClassVar[type]
    routed_router_class: ClassVar[type]

    def patch_routers(self, model: nn.Module, context) -> None:
        """Swap each router for the subclass that asks `context.route` for its selection (`specmoe_context`,
        `specmoe_layer` on the module)."""
        routers = self.routers(model)
        for layer, router in enumerate(routers):
            if type(router) not in (self.router_class, self.routed_router_class):
                raise TypeError(f"router of MoE layer {layer} is a {type(router).__name__}, not a "
                                f"{self.router_class.__name__}")
        for layer, router in enumerate(routers):
            router.__class__ = self.routed_router_class
            router.specmoe_context = context
            router.specmoe_layer = layer

    def unpatch_routers(self, model: nn.Module) -> None:
        """Undo `patch_routers` (the original router class, no context)."""
        for router in self.routers(model):
            if isinstance(router, self.routed_router_class):
                router.__class__ = self.router_class
                del router.specmoe_context, router.specmoe_layer


def routed_forward(router: nn.Module, original, hidden_states: torch.Tensor, keep_own_order: bool):
    """The forward of a router patched by the harness (`MoEAdapter.patch_routers`): the original router's
    outputs (`original`: the unpatched class's forward, e.g. `super().forward`), then the top-K the routing
    context chooses (`router.specmoe_context.route` for MoE layer `router.specmoe_layer`) with the adapter's
    execution weights. keep_own_order: rows whose executed set is the model's own keep the original's weights
    and expert order (routers that renormalise sum the weights in torch.topk's unsorted order, and float addition
    depends on the order: this keeps exact routing bitwise equal to the model's own). Returns (router_logits
    [N, E], weights [N, K], selected [N, K] int64), as the original does."""
    router_logits, own_weights, own_selected = original(hidden_states)
    context = router.specmoe_context
    selected = context.route(router.specmoe_layer, router_logits, hidden_states.reshape(-1, router.hidden_dim))
    weights = context.adapter.execution_weights(router_logits, selected)
    if not keep_own_order:
        return router_logits, weights, selected
    same = (selected.sort(dim=-1).values == own_selected.sort(dim=-1).values).all(dim=-1, keepdim=True)
    return router_logits, torch.where(same, own_weights, weights), torch.where(same, own_selected, selected)


def extract_context_feature(hidden_states, layer_ids: list[int]) -> torch.Tensor:
    """Concatenate the target's hidden states after each layer in `layer_ids` ([B, T, n*H]): the features a
    drafter that reads the target (`Drafter.target_layer_ids`, DFlash) is handed. `hidden_states` is
    transformers' tuple: index 0 is the embedding output, index l+1 layer l's output."""
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)
