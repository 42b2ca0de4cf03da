"""Block-wise FP8 experts: the quantisation format, and the FP8 row of the expert store and the slot buffers.

The format is the one DeepSeek-V3's and Qwen's FP8 checkpoints ship (transformers' fine-grained FP8): a weight
[R, C] is stored as float8 e4m3 values q [R, C] and a float32 inverse scale per block of FP8_BLOCK x FP8_BLOCK
elements, `weight_scale_inv` [ceil(R / B), ceil(C / B)]; the weight is

    w[r, c] = float(q[r, c]) * scale_inv[r // B, c // B]

An FP8 expert row (uint8, `fp8_row_layout`) holds one whole expert, so one copy still moves one expert:

    [gate q (I x H) | up q (I x H) | down q (H x I) | pad to 16 bytes |
     gate scale_inv [nI, nH] | up scale_inv [nI, nH] | down scale_inv [nH, nI] (float32) | pad to 16 bytes]

with nI = ceil(I / B), nH = ceil(H / B): the bf16 row's element order, one byte per weight, then the block
scales (for Qwen3.6's experts 3 MiB + 768 bytes, against 6 MiB in bf16). The slot MoE kernels read this row
and dequantise on the fly to the model dtype: each weight is rounded to the model dtype exactly as
`dequantize_fp8` rounds it, so an FP8 slot buffer computes what the bf16 kernels compute over the
dequantised weights.

`quantize_fp8` (the checkpoint converter's and the FP8 store's quantiser) rounds each inverse scale up to a
power of two (as the ue8m0 scale format does): then every dequantised weight is exact in bf16 and in float32,
and quantising dequantised weights again gives back the same weights, so a model loaded dequantised and the
FP8 store made from it agree exactly.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

FP8_BLOCK = 128  # the block edge B of the shipped checkpoints' weight_block_size [128, 128]
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3 value


class Fp8Row(NamedTuple):
    """Byte offsets of one FP8 expert row (module doc): the scales start at `scale_offset`; `gate_blocks` =
    (nI, nH) is the block grid of gate and of up, down's is (nH, nI); `width` is the row's bytes."""

    scale_offset: int
    gate_blocks: tuple[int, int]
    num_scales: int
    width: int


def _align16(n: int) -> int:
    return (n + 15) // 16 * 16


def fp8_row_layout(hidden: int, inter: int) -> Fp8Row:
    """The FP8 row of an expert with hidden size H and expert width I (module doc)."""
    n_i, n_h = -(-inter // FP8_BLOCK), -(-hidden // FP8_BLOCK)
    offset = _align16(3 * inter * hidden)
    return Fp8Row(offset, (n_i, n_h), 3 * n_i * n_h, _align16(offset + 4 * 3 * n_i * n_h))


def is_fp8_rows(rows: torch.Tensor) -> bool:
    """Whether a store or slot-buffer tensor holds FP8 rows (uint8) rather than rows in the model dtype."""
    return rows.dtype == torch.uint8


def _blocks(t: torch.Tensor) -> torch.Tensor:
    """[..., R, C] -> [..., nR, B, nC, B] zero-padded to whole blocks."""
    r, c = t.shape[-2:]
    pr, pc = -r % FP8_BLOCK, -c % FP8_BLOCK
    t = torch.nn.functional.pad(t, (0, pc, 0, pr))
    return t.reshape(*t.shape[:-2], (r + pr) // FP8_BLOCK, FP8_BLOCK, (c + pc) // FP8_BLOCK, FP8_BLOCK)


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q float8 e4m3 [..., R, C], scale_inv float32 [..., nR, nC]) of a weight [..., R, C]: per block the
    smallest power-of-two inverse scale that maps the block's largest magnitude to at most FP8_MAX (an
    all-zero block gets 1)."""
    r, c = weight.shape[-2:]
    blocks = _blocks(weight.float())
    amax = blocks.abs().amax(dim=(-3, -1))
    scale_inv = torch.where(amax > 0, torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX))), torch.ones_like(amax))
    q = (blocks / scale_inv[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.reshape(*q.shape[:-4], q.shape[-4] * FP8_BLOCK, q.shape[-2] * FP8_BLOCK)[..., :r, :c]
    return q.contiguous(), scale_inv.float().contiguous()


def dequantize_fp8(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight [..., R, C] of FP8 values q and block inverse scales [..., nR, nC] (module doc), computed in
    float32 and rounded once to `dtype`."""
    r, c = q.shape[-2:]
    scale = scale_inv.float().repeat_interleave(FP8_BLOCK, -2).repeat_interleave(FP8_BLOCK, -1)[..., :r, :c]
    return (q.float() * scale).to(dtype)


def check_scale_grid(shape: tuple, scale_shape: tuple) -> str | None:
    """None if `scale_shape` is the block grid of a weight of `shape` at FP8_BLOCK, else why not."""
    want = (*shape[:-2], -(-shape[-2] // FP8_BLOCK), -(-shape[-1] // FP8_BLOCK))
    if tuple(scale_shape) != want:
        return (f"inverse scales of shape {tuple(scale_shape)}, expected {want} (block {FP8_BLOCK} x {FP8_BLOCK}, "
                "the only FP8 block size the expert rows hold)")
    return None


def pack_fp8_row(row: torch.Tensor, hidden: int, inter: int, parts) -> None:
    """Write one expert's ((gate q, gate scale_inv), (up q, up s), (down q, down s)) into the uint8 row."""
    lay = fp8_row_layout(hidden, inter)
    size = inter * hidden
    scales = row[lay.scale_offset: lay.scale_offset + 4 * lay.num_scales].view(torch.float32)
    n = lay.gate_blocks[0] * lay.gate_blocks[1]
    for i, (q, s) in enumerate(parts):
        row[i * size:(i + 1) * size].copy_(q.reshape(-1).view(torch.uint8))
        scales[i * n:(i + 1) * n].copy_(s.reshape(-1))


def unpack_fp8_rows(rows: torch.Tensor, hidden: int, inter: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The dequantised (gate_up [N, 2I, H], down [N, H, I]) in `dtype` of FP8 rows [N, width] (uint8)."""
    lay = fp8_row_layout(hidden, inter)
    n_rows, size = rows.shape[0], inter * hidden
    n_i, n_h = lay.gate_blocks
    q = rows[:, :3 * size].view(FP8_DTYPE)
    s = rows[:, lay.scale_offset: lay.scale_offset + 4 * lay.num_scales].view(torch.float32)
    gate = dequantize_fp8(q[:, :size].view(n_rows, inter, hidden), s[:, :n_i * n_h].view(n_rows, n_i, n_h), dtype)
    up = dequantize_fp8(q[:, size:2 * size].view(n_rows, inter, hidden),
                        s[:, n_i * n_h:2 * n_i * n_h].view(n_rows, n_i, n_h), dtype)
    down = dequantize_fp8(q[:, 2 * size:].view(n_rows, hidden, inter), s[:, 2 * n_i * n_h:].view(n_rows, n_h, n_i),
                          dtype)
    return torch.cat([gate, up], dim=1), down


def fp8_rows_of(gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """FP8 rows [N, width] (uint8) of experts given as gate_up [N, 2I, H] and down [N, H, I] (quantised with
    `quantize_fp8`): tests, benchmarks and the store's `from_model`."""
    n, two_i, hidden = gate_up.shape
    inter = two_i // 2
    rows = torch.zeros(n, fp8_row_layout(hidden, inter).width, dtype=torch.uint8)
    for e in range(n):
        pack_fp8_row(rows[e], hidden, inter, (quantize_fp8(gate_up[e, :inter]), quantize_fp8(gate_up[e, inter:]),
                                              quantize_fp8(down[e])))
    return rows
