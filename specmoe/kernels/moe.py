"""Slot-indexed MoE for one token: the executed experts' weights are read from a slot buffer at slot ids.

The slot buffer of a layer is [C, W], one row per slot, each row one expert laid out as
[gate (I x H) | up (I x H) | down (H x I)] (the expert store's row layout, see `specmoe.offload.store`), in the
model dtype, or FP8 rows (uint8: the same weights in float8 e4m3 followed by their 128 x 128 block scales,
`specmoe.kernels.fp8`), which every path here dequantises on the fly to the model dtype (the dtype of x).
The routing of a token arrives in a small int32 device tensor `route` [2K]: K slot ids, then the K execution
weights as float32 bit patterns. `slot_moe` computes

    out = residual + sum_j w_j * down_j(silu(gate_j x) * up_j x)

with the rounding points of transformers' bf16 OLMoE experts (each projection's output and the weighted
expert output rounded to the model dtype; the sum over experts in float32). Each dot product is summed in a
fixed order (`row_sums`: a pairwise tree over each tile of columns, the tiles in order), not tl.sum's, whose
order follows the compiler's layout of the tile: over FP8 rows the layout differs from that over bf16 rows, so
the FP8 kernel would otherwise not compute bit for bit what the bf16 kernel computes on the dequantised rows.

Why our own kernel by default: at batch 1 the slot ids are written by the host-side routing step between the
two CUDA graphs of a layer, so the kernel must take them from a device tensor inside a captured graph with a
static launch shape and index a per-layer slot buffer whose rows are whole experts; no library kernel does
that. Two Triton launches suffice, and each selected expert's weights are read exactly once. The torch
fallback (index_select + bmm) serves the CPU and any device without Triton. vLLM's `fused_experts` is the
optional alternative (`slot_moe_vllm`); how it is called and what is unverified: docs/kernels.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import pdl
from .fp8 import FP8_BLOCK, fp8_row_layout, is_fp8_rows, unpack_fp8_rows
from .tuning import LaunchChoice, device_identity, dtype_name, fastest, launch_params, rotation

try:  # Triton is optional: CPU machines and CI run the torch path
    import triton
    import triton.language as tl

    from .pdl import enter
except ImportError:  # pragma: no cover - depends on the environment
    triton = None

# Default launch parameters, per kernel (tune=False, and off CUDA); on CUDA `moe_launch_params` picks the fastest of
# MOE_CANDIDATES once per device and shape (`specmoe.kernels.tuning`).
MOE_DEFAULTS = dict(block_n=16, block_k=256, block_h=16, block_k2=256, warps1=4, warps2=4)


def triton_available() -> bool:
    return triton is not None


def split_route(route: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The slot ids (int64) and execution weights (float32) held in a route row [2K] int32."""
    return route[:top_k].long(), route[top_k:].view(torch.float32)


