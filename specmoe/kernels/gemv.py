"""Linear layers of one row (GEMV: y = W x, W [N, K] row-major, x one row of K): a Triton kernel on CUDA, cuBLAS
(`F.linear`) everywhere else.

Why our own: a decode step's dense projections run at one row, and there cuBLAS's heuristics choose tiles of 64
or more output rows. On the H200 (`scripts/profile_engine.py`, OLMoE at a 2k context) OLMoE's query/key/value
and output projections ([6144, 2048] and [2048, 2048]) took 14.2 µs per layer against the 8.0 µs their bytes
take (the output projection is 32 thread blocks on 132 SMs), and its router ([128, 2048] with the next layer's
router) 5.0 µs for 0.5 MB, plus a copy into the float32 logits. Splitting the rows more finely keeps more loads
in flight. A library GEMV would do as well where one fits; none of ours takes the decoders' rounding point and
writes the float32 copy of the result (router logits, head logits) in the same pass.

`gemv_triton(x, w, params, out=, out32=)`: program p owns rows p BLOCK_N .. p BLOCK_N + BLOCK_N - 1 and walks K
in steps of BLOCK_K with a [BLOCK_N, BLOCK_K] float32 accumulator, summed over K once at the end, the result
rounded to x's dtype once: cuBLAS's rounding point (float32 accumulation of the products, one rounding), another
summation order, so outputs can differ from cuBLAS's in the last bit of the model dtype. `out32` receives the
rounded value as float32 (what `F.linear(x, w).float()` holds) in the same pass.

With programmatic dependent launch (`specmoe.kernels.pdl`, on by default on Hopper) each program loads its first
tile of weights before it waits for the kernel before it, so the weights of the next projection start to stream
while the norm or reduction before it finishes; the sums are the same.

`Linears` is a decoder's set of one-row linear layers: per weight shape (N, K, dtype) the launch of
GEMV_CANDIDATES that was fastest on the device (`gemv_launch_params`: tuned once, each candidate timed in a CUDA
graph of products over weights that do not fit the L2, and kept in the tuning cache file,
`specmoe.kernels.tuning`), checked against `F.linear` at that shape before use (`checks.check_gemv`; cuBLAS
where the check fails). tune=False and the CPU run cuBLAS / torch, so outputs stay
those of `F.linear`; rows D > 1 (verification blocks, prefill chunks) run `F.linear`, which tiles a block of rows
well, except a router's: a small weight whose float32 logits are asked for runs on the GEMV row by row (`linear`).

cuBLAS is not a tuning candidate. Timed eagerly (do_bench) it looked faster than the GEMV at two of OLMoE's
shapes on the H200 (the output projection [2048, 2048] and the router pair [128, 2048]); in a token the GEMV's
launch and first weight tile overlap the kernel before it (programmatic dependent launch), cuBLAS's do not, and the
tokens measured with every projection on the GEMV were faster than those on cuBLAS (OLMoE 1.115x, Moonlight and
Qwen3.6 1.17x: BENCHMARKS.md). Timed in CUDA graphs over weights past the L2, as the tuner times, the GEMV is ahead
at all three of OLMoE's projection shapes (output 2.90 against 5.95 µs, router pair 1.32 against 5.35).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import pdl
from .tuning import LaunchChoice, check_tune, device_identity, dtype_name, fastest, launch_params, rotation

try:
    import triton
    import triton.language as tl

    from .pdl import enter
except ImportError:  # pragma: no cover - depends on the environment
    triton = None

CUBLAS = {"cublas": 1}  # the launch "F.linear as it is": the default off CUDA and where a check fails
GEMV_CANDIDATES = (  # rows per program x columns per step; few rows per program = many programs in flight
    dict(block_n=1, block_k=1024, num_warps=4, num_stages=2),
    dict(block_n=2, block_k=1024, num_warps=4, num_stages=2),
    dict(block_n=4, block_k=512, num_warps=4, num_stages=3),
    dict(block_n=4, block_k=1024, num_warps=4, num_stages=2),
    dict(block_n=8, block_k=256, num_warps=4, num_stages=3),
    dict(block_n=8, block_k=512, num_warps=4, num_stages=3),
    dict(block_n=8, block_k=512, num_warps=8, num_stages=2),
    dict(block_n=16, block_k=256, num_warps=4, num_stages=3),
    dict(block_n=16, block_k=512, num_warps=8, num_stages=2),
    dict(block_n=32, block_k=128, num_warps=4, num_stages=4),
    dict(block_n=32, block_k=256, num_warps=8, num_stages=3),
)
GEMV_DEFAULTS = CUBLAS  # tune=False and off CUDA: F.linear's outputs, bit for bit


def padded_rows(weight: torch.Tensor, multiple: int) -> torch.Tensor:
    """`weight` [N, K] with zero rows appended up to a multiple of `multiple` rows (itself when N is one): a fused
    weight whose row count is odd keeps the products' output rows aligned, which cuBLAS's fast kernels need; the
    extra outputs are zeros for the caller to leave unread."""
    extra = -weight.shape[0] % multiple
    if not extra:
        return weight
    return torch.cat([weight, weight.new_zeros(extra, weight.shape[1])], dim=0)


if triton is not None:

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, out_ptr, out32_ptr, N, K: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, STAGES: tl.constexpr, WRITE: tl.constexpr, WRITE32: tl.constexpr,
                     FIRST_TILE: tl.constexpr = False, PDL: tl.constexpr = False):
        """Rows [pid BLOCK_N, pid BLOCK_N + BLOCK_N) of W x for row program_id(1) of x (and of out / out32: x
        [D, K], out [D, N]); WRITE: into out (x's dtype), WRITE32: the rounded
        values as float32 into out32. FIRST_TILE (with PDL): the first tile of weights is loaded before waiting
        for the kernel before (`specmoe.kernels.pdl`; no kernel of a step writes weights), x only after; the
        same sums either way."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        position = tl.program_id(1)  # which row of x (several: `linear`'s rows of a small weight)
        x_ptr += position * K
        out_ptr += position * N
        out32_ptr += position * N
        base = w_ptr + rows.to(tl.int64)[:, None] * K
        if FIRST_TILE:
            cols = tl.arange(0, BLOCK_K)
            col_ok = cols < K
            w = tl.load(base + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
            enter(PDL)
            x = tl.load(x_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
            acc = w.to(tl.float32) * x[None, :]  # = 0 + w x: the sum below is the same with PDL on or off
            first = BLOCK_K
        else:
            enter(PDL)
            acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
            first = 0
        for start in tl.range(first, K, BLOCK_K, num_stages=STAGES):
            cols = start + tl.arange(0, BLOCK_K)
            col_ok = cols < K
            x = tl.load(x_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
            w = tl.load(base + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
            acc += w.to(tl.float32) * x[None, :]
        y = tl.sum(acc, axis=1).to(x_ptr.dtype.element_ty)
        if WRITE:
            tl.store(out_ptr + rows, y, mask=row_ok)
        if WRITE32:
            tl.store(out32_ptr + rows, y.to(tl.float32), mask=row_ok)


def gemv_triton(x: torch.Tensor, w: torch.Tensor, params: dict, out: torch.Tensor | None = None,
                out32: torch.Tensor | None = None) -> torch.Tensor | None:
    """W x for x [D, K] (or [K]) and w [N, K], both contiguous in one dtype: into out ([D, N] or [N], x's dtype)
    and / or out32 (float32, the rounded values); with neither, a new out [D, N]. Returns out (None if only
    out32). Each row of x is summed as a one-row launch sums it (the grid's second axis is the row), so a row's
    result does not depend on the rows beside it; each row reads all of w (`linear` takes several rows only for
    a small weight). Where programmatic dependent launch is on (`specmoe.kernels.pdl`) the kernel reads w's first
    tile before the kernel launched just before it has finished: w must be a weight, not written by that
    kernel."""
    if triton is None:
        raise ImportError("the GEMV kernel needs Triton (pip install triton)")
    n, k = w.shape
    if x.shape[-1] != k or x.dim() > 2 or x.dtype != w.dtype or not (x.is_contiguous() and w.is_contiguous()):
        raise ValueError(f"gemv_triton takes contiguous rows of {k} values in the weight's dtype {w.dtype} and a "
                         f"contiguous weight; got x {tuple(x.shape)} {x.dtype}, weight {tuple(w.shape)}")
    d = x.numel() // k
    for name, t, dtype in (("out", out, x.dtype), ("out32", out32, torch.float32)):
        if t is not None and (t.numel() != d * n or t.dtype != dtype or not t.is_contiguous()):
            raise ValueError(f"gemv_triton's {name} must be {d} x {n} contiguous {dtype} values, got "
                             f"{tuple(t.shape)} {t.dtype}")
    if out is None and out32 is None:
        out = torch.empty(d, n, dtype=x.dtype, device=x.device)
    p, overlap = params, pdl.options(x)
    _gemv_kernel[(triton.cdiv(n, p["block_n"]), d)](
        x, w, out if out is not None else out32, out32 if out32 is not None else out, n, K=k,
        BLOCK_N=p["block_n"], BLOCK_K=p["block_k"], STAGES=p["num_stages"], WRITE=out is not None,
        WRITE32=out32 is not None, FIRST_TILE=bool(overlap), num_warps=p["num_warps"], **overlap)
    return out


ROWS_MAX = 64  # `linear`: the most rows of x run on the GEMV (a verification block's k + 1, a prefill chunk's more)
ROWS_MAX_WEIGHT_BYTES = 4 << 20  # ... and the largest weight: each row reads it all, from L2 once it is there


def linear(x: torch.Tensor, w: torch.Tensor, params: dict | None,
           out32: torch.Tensor | None = None) -> torch.Tensor | None:
    """x W^T: the GEMV kernel where `params` name one of its launches and x is one contiguous row [1, K] in the
    dtype of a contiguous w, else `F.linear`; out32 (optional, float32) receives the result's values (the rounded
    ones, as F.linear(x, w).float() holds them; a float32 x and w's GEMM writes straight into an out32 of the
    result's shape). Returns the result in x's dtype (None where the kernel wrote only out32). The one way a
    decoder's router writes its float32 logits rows, whatever its dtype.

    Several rows (a verification block, a prefill chunk) run on the GEMV too where out32 is asked for and w is
    small (at most ROWS_MAX rows, ROWS_MAX_WEIGHT_BYTES of weight: a router's logits): one launch with
    programmatic dependent launch in place of cuBLAS's GEMM and the copy into float32, two kernels that take
    none, and each row's logits are those its one-row step computes."""
    one_row = x.dim() == 2 and x.shape[0] == 1
    small = out32 is not None and x.dim() == 2 and x.shape[0] <= ROWS_MAX \
        and w.numel() * w.element_size() <= ROWS_MAX_WEIGHT_BYTES
    kernel = params is not None and "cublas" not in params and (one_row or small) and x.is_contiguous() \
        and w.is_contiguous() and x.dtype == w.dtype
    if not kernel:
        if out32 is not None and x.dtype == w.dtype == torch.float32 and x.dim() == 2 \
                and out32.shape == (x.shape[0], w.shape[0]):
            return torch.mm(x, w.t(), out=out32)  # float32 rows: the GEMM writes them, no copy
        y = F.linear(x, w)
        if out32 is not None:
            out32.copy_(y)
        return y
    return gemv_triton(x, w, params, out32=out32)


def tune_gemv(n: int, k: int, dtype: torch.dtype, device, weight: torch.Tensor | None = None) -> tuple[dict, dict]:
    """The fastest of GEMV_CANDIDATES for a weight [n, k] on this CUDA device: (params, {candidate index: median
    ms per product}), each candidate timed over a batch of products that rotates through enough weights of the
    shape to read past the L2 (`tuning.rotation`: a decode step reads each weight from HBM), launched back to back
    in a CUDA graph (`tuning.fastest`). Not cuBLAS (module docstring). The first weight is `weight` where given
    (the layer's own, only read: a large head needs no other), the rest seeded random ones."""
    g = torch.Generator(device=device).manual_seed(0)
    usable = weight is not None and weight.shape == (n, k) and weight.dtype == dtype and weight.is_contiguous()
    count = rotation(n * k * torch.empty((), dtype=dtype).element_size(), device)
    weights = [weight] if usable else []
    weights += [torch.randn(n, k, device=device, dtype=dtype, generator=g) for _ in range(count - len(weights))]
    x = torch.randn(1, k, device=device, dtype=dtype, generator=g)
    out32 = torch.empty(n, device=device, dtype=torch.float32)

    def batch(cand):
        for w in weights:
            linear(x, w, cand, out32)

    return fastest(GEMV_CANDIDATES, batch, "GEMV", launches=count)


def gemv_launch_params(tune, n: int, k: int, dtype: torch.dtype, device,
                       weight: torch.Tensor | None = None) -> LaunchChoice:
    """The launch of a one-row linear layer with weight [n, k] (`tuning.launch_params`: cached, tuned now with
    `tune_gemv` on `weight` where given, or cuBLAS)."""
    shape = {"n": n, "k": k, "dtype": dtype_name(dtype)}
    return launch_params(tune, "gemv", shape, device_identity(device), GEMV_CANDIDATES, GEMV_DEFAULTS,
                         lambda: tune_gemv(n, k, dtype, device, weight))


class Linears:
    """A decoder's one-row linear layers: the launch per weight shape (module docstring). Empty (every shape on
    `F.linear`) until `choose`."""

    def __init__(self):
        self.params: dict[tuple[int, int, torch.dtype], dict] = {}

    def choose(self, weights, tune, notes: list, launch: dict, check) -> None:
        """Per distinct shape among `weights` (tensors [N, K] on one device, one dtype): its launch, cached or
        tuned (`gemv_launch_params`), then a kernel launch checked against F.linear by check(n, k, params, dtype,
        device) (`checks.check_gemv`; a failure puts that shape on cuBLAS, noted). Notes into `notes`, each
        shape's choice into launch["gemv NxK"]."""
        tune = check_tune(tune)
        self.params.clear()
        for w in weights:
            n, k = w.shape
            if (n, k, w.dtype) in self.params:
                continue
            try:
                choice = gemv_launch_params(tune, n, k, w.dtype, w.device, w)
                if "cublas" not in choice.params:
                    check(n, k, choice.params, w.dtype, w.device)
            except Exception as exc:  # a failed tune or check must not cost the run
                if w.is_cuda:
                    torch.cuda.synchronize(w.device)
                notes.append(f"GEMV kernel for [{n}, {k}] unusable ({type(exc).__name__}: {exc}); cuBLAS used")
                choice = LaunchChoice(dict(CUBLAS), "defaults")
            notes.extend(choice.notes)
            self.params[(n, k, w.dtype)] = choice.params
            launch[f"gemv {n}x{k}"] = {"params": choice.params, "source": choice.source}

    def clear(self) -> None:
        self.params.clear()

    def __call__(self, x: torch.Tensor, w: torch.Tensor, out32: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None) -> torch.Tensor | None:
        """x W^T (+ bias) on the launch chosen for w's shape (`linear`); with a bias (an attention bias some
        checkpoints have) F.linear, into its own output (no out32)."""
        if bias is not None:
            if out32 is not None:
                raise ValueError("Linears: a bias and out32 together are not supported")
            return F.linear(x, w, bias)
        return linear(x, w, self.params.get((*w.shape, w.dtype)), out32)


__all__ = ["CUBLAS", "GEMV_CANDIDATES", "GEMV_DEFAULTS", "Linears", "gemv_launch_params", "gemv_triton", "linear",
           "tune_gemv"]
