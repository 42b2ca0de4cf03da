"""Grouped slot-indexed MoE for the D positions of a step: each distinct slot's expert is read once per layer.

A verification block sends D = k + 1 positions through a layer at once, each routed to K slots of the layer's
slot buffer [C, W] (row = [gate (I x H) | up (I x H) | down (H x I)]); positions of a block share many
experts. The per-token kernel (`moe.slot_moe_triton`) run once per position reads a shared expert once per
position that uses it; this one reads it once for all of them. For every position i it computes

    out_i = residual_i + sum_j w_ij * down_{s_ij}(silu(gate_{s_ij} x_i) * up_{s_ij} x_i)

with the per-token kernel's rounding points: gate and up projections rounded to the model dtype, silu(gate)
rounded, times up, rounded (the activation); the down projection rounded, times the rounded weight, rounded;
those K terms summed in float32 in route order j = 0 .. K - 1, plus the residual, rounded once.

Four launches (six with late slots, below), all of static shape for a given D and slot buffer (a CUDA graph
captures them; nothing is read on the host, so the number of distinct slots is never known there):
1. grouping, one program: which of the C slots the D * K (position, slot) pairs of `route` use, compacted in
   ascending order into `groups` [G], G = min(D * K, C); entries past the n distinct slots are -1. (A
   counting pass over the slots, not a sort: within a group the positions are simply the rows of a tile.)
2. gate/up, grid (G, I / BLOCK_N, D / BLOCK_M): program (g, n, m) takes slot groups[g] (exits if -1) and the
   positions of chunk m routed to it (found by comparing the route rows with the slot; exits if none), and
   computes their activations for its BLOCK_N rows as one [BLOCK_M, H] x [H, BLOCK_N] product per
   projection (tl.dot, float32 accumulation): the weight rows are loaded once for all those positions. The
   activation of pair (i, j) goes to the scratch `act` [D, K, I] at the first j of position i on that slot.
3. down, grid (G, H / BLOCK_H, D / BLOCK_M): likewise y = act @ down^T, rounded, written to the scratch `y`
   [D, K, H] at every pair (i, j) on that slot.
4. combine, grid (D, H / BLOCK_C): out_i = residual_i + sum_j round(y_ij * round(w_ij)) in j order, exactly
   the per-token kernel's combine; grouping by slot changes no summation order over experts.
With late slots (`late=(first, wait)`: slots first .. C - 1 are being written by copies on another stream, the
speculative engine's demand copies) launches 2 and 3 run over the slots below `first`, then `wait()` joins the
copies, then 2 and 3 run over the late slots: the experts already resident compute while the missing ones arrive.
Each pair's activation and output come from the same program in either case (same bits).
The tile products sum each dot product in another order than the per-token kernel's elementwise sums
(tensor-core tiles vs. tl.sum), so the two agree to float32 accumulation noise before the same roundings:
occasionally one unit in the last place of the model dtype, not bitwise (bitwise wherever the dot products
are exact, as the tests check). Slot ids must lie in [0, C); a position may repeat a slot (its pairs then
share one activation, as they would share the value).

FP8 slot buffers (uint8 rows, `specmoe.kernels.fp8`): both weight kernels dequantise each loaded tile with its
block scales and round it to the model dtype before tl.dot, so they compute what they compute over the
dequantised weights.

`slot_moe_grouped_torch` is the reference and the CPU path: `moe.slot_moe_torch` once per position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import pdl
from .fp8 import is_fp8_rows
from .moe import compute_dtype, fp8_kernel_args, slot_moe_torch
from .tuning import LaunchChoice, device_identity, dtype_name, fastest, launch_params, next_pow2

try:  # Triton is optional: CPU machines run the torch reference
    import triton
    import triton.language as tl

    from .moe import fp8_weights
    from .pdl import enter
except ImportError:  # pragma: no cover - depends on the environment
    triton = None

# Launch parameters (block_m is chosen from D unless given: positions per tile, 16 .. 64): the gate/up kernel's
# (block_n, block_k, warps, stages, swap) and the down kernel's (block_h, block_k2, warps2, stages2, swap2) are
# chosen apart (swap: the weight rows as the tile product's M, `_tile_dot`). On CUDA `grouped_launch_params` picks
# the fastest of GATE_UP_CANDIDATES and of DOWN_CANDIDATES once per device and shape (`tune_grouped_moe`, each
# kernel timed alone). The defaults (tune=False, or off CUDA) were the fastest one choice for both kernels on the
# H200 at D = 9 and 17 at OLMoE's size (scripts/bench_grouped_moe.py --tune).
GROUPED_DEFAULTS = dict(block_n=64, block_k=128, warps=4, stages=3, swap=0, block_h=64, block_k2=128, warps2=4,
                        stages2=3, swap2=0, block_c=256)
# the fastest tiles of a sweep of 60 per kernel on the H200 (D = 17, scripts/sweep_grouped_moe.py; BENCHMARKS.md,
# 2026-12-03) and smaller ones, which give more programs where a block's layer reads few distinct experts; then
# swapped tiles (64 or 128 weight rows on 4 or 8 warps: Hopper's warpgroup product at D = 9 and 17, where the
# others run on mma.sync), those that compile for sm_90 without spills at D <= 17 (scripts/kernel_registers.py)
GATE_UP_CANDIDATES = tuple(dict(block_n=n, block_k=k, warps=w, stages=st, swap=sw) for n, k, w, st, sw in (
    (64, 128, 4, 3, 0), (64, 64, 4, 4, 0), (32, 128, 2, 3, 0), (32, 128, 4, 3, 0), (32, 64, 4, 4, 0),
    (16, 128, 2, 4, 0), (16, 128, 2, 3, 0), (16, 256, 4, 3, 0),
    (64, 128, 4, 3, 1), (64, 64, 4, 4, 1), (64, 64, 8, 4, 1), (128, 64, 8, 4, 1)))
DOWN_CANDIDATES = tuple(dict(block_h=n, block_k2=k, warps2=w, stages2=st, swap2=sw) for n, k, w, st, sw in (
    (64, 128, 4, 3, 0), (64, 64, 4, 4, 0), (32, 128, 2, 3, 0), (32, 128, 4, 3, 0), (32, 64, 4, 4, 0),
    (64, 256, 4, 3, 0), (16, 128, 2, 4, 0), (16, 256, 4, 3, 0),
    (64, 128, 4, 3, 1), (64, 64, 4, 4, 1), (128, 64, 8, 4, 1), (128, 128, 8, 3, 1)))
# every pairing: what a tuning cache entry may name
GROUPED_CANDIDATES = tuple({**up, **down} for up in GATE_UP_CANDIDATES for down in DOWN_CANDIDATES)
# The tuner's routes share experts as a trained model's verification blocks do: a Zipf-like popularity of exponent
# 3 over 64 slots gives 20.6 distinct experts per layer at D = 17 and 16.9 at D = 9, where the olmoe-like routing
# source's blocks read 20.1 and 18.0 (scripts/profile_blocks.py). The number of distinct experts sets how many
# programs the kernels have, hence which tiles fill the chip.
TUNE_ZIPF = 3.0
TUNE_ROUTES = 4  # routes the tuner's graph cycles through (each its own ranking: less reuse of experts in L2)
_OPTIONS = frozenset(GROUPED_DEFAULTS) | {"block_m"}


def default_block_m(num_positions: int) -> int:
    """Positions per tile: D rounded up to a power of two, at least 16 (tl.dot's minimum), at most 64."""
    return min(64, max(16, next_pow2(num_positions)))


@dataclass
class GroupedMoEWorkspace:
    """Scratch of one (D, K, H, I, dtype): the compacted distinct slots `groups` [D * K] int32, the activations
    `act` [D, K, I] and the weighted-sum inputs `y` [D, K, H] in the model dtype. Made once per step shape
    (`make_grouped_workspace`) and reused by every call; G = min(D * K, C) entries of `groups` are used."""

    num_positions: int
    top_k: int
    hidden: int
    inter: int
    groups: torch.Tensor
    act: torch.Tensor
    y: torch.Tensor


def make_grouped_workspace(num_positions: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype,
                           device) -> GroupedMoEWorkspace:
    if min(num_positions, top_k, hidden, inter) < 1:
        raise ValueError("num_positions, top_k, hidden and inter must be positive")
    d, k = num_positions, top_k
    return GroupedMoEWorkspace(d, k, hidden, inter, torch.full((d * k,), -1, dtype=torch.int32, device=device),
                               torch.zeros(d, k, inter, dtype=dtype, device=device),
                               torch.zeros(d, k, hidden, dtype=dtype, device=device))


def _check_inputs(x, residual, slot_buf, route, out, hidden, inter, ws: GroupedMoEWorkspace | None) -> None:
    """Shapes, dtypes, devices and layout; nothing read from the device (safe during graph capture)."""
    if x.dim() != 2 or x.shape[1] != hidden:
        raise ValueError(f"x must be [D, H={hidden}], got {tuple(x.shape)}")
    d = x.shape[0]
    for name, t in (("residual", residual), ("out", out)):
        if t.shape != x.shape or t.dtype != x.dtype or t.device != x.device:
            raise ValueError(f"{name} must be [{d}, {hidden}] {x.dtype} on {x.device} like x, got "
                             f"{tuple(t.shape)} {t.dtype} on {t.device}")
    if route.dim() != 2 or route.shape[0] != d or route.shape[1] % 2 or route.dtype != torch.int32:
        raise ValueError(f"route must be int32 [D={d}, 2K], got {tuple(route.shape)} {route.dtype}")
    if route.device != x.device or slot_buf.device != x.device:
        raise ValueError("x, route and the slot buffer must be on one device")
    if slot_buf.dim() != 2 or slot_buf.shape[1] < 3 * hidden * inter or \
            not (slot_buf.dtype == x.dtype or is_fp8_rows(slot_buf)):
        raise ValueError(f"the slot buffer must be [C, >= 3 * H * I] in x's dtype or FP8 rows (uint8), got "
                         f"{tuple(slot_buf.shape)} {slot_buf.dtype}")
    if not all(t.is_contiguous() for t in (x, residual, route, out)) or slot_buf.stride(1) != 1:
        raise ValueError("x, residual, route and out must be contiguous, and the slot buffer's rows too")
    if ws is not None:
        shape = (ws.num_positions, ws.top_k, ws.hidden, ws.inter)
        if shape != (d, route.shape[1] // 2, hidden, inter):
            raise ValueError(f"the workspace is for (D, K, H, I) = {shape}, the call is "
                             f"{(d, route.shape[1] // 2, hidden, inter)}")
        if ws.act.dtype != x.dtype or ws.act.device != x.device:
            raise ValueError(f"the workspace holds {ws.act.dtype} on {ws.act.device}, x is {x.dtype} on {x.device}")


def slot_moe_grouped_torch(x: torch.Tensor, residual: torch.Tensor, slot_buf: torch.Tensor, route: torch.Tensor,
                           out: torch.Tensor, hidden: int, inter: int,
                           workspace: GroupedMoEWorkspace | None = None) -> torch.Tensor:
    """Reference: `slot_moe_torch` for each position i (x [D, H], residual and out [D, H], route [D, 2K]);
    out may alias residual. Uses the workspace's `act` as the per-position activation buffer if given."""
    _check_inputs(x, residual, slot_buf, route, out, hidden, inter, workspace)
    top_k = route.shape[1] // 2
    for i in range(x.shape[0]):
        act = workspace.act[i] if workspace is not None else torch.empty(top_k, inter, dtype=x.dtype,
                                                                          device=x.device)
        slot_moe_torch(x[i], residual[i], slot_buf, route[i], act, out[i], hidden, inter)
    return out


if triton is not None:

    @triton.jit
    def _group_slots_kernel(route_ptr, groups_ptr, P: tl.constexpr, K: tl.constexpr, C: tl.constexpr,
                            C_PAD: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_P: tl.constexpr,
                            PDL: tl.constexpr = False):
        """groups[0 .. n) = the n distinct slots of the P = D * K pairs, ascending; groups[n .. G) = -1."""
        enter(PDL)
        c = tl.arange(0, C_PAD)
        used = tl.zeros([C_PAD], dtype=tl.int32)
        for p0 in tl.static_range(0, P, BLOCK_P):
            p = p0 + tl.arange(0, BLOCK_P)
            s = tl.load(route_ptr + (p // K) * (2 * K) + p % K, mask=p < P, other=-1)
            used = tl.maximum(used, tl.max((s[None, :] == c[:, None]).to(tl.int32), axis=1))
        used = tl.where(c < C, used, 0)
        index = tl.cumsum(used, axis=0) - 1
        tl.store(groups_ptr + index, c, mask=(used > 0) & (index < G))
        n = tl.sum(used, axis=0)
        g = tl.arange(0, G_PAD)
        tl.store(groups_ptr + g, tl.full([G_PAD], -1, tl.int32), mask=(g >= n) & (g < G))

    @triton.jit
    def _first_pair(route_ptr, slot, pos, D: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr):
        """For each position of `pos`, the first j with route[pos, j] == slot, else K."""
        first = tl.full([BLOCK_M], K, tl.int32)
        for jj in tl.static_range(K):
            j = K - 1 - jj
            s = tl.load(route_ptr + pos * (2 * K) + j, mask=pos < D, other=-1)
            first = tl.where(s == slot, j, first)
        return first

    @triton.jit
    def _tile_dot(a, w, acc, SWAP: tl.constexpr, PRECISION: tl.constexpr):
        """acc + a @ w for a [BLOCK_M, BLOCK_K] tile of positions and w [BLOCK_K, BLOCK_N] of weight rows; with
        SWAP the accumulator is [BLOCK_N, BLOCK_M] and the product w^T @ a^T: the weight rows are the product's
        M, so at any number of positions the tile can fill Hopper's 64-row warpgroup product (wgmma), where
        BLOCK_M positions as M (16 or 32 at D = 9 or 17) run on the older per-warp mma.sync."""
        if SWAP:
            acc = tl.dot(tl.trans(w), tl.trans(a), acc, input_precision=PRECISION)
        else:
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
        return acc

    @triton.jit
    def _tile_zeros(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWAP: tl.constexpr):
        """`_tile_dot`'s float32 accumulator: [BLOCK_M, BLOCK_N], or [BLOCK_N, BLOCK_M] with SWAP."""
        if SWAP:
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        return acc

    @triton.jit
    def _tile_result(acc, SWAP: tl.constexpr):
        """`_tile_dot`'s accumulator as [BLOCK_M, BLOCK_N] (positions, weight rows)."""
        if SWAP:
            acc = tl.trans(acc)
        return acc

    # the slot range is a runtime value, not specialised: one compiled kernel for both phases (a graph capture
    # must not meet a new compile)
    @triton.jit(do_not_specialize=["slot_lo", "slot_hi"])
    def _grouped_gate_up_kernel(x_ptr, buf_ptr, route_ptr, groups_ptr, act_ptr, slot_lo, slot_hi, D: tl.constexpr,
                                K: tl.constexpr, H: tl.constexpr, I: tl.constexpr, W: tl.constexpr,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                PRECISION: tl.constexpr, FP8: tl.constexpr, SOFF: tl.constexpr, NI: tl.constexpr,
                                NH: tl.constexpr, B: tl.constexpr, SWAP: tl.constexpr = False,
                                PDL: tl.constexpr = False):
        """act[i, first j on slot, rows] = silu(gate x_i) * (up x_i) for the positions i of this chunk on this
        program's slot (if in [slot_lo, slot_hi)), rows of this program."""
        enter(PDL)
        slot = tl.load(groups_ptr + tl.program_id(0))
        if (slot < slot_lo) | (slot >= slot_hi):
            return  # fewer distinct slots than programs (-1), or a slot of the other phase
        pos = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
        first = _first_pair(route_ptr, slot, pos, D, K, BLOCK_M)
        on_slot = first < K
        if tl.max(on_slot.to(tl.int32), axis=0) == 0:
            return  # no position of this chunk uses the slot
        dt = act_ptr.dtype.element_ty
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < I
        base = buf_ptr + slot.to(tl.int64) * W
        scales = (base + SOFF).to(tl.pointer_type(tl.float32))  # FP8 rows only
        acc_g = _tile_zeros(BLOCK_M, BLOCK_N, SWAP)
        acc_u = _tile_zeros(BLOCK_M, BLOCK_N, SWAP)
        for k0 in range(0, H, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            cmask = cols < H
            xt = tl.load(x_ptr + pos[:, None] * H + cols[None, :], mask=on_slot[:, None] & cmask[None, :], other=0.0)
            m2 = cmask[:, None] & rmask[None, :]
            wg = tl.load(base + rows[None, :] * H + cols[:, None], mask=m2, other=0.0)  # gate^T tile [BLOCK_K, BLOCK_N]
            wu = tl.load(base + (rows[None, :] + I) * H + cols[:, None], mask=m2, other=0.0)
            if FP8:  # the tile's rows lie in one row block (BLOCK_N divides B): one scale per column block
                index = ((tl.program_id(1) * BLOCK_N) // B * NH + cols // B)[:, None]
                wg = fp8_weights(wg, scales, index, cmask[:, None]).to(dt)
                wu = fp8_weights(wu, scales + NI * NH, index, cmask[:, None]).to(dt)
            acc_g = _tile_dot(xt, wg, acc_g, SWAP, PRECISION)
            acc_u = _tile_dot(xt, wu, acc_u, SWAP, PRECISION)
        g = _tile_result(acc_g, SWAP).to(dt).to(tl.float32)
        u = _tile_result(acc_u, SWAP).to(dt).to(tl.float32)
        a = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32) * u  # as the per-token kernel
        tl.store(act_ptr + (pos[:, None] * K + first[:, None]) * I + rows[None, :], a.to(dt),
                 mask=on_slot[:, None] & rmask[None, :])

    # the slot range is a runtime value, not specialised: one compiled kernel for both phases (a graph capture
    # must not meet a new compile)
    @triton.jit(do_not_specialize=["slot_lo", "slot_hi"])
    def _grouped_down_kernel(act_ptr, buf_ptr, route_ptr, groups_ptr, y_ptr, slot_lo, slot_hi, D: tl.constexpr,
                             K: tl.constexpr,
                             H: tl.constexpr, I: tl.constexpr, W: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                             FP8: tl.constexpr, SOFF: tl.constexpr, NI: tl.constexpr, NH: tl.constexpr,
                             B: tl.constexpr, SWAP: tl.constexpr = False, PDL: tl.constexpr = False):
        """y[i, j, rows] = down(act_i) for every pair (i, j) of this chunk on this program's slot (if in
        [slot_lo, slot_hi))."""
        enter(PDL)
        slot = tl.load(groups_ptr + tl.program_id(0))
        if (slot < slot_lo) | (slot >= slot_hi):
            return
        pos = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
        first = _first_pair(route_ptr, slot, pos, D, K, BLOCK_M)
        on_slot = first < K
        if tl.max(on_slot.to(tl.int32), axis=0) == 0:
            return
        dt = y_ptr.dtype.element_ty
        rows = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        rmask = rows < H
        base = buf_ptr + slot.to(tl.int64) * W + 2 * I * H
        scales = (buf_ptr + slot.to(tl.int64) * W + SOFF).to(tl.pointer_type(tl.float32)) + 2 * NI * NH
        acc = _tile_zeros(BLOCK_M, BLOCK_H, SWAP)
        for k0 in range(0, I, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            cmask = cols < I
            a = tl.load(act_ptr + (pos[:, None] * K + first[:, None]) * I + cols[None, :],
                        mask=on_slot[:, None] & cmask[None, :], other=0.0)
            wd = tl.load(base + rows[None, :] * I + cols[:, None], mask=cmask[:, None] & rmask[None, :],
                         other=0.0)  # down^T tile [BLOCK_K, BLOCK_H]
            if FP8:
                wd = fp8_weights(wd, scales, ((tl.program_id(1) * BLOCK_H) // B * NI + cols // B)[:, None],
                                 cmask[:, None]).to(dt)
            acc = _tile_dot(a, wd, acc, SWAP, PRECISION)
        y = _tile_result(acc, SWAP).to(dt)
        for j in tl.static_range(K):  # every pair of the position on this slot (a repeated slot: each copy)
            s = tl.load(route_ptr + pos * (2 * K) + j, mask=pos < D, other=-1)
            tl.store(y_ptr + (pos[:, None] * K + j) * H + rows[None, :], y,
                     mask=(s == slot)[:, None] & rmask[None, :])

    @triton.jit
    def _combine_kernel(y_ptr, route_ptr, res_ptr, out_ptr, K: tl.constexpr, H: tl.constexpr,
                        BLOCK_C: tl.constexpr, PDL: tl.constexpr = False):
        """out[i, rows] = residual[i, rows] + sum_j round(y[i, j, rows] * round(w_ij)), j in order (the
        per-token kernel's combine)."""
        enter(PDL)
        i = tl.program_id(0)
        dt = out_ptr.dtype.element_ty
        rows = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        rmask = rows < H
        acc = tl.zeros([BLOCK_C], dtype=tl.float32)
        for j in tl.static_range(K):
            w = tl.load(route_ptr + i * (2 * K) + K + j).to(tl.float32, bitcast=True).to(dt).to(tl.float32)
            y = tl.load(y_ptr + (i * K + j) * H + rows, mask=rmask, other=0.0).to(tl.float32)
            acc += (y * w).to(dt).to(tl.float32)
        res = tl.load(res_ptr + i * H + rows, mask=rmask, other=0.0).to(tl.float32)
        tl.store(out_ptr + i * H + rows, (res + acc).to(dt), mask=rmask)


def grouped_params(num_positions: int, params: dict | None = None) -> dict:
    """The launch parameters of a call: GROUPED_DEFAULTS, block_m from D, then `params` (ValueError for an
    unknown option or a tile below tl.dot's 16)."""
    unknown = set(params or {}) - _OPTIONS
    if unknown:
        raise ValueError(f"unknown grouped MoE options {sorted(unknown)}; known: {sorted(_OPTIONS)}")
    p = {**GROUPED_DEFAULTS, "block_m": default_block_m(num_positions), **(params or {})}
    for key in ("block_m", "block_n", "block_k", "block_h", "block_k2"):
        if p[key] < 16 or p[key] & (p[key] - 1):
            raise ValueError(f"{key} must be a power of two >= 16, got {p[key]}")
    for key in ("swap", "swap2"):
        if p[key] not in (0, 1):
            raise ValueError(f"{key} must be 0 or 1, got {p[key]!r}")
    return p


def slot_moe_grouped_triton(x: torch.Tensor, residual: torch.Tensor, slot_buf: torch.Tensor, route: torch.Tensor,
                            out: torch.Tensor, hidden: int, inter: int, workspace: GroupedMoEWorkspace,
                            params: dict | None = None, late: tuple | None = None) -> torch.Tensor:
    """The Triton kernels (module doc) for x [D, H], residual and out [D, H] (out may alias residual), the
    slot buffer [C, W] and route [D, 2K] int32 on one device; workspace from `make_grouped_workspace` for
    (D, K, H, I). Allocates nothing and reads nothing on the host: captures into a CUDA graph.

    late = (first, wait): the slots from `first` on are still being written (copies in flight on another
    stream). The gate/up and down launches then run twice: over the slots below `first`, then, after `wait()`
    (which orders the copies before what the stream runs next), over the others; the combine last. Every pair's
    value comes from the same program either way, so the output is the same bits; the first half overlaps the
    copies."""
    _check_inputs(x, residual, slot_buf, route, out, hidden, inter, workspace)
    if triton is None:
        raise ImportError("slot_moe_grouped_triton needs Triton (pip install triton)")
    if late is not None and (not 0 <= late[0] <= slot_buf.shape[0] or not callable(late[1])):
        raise ValueError(f"late must be (first slot in [0, {slot_buf.shape[0]}], a callable), got {late!r}")
    p = grouped_params(x.shape[0], params)
    num_slots = slot_buf.shape[0]
    _launch_grouping(route, workspace, num_slots)
    phases = [(0, num_slots, False)] if late is None else [(0, late[0], False), (late[0], num_slots, True)]
    for lo, hi, after_copies in phases:
        if after_copies:
            late[1]()  # the late slots are written from here on
        if lo == hi:
            continue
        _launch_gate_up(x, slot_buf, route, workspace, lo, hi, p)
        _launch_down(slot_buf, route, workspace, lo, hi, p)
    _combine_kernel[(x.shape[0], triton.cdiv(hidden, p["block_c"]))](
        workspace.y, route, residual, out, K=route.shape[1] // 2, H=hidden, BLOCK_C=p["block_c"], num_warps=4,
        **pdl.options(workspace.y))
    return out


def _launch_grouping(route: torch.Tensor, ws: GroupedMoEWorkspace, num_slots: int) -> None:
    """Launch 1 (module doc): the distinct slots of `route` into ws.groups."""
    pairs = route.shape[0] * (route.shape[1] // 2)
    g, c_pad = min(pairs, num_slots), next_pow2(num_slots)
    _group_slots_kernel[(1,)](route, ws.groups, P=pairs, K=route.shape[1] // 2, C=num_slots, C_PAD=c_pad, G=g,
                              G_PAD=next_pow2(g), BLOCK_P=min(next_pow2(pairs), max(16, 8192 // c_pad)),
                              num_warps=4, **pdl.options(route))


def _weight_args(x_or_act: torch.Tensor, slot_buf: torch.Tensor, route: torch.Tensor, ws: GroupedMoEWorkspace,
                 p: dict) -> tuple[tuple, dict]:
    """The grid's first and third extents and the constants both weight kernels take."""
    d, top_k = route.shape[0], route.shape[1] // 2
    precision = "ieee" if x_or_act.dtype == torch.float32 else "tf32"  # tf32 is ignored for bf16/fp16 operands
    fp8 = fp8_kernel_args(slot_buf, ws.hidden, ws.inter, p["block_n"], p["block_h"])
    return ((min(d * top_k, slot_buf.shape[0]), triton.cdiv(d, p["block_m"])),
            dict(D=d, K=top_k, H=ws.hidden, I=ws.inter, W=slot_buf.stride(0), BLOCK_M=p["block_m"],
                 PRECISION=precision, **fp8))


def _launch_gate_up(x, slot_buf, route, ws: GroupedMoEWorkspace, lo: int, hi: int, p: dict) -> None:
    """Launch 2 (module doc) over the slots in [lo, hi), with the gate/up parameters of `p` (`grouped_params`)."""
    (g, m_chunks), const = _weight_args(x, slot_buf, route, ws, p)
    _grouped_gate_up_kernel[(g, triton.cdiv(ws.inter, p["block_n"]), m_chunks)](
        x, slot_buf, route, ws.groups, ws.act, lo, hi, **const, BLOCK_N=p["block_n"], BLOCK_K=p["block_k"],
        SWAP=bool(p["swap"]), num_warps=p["warps"], num_stages=p["stages"], **pdl.options(x))


def _launch_down(slot_buf, route, ws: GroupedMoEWorkspace, lo: int, hi: int, p: dict) -> None:
    """Launch 3 (module doc) over the slots in [lo, hi), with the down parameters of `p` (`grouped_params`)."""
    (g, m_chunks), const = _weight_args(ws.act, slot_buf, route, ws, p)
    _grouped_down_kernel[(g, triton.cdiv(ws.hidden, p["block_h"]), m_chunks)](
        ws.act, slot_buf, route, ws.groups, ws.y, lo, hi, **const, BLOCK_H=p["block_h"], BLOCK_K=p["block_k2"],
        SWAP=bool(p["swap2"]), num_warps=p["warps2"], num_stages=p["stages2"], **pdl.options(ws.act))


def slot_moe_grouped(x, residual, slot_buf, route, out, hidden, inter, workspace, backend: str = "torch",
                     params=None, late: tuple | None = None) -> torch.Tensor:
    """out = residual + MoE(x) for D positions; backend "triton" (the CPU without the Triton interpreter
    computes the reference) or "torch"; late as `slot_moe_grouped_triton`'s (the reference waits first)."""
    if backend == "triton" and (x.is_cuda or pdl.interpreting()):
        return slot_moe_grouped_triton(x, residual, slot_buf, route, out, hidden, inter, workspace, params, late)
    if late is not None:
        late[1]()
    return slot_moe_grouped_torch(x, residual, slot_buf, route, out, hidden, inter, workspace)


def zipf_routes(num_routes: int, num_positions: int, top_k: int, num_slots: int, exponent: float,
                generator: torch.Generator, device="cpu") -> torch.Tensor:
    """Routes [R, D, 2K] int32 whose positions share experts as a trained model's do: each position's K
    distinct slots drawn without replacement from a Zipf-like popularity (slot of rank r: 1 / (r + 1)^a, the
    ranking a random permutation per route; a = 0 is uniform), softmax execution weights."""
    routes = torch.zeros(num_routes, num_positions, 2 * top_k, dtype=torch.int32)
    ranks = torch.arange(1, num_slots + 1, dtype=torch.float64) ** -float(exponent)
    for r in range(num_routes):
        popularity = ranks[torch.randperm(num_slots, generator=generator)]
        routes[r, :, :top_k] = torch.multinomial(popularity.expand(num_positions, num_slots), top_k,
                                                 replacement=False, generator=generator).int()
        routes[r, :, top_k:].view(torch.float32)[:] = torch.softmax(
            torch.randn(num_positions, top_k, generator=generator), -1)
    return routes.to(device)


def grouped_moe_bytes(route: torch.Tensor, hidden: int, inter: int, itemsize: int) -> int:
    """Expert bytes the grouped kernel must read for `route` [D, 2K] (host-side, for benchmarks): distinct
    slots x 3 * H * I * itemsize (itemsize 1 for FP8 rows, whose scales add < 0.1%)."""
    top_k = route.shape[-1] // 2
    return int(torch.unique(route[:, :top_k].cpu()).numel()) * 3 * hidden * inter * itemsize


def tune_grouped_moe(slot_buf: torch.Tensor, num_positions: int, top_k: int, hidden: int, inter: int,
                     exponent: float = TUNE_ZIPF, seed: int = 0) -> tuple[dict, dict]:
    """Pick the fastest of GATE_UP_CANDIDATES and, apart, of DOWN_CANDIDATES for D = num_positions on this
    device (CUDA only): each weight kernel timed alone over TUNE_ROUTES Zipf-like routes (`zipf_routes`;
    TUNE_ZIPF: a trained model's blocks), launched back to back in a CUDA graph as the decoder's step runs them
    (`tuning.fastest`). Returns (params: one of GROUPED_CANDIDATES, {"gate_up i" / "down i": median ms per call});
    candidates that fail to compile are skipped."""
    device, dtype = slot_buf.device, compute_dtype(slot_buf)
    g = torch.Generator().manual_seed(seed)
    num_slots = slot_buf.shape[0]
    routes = zipf_routes(TUNE_ROUTES, num_positions, top_k, num_slots, exponent, g, device)
    x = torch.randn(num_positions, hidden, generator=g).to(device=device, dtype=dtype)
    spaces = [make_grouped_workspace(num_positions, top_k, hidden, inter, dtype, device) for _ in routes]
    for route, ws in zip(routes, spaces):
        _launch_grouping(route, ws, num_slots)

    up, up_ms = fastest(GATE_UP_CANDIDATES, lambda cand: [
        _launch_gate_up(x, slot_buf, route, ws, 0, num_slots, grouped_params(num_positions, cand))
        for route, ws in zip(routes, spaces)], "grouped Triton MoE (gate/up)", launches=len(spaces))
    down, down_ms = fastest(DOWN_CANDIDATES, lambda cand: [
        _launch_down(slot_buf, route, ws, 0, num_slots, grouped_params(num_positions, cand))
        for route, ws in zip(routes, spaces)], "grouped Triton MoE (down)", launches=len(spaces))
    times = {**{f"gate_up {i}": t for i, t in up_ms.items()}, **{f"down {i}": t for i, t in down_ms.items()}}
    return {**up, **down}, times


def grouped_launch_params(tune, slot_buf: torch.Tensor, num_positions: int, top_k: int, hidden: int,
                          inter: int) -> LaunchChoice:
    """The grouped kernel's launch parameters for D = num_positions on the slot buffer's device
    (`tuning.launch_params`: cached, tuned now with `tune_grouped_moe`, or GROUPED_DEFAULTS); the key holds
    the slot count C, which bounds the kernels' grid (G = min(D * K, C))."""
    shape = {"positions": num_positions, "top_k": top_k, "hidden": hidden, "inter": inter,
             "slots": slot_buf.shape[0], "dtype": dtype_name(slot_buf.dtype)}
    return launch_params(tune, "grouped_slot_moe", shape, device_identity(slot_buf.device), GROUPED_CANDIDATES,
                         GROUPED_DEFAULTS, lambda: tune_grouped_moe(slot_buf, num_positions, top_k, hidden, inter))


__all__ = ["DOWN_CANDIDATES", "GATE_UP_CANDIDATES", "GROUPED_CANDIDATES", "GROUPED_DEFAULTS", "TUNE_ZIPF",
           "GroupedMoEWorkspace", "default_block_m", "grouped_launch_params", "grouped_moe_bytes", "grouped_params",
           "make_grouped_workspace", "slot_moe_grouped", "slot_moe_grouped_torch", "slot_moe_grouped_triton",
           "tune_grouped_moe", "zipf_routes"]
