"""Routing on the device when every expert is resident: the host `route` step's result, computed in torch.

With all E experts of a layer in the logical cache (C = E), a policy whose bonus goes to resident experts
(exact, Cache-Prior, PSR) ranks exactly as the router's own top-K: the bonus is the same for every expert
and nothing is ever inserted or evicted. Routing then needs no host state, so the engine can run a whole
token as one CUDA graph (no host round trip per layer). This module is that selection in torch, written to
give what `LogicalCache.route` gives on the same float32 logits:

- the K best experts by score, ties broken by lower expert index, best first (the numba `_rank` order);
- execution weights: softmax over all E in float64, renormalised and scaled as the model's `RouterScoring`
  says, stored as float32.

Speculative execution is not covered (at C = E it still executes the predicted set), nor sigmoid routers
(their float64 scores + selection bias would need the host's exact arithmetic to break ties alike): the
engines keep the host path for those. `device_routing_applies` says when this module may stand in for the
host step; tests compare the two on the same logits.
"""

from __future__ import annotations

import torch

from specmoe.routing import PolicyConfig, RouterScoring

RESIDENT_RANKING_KINDS = ("exact", "cache_prior", "psr")


def device_routing_applies(policy: PolicyConfig, num_experts: int, scoring: RouterScoring) -> str | None:
    """None if routing reduces to the router's own top-K on the device for this policy and model, else the
    reason it does not."""
    if policy.capacity != num_experts:
        return f"C={policy.capacity} < E={num_experts}: routing reads the logical cache"
    if policy.kind not in RESIDENT_RANKING_KINDS:
        return f"policy kind {policy.kind!r} does not select the router's own top-K when all experts are resident"
    if scoring.kind != "softmax":
        return f"{scoring.kind} routers are routed on the host"
    return None


def _ranking_keys(z: torch.Tensor) -> torch.Tensor:
    """int64 keys whose descending order is (z descending, expert index ascending): the float32 bits mapped
    to a monotone int32 in the high word, E - 1 - index in the low word."""
    bits = (z.float() + 0.0).contiguous().view(torch.int32).long()  # + 0.0: -0.0 ties with +0.0, as compared
    monotone = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    index = torch.arange(z.shape[-1], device=z.device)
    return monotone * (1 << 32) + (z.shape[-1] - 1 - index)


def route_resident(z: torch.Tensor, top_k: int, scoring: RouterScoring, slot_of: torch.Tensor,
                   experts_out: torch.Tensor, route_out: torch.Tensor, kernel: str = "torch") -> None:
    """Exact routing of D positions with every expert resident, with static shapes (graph-capturable).

    z [D, E] float32 router logits; slot_of [E] int32: the slot of each expert; writes experts_out [D, K]
    int64 (best first) and route_out [D, 2K] int32 (slot ids, then the execution weights' float32 bits).
    kernel: "torch" (this function's torch ops, the reference) or "triton" (one launch,
    `resident_routing`)."""
    if kernel == "triton":
        from .resident_routing import route_resident_triton

        return route_resident_triton(z, top_k, scoring.renormalise, scoring.scale, slot_of, experts_out, route_out)
    route_resident_torch(z, top_k, scoring, slot_of, experts_out, route_out)


def route_resident_torch(z: torch.Tensor, top_k: int, scoring: RouterScoring, slot_of: torch.Tensor,
                         experts_out: torch.Tensor, route_out: torch.Tensor) -> None:
    """`route_resident` in torch ops (any device)."""
    selected = torch.topk(_ranking_keys(z), top_k, dim=-1, sorted=True).indices
    experts_out.copy_(selected)
    z64 = z.double()
    probs = torch.exp(z64 - z64.amax(dim=-1, keepdim=True))
    weights = probs.gather(-1, selected) / probs.sum(dim=-1, keepdim=True)
    if scoring.renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = (weights * scoring.scale).float()
    route_out[:, :top_k].copy_(slot_of[selected])
    route_out[:, top_k:].copy_(weights.view(torch.int32))
