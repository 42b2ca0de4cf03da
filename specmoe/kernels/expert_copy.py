"""Copies of a device-written list of experts from the host expert store into a layer's slot buffer, as one Triton
launch that the GPU drives: the copy half of the device policy (`specmoe.engines.device_policy`).

The list is the device cache's demand or prefetch list (`DeviceCache.demand` / `DeviceCache.prefetch`): int64
[1 + 2N], the count n, then N expert ids (the first n valid), then their N slots. The kernel reads the count on
the device, so neither the host nor the launch depends on it: a fixed grid of `blocks` programs loops over the
n listed experts and, for each, over its row in chunks of `block` words, program p taking chunks p, p + blocks,
... A launch with n = 0 only reads the count. The launch therefore has one shape whatever the list holds and
captures into a CUDA graph.

On CUDA the source is the pinned host store read through unified virtual addressing: the GPU loads the host
rows over the link itself (no copy engine, no host call per copy). The grid is small on purpose: the programs
occupy SMs that the token's other kernels would use; `blocks` and `block` are launch parameters. The default,
32 programs of 1024 words, is `scripts/bench_expert_copy.py`'s choice on the H200 (BENCHMARKS.md): one 12.6 MB
expert at 45.7 GB/s (the copy engine 40.9, the earlier 8 x 1024 38.6), four at 50.1 (copy engine 54.2), 36.0
beside a bf16 GEMM that it slowed by 0.6%; fewer programs are slower, more or longer chunks no faster and cost
the GEMM up to 7.5%.

Rows are copied as words of the widest integer type that divides a row's bytes (int64 for every real model),
so a bf16 row and an FP8 row (its float8 weights followed by their float32 block scales, `kernels.fp8`) are
copied the same way, scales included, bit for bit. `copy_experts_torch` is the reference.
"""

from __future__ import annotations

import torch

from . import pdl
from .tuning import next_pow2

try:
    import triton
    import triton.language as tl

    from .pdl import enter
except ImportError:  # pragma: no cover - depends on the environment
    triton = None

COPY_BLOCKS = 32  # programs per launch (module docstring: measured)
COPY_BLOCK = 1024  # words per program and chunk (8 KiB of int64)
INTERPRETER_CHUNK = 1 << 16  # the most words per chunk in Triton's interpreter (`launch_shape`)


def launch_shape(device: torch.device, row_words: int) -> tuple[int, int]:
    """(programs, words per chunk) of the copy launches on `device` for rows of `row_words` words: the measured
    shape on CUDA; on the CPU, where only Triton's interpreter runs the kernel and every operation of every program
    is a NumPy call, one program whose chunk holds a whole row (at most 64 Ki words, 512 KiB of int64): the same
    words moved in a few calls per expert rather than a few per 8 KiB chunk and program. The shape changes neither
    what is copied nor where."""
    if torch.device(device).type != "cuda":
        return 1, min(next_pow2(row_words), INTERPRETER_CHUNK)
    return COPY_BLOCKS, COPY_BLOCK

if triton is not None:

    @triton.jit
    def _expert_copy_kernel(src_ptr, dst_ptr, list_ptr, ROW, MAX_N: tl.constexpr, BLOCK: tl.constexpr,
                            BLOCKS: tl.constexpr, PDL: tl.constexpr = False):
        enter(PDL)
        pid = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        n = tl.load(list_ptr)
        for j in range(n):
            expert = tl.load(list_ptr + 1 + j)  # int64: expert * ROW does not overflow
            slot = tl.load(list_ptr + 1 + MAX_N + j)
            src = src_ptr + expert * ROW
            dst = dst_ptr + slot * ROW
            for start in range(pid * BLOCK, ROW, BLOCKS * BLOCK):
                at = start + offs
                inside = at < ROW
                words = tl.load(src + at, mask=inside, eviction_policy="evict_first")
                tl.store(dst + at, words, mask=inside)


