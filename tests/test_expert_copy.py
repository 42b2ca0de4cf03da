"""The expert copy kernel (`specmoe.kernels.expert_copy`): a device-written list of experts copied from the store's
rows into the slot rows, bit for bit as torch indexing does, in Triton's interpreter on the CPU (count 0, partial
and full lists, bf16 and FP8 rows with their block scales, row widths that are not a multiple of the chunk or of 8
bytes, 1 to 8 programs), and through unified addressing from a pinned store on a CUDA device (marked gpu)."""

import importlib.util

import pytest
import torch
from _interpreter import run_in_interpreter

from specmoe.kernels.expert_copy import (COPY_BLOCK, COPY_BLOCKS, check_copy_args, copy_experts_torch,
                                        launch_shape, word_view)

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")

# the cases and their check, shared by the interpreter script and the gpu test
CASES = r"""
import numpy as np
import torch
from specmoe.kernels.expert_copy import copy_experts, copy_experts_torch
from specmoe.kernels.fp8 import fp8_row_layout, pack_fp8_row, quantize_fp8


def fp8_store(num_experts, hidden, inter, gen):
    width = fp8_row_layout(hidden, inter).width
    rows = torch.zeros(num_experts, width, dtype=torch.uint8)
    for e in range(num_experts):
        mats = [torch.randn(inter, hidden, generator=gen), torch.randn(inter, hidden, generator=gen),
                torch.randn(hidden, inter, generator=gen)]
        pack_fp8_row(rows[e], hidden, inter, [quantize_fp8(m * (e + 1)) for m in mats])
    return rows


def listing_of(experts, slots, max_n, device):
    out = torch.full((1 + 2 * max_n,), -7, dtype=torch.int64)  # junk beyond the count must not be read
    out[0] = len(experts)
    out[1:1 + len(experts)] = torch.tensor(experts, dtype=torch.int64)
    out[1 + max_n:1 + max_n + len(slots)] = torch.tensor(slots, dtype=torch.int64)
    return out.to(device)


def run_cases(device, pin=False):
    gen = torch.Generator().manual_seed(0)
    stores = {
        "bf16": torch.randn(12, 3 * 40 * 24, generator=gen).to(torch.bfloat16),  # 5760 bytes: int64 words
        "bf16_odd": torch.randn(9, 3 * 5 * 7, generator=gen).to(torch.bfloat16),  # 210 bytes: int16 words
        "f32": torch.randn(6, 2500, generator=gen),  # 10000 bytes, 1250 words: not a multiple of the chunk
        "fp8": fp8_store(8, 160, 96, gen),  # uint8 rows: weights, then float32 block scales
    }
    done = 0
    for name, store in stores.items():
        num_experts = store.shape[0]
        store = store.pin_memory() if pin else store.to(device)
        for capacity, lists in ((4, [([], []), ([3], [2]), ([0, num_experts - 1, 5, 1], [3, 0, 1, 2])]),
                                (num_experts // 2, [([num_experts - 1 - i for i in range(num_experts // 2)],
                                                     list(range(num_experts // 2))[::-1])])):
            for max_n in sorted({max(len(lists[-1][0]), 1), 8}):
                for experts, slots in lists:
                    if len(experts) > max_n:
                        continue
                    for blocks, block in ((1, 64), (3, 128), (8, 1024)):
                        slot_rows = torch.randint(0, 255, (capacity, store.shape[1] * store.element_size()),
                                                  generator=gen, dtype=torch.uint8).view(store.dtype).to(device)
                        expected = slot_rows.clone()
                        listing = listing_of(experts, slots, max_n, device)
                        copy_experts_torch(store, expected, listing)
                        copy_experts(store, slot_rows, listing, blocks=blocks, block=block)
                        if device != "cpu":
                            torch.cuda.synchronize()
                        same = torch.equal(slot_rows.view(torch.uint8), expected.view(torch.uint8))
                        assert same, (name, capacity, experts, slots, blocks, block)
                        done += 1
    return done
"""


@needs_triton
def test_expert_copy_kernel_equals_torch_indexing_in_the_interpreter():
    done = run_in_interpreter(CASES + "\nprint('ok', run_cases('cpu'))\n")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "ok " in done.stdout and int(done.stdout.split("ok ")[1].split()[0]) > 50, done.stdout


def test_copy_reference_and_argument_checks():
    store = torch.arange(5 * 6, dtype=torch.float32).view(5, 6)
    slots = torch.zeros(3, 6)
    listing = torch.tensor([2, 4, 1, 99, 0, 2, 99], dtype=torch.int64)  # count 2 of at most 3
    copy_experts_torch(store, slots, listing)
    assert torch.equal(slots[0], store[4]) and torch.equal(slots[2], store[1]) and not slots[1].any()
    copy_experts_torch(store, slots, torch.tensor([0, 1, 1], dtype=torch.int64))  # count 0: nothing
    with pytest.raises(ValueError, match="width"):
        check_copy_args(store, torch.zeros(3, 5), listing)
    with pytest.raises(ValueError, match="int64"):
        check_copy_args(store, slots, listing.int())
    with pytest.raises(ValueError, match="1 \\+ 2N"):
        check_copy_args(store, slots, listing[:6])
    assert word_view(torch.zeros(2, 8, dtype=torch.bfloat16)).dtype == torch.int64
    assert word_view(torch.zeros(2, 6, dtype=torch.bfloat16)).dtype == torch.int32
    assert word_view(torch.zeros(2, 3, dtype=torch.uint8)).dtype == torch.uint8


@pytest.mark.gpu
def test_expert_copy_kernel_reads_the_pinned_store_on_the_device():
    namespace = {}
    exec(CASES, namespace)
    assert namespace["run_cases"]("cuda", pin=True) > 50
    # an unpinned host store is refused before the launch
    from specmoe.kernels.expert_copy import copy_experts

    listing = torch.tensor([0, 0, 0], dtype=torch.int64, device="cuda")
    with pytest.raises(ValueError, match="pinned"):
        copy_experts(torch.zeros(2, 8), torch.zeros(2, 8, device="cuda"), listing)


def test_launch_shape_per_device():
    """The measured shape on CUDA whatever the row; in the interpreter (CPU) one program whose chunk, a power of
    two, holds the whole row, up to 64 Ki words."""
    assert launch_shape(torch.device("cuda", 0), 5) == launch_shape("cuda", 10**7) == (COPY_BLOCKS, COPY_BLOCK)
    assert [launch_shape("cpu", n) for n in (1, 3072, 3073, 1 << 16, 10**7)] == \
        [(1, 1), (1, 4096), (1, 4096), (1, 1 << 16), (1, 1 << 16)]
