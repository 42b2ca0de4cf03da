"""Run a transformers MoE model under a routing policy: patched routers plus a routing context.

`patch_model` swaps every router for a subclass of the model's own router class (see the adapter) that asks
a `RoutingContext` for its selection, and hooks the decoder stack so the context sees the token ids and the
attention mask of each forward. The context holds all policy state: one `LogicalCache` per batch row, on
which each router runs `LogicalCache.run_span` for the row's positions (no other implementation of the
policy exists). Layers are independent: at MoE layer l the context passes the router logits z_l and the
pre-gate logits g_l (router l on layer l-1's MoE input, computed and stashed by the router of layer l-1;
none for the first MoE layer, and none for policies that insert nothing, insert_budget = 0).

Sequences: a forward with no past positions (no KV cache, or an empty one) starts new sequences, so the
context resets itself to the batch size; a forward with past positions (generate's decode steps) continues
them, and the context checks that every row's logical cache has processed exactly the row's unpadded past
positions. Padded positions (attention mask 0; left padding in generate, right padding in the diagnostics)
never update state, and every row's cache is independent of the others.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from specmoe.models import MoEAdapter, adapter_for
from specmoe.routing import Calibration, LogicalCache, PolicyConfig, PolicyError, RouterScoring


@dataclass
class _Forward:
    """Metadata of the forward in progress: token ids [B, S] (-1 where unknown) and validity [B, S]."""

    tokens: np.ndarray
    valid: np.ndarray
    record: dict | None = None  # when recording: z, g [B, S, L, E] and selected [B, S, L, K], layer by layer


def model_scoring(model: nn.Module, adapter: MoEAdapter) -> RouterScoring:
    """The router rule of a transformers model (`adapter.router_scoring`, its learned parts such as
    DeepSeek-V3's selection bias read from the model's parameters and buffers by transformers' names)."""
    params = {**dict(model.named_buffers()), **dict(model.named_parameters())}
    return adapter.router_scoring(lambda name: params[name])


class RoutingContext:
    """The routing state of a patched model: the policy, its calibration, one logical cache per batch row,
    the forward in progress and (with `record=True`) what every routed position saw and selected."""

    def __init__(self, adapter: MoEAdapter, policy: PolicyConfig, calibration: Calibration,
                 routers: list[nn.Module], record: bool = False, scoring: RouterScoring | None = None):
        self.adapter = adapter
        # the router's rule: routing ranks its selection scores of the raw logits, computed by the routing core
        self.scoring = scoring or RouterScoring("softmax", renormalise=adapter.norm_topk_prob,
                                                n_group=adapter.groups[0], topk_group=adapter.groups[1])
        self.policy = policy
        self.calibration = calibration
        self.routers = routers
        self.record = record
        self.uses_pregate = policy.insert_budget > 0
        self.pool: list[LogicalCache] = []  # caches ever used; the first batch_size serve the rows
        self.caches: list[LogicalCache] = []
        self._forward: _Forward | None = None
        self._pregate: list[np.ndarray | None] = [None] * adapter.num_moe_layers
        self._chunks: list[_Forward] = []
        self._hook = None

    # -- sequences ----------------------------------------------------------------------------------
    def reset(self, batch_size: int) -> None:
        """Start new sequences in `batch_size` rows: every cache back to the warm set (prefetches left
        unexecuted count as unused), recordings cleared. Counters keep accumulating (`clear_counters`)."""
        for cache in self.pool:
            cache.reset()
        while len(self.pool) < batch_size:
            self.pool.append(LogicalCache(self.policy, self.calibration, self.adapter.num_moe_layers,
                                          self.adapter.num_experts, self.adapter.groups))
        self.caches = self.pool[:batch_size]
        self._chunks = []

    def finish(self) -> None:
        """End the current sequences (counts their unexecuted prefetches as unused), keeping recordings."""
        for cache in self.pool:
            cache.reset()

    def totals(self) -> dict:
        """Counters summed over rows since `clear_counters`, plus `tokens` (routed positions = steps / L).
        Call `finish` first to count the unused prefetches of the sequences in progress."""
        keys = ("steps", "demand", "prefetch", "unused", "replaced", "displaced_mass")
        total = {key: 0 for key in keys}
        for cache in self.pool:
            for key, value in cache.totals().items():
                total[key] += value
        total["tokens"] = total["steps"] // self.adapter.num_moe_layers
        return total

    def clear_counters(self) -> None:
        for cache in self.pool:
            cache.clear_counters()

    # -- what the hooks call --------------------------------------------------------------------------
    def begin_forward(self, tokens: np.ndarray, valid: np.ndarray, past_valid: np.ndarray | None) -> None:
        """Called before each forward of the decoder stack: token ids and validity [B, S] of the new
        positions; past_valid [B]: unpadded past positions per row (None: no past, new sequences)."""
        batch, span = tokens.shape
        if past_valid is None:
            self.reset(batch)
        else:
            if len(self.caches) != batch:
                raise RuntimeError(f"a forward with past positions for {batch} rows, but the routing context "
                                   f"holds {len(self.caches)} sequences: start from an empty KV cache")
            for row, cache in enumerate(self.caches):
                if cache.position(0) != past_valid[row]:
                    raise RuntimeError(
                        f"row {row}: the routing state has processed {cache.position(0)} tokens but the KV cache "
                        f"holds {int(past_valid[row])}; the context and the KV cache belong to different sequences"
                    )
        self._forward = _Forward(tokens, valid, {} if self.record else None)
        self._pregate = [None] * self.adapter.num_moe_layers
        if self.record:
            self._chunks.append(self._forward)

    def route(self, layer: int, router_logits: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The executed experts [N, K] (int64, best first, on the logits' device) of MoE layer `layer` for
        the N = B * S positions of the forward in progress; `hidden` [N, H] is the layer's MoE input, from
        which the pre-gate of the next MoE layer is computed."""
        fwd = self._forward
        if fwd is None:
            raise RuntimeError("routed router called outside a hooked forward: patch the model with patch_model")
        batch, span = fwd.tokens.shape
        num_experts = self.adapter.num_experts
        if router_logits.shape != (batch * span, num_experts):
            raise RuntimeError(f"router logits of layer {layer} have shape {tuple(router_logits.shape)}, "
                               f"expected {(batch * span, num_experts)} for a batch of {batch} x {span}")
        raw = self._host(router_logits).reshape(batch, span, num_experts)
        z = self._scores(raw, layer)
        g_raw = self._pregate[layer] if layer > 0 else None
        g = None if g_raw is None else self._scores(g_raw, layer)
        if layer > 0 and g is None and (self.uses_pregate or self.record):
            raise RuntimeError(f"no pre-gate logits for layer {layer}: MoE layers must run in order")
        if layer + 1 < self.adapter.num_moe_layers and (self.uses_pregate or self.record):
            nxt = self.adapter.router_logits(self.routers[layer + 1], hidden)
            self._pregate[layer + 1] = self._host(nxt).reshape(batch, span, num_experts)
        selected = np.empty((batch, span, self.policy.top_k), dtype=np.int64)
        for row, cache in enumerate(self.caches):
            pregate = None if g is None else g[row]
            selected[row] = cache.run_span(layer, z[row], pregate, fwd.tokens[row], fwd.valid[row])
        if fwd.record is not None:
            if not fwd.record:  # float32 holds float32/bfloat16/float16 scores exactly
                dtype = np.float64 if router_logits.dtype == torch.float64 else np.float32
                shape = (batch, span, self.adapter.num_moe_layers)
                fwd.record.update(z=np.full((*shape, num_experts), np.nan, dtype=dtype),
                                  g=np.full((*shape, num_experts), np.nan, dtype=dtype),
                                  selected=np.full((*shape, self.policy.top_k), -1, dtype=np.int64))
            fwd.record["z"][:, :, layer] = raw
            if g_raw is not None:
                fwd.record["g"][:, :, layer] = g_raw
            if layer + 1 == self.adapter.num_moe_layers:  # row 0: router 0 on the last layer's input (tiling)
                wrap = self.adapter.router_logits(self.routers[0], hidden)
                fwd.record["g"][:, :, 0] = self._host(wrap).reshape(batch, span, num_experts)
            fwd.record["selected"][:, :, layer] = selected
        return torch.from_numpy(selected.reshape(batch * span, -1)).to(router_logits.device)

    def _scores(self, logits: np.ndarray, layer: int) -> np.ndarray:
        """The selection scores of raw logits [..., E] of MoE layer `layer` (the logits themselves for softmax)."""
        return logits if self.scoring.kind == "softmax" else self.scoring.selection_scores(logits, layer)

    @staticmethod
    def _host(scores: torch.Tensor) -> np.ndarray:
        """float64 host copy (exact for float32, bfloat16 and float16 scores)."""
        return scores.detach().to("cpu", torch.float64).numpy()

    # -- recordings ------------------------------------------------------------------------------------
    def recorded(self, row: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """What row `row` saw since its sequence started, over its unpadded positions in order:
        (raw router_logits [T, L, E], raw pregate_logits [T, L, E] (layer 0: router 0 on layer L-1's input,
        which routing ignores and a tiled trace uses; selection ranks `scoring.selection_scores` of both),
        token_ids [T] (-1 where the forward had no input ids), selected [T, L, K]). Needs `record=True`."""
        if not self.record:
            raise RuntimeError("this routing context does not record: patch_model(..., record=True)")
        if not 0 <= row < len(self.caches):
            raise IndexError(f"row {row} out of range for a batch of {len(self.caches)}")
        parts = []
        for chunk in self._chunks:
            if chunk.record:  # empty when the forward stopped before its first MoE layer
                keep = chunk.valid[row]
                parts.append((chunk.record["z"][row][keep], chunk.record["g"][row][keep], chunk.tokens[row][keep],
                              chunk.record["selected"][row][keep]))
        if not parts:
            num_layers, num_experts = self.adapter.num_moe_layers, self.adapter.num_experts
            logits = np.zeros((0, num_layers, num_experts), np.float32)
            return logits, logits.copy(), np.zeros(0, np.int64), np.zeros((0, num_layers, self.policy.top_k), np.int64)
        return tuple(np.concatenate(arrays) for arrays in zip(*parts))


def _before_forward(context: RoutingContext):
    """Forward pre-hook of the decoder stack: hands the context the ids, validity and past of the forward."""

    def hook(module, args, kwargs):
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if input_ids is not None:
            batch, span = input_ids.shape
            tokens = input_ids.detach().to("cpu", torch.int64).numpy()
        else:
            embeds = kwargs.get("inputs_embeds")
            if embeds is None:
                raise ValueError("the harness needs input_ids or inputs_embeds")
            batch, span = embeds.shape[:2]
            tokens = np.full((batch, span), -1, dtype=np.int64)
        mask = kwargs.get("attention_mask")
        past = kwargs.get("past_key_values")
        if mask is not None:
            if mask.dim() != 2 or mask.shape[0] != batch or mask.shape[1] < span:
                raise ValueError(f"the harness needs a 2-D attention mask [batch, past + new] = [{batch}, >= {span}], "
                                 f"got shape {tuple(mask.shape)}")
            host = mask.detach().to("cpu") != 0
            valid = host[:, mask.shape[1] - span:].numpy()
            past_len = mask.shape[1] - span
            past_valid = host[:, :past_len].sum(dim=1).numpy() if past_len else None
            if past is not None and past.get_seq_length() != past_len:
                raise ValueError(f"the attention mask covers {past_len} past positions but the KV cache holds "
                                 f"{past.get_seq_length()}: pass the mask of all past and new positions")
        else:
            valid = np.ones((batch, span), dtype=bool)
            past_len = past.get_seq_length() if past is not None else 0
            past_valid = np.full(batch, past_len) if past_len else None
        context.begin_forward(tokens, np.ascontiguousarray(valid), past_valid)

    return hook


def patch_model(model: nn.Module, adapter: MoEAdapter, policy: PolicyConfig, calibration: Calibration, *,
                record: bool = False) -> RoutingContext:
    """Route `model` with `policy`; returns the context that holds its state (also `model.specmoe_context`).

    Checks that the policy fits the model (K, C <= E) and that the calibration was made for this model
    (layers, experts, vocabulary, router fingerprint). A model already patched is re-patched. With
    `record=True` the context keeps every routed position's logits and selection (`recorded`)."""
    if policy.top_k != adapter.top_k:
        raise PolicyError(f"policy top_k K={policy.top_k} but the model routes each token to K={adapter.top_k} experts")
    policy.check_experts(adapter.num_experts)
    check_calibration(model, adapter, calibration)
    unpatch(model)
    context = RoutingContext(adapter, policy, calibration, adapter.routers(model), record=record,
                             scoring=model_scoring(model, adapter))
    attach_context(model, context)
    return context


def check_calibration(model: nn.Module, adapter: MoEAdapter, calibration: Calibration) -> None:
    """CalibrationError unless `calibration` was made for this model (layers, experts, vocabulary, and the
    router fingerprint where the calibration records one)."""
    fingerprinted = calibration.provenance.get("fingerprint") is not None  # else there is nothing to compare
    calibration.check(adapter.num_moe_layers, adapter.num_experts, adapter.vocab_size,
                      fingerprint=adapter.fingerprint(model) if fingerprinted else None)


def attach_context(model: nn.Module, context) -> None:
    """Route `model` through `context`: any object with `adapter`, `begin_forward(tokens, valid, past_valid)`
    and `route(layer, router_logits, hidden)` (a `RoutingContext`, or the speculative loop's block context).
    The model must not be patched already (`unpatch` first, or use `routed_by`)."""
    context.adapter.patch_routers(model, context)
    context._hook = context.adapter.base_model(model).register_forward_pre_hook(_before_forward(context),
                                                                                with_kwargs=True)
    model.specmoe_context = context


def unpatch(model: nn.Module) -> RoutingContext | None:
    """Give `model` its own routers back; returns the context it had (None if it was not patched)."""
    context = getattr(model, "specmoe_context", None)
    if context is None:
        return None
    context.adapter.unpatch_routers(model)
    context._hook.remove()
    context._hook = None
    del model.specmoe_context
    return context


@contextlib.contextmanager
def original_routing(model: nn.Module):
    """Run `model` with transformers' own routers inside the block, then restore its routing context.

    These are exact routing up to ties: where two router logits are exactly equal at the top-K boundary
    (frequent in bfloat16), torch.topk picks its own way, while specmoe's exact routing (`exact_routing`)
    takes the lower expert index like every policy of the routing core."""
    context = unpatch(model)
    try:
        yield model
    finally:
        if context is not None:
            attach_context(model, context)


def exact_policy(adapter: MoEAdapter) -> PolicyConfig:
    """The exact policy with every expert resident (C = E): the router's own top-K, no copies."""
    return PolicyConfig(kind="exact", capacity=adapter.num_experts, top_k=adapter.top_k, priority="lru")


@contextlib.contextmanager
def exact_routing(model: nn.Module, adapter: MoEAdapter | None = None, *, record: bool = False):
    """Run `model` with specmoe's exact routing inside the block (the routing core's exact policy, ties to
    the lower expert index: the reference of every diagnostic); yields its context, then restores the
    model's previous routing. Bitwise equal to transformers' own routing except on exact logit ties."""
    adapter = adapter or adapter_for(model.config)
    context = RoutingContext(adapter, exact_policy(adapter),
                             Calibration.uniform(adapter.num_moe_layers, adapter.num_experts, adapter.vocab_size),
                             adapter.routers(model), record=record, scoring=model_scoring(model, adapter))
    with routed_by(model, context):
        yield context


@contextlib.contextmanager
def routed_by(model: nn.Module, context):
    """Route `model` through `context` (see `attach_context`) inside the block, then restore the routing it
    had before (its previous context, or its own routers)."""
    previous = unpatch(model)
    try:
        attach_context(model, context)
        yield context
    finally:
        unpatch(model)
        if previous is not None:
            attach_context(model, previous)
