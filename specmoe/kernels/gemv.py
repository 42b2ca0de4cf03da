"""Linear layers of one row (GEMV: y = W x, W [N, K] row-major, x one row of K) and of a few rows: Triton kernels
where they beat cuBLAS on the device, cuBLAS (`F.linear`) everywhere else.

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

A few rows (2 <= D <= ROWS_MAX: a verification block's k + 1 positions) run `gemm_rows_triton`, the same walk
over W for a [BLOCK_D, BLOCK_N] tile of outputs: each program reads its rows of W once for all D inputs and sums
their products on the tensor cores (`tl.dot`, float32 accumulation, one rounding; float32 inputs in IEEE
precision), BLOCK_D = 16 or 32 covering the D rows (the padding rows are masked). Why our own here too: at D = 9
or 17 cuBLAS runs the same tiles as for large batches, without programmatic dependent launch, so every dense
projection of a block broke the chain of overlapped launches the block's Triton kernels form, four times per
layer, and read its weights at cuBLAS's few-row efficiency; under PDL this kernel, like the GEMV, loads its
first weight tile before it waits.

`Linears` is a decoder's set of linear layers of one row and of a few rows: per weight shape (N, K, dtype) and
row count D the launch that was fastest on the device among the candidates and cuBLAS (`gemv_launch_params`,
`rows_launch_params`: tuned once with triton's do_bench and kept in the tuning cache file,
`specmoe.kernels.tuning`), checked against `F.linear` at that shape before use (`checks.check_gemv`). One-row
launches are chosen with the decoder's kernels (`Linears.choose`), those of D rows when a decoder first builds
its step of D positions (`Linears.choose_rows`), both outside any graph capture. tune=False and the CPU run
cuBLAS / torch, so outputs stay those of `F.linear`; a row count without a chosen launch (prefill chunks, D >
ROWS_MAX) runs `F.linear`, which tiles many rows well.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import pdl
from .tuning import LaunchChoice, check_tune, device_identity, dtype_name, launch_params

try:
    import triton
    import triton.language as tl

    from .pdl import enter
except ImportError:  # pragma: no cover - depends on the environment
    triton = None

CUBLAS = {"cublas": 1}  # the candidate "F.linear as it is"
GEMV_CANDIDATES = (  # rows per program x columns per step; few rows per program = many programs in flight
    CUBLAS,
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
ROWS_CANDIDATES = (  # output columns per program x columns of K per step; tl.dot takes tiles of 16 and more
    CUBLAS,
    dict(block_n=16, block_k=128, num_warps=4, num_stages=4),
    dict(block_n=16, block_k=256, num_warps=4, num_stages=4),
    dict(block_n=16, block_k=512, num_warps=4, num_stages=3),
    dict(block_n=32, block_k=128, num_warps=4, num_stages=4),
    dict(block_n=32, block_k=256, num_warps=4, num_stages=3),
    dict(block_n=32, block_k=256, num_warps=8, num_stages=4),
    dict(block_n=64, block_k=128, num_warps=4, num_stages=3),
    dict(block_n=64, block_k=256, num_warps=8, num_stages=3),
)
ROW_BLOCKS = (16, 32)  # BLOCK_D: the few-row kernel's row tiles; a launch is chosen per tile, not per D
ROWS_MAX = ROW_BLOCKS[-1]


def row_block(rows: int) -> int:
    """The launch class of `rows` input rows: 1 (the GEMV), the smallest of ROW_BLOCKS holding them (the few-row
    kernel), or 0 (more than ROWS_MAX: F.linear)."""
    if rows == 1:
        return 1
    return next((b for b in ROW_BLOCKS if rows <= b), 0)


if triton is not None:

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, out_ptr, out32_ptr, N, K: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, STAGES: tl.constexpr, WRITE: tl.constexpr, WRITE32: tl.constexpr,
                     FIRST_TILE: tl.constexpr = False, PDL: tl.constexpr = False):
        """Rows [pid BLOCK_N, pid BLOCK_N + BLOCK_N) of W x; WRITE: into out (x's dtype), WRITE32: the rounded
        values as float32 into out32. FIRST_TILE (with PDL): the first tile of weights is loaded before waiting
        for the kernel before (`specmoe.kernels.pdl`; no kernel of a step writes weights), x only after; the
        same sums either way."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
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


    @triton.jit
    def _rows_kernel(x_ptr, w_ptr, out_ptr, out32_ptr, D, N, K: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, WRITE: tl.constexpr,
                     WRITE32: tl.constexpr, FIRST_TILE: tl.constexpr = False, PDL: tl.constexpr = False):
        """Columns [pid BLOCK_N, pid BLOCK_N + BLOCK_N) of the D rows of x W^T (x [D, K], out [D, N]), each tile of
        W read once for the BLOCK_D >= D rows (rows >= D masked); WRITE / WRITE32 and FIRST_TILE as the GEMV's."""
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        rows = tl.arange(0, BLOCK_D)
        row_ok = rows < D
        w_base = w_ptr + cols.to(tl.int64)[:, None] * K
        x_base = x_ptr + rows[:, None] * K
        acc = tl.zeros([BLOCK_D, BLOCK_N], tl.float32)
        if FIRST_TILE:
            ks = tl.arange(0, BLOCK_K)
            k_ok = ks < K
            w = tl.load(w_base + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            enter(PDL)
            x = tl.load(x_base + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")  # the loop's first step, as without PDL
            first = BLOCK_K
        else:
            enter(PDL)
            first = 0
        for start in tl.range(first, K, BLOCK_K, num_stages=STAGES):
            ks = start + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            w = tl.load(w_base + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_base + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        y = acc.to(x_ptr.dtype.element_ty)
        offsets = rows[:, None] * N + cols[None, :]
        ok = row_ok[:, None] & col_ok[None, :]
        if WRITE:
            tl.store(out_ptr + offsets, y, mask=ok)
        if WRITE32:
            tl.store(out32_ptr + offsets, y.to(tl.float32), mask=ok)


def _check_outputs(rows: int, n: int, dtype: torch.dtype, out, out32, who: str) -> None:
    for name, t, want in (("out", out, dtype), ("out32", out32, torch.float32)):
        if t is not None and (t.numel() != rows * n or t.dtype != want or not t.is_contiguous()):
            raise ValueError(f"{who}'s {name} must be {rows * n} contiguous {want} values, got {tuple(t.shape)} "
                             f"{t.dtype}")


def gemv_triton(x: torch.Tensor, w: torch.Tensor, params: dict, out: torch.Tensor | None = None,
                out32: torch.Tensor | None = None) -> torch.Tensor | None:
    """W x for x [1, K] (or [K]) and w [N, K], both contiguous in one dtype: into out ([1, N] or [N], x's dtype)
    and / or out32 (float32, the rounded values); with neither, a new out. Returns out (None if only out32).
    Where programmatic dependent launch is on (`specmoe.kernels.pdl`) the kernel reads w's first tile before the
    kernel launched just before it has finished: w must be a weight, not written by that kernel."""
    if triton is None:
        raise ImportError("the GEMV kernel needs Triton (pip install triton)")
    n, k = w.shape
    if x.numel() != k or x.dtype != w.dtype or not (x.is_contiguous() and w.is_contiguous()):
        raise ValueError(f"gemv_triton takes one contiguous row of {k} values in the weight's dtype {w.dtype} and a "
                         f"contiguous weight; got x {tuple(x.shape)} {x.dtype}, weight {tuple(w.shape)}")
    _check_outputs(1, n, x.dtype, out, out32, "gemv_triton")
    if out is None and out32 is None:
        out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    p, overlap = params, pdl.options(x)
    _gemv_kernel[(triton.cdiv(n, p["block_n"]),)](
        x, w, out if out is not None else out32, out32 if out32 is not None else out, n, K=k,
        BLOCK_N=p["block_n"], BLOCK_K=p["block_k"], STAGES=p["num_stages"], WRITE=out is not None,
        WRITE32=out32 is not None, FIRST_TILE=bool(overlap), num_warps=p["num_warps"], **overlap)
    return out


def gemm_rows_triton(x: torch.Tensor, w: torch.Tensor, params: dict, out: torch.Tensor | None = None,
                     out32: torch.Tensor | None = None) -> torch.Tensor | None:
    """x W^T for x [D, K] (2 <= D <= ROWS_MAX rows) and w [N, K], both contiguous in one dtype, with a launch of
    ROWS_CANDIDATES: into out ([D, N], x's dtype) and / or out32 (float32, the rounded values); with neither, a
    new out. Returns out (None if only out32). Under programmatic dependent launch w's first tile is read before
    the kernel launched just before has finished (as `gemv_triton`): w must be a weight."""
    if triton is None:
        raise ImportError("the few-row linear kernel needs Triton (pip install triton)")
    n, k = w.shape
    d = x.shape[0] if x.dim() == 2 else 0
    if not (2 <= d <= ROWS_MAX and x.shape[1] == k and x.dtype == w.dtype and x.is_contiguous()
            and w.is_contiguous()):
        raise ValueError(f"gemm_rows_triton takes 2 to {ROWS_MAX} contiguous rows of {k} values in the weight's "
                         f"dtype {w.dtype} and a contiguous weight; got x {tuple(x.shape)} {x.dtype}, weight "
                         f"{tuple(w.shape)}")
    if params.get("block_n", 0) < 16 or params.get("block_k", 0) < 16:
        raise ValueError(f"gemm_rows_triton needs tiles of at least 16 columns (a launch of ROWS_CANDIDATES), got "
                         f"{params}")
    _check_outputs(d, n, x.dtype, out, out32, "gemm_rows_triton")
    if out is None and out32 is None:
        out = torch.empty(d, n, dtype=x.dtype, device=x.device)
    p, overlap = params, pdl.options(x)
    _rows_kernel[(triton.cdiv(n, p["block_n"]),)](
        x, w, out if out is not None else out32, out32 if out32 is not None else out, d, n, K=k,
        BLOCK_D=row_block(d), BLOCK_N=p["block_n"], BLOCK_K=p["block_k"], STAGES=p["num_stages"],
        WRITE=out is not None, WRITE32=out32 is not None, FIRST_TILE=bool(overlap), num_warps=p["num_warps"],
        **overlap)
    return out


def linear(x: torch.Tensor, w: torch.Tensor, params: dict | None, out32: torch.Tensor | None = None) -> torch.Tensor | None:
    """x W^T: for x of D contiguous rows [D, K] in the dtype of a contiguous w, the GEMV kernel (D = 1) or the
    few-row kernel (2 <= D <= ROWS_MAX) where `params` name a launch that kernel takes (the few-row kernel's
    tiles have 16 columns or more), else `F.linear`;
    out32 (optional, float32) receives the result's values (the rounded ones, as F.linear(x, w).float() holds
    them; a float32 x and w's GEMM writes straight into an out32 of the result's shape). Returns the result in
    x's dtype (None where a kernel wrote only out32). The one way a decoder's router writes its float32 logits
    rows, whatever its dtype."""
    rows = row_block(x.shape[0]) if x.dim() == 2 else 0
    kernel = params is not None and "cublas" not in params and (rows == 1 or rows > 1 and params["block_n"] >= 16)
    if not (kernel and x.is_contiguous() and w.is_contiguous() and x.dtype == w.dtype):
        if out32 is not None and x.dtype == w.dtype == torch.float32 and x.dim() == 2 \
                and out32.shape == (x.shape[0], w.shape[0]):
            return torch.mm(x, w.t(), out=out32)  # float32 rows: the GEMM writes them, no copy
        y = F.linear(x, w)
        if out32 is not None:
            out32.copy_(y)
        return y
    if rows == 1:
        return gemv_triton(x, w, params, out32=out32)
    return gemm_rows_triton(x, w, params, out32=out32)


def tune_gemv(n: int, k: int, dtype: torch.dtype, device, rows: int = 1) -> tuple[dict, dict]:
    """The fastest launch for a weight [n, k] on this CUDA device at `rows` input rows: of GEMV_CANDIDATES at one
    row, of ROWS_CANDIDATES at more (a row block of ROW_BLOCKS, timed with that many rows); cuBLAS is among both.
    (params, {candidate index: median ms}), each timed by triton's do_bench with the L2 cache flushed (the
    weights come from HBM in a decode step)."""
    from .moe import fastest

    g = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(n, k, device=device, dtype=dtype, generator=g)
    x = torch.randn(rows, k, device=device, dtype=dtype, generator=g)
    out32 = torch.empty(rows, n, device=device, dtype=torch.float32)
    candidates, what = (GEMV_CANDIDATES, "GEMV") if rows == 1 else (ROWS_CANDIDATES, "few-row linear")
    return fastest(candidates, lambda cand: linear(x, w, cand, out32), what)


def gemv_launch_params(tune, n: int, k: int, dtype: torch.dtype, device, rows: int = 1) -> LaunchChoice:
    """The launch of a linear layer with weight [n, k] at one row (`rows` 1: kernel "gemv") or at the row block
    `rows` of ROW_BLOCKS (kernel "gemm_rows"): `tuning.launch_params`, cached, tuned now with `tune_gemv`, or
    cuBLAS."""
    shape = {"n": n, "k": k, "dtype": dtype_name(dtype)}
    if rows == 1:
        return launch_params(tune, "gemv", shape, device_identity(device), GEMV_CANDIDATES, GEMV_DEFAULTS,
                             lambda: tune_gemv(n, k, dtype, device))
    if rows not in ROW_BLOCKS:
        raise ValueError(f"rows must be 1 or a row block of {ROW_BLOCKS}, got {rows}")
    return launch_params(tune, "gemm_rows", {**shape, "rows": rows}, device_identity(device), ROWS_CANDIDATES,
                         GEMV_DEFAULTS, lambda: tune_gemv(n, k, dtype, device, rows))


class Linears:
    """A decoder's linear layers of one row and of a few rows: the launch per weight shape and row block (module
    docstring). Empty (every call on `F.linear`) until `choose`."""

    def __init__(self):
        self.params: dict[tuple[int, int, torch.dtype, int], dict] = {}  # (N, K, dtype, row block) -> launch
        self._shapes: list[tuple[int, int, torch.dtype, torch.device]] = []
        self._tune, self._check = False, None

    def choose(self, weights, tune, notes: list, launch: dict, check) -> None:
        """Per distinct shape among `weights` (tensors [N, K] on one device, one dtype): its one-row launch,
        cached or tuned (`gemv_launch_params`), then a kernel launch checked against F.linear by check(n, k,
        params, dtype, device, rows) (`checks.check_gemv`; a failure puts that shape on cuBLAS, noted). Notes
        into `notes`, each shape's choice into launch["gemv NxK"]. Launches for more rows: `choose_rows`."""
        self._tune = check_tune(tune)
        self.clear()
        for w in weights:
            shape = (*w.shape, w.dtype, w.device)
            if shape not in self._shapes:
                self._shapes.append(shape)
        self._check = check
        self._choose(1, notes, launch)

    def choose_rows(self, rows: int, notes: list, launch: dict) -> None:
        """The launches for `rows` input rows (their row block, `row_block`) at every shape of the last `choose`,
        as `choose` does at one row (launch["gemv NxK D<=B"]), unless chosen already; nothing before `choose`,
        after `clear`, or for one row or more than ROWS_MAX. Call it outside any graph capture: it may tune."""
        block = row_block(rows)
        if block > 1 and self._shapes and (*self._shapes[0][:3], block) not in self.params:
            self._choose(block, notes, launch)

    def _choose(self, block: int, notes: list, launch: dict) -> None:
        for n, k, dtype, device in self._shapes:
            where = f"[{n}, {k}]" if block == 1 else f"[{n}, {k}] at up to {block} rows"
            try:
                choice = gemv_launch_params(self._tune, n, k, dtype, device, block)
                if "cublas" not in choice.params:  # checked at a ragged row count of the block
                    self._check(n, k, choice.params, dtype, device, 1 if block == 1 else block // 2 + 1)
            except Exception as exc:  # a failed tune or check must not cost the run
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                notes.append(f"linear kernel for {where} unusable ({type(exc).__name__}: {exc}); cuBLAS used")
                choice = LaunchChoice(dict(CUBLAS), "defaults")
            notes.extend(choice.notes)
            self.params[(n, k, dtype, block)] = choice.params
            launch[f"gemv {n}x{k}" if block == 1 else f"gemv {n}x{k} D<={block}"] = {
                "params": choice.params, "source": choice.source}

    def clear(self) -> None:
        self.params.clear()
        self._shapes = []

    def __call__(self, x: torch.Tensor, w: torch.Tensor, out32: torch.Tensor | None = None) -> torch.Tensor | None:
        """x W^T on the launch chosen for w's shape at x's rows (`linear`; F.linear where none is chosen)."""
        block = row_block(x.shape[0]) if x.dim() == 2 else 0
        return linear(x, w, self.params.get((*w.shape, w.dtype, block)), out32)


__all__ = ["CUBLAS", "GEMV_CANDIDATES", "GEMV_DEFAULTS", "Linears", "ROWS_CANDIDATES", "ROWS_MAX", "ROW_BLOCKS",
           "gemm_rows_triton", "gemv_launch_params", "gemv_triton", "linear", "row_block", "tune_gemv"]
