"""Routing of D positions with every expert resident, as one Triton launch (the torch version is
`specmoe.kernels.device_routing.route_resident_torch`, the reference).

Why our own kernel: the torch version is about twenty small launches per layer (ranking keys, top-K, a
float64 softmax, gathers); at batch 1 they cost as much as the host round trip they replace. One program per
position loads the E logits, ranks them K times by an int64 key (float32 bits made monotone in the high
word, E - 1 - index in the low word: higher logit first, then lower index, the host's order), and computes
the softmax weights in float64 as the host's `execution_weights` does.

Sigmoid routers (DeepSeek-V3; `route_sigmoid_torch` is the reference): the float64 selection scores
1 / (1 + exp(-z)) + the layer's bias row, the group step where the scoring has groups (a group scores the sum
of its two best scores; the topk_group best kept, ties to the lower group; the other groups' experts masked),
then K passes of (highest score, then lowest index), and the unbiased sigmoid weights summed in that order
(+ 1e-20) where renormalised, times the scale: the host's `selection_scores`, `keep_groups`, `_rank` and
`execution_weights` step for step.
"""

from __future__ import annotations

import torch

from . import pdl

try:
    import triton
    import triton.language as tl

    from .pdl import enter
except ImportError:  # pragma: no cover - depends on the environment
    triton = None

