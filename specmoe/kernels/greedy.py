"""The greedy head of a drafter: for each of D rows of logits [D, V], the greedy token (the first index of the
largest logit) and the drafter's probability of it (its softmax entry in float32).

`greedy_torch` is the reference: a float32 softmax over the whole vocabulary, its argmax and the gathered entry
(four kernels over D x V float32 values). `greedy_triton` gets the same token and probability in one pass over
the logits as stored (split over the vocabulary, then combined): a running maximum, its first index and the sum
of exp(logit - maximum) (rescaled when the maximum grows); the probability of the argmax is 1 / that sum, which
is what the softmax's entry is. Both write
the results at rows `index`, `index + 1`, ... of the outputs, `index` a device tensor [1] (None: from row 0), so
that a captured step writes its draft after the position it read without a host value.
"""

from __future__ import annotations

import torch

from . import pdl

try:
    import triton
    import triton.language as tl

    from .pdl import enter
except ImportError:  # pragma: no cover
    triton = None


def greedy_torch(logits: torch.Tensor, tokens: torch.Tensor, probs: torch.Tensor,
                 index: torch.Tensor | None = None) -> None:
    """tokens[index + i] = argmax of logits[i] (int64), probs[index + i] = its softmax probability (float32)."""
    p = torch.softmax(logits.float(), dim=-1)
    tok = p.argmax(-1)
    conf = p.gather(-1, tok[:, None])[:, 0]
    if index is None:
        tokens[:tok.shape[0]].copy_(tok)
        probs[:tok.shape[0]].copy_(conf)
    else:
        rows = index + torch.arange(tok.shape[0], device=index.device)
        tokens.index_copy_(0, rows, tok)
        probs.index_copy_(0, rows, conf)


if triton is not None:

    @triton.jit
    def _greedy_partial_kernel(logits_ptr, max_ptr, arg_ptr, sum_ptr, V, SPLITS, CHUNK: tl.constexpr,
                               BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        """Program (row, split): over the columns [split CHUNK, (split + 1) CHUNK) of the row, in blocks of BLOCK,
        per lane the running maximum, its first index and the sum of exp(logit - maximum); the lanes are
        combined into the split's maximum, first index of it and sum relative to it."""
        enter(PDL)
        row = tl.program_id(0).to(tl.int64)
        split = tl.program_id(1)
        logits_ptr += row * V
        offs = tl.arange(0, BLOCK)
        best = tl.full((BLOCK,), float("-inf"), tl.float32)
        arg = tl.zeros((BLOCK,), tl.int64)
        total = tl.zeros((BLOCK,), tl.float32)
        for start in range(0, CHUNK, BLOCK):
            cols = split * CHUNK + start + offs
            x = tl.load(logits_ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            bigger = x > best  # strictly: a lane keeps the first index of its maximum
            new = tl.where(bigger, x, best)
            total = tl.where(new == float("-inf"), 0.0, total * tl.exp(best - new) + tl.exp(x - new))
            arg = tl.where(bigger, cols, arg)
            best = new
        top = tl.max(best, axis=0)
        first = tl.min(tl.where(best == top, arg, V), axis=0)  # the first index among the lanes at the maximum
        out = row * SPLITS + split
        tl.store(max_ptr + out, top)
        tl.store(arg_ptr + out, first)
        tl.store(sum_ptr + out, tl.sum(tl.where(best == float("-inf"), 0.0, total * tl.exp(best - top)), axis=0))

    @triton.jit
    def _greedy_combine_kernel(max_ptr, arg_ptr, sum_ptr, tok_ptr, prob_ptr, index_ptr, V, SPLITS,
                               BLOCK_S: tl.constexpr, HAS_INDEX: tl.constexpr, PDL: tl.constexpr = False):
        """One program per row: the splits' maxima, first indices and sums combined (splits in column order,
        so the smallest index at the maximum is the row's first); probability 1 / the sum relative to it."""
        enter(PDL)
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_S)
        m = offs < SPLITS
        best = tl.load(max_ptr + row * SPLITS + offs, mask=m, other=float("-inf"))
        arg = tl.load(arg_ptr + row * SPLITS + offs, mask=m, other=V)
        total = tl.load(sum_ptr + row * SPLITS + offs, mask=m, other=0.0)
        top = tl.max(best, axis=0)
        first = tl.min(tl.where(best == top, arg, V), axis=0)
        s = tl.sum(tl.where(best == float("-inf"), 0.0, total * tl.exp(best - top)), axis=0)
        out = row
        if HAS_INDEX:
            out += tl.load(index_ptr).to(tl.int64)
        tl.store(tok_ptr + out, first)
        tl.store(prob_ptr + out, 1.0 / s)


def greedy_triton(logits: torch.Tensor, tokens: torch.Tensor, probs: torch.Tensor,
                  index: torch.Tensor | None = None, chunk: int = 2048, block: int = 1024) -> None:
    """`greedy_torch` in two launches (logits [D, V] contiguous, tokens int64, probs float32): the vocabulary in
    splits of `chunk` columns read in parallel, then one program per row combining them (a row of 50k logits
    read by one program would be latency-bound)."""
    d, v = logits.shape
    block = min(block, triton.next_power_of_2(v))
    chunk = max(block, min(chunk, triton.next_power_of_2(v)))
    splits = triton.cdiv(v, chunk)
    part_max = torch.empty(d, splits, dtype=torch.float32, device=logits.device)
    part_arg = torch.empty(d, splits, dtype=torch.int64, device=logits.device)
    part_sum = torch.empty_like(part_max)
    _greedy_partial_kernel[(d, splits)](logits, part_max, part_arg, part_sum, v, splits, CHUNK=chunk, BLOCK=block,
                                        num_warps=4, **pdl.options(logits))
    _greedy_combine_kernel[(d,)](part_max, part_arg, part_sum, tokens, probs, tokens if index is None else index, v,
                                 splits, BLOCK_S=triton.next_power_of_2(splits), HAS_INDEX=index is not None,
                                 num_warps=1, **pdl.options(logits))
