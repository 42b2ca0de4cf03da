"""Routing on the device when every expert is resident: the host `route` step's result, computed in torch.

With all E experts of a layer in the logical cache (C = E), a policy whose bonus goes to resident experts
(exact, Cache-Prior, PSR) ranks exactly as the router's own top-K: the bonus is the same for every expert
and nothing is ever inserted or evicted. Routing then needs no host state, so the engine can run a whole
token as one CUDA graph (no host round trip per layer). This module is that selection in torch, written to
give what `LogicalCache.route` gives on the same float32 logits:

- softmax routers (OLMoE): the K best experts by logit, ties broken by lower expert index, best first (the
  numba `_rank` order); execution weights: softmax over all E in float64, renormalised and scaled as the
  model's `RouterScoring` says, stored as float32;
- sigmoid routers (DeepSeek-V3): the host's arithmetic in float64 torch ops (`route_sigmoid_torch`): selection
  scores 1 / (1 + exp(-z)) + the layer's selection bias (`selection_scores`), group-limited choice where the
  scoring has groups (`keep_groups`: a group scores the sum of its two best scores, the topk_group best kept,
  ties to the lower group), the K best of the kept experts by score, ties to the lower index, best first;
  weights: the unbiased sigmoid at the K, summed in selection order + 1e-20 where renormalised, times the
  routed scaling factor (`execution_weights`), stored as float32; one Triton launch per layer on CUDA
  (`resident_routing`), checked against the torch version. The layer's bias row comes as a device tensor
  (`bias_rows_on`), so that the call captures into a CUDA graph.

Speculative execution is not covered (at C = E it still executes the predicted set): the engines keep the host
path for it. With groups and a bonus policy (Cache-Prior, PSR) the host scores groups on score + bonus, whose
float64 rounding can reorder two groups whose sums agree to the last bit; the device scores the plain scores
(exact routing is identical). `device_routing_applies` says when this module may stand in for the host step;
tests compare the two on the same logits.
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
    return None


def bias_rows_on(scoring: RouterScoring, num_layers: int, num_experts: int, device) -> torch.Tensor | None:
    """The selection bias [L, E] float64 on `device` for `route_resident` (None for softmax routers)."""
    if scoring.kind == "softmax":
        return None
    return torch.as_tensor(scoring.bias_rows(num_layers, num_experts), dtype=torch.float64).to(device)


def _ranking_keys(z: torch.Tensor) -> torch.Tensor:
    """int64 keys whose descending order is (z descending, expert index ascending): the float32 bits mapped
    to a monotone int32 in the high word, E - 1 - index in the low word."""
    bits = (z.float() + 0.0).contiguous().view(torch.int32).long()  # + 0.0: -0.0 ties with +0.0, as compared
    monotone = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    index = torch.arange(z.shape[-1], device=z.device)
    return monotone * (1 << 32) + (z.shape[-1] - 1 - index)


def route_resident(z: torch.Tensor, top_k: int, scoring: RouterScoring, slot_of: torch.Tensor,
                   experts_out: torch.Tensor, route_out: torch.Tensor, kernel: str = "torch",
                   bias: torch.Tensor | None = None) -> None:
    """Exact routing of D positions with every expert resident, with static shapes (graph-capturable).

    z [D, E] float32 router logits; slot_of [E] int32: the slot of each expert; writes experts_out [D, K]
    int64 (best first) and route_out [D, 2K] int32 (slot ids, then the execution weights' float32 bits).
    bias: the layer's selection bias [E] float64 on z's device (sigmoid routers; `bias_rows_on`).
    kernel: "torch" (this function's torch ops, the reference) or "triton" (one launch,
    `resident_routing`)."""
    if scoring.kind == "sigmoid":
        if bias is None:
            raise ValueError("routing a sigmoid router on the device needs the layer's selection bias row")
        if kernel == "triton":
            from .resident_routing import route_sigmoid_triton

            return route_sigmoid_triton(z, top_k, scoring, bias, slot_of, experts_out, route_out)
        return route_sigmoid_torch(z, top_k, scoring, bias, slot_of, experts_out, route_out)
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


def _top_by_score(score: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the `count` largest entries of each row of `score` [..., N] (float64), best first, ties to the
    lower index (a stable descending sort keeps index order among equals)."""
    return torch.sort(score, dim=-1, descending=True, stable=True).indices[..., :count]


def route_sigmoid_torch(z: torch.Tensor, top_k: int, scoring: RouterScoring, bias: torch.Tensor,
                        slot_of: torch.Tensor, experts_out: torch.Tensor, route_out: torch.Tensor) -> None:
    """`route_resident` of a sigmoid router in float64 torch ops (any device): the host's `selection_scores`,
    `keep_groups` / `_rank_groups` and `execution_weights` (module docstring)."""
    num_pos, num_experts = z.shape
    z64 = z.double()
    sig = 1.0 / (1.0 + torch.exp(-z64))
    score = sig + bias
    n_group, topk_group = scoring.n_group, scoring.topk_group
    if 1 < n_group and topk_group < n_group:
        grouped = score.view(num_pos, n_group, num_experts // n_group)
        best = torch.topk(grouped, 2, dim=-1, sorted=True).values
        kept_groups = _top_by_score(best[..., 0] + best[..., 1], topk_group)  # [D, topk_group]
        kept = torch.zeros(num_pos, n_group, dtype=torch.bool, device=z.device).scatter_(1, kept_groups, True)
        kept = kept[:, :, None].expand(num_pos, n_group, num_experts // n_group).reshape(num_pos, num_experts)
        score = torch.where(kept, score, float("-inf"))
    selected = _top_by_score(score, top_k)
    experts_out.copy_(selected)
    weights = sig.gather(-1, selected)
    if scoring.renormalise:
        total = weights[:, 0]
        for j in range(1, top_k):  # in selection order, as the host sums
            total = total + weights[:, j]
        weights = weights / (total + 1e-20)[:, None]
    weights = (weights * scoring.scale).float()
    route_out[:, :top_k].copy_(slot_of[selected])
    route_out[:, top_k:].copy_(weights.view(torch.int32))