if triton is not None:

    @triton.jit
    def _route_sigmoid_kernel(z_ptr, z_stride, bias_ptr, slot_ptr, experts_ptr, route_ptr, scale, E: tl.constexpr,
                              BLOCK_E: tl.constexpr, K: tl.constexpr, RENORMALISE: tl.constexpr,
                              N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                              PDL: tl.constexpr = False):
        enter(PDL)
        d = tl.program_id(0)
        idx = tl.arange(0, BLOCK_E)
        valid = idx < E
        z64 = tl.load(z_ptr + d * z_stride + idx, mask=valid, other=0.0).to(tl.float32).to(tl.float64)
        sig = 1.0 / (1.0 + tl.exp(-z64))
        score = tl.where(valid, sig + tl.load(bias_ptr + idx, mask=valid, other=0.0).to(tl.float64), float("-inf"))
        if N_GROUP > 1 and TOPK_GROUP < N_GROUP:
            size = E // N_GROUP
            groups = tl.arange(0, BLOCK_G)
            group_score = tl.full([BLOCK_G], float("-inf"), tl.float64)
            for g in tl.static_range(N_GROUP):  # the sum of each group's two best scores
                member = (idx // size) == g
                best1 = tl.max(tl.where(member, score, float("-inf")), axis=0)
                first = tl.min(tl.where(member & (score == best1), idx, BLOCK_E), axis=0)
                best2 = tl.max(tl.where(member & (idx != first), score, float("-inf")), axis=0)
                group_score = tl.where(groups == g, best1 + best2, group_score)
            kept = tl.zeros([BLOCK_G], tl.int32)
            for _ in tl.static_range(TOPK_GROUP):  # the best groups, ties to the lower group
                open_score = tl.where((kept == 0) & (groups < N_GROUP), group_score, float("-inf"))
                best = tl.max(open_score, axis=0)
                pick = tl.min(tl.where((open_score == best) & (kept == 0) & (groups < N_GROUP), groups, BLOCK_G),
                              axis=0)
                kept = tl.where(groups == pick, 1, kept)
            keep = idx < 0
            for g in tl.static_range(N_GROUP):
                keep = keep | (((idx // size) == g) & (tl.sum(tl.where(groups == g, kept, 0), axis=0) > 0))
            score = tl.where(keep, score, float("-inf"))
        rank = tl.full([BLOCK_E], -1, tl.int32)
        total = 0.0
        for j in tl.static_range(K):  # highest score, then lowest index; the weights' sum in this order
            best = tl.max(score, axis=0)
            pick = tl.min(tl.where(score == best, idx, BLOCK_E), axis=0)
            chosen = idx == pick
            rank = tl.where(chosen, j, rank)
            total = total + tl.sum(tl.where(chosen, sig, 0.0), axis=0)
            score = tl.where(chosen, float("-inf"), score)
        picked = rank >= 0
        w = sig
        if RENORMALISE:
            w = w / (total + 1e-20)
        w32 = (w * scale).to(tl.float32)
        slots = tl.load(slot_ptr + idx, mask=picked, other=0)
        tl.store(experts_ptr + d * K + rank, idx.to(tl.int64), mask=picked)
        tl.store(route_ptr + d * 2 * K + rank, slots, mask=picked)
        tl.store(route_ptr + d * 2 * K + K + rank, w32.to(tl.int32, bitcast=True), mask=picked)

    @triton.jit
    def _route_resident_kernel(z_ptr, z_stride, slot_ptr, experts_ptr, route_ptr, scale, E: tl.constexpr,
                               BLOCK_E: tl.constexpr, K: tl.constexpr, RENORMALISE: tl.constexpr,
                               PDL: tl.constexpr = False):
        enter(PDL)
        d = tl.program_id(0)
        idx = tl.arange(0, BLOCK_E)
        valid = idx < E
        z = tl.load(z_ptr + d * z_stride + idx, mask=valid, other=0.0).to(tl.float32) + 0.0  # -0.0 ties +0.0
        bits = z.to(tl.int32, bitcast=True)
        monotone = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)
        lowest = -9223372036854775807 - 1
        key = tl.where(valid, (monotone << 32) + (E - 1 - idx).to(tl.int64), lowest)
        rank = tl.full([BLOCK_E], -1, tl.int32)
        for j in tl.static_range(K):
            best = tl.max(key, axis=0)
            chosen = key == best
            rank = tl.where(chosen, j, rank)
            key = tl.where(chosen, lowest, key)
        z64 = z.to(tl.float64)
        zmax = tl.max(tl.where(valid, z64, float("-inf")), axis=0)
        p = tl.where(valid, tl.exp(z64 - zmax), 0.0)
        w = p / tl.sum(p, axis=0)
        picked = rank >= 0
        if RENORMALISE:
            w = w / tl.sum(tl.where(picked, w, 0.0), axis=0)
        w32 = (w * scale).to(tl.float32)
        slots = tl.load(slot_ptr + idx, mask=picked, other=0)
        tl.store(experts_ptr + d * K + rank, idx.to(tl.int64), mask=picked)
        tl.store(route_ptr + d * 2 * K + rank, slots, mask=picked)
        tl.store(route_ptr + d * 2 * K + K + rank, w32.to(tl.int32, bitcast=True), mask=picked)


def route_resident_triton(z: torch.Tensor, top_k: int, renormalise: bool, scale: float, slot_of: torch.Tensor,
                          experts_out: torch.Tensor, route_out: torch.Tensor) -> None:
    """`route_resident` in one launch; z [D, E] float32 with unit stride along E (rows may be strided)."""
    num_positions, num_experts = z.shape
    if z.stride(1) != 1 or not route_out.is_contiguous() or not experts_out.is_contiguous():
        raise ValueError("route_resident_triton needs z rows of unit stride and contiguous outputs")
    _route_resident_kernel[(num_positions,)](
        z, z.stride(0), slot_of, experts_out, route_out, float(scale), E=num_experts,
        BLOCK_E=triton.next_power_of_2(num_experts), K=top_k, RENORMALISE=bool(renormalise), num_warps=1, **pdl.options(z))


def route_sigmoid_triton(z: torch.Tensor, top_k: int, scoring, bias: torch.Tensor, slot_of: torch.Tensor,
                         experts_out: torch.Tensor, route_out: torch.Tensor) -> None:
    """`route_sigmoid_torch` in one launch (module docstring); z [D, E] float32 with unit stride along E, bias
    the layer's row [E] float64."""
    num_positions, num_experts = z.shape
    if z.stride(1) != 1 or not route_out.is_contiguous() or not experts_out.is_contiguous() \
            or not bias.is_contiguous():
        raise ValueError("route_sigmoid_triton needs z rows of unit stride and contiguous bias and outputs")
    n_group, topk_group = scoring.n_group, scoring.topk_group
    _route_sigmoid_kernel[(num_positions,)](
        z, z.stride(0), bias, slot_of, experts_out, route_out, float(scoring.scale), E=num_experts,
        BLOCK_E=triton.next_power_of_2(num_experts), K=top_k, RENORMALISE=bool(scoring.renormalise),
        N_GROUP=n_group, TOPK_GROUP=topk_group, BLOCK_G=triton.next_power_of_2(n_group), num_warps=1, **pdl.options(z))