def word_view(rows: torch.Tensor) -> torch.Tensor:
    """rows [N, W] (contiguous) as [N, W'] words of the widest of int64 / int32 / int16 / uint8 that divides a
    row's bytes; the same storage (a pinned tensor stays pinned)."""
    if rows.dim() != 2 or not rows.is_contiguous():
        raise ValueError(f"expert rows must be a contiguous [N, W] tensor, got {tuple(rows.shape)}")
    row_bytes = rows.shape[1] * rows.element_size()
    for dtype in (torch.int64, torch.int32, torch.int16, torch.uint8):
        size = torch.empty((), dtype=dtype).element_size()
        if row_bytes % size == 0 and rows.data_ptr() % size == 0:
            return rows.view(dtype)
    raise AssertionError("unreachable: uint8 divides every row")


def check_copy_args(store_rows: torch.Tensor, slot_rows: torch.Tensor, listing: torch.Tensor) -> None:
    """ValueError unless store_rows [E, W] and slot_rows [C, W] are rows of one width and dtype, the listing is a
    contiguous int64 [1 + 2N] on the slots' device, and (on CUDA) the store is on that device or pinned host
    memory."""
    if store_rows.dtype != slot_rows.dtype or store_rows.dim() != 2 or slot_rows.dim() != 2 \
            or store_rows.shape[1] != slot_rows.shape[1]:
        raise ValueError(f"store rows {store_rows.dtype} {tuple(store_rows.shape)} and slot rows {slot_rows.dtype} "
                         f"{tuple(slot_rows.shape)} differ in dtype or width")
    if listing.dtype != torch.int64 or listing.dim() != 1 or listing.numel() % 2 != 1 or not listing.is_contiguous() \
            or listing.device != slot_rows.device:
        raise ValueError(f"the copy list must be a contiguous int64 [1 + 2N] on {slot_rows.device}, got "
                         f"{listing.dtype} {tuple(listing.shape)} on {listing.device}")
    if slot_rows.is_cuda and store_rows.device != slot_rows.device and not store_rows.is_pinned():
        raise ValueError("the copy kernel reads the store through unified addressing: the host store must be pinned")


def copy_experts(store_rows: torch.Tensor, slot_rows: torch.Tensor, listing: torch.Tensor,
                 blocks: int = COPY_BLOCKS, block: int = COPY_BLOCK) -> None:
    """slot_rows[listing slots[:n]] = store_rows[listing experts[:n]] in one launch of `blocks` programs (module
    docstring); n is read on the device. store_rows [E, W]: one layer of the expert store (pinned host memory, or
    on the slots' device); slot_rows [C, W]: that layer's slot buffer; listing int64 [1 + 2N].

    Pointers: Triton 3.6's launcher takes any argument with `data_ptr()` and resolves it with
    cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_DEVICE_POINTER), which for page-locked host memory (cudaHostAlloc,
    or registered with cudaHostRegister) returns its device-side address under unified addressing and refuses
    pageable memory ("cannot be accessed from Triton (cpu tensor?)"). So a pinned CPU tensor is passed as it is,
    no wrapper needed; `check_copy_args` refuses an unpinned store before the launch with a clearer message."""
    check_copy_args(store_rows, slot_rows, listing)
    src, dst = word_view(store_rows), word_view(slot_rows)
    if src.dtype != dst.dtype:  # different alignments of the two buffers: the narrower words for both
        narrow = min((src, dst), key=lambda t: t.element_size()).dtype
        src, dst = store_rows.view(narrow), slot_rows.view(narrow)
    launch_copy(src, dst, listing, blocks, block)


def launch_copy(src: torch.Tensor, dst: torch.Tensor, listing: torch.Tensor, blocks: int = COPY_BLOCKS,
                block: int = COPY_BLOCK) -> None:
    """The launch of `copy_experts` on word views already made and checked (the device policy makes them once)."""
    _expert_copy_kernel[(blocks,)](src, dst, listing, src.shape[1], MAX_N=(listing.numel() - 1) // 2, BLOCK=block,
                                   BLOCKS=blocks, num_warps=4, **pdl.options(dst))


def copy_experts_torch(store_rows: torch.Tensor, slot_rows: torch.Tensor, listing: torch.Tensor) -> None:
    """`copy_experts` in torch indexing (the reference; reads the count on the host)."""
    check_copy_args(store_rows, slot_rows, listing)
    n, max_n = int(listing[0]), (listing.numel() - 1) // 2
    if n:
        experts, slots = listing[1:1 + n].cpu(), listing[1 + max_n:1 + max_n + n].to(slot_rows.device)
        slot_rows[slots] = store_rows[experts].to(slot_rows.device)
