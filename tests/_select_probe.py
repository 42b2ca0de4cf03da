"""Probe kernels for `test_device_select.py`: the block selection's sum and extra-candidate ranking launched alone, so
that a test checks them on values the whole selection rarely meets (wide magnitudes, ties in u)."""

import triton
import triton.language as tl

from specmoe.kernels.device_select import _halving_sum, _order_positive


@triton.jit
def sum_kernel(x_ptr, out_ptr, BLOCK_E: tl.constexpr):
    tl.store(out_ptr, _halving_sum(tl.load(x_ptr + tl.arange(0, BLOCK_E)), BLOCK_E))


@triton.jit
def order_kernel(u_ptr, out_ptr, f_ptr, r_ptr, limit, E: tl.constexpr, BLOCK_E: tl.constexpr):
    idx = tl.arange(0, BLOCK_E)
    u = tl.load(u_ptr + idx, mask=idx < E, other=0.0)
    positive = (u > 0.0) & (idx < E)
    m = tl.sum(positive.to(tl.int32), axis=0)
    tl.store(out_ptr + idx, _order_positive(u, positive, idx, limit, m, f_ptr, r_ptr, BLOCK_E))