def expert_weights(rows: torch.Tensor, hidden: int, inter: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up [N, 2I, H], down [N, H, I]) of expert rows [N, W]: views of rows in the model dtype, the
    weights dequantised to `dtype` of FP8 rows."""
    if is_fp8_rows(rows):
        return unpack_fp8_rows(rows, hidden, inter, dtype)
    n = rows.shape[0]
    return rows[:, : 2 * inter * hidden].view(n, 2 * inter, hidden), rows[:, 2 * inter * hidden:].view(n, hidden, inter)


def fp8_kernel_args(slot_buf: torch.Tensor, hidden: int, inter: int, *row_tiles: int) -> dict:
    """The Triton MoE kernels' FP8 constants for this slot buffer (FP8=False and zeros for rows in the model
    dtype): the scales' byte offset in a row, the block grid (NI, NH) and the block edge B. The kernels' weight
    tiles span `row_tiles` output rows each (powers of two), which must divide B: a tile's rows then share one
    row of scales, and only the scales along the reduction are gathered."""
    if not is_fp8_rows(slot_buf):
        return dict(FP8=False, SOFF=0, NI=1, NH=1, B=FP8_BLOCK)
    if any(FP8_BLOCK % t for t in row_tiles):
        raise ValueError(f"FP8 rows need weight tiles of at most {FP8_BLOCK} rows dividing {FP8_BLOCK}, got "
                         f"{list(row_tiles)}")
    lay = fp8_row_layout(hidden, inter)
    return dict(FP8=True, SOFF=lay.scale_offset, NI=lay.gate_blocks[0], NH=lay.gate_blocks[1], B=FP8_BLOCK)


def slot_moe_torch(x: torch.Tensor, residual: torch.Tensor, slot_buf: torch.Tensor, route: torch.Tensor,
                   act: torch.Tensor, out: torch.Tensor, hidden: int, inter: int) -> None:
    """Reference implementation: out = residual + MoE(x) over the slots in `route` (see module doc)."""
    top_k = route.numel() // 2
    slots, weights = split_route(route, top_k)
    gate_up, down = expert_weights(slot_buf.index_select(0, slots), hidden, inter, x.dtype)  # [K, 2I, H], [K, H, I]
    h = torch.bmm(gate_up, x.view(1, hidden, 1).expand(top_k, hidden, 1)).view(top_k, 2 * inter)
    gate, up = h.split(inter, dim=-1)
    act.copy_(F.silu(gate) * up)
    y = torch.bmm(down, act.unsqueeze(-1)).view(top_k, hidden)
    y = (y * weights.to(y.dtype)[:, None]).float().sum(0)
    out.copy_(residual.float() + y)


if triton is not None:

    @triton.jit
    def fp8_weights(w, scale_ptr, index, mask):
        """FP8 bytes w times their block scales at scale_ptr + index (broadcast over w; the per-token kernels
        pass a vector along the columns, so the scale load does not impose its layout on the tile), in float32 (callers
        round the result to the model dtype, as `fp8.dequantize_fp8` does)."""
        s = tl.load(scale_ptr + index, mask=mask, other=0.0)
        return w.to(tl.float8e4nv, bitcast=True).to(tl.float32) * s

    @triton.jit
    def row_sums(t, ROWS: tl.constexpr, COLS: tl.constexpr):
        """The sums of the rows of t [ROWS, COLS] (COLS a power of two) in float32, as a fixed pairwise tree:
        adjacent pairs first, then pairs of those, and so on. A sum of two is the same whichever way round,
        so the result does not depend on how the compiler spreads t over threads (tl.sum's order does: the
        FP8 kernels' tiles get another layout than the bf16 ones'); the tree's first levels stay inside a
        thread where it holds adjacent columns."""
        for level in tl.static_range(1, COLS.bit_length()):
            t = tl.sum(tl.reshape(t, (ROWS, COLS >> level, 2)), axis=2)
        return tl.reshape(t, (ROWS,))

    @triton.jit
    def _gate_up_act_kernel(x_ptr, buf_ptr, route_ptr, act_ptr, H: tl.constexpr, I: tl.constexpr,
                            W: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP8: tl.constexpr,
                            SOFF: tl.constexpr, NI: tl.constexpr, NH: tl.constexpr, B: tl.constexpr,
                            PDL: tl.constexpr = False):
        """act[j, n] = silu(gate_j[n] . x) * (up_j[n] . x) for the rows n of this program, expert j."""
        enter(PDL)
        j = tl.program_id(0)
        pid_n = tl.program_id(1)
        dt = act_ptr.dtype.element_ty
        slot = tl.load(route_ptr + j).to(tl.int64)
        base = buf_ptr + slot * W
        scales = (base + SOFF).to(tl.pointer_type(tl.float32))  # FP8 rows only
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < I
        acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            cmask = cols < H
            xv = tl.load(x_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
            m2 = rmask[:, None] & cmask[None, :]
            wg = tl.load(base + rows[:, None] * H + cols[None, :], mask=m2, other=0.0)
            wu = tl.load(base + (rows[:, None] + I) * H + cols[None, :], mask=m2, other=0.0)
            if FP8:  # this program's rows lie in one row block (BLOCK_N divides B): one scale per column block
                index = (pid_n * BLOCK_N) // B * NH + cols // B  # a vector, as x: the tile keeps its own layout
                wg = fp8_weights(wg, scales, index, cmask).to(dt)
                wu = fp8_weights(wu, scales + NI * NH, index, cmask).to(dt)
            acc_g += row_sums(wg.to(tl.float32) * xv[None, :], BLOCK_N, BLOCK_K)
            acc_u += row_sums(wu.to(tl.float32) * xv[None, :], BLOCK_N, BLOCK_K)
        g = acc_g.to(dt).to(tl.float32)
        u = acc_u.to(dt).to(tl.float32)
        a = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32) * u
        tl.store(act_ptr + j * I + rows, a.to(dt), mask=rmask)

    @triton.jit
    def _down_combine_kernel(act_ptr, buf_ptr, route_ptr, res_ptr, out_ptr, H: tl.constexpr, I: tl.constexpr,
                             W: tl.constexpr, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
                             FP8: tl.constexpr, SOFF: tl.constexpr, NI: tl.constexpr, NH: tl.constexpr,
                             B: tl.constexpr, PDL: tl.constexpr = False):
        """out[rows] = residual[rows] + sum_j w_j * (down_j[rows] . act_j) for this program's rows."""
        enter(PDL)
        pid = tl.program_id(0)
        dt = out_ptr.dtype.element_ty
        rows = pid * BLOCK_H + tl.arange(0, BLOCK_H)
        rmask = rows < H
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for j in tl.static_range(TOP_K):  # unrolled: the K slot loads and weight streams are independent
            slot = tl.load(route_ptr + j).to(tl.int64)
            w = tl.load(route_ptr + TOP_K + j).to(tl.float32, bitcast=True).to(dt).to(tl.float32)
            base = buf_ptr + slot * W + 2 * I * H
            scales = (buf_ptr + slot * W + SOFF).to(tl.pointer_type(tl.float32)) + 2 * NI * NH  # FP8 rows only
            acc_j = tl.zeros([BLOCK_H], dtype=tl.float32)
            for k0 in range(0, I, BLOCK_K):
                cols = k0 + tl.arange(0, BLOCK_K)
                cmask = cols < I
                a = tl.load(act_ptr + j * I + cols, mask=cmask, other=0.0).to(tl.float32)
                wd = tl.load(base + rows[:, None] * I + cols[None, :], mask=rmask[:, None] & cmask[None, :],
                             other=0.0)
                if FP8:
                    wd = fp8_weights(wd, scales, (pid * BLOCK_H) // B * NI + cols // B, cmask).to(dt)
                acc_j += row_sums(wd.to(tl.float32) * a[None, :], BLOCK_H, BLOCK_K)
            acc += (acc_j.to(dt).to(tl.float32) * w).to(dt).to(tl.float32)
        res = tl.load(res_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
        tl.store(out_ptr + rows, (res + acc).to(dt), mask=rmask)


def slot_moe_triton(x: torch.Tensor, residual: torch.Tensor, slot_buf: torch.Tensor, route: torch.Tensor,
                    act: torch.Tensor, out: torch.Tensor, hidden: int, inter: int, params: dict | None = None) -> None:
    """Triton implementation of `slot_moe_torch` (same arguments; `out` may alias `residual`)."""
    p = {**MOE_DEFAULTS, **(params or {})}
    top_k = route.numel() // 2
    width = slot_buf.shape[-1]
    fp8 = fp8_kernel_args(slot_buf, hidden, inter, p["block_n"], p["block_h"])
    grid1 = (top_k, triton.cdiv(inter, p["block_n"]))
    _gate_up_act_kernel[grid1](x, slot_buf, route, act, H=hidden, I=inter, W=width,
                               BLOCK_N=p["block_n"], BLOCK_K=p["block_k"], num_warps=p["warps1"], **fp8, **pdl.options(x))
    grid2 = (triton.cdiv(hidden, p["block_h"]),)
    _down_combine_kernel[grid2](act, slot_buf, route, residual, out, H=hidden, I=inter, W=width, TOP_K=top_k,
                                BLOCK_H=p["block_h"], BLOCK_K=p["block_k2"], num_warps=p["warps2"], **fp8, **pdl.options(x))


def load_fused_experts():
    """vLLM's `fused_experts`; an ImportError that names the package and the extra if it is missing."""
    try:
        from vllm.model_executor.layers.fused_moe import fused_experts
    except ImportError as exc:
        raise ImportError(f"moe='vllm' needs the vllm package, which could not be imported ({exc}); install it "
                          "with pip install 'specmoe[vllm]' or use moe='slot'") from exc
    return fused_experts


def slot_moe_vllm(x: torch.Tensor, residual: torch.Tensor, slot_buf: torch.Tensor, route: torch.Tensor,
                  out: torch.Tensor, hidden: int, inter: int, fused_experts) -> None:
    """`slot_moe_torch` through vLLM's fused_experts (see module doc; no `act` buffer: vLLM allocates its own
    intermediates); `out` may alias `residual`."""
    if is_fp8_rows(slot_buf):
        raise ValueError("moe='vllm' does not run FP8 expert rows; use moe='slot' (the Triton kernels dequantise "
                         "them on the fly)")
    top_k = route.numel() // 2
    num_slots = slot_buf.shape[0]
    w1 = slot_buf[:, : 2 * inter * hidden].view(num_slots, 2 * inter, hidden)  # [gate; up], no copy
    w2 = slot_buf[:, 2 * inter * hidden:].view(num_slots, hidden, inter)
    slots = route[:top_k].view(1, top_k)  # int32, as vLLM's own top-k emits them
    weights = route[top_k:].view(torch.float32).view(1, top_k)
    y = fused_experts(x.view(1, hidden), w1, w2, weights, slots)
    torch.add(residual, y.view(hidden), out=out)


def slot_moe(x, residual, slot_buf, route, act, out, hidden, inter, backend: str = "torch", params=None) -> None:
    """out = residual + MoE(x) over the slots and weights in `route`; backend "triton" or "torch"."""
    if backend == "triton":
        slot_moe_triton(x, residual, slot_buf, route, act, out, hidden, inter, params)
    else:
        slot_moe_torch(x, residual, slot_buf, route, act, out, hidden, inter)


MOE_CANDIDATES = (  # smaller row blocks = more programs in flight, which a batch-1 GEMV needs to fill the chip
    dict(block_n=16, block_k=256, block_h=16, block_k2=256, warps1=4, warps2=4),
    dict(block_n=8, block_k=512, block_h=8, block_k2=512, warps1=4, warps2=4),
    dict(block_n=8, block_k=1024, block_h=4, block_k2=1024, warps1=4, warps2=4),
    dict(block_n=4, block_k=1024, block_h=4, block_k2=1024, warps1=4, warps2=4),
    dict(block_n=16, block_k=256, block_h=8, block_k2=512, warps1=4, warps2=4),
    dict(block_n=4, block_k=512, block_h=2, block_k2=1024, warps1=2, warps2=2),
    dict(block_n=2, block_k=2048, block_h=2, block_k2=1024, warps1=4, warps2=2),
    dict(block_n=4, block_k=1024, block_h=8, block_k2=512, warps1=4, warps2=4),
)


def compute_dtype(slot_buf: torch.Tensor) -> torch.dtype:
    """The activations' dtype to tune a slot buffer's kernels with: its own, bfloat16 for FP8 rows."""
    return torch.bfloat16 if is_fp8_rows(slot_buf) else slot_buf.dtype


def tune_moe(slot_buf: torch.Tensor, top_k: int, hidden: int, inter: int, dtype: torch.dtype,
             seed: int = 0) -> tuple[dict, dict]:
    """Pick the fastest of MOE_CANDIDATES on this device for one layer's slot buffer (CUDA only): each candidate
    timed over a batch of tokens whose routes (K distinct slots each, seeded) rotate through the slots so that
    the batch reads past the L2 (`tuning.rotation`; every slot once before any is read again), launched back to
    back in a CUDA graph (`tuning.fastest`). Returns (params, {candidate index: median ms per token});
    candidates that fail to compile are skipped."""
    device = slot_buf.device
    num_slots = slot_buf.shape[0]
    g = torch.Generator().manual_seed(seed)
    tokens = rotation(top_k * slot_buf[0].numel() * slot_buf.element_size(), device, 64)
    cycle = torch.randperm(num_slots, generator=g)  # token r: the K slots from r K on, cyclically (distinct, K <= C)
    routes = torch.zeros(tokens, 2 * top_k, dtype=torch.int32)
    routes[:, :top_k] = cycle[(torch.arange(tokens)[:, None] * top_k + torch.arange(top_k)) % num_slots]
    routes[:, top_k:].view(torch.float32)[:] = 1.0 / top_k
    routes = routes.to(device)
    x = torch.randn(hidden, generator=g).to(device=device, dtype=dtype)
    res = torch.randn(hidden, generator=g).to(device=device, dtype=dtype)
    out = torch.empty_like(res)
    act = torch.empty(top_k, inter, device=device, dtype=dtype)

    def batch(cand):
        for route in routes:
            slot_moe_triton(x, res, slot_buf, route, act, out, hidden, inter, cand)

    return fastest(MOE_CANDIDATES, batch, "Triton MoE", launches=tokens)


def moe_launch_params(tune, slot_buf: torch.Tensor, top_k: int, hidden: int, inter: int) -> LaunchChoice:
    """The slot MoE kernel's launch parameters for this shape on the slot buffer's device (`tuning.launch_params`:
    cached, tuned now with `tune_moe`, or MOE_DEFAULTS). The key has no slot count: the launch does not
    depend on it."""
    shape = {"hidden": hidden, "inter": inter, "top_k": top_k, "dtype": dtype_name(slot_buf.dtype)}
    return launch_params(tune, "slot_moe", shape, device_identity(slot_buf.device), MOE_CANDIDATES, MOE_DEFAULTS,
                         lambda: tune_moe(slot_buf, top_k, hidden, inter, compute_dtype(slot_buf)))
