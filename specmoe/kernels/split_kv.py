"""Split-KV decode attention (flash-decoding) over a static KV cache, reading only the written positions.

The engine's cache of a layer is [NKV, S, HD] for the whole maximum sequence; SDPA with an additive mask reads
all S positions at every step. This kernel reads only positions 0 .. seq_len - 1, with seq_len taken from a
device tensor: the launch (grid and arguments) depends on static shapes only, so a step captures into the
same CUDA graph at every position. It is our own rather than flash-attn's because it takes the head-major
cache as it is, runs on any GPU Triton supports, and takes D causal queries (the speculative engine's
verification block) in the same launch.

Two launches:
1. partials, grid (M blocks, splits, NKV): each program takes one KV head's chunk of positions and every
   query row that uses that head (the GQA group times the D queries: row = query * G + group member), so a
   chunk of K and V is read once per KV head. The chunk is ceil(seq_len / splits) rounded up to the key
   block, computed in the kernel, so all splits share the work at any length; programs past seq_len exit.
   Online softmax in float32 within the chunk (Q K^T and P V through tl.dot, rows padded to 16; an
   elementwise variant for a single row, block_m = 1, stays as an option); writes the chunk's normalised output and log-sum-exp (base 2) per row.
2. reduction, grid (D * NH, HD blocks): combines the active splits' partials by their log-sum-exps and
   rounds to the model dtype once.
Query i of the block attends positions 0 .. seq_len - D + i; a row that sees no position of a chunk gets an
empty partial (log-sum-exp -inf), and an output row that sees none at all (seq_len < D, a caller error) is 0.

`split_kv_attention_reference` is the torch definition (float32 softmax, explicit causal mask), used by the
tests and on the CPU.

Latent attention (MLA at decode, `split_kv_latent_attention`): the same two launches over one layer's latent
cache [S, R + P] (`specmoe.kernels.mla`): one KV head (G = NH: every query head of a position is a row of the
same program), keys R + P wide (the partial kernel's PE = P extra key columns, scored by a second tl.dot) and
values the first R columns of the same rows (V_FROM_K: the key tile is the value tile, read once). The
partials and the combine pass are the ones above with HD = R.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import pdl
from .tuning import next_pow2

try:  # Triton is optional: CPU machines run the torch reference
    import triton
    import triton.language as tl

    from .pdl import enter
except ImportError:  # pragma: no cover - depends on the environment
    triton = None

LOG2E = 1.4426950408889634
DEFAULT_SMS = 132  # H200; used when the workspace is not on a CUDA device


def block_params(rows: int, head_dim: int, itemsize: int) -> dict:
    """Tile sizes of the partial kernel for `rows` = D * G query rows per KV head.

    - block_m: rows per program, padded to a power of two of at least 16 for tl.dot (also one row: on the
      H200 the padded tensor-core path beat the elementwise one, block_m = 1, at every length, 14.4 against
      20.1 µs at 4000 positions), capped so the float32 accumulator [block_m, HD] stays in registers;
    - block_n: keys per inner step, a 16 KB tile of K and one of V (8 KB with 64 rows), at most 128 keys;
    - num_stages: 1 for one row (no pipelining: more programs share an SM, their loads in flight
      together), 3 for a block of rows (the next tiles load into shared memory while these are used; 17.0
      against 19.6 µs with 2 stages for D = 17 at 4000 positions), 1 for float32, whose tl.dot runs on CUDA
      cores in full precision and needs the registers, with 8 warps for 32 rows or more.
    Measured with scripts/bench_attention.py (BENCHMARKS.md); compiled for sm_90 with Triton 3.6. Value widths
    above 256 (MLA's latent, R = 512) take at most 32 rows per block and 8 warps (the accumulator [32, 512] in
    float32 over 256 threads); those were not measured.
    """
    block_m = min(max(16, next_pow2(rows)), 64 if head_dim <= 128 else 32)
    block_n = min(128, max(16, (16384 if block_m < 64 else 8192) // (head_dim * itemsize)))
    wide = itemsize >= 4
    return dict(block_m=block_m, block_n=block_n, num_stages=1 if wide or rows == 1 else 3,
                num_warps=8 if (wide or head_dim > 256) and block_m >= 32 else 4)


def split_kv_config(num_queries: int, num_heads: int, num_kv_heads: int, head_dim: int, max_seq_len: int,
                    itemsize: int = 2, num_sms: int = DEFAULT_SMS) -> dict:
    """Launch parameters from static shapes only: `block_params` and num_splits, the number of programs per
    KV head and M block along the positions. NKV * M blocks * splits programs in all: 4 per SM for one row
    (not pipelined, several fit on an SM at once), 2 per SM for one query's block of rows (pipelined; GQA groups or
    a latent cache's heads), so that at long lengths one wave of programs keeps enough loads in flight to stream
    the cache; a verification block (D > 1 queries) takes at most one program per SM, one wave in which each
    program streams a longer chunk with its stages in flight and the reduction combines fewer partials. On the
    H200 at OLMoE's shapes (16 KV heads, D = 9 and 17, 1024-4000 positions; BENCHMARKS.md, 2026-12-04) 8 splits
    (128 programs) took 0.77-0.99 of 17's time, and 9 splits (144 programs: a second wave of 12) 1.07-1.17. At
    Qwen3.6's grouped queries (2 KV heads; 22 splits at D = 9, 13 at 17) the rule is not the fastest count: 33
    splits at D = 9 and 8 at D = 17 took 0.74-0.95 of its time (`scripts/bench_attention.py --model
    qwen3.6-35b-a3b`), at most about 0.04 ms of a block over its 10 attention layers; a rule for grouped queries
    is not measured yet. At most one split per key block; and at most S / (2 rows), so the float32 partials (8
    bytes per row, split and head dim, written and read back, mostly within L2) stay under the K/V bytes of a full
    cache."""
    rows = num_queries * (num_heads // num_kv_heads)
    cfg = block_params(rows, head_dim, itemsize)
    m_blocks = -(-rows // cfg["block_m"])
    max_splits = max(1, min(-(-max_seq_len // cfg["block_n"]), max_seq_len // (2 * rows)))
    if num_queries > 1:  # one wave: splits rounded down
        splits = num_sms // (num_kv_heads * m_blocks)
    else:  # several programs per SM: rounded up
        splits = -(-(4 if rows == 1 else 2) * num_sms // (num_kv_heads * m_blocks))
    cfg["num_splits"] = max(1, min(max_splits, splits))
    return cfg


_OPTIONS = ("block_m", "block_n", "num_stages", "num_warps", "num_splits")


@dataclass
class SplitKVWorkspace:
    """Scratch of one (D, NH, HD, S) shape: float32 partial outputs [D * NH, splits, HD] and log-sum-exps
    [D * NH, splits]. Made once (`make_split_kv_workspace`), reused by every call; the tile sizes follow the
    dtype of the call (`block_params`) unless `overrides` fixes them. rope_dim: the extra key columns P of a
    latent cache (`split_kv_latent_attention`; 0 for `split_kv_attention`)."""

    num_queries: int
    num_heads: int
    head_dim: int
    max_seq_len: int
    num_kv_heads: int
    num_splits: int
    partial_out: torch.Tensor
    partial_lse: torch.Tensor
    overrides: dict = field(default_factory=dict)
    rope_dim: int = 0
    _launch: dict = field(default_factory=dict, repr=False)

    def launch_params(self, dtype: torch.dtype) -> dict:
        """The partial kernel's tile sizes for q's dtype (computed once per dtype)."""
        if dtype not in self._launch:
            rows = self.num_queries * (self.num_heads // self.num_kv_heads)
            cfg = {**block_params(rows, self.head_dim, torch.empty((), dtype=dtype).element_size()),
                   **self.overrides, "num_splits": self.num_splits}
            _check_options(cfg, rows)
            self._launch[dtype] = cfg
        return self._launch[dtype]


def _check_options(cfg: dict, rows: int) -> None:
    bm, bn = cfg["block_m"], cfg["block_n"]
    if bm != 1 and (bm < 16 or bm & (bm - 1)):
        raise ValueError(f"block_m must be 1 or a power of two >= 16, got {bm}")
    if bm == 1 and rows != 1:
        raise ValueError(f"block_m = 1 (elementwise) takes one query row per KV head, not D * G = {rows}")
    if bn < 16 or bn & (bn - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {bn}")
    if cfg["num_splits"] < 1 or cfg["num_stages"] < 1 or cfg["num_warps"] not in (1, 2, 4, 8, 16):
        raise ValueError(f"bad split-KV options {cfg}")


def make_split_kv_workspace(num_queries: int, num_heads: int, head_dim: int, max_seq_len: int, device,
                            num_kv_heads: int | None = None, rope_dim: int = 0, **overrides) -> SplitKVWorkspace:
    """The workspace of `split_kv_attention` for D = num_queries queries of num_heads heads over a cache of
    max_seq_len positions. Pass num_kv_heads for GQA (default: as many as the query heads; it sets the number
    of splits, not the buffers). For `split_kv_latent_attention`: head_dim = R (kv_lora_rank), rope_dim = P,
    num_kv_heads = 1. Overrides (block_m, block_n, num_stages, num_warps, num_splits) replace the defaults of
    `split_kv_config`, e.g. in a benchmark sweep."""
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    if rope_dim and (rope_dim < 16 or rope_dim & (rope_dim - 1) or num_kv_heads != 1):
        raise ValueError(f"a latent cache's rope dim must be a power of two >= 16 with one KV head, got rope_dim="
                         f"{rope_dim}, num_kv_heads={num_kv_heads}")
    if min(num_queries, num_heads, num_kv_heads, head_dim, max_seq_len) < 1:
        raise ValueError("num_queries, num_heads, num_kv_heads, head_dim and max_seq_len must be positive")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    _check_head_dim(head_dim, 512 if rope_dim else 256)
    if num_queries > max_seq_len:
        raise ValueError(f"{num_queries} queries do not fit in a cache of {max_seq_len} positions")
    unknown = set(overrides) - set(_OPTIONS)
    if unknown:
        raise ValueError(f"unknown split-KV options {sorted(unknown)}; known: {list(_OPTIONS)}")
    device = torch.device(device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else DEFAULT_SMS
    splits = overrides.pop("num_splits", None)
    if splits is None:
        splits = split_kv_config(num_queries, num_heads, num_kv_heads, head_dim, max_seq_len, num_sms=sms)["num_splits"]
    ws = SplitKVWorkspace(num_queries, num_heads, head_dim, max_seq_len, num_kv_heads, splits,
                          torch.empty(num_queries * num_heads, splits, head_dim, dtype=torch.float32, device=device),
                          torch.empty(num_queries * num_heads, splits, dtype=torch.float32, device=device), overrides,
                          int(rope_dim))
    ws.launch_params(torch.bfloat16)  # validates the overrides now rather than at the first call
    return ws


def _check_head_dim(head_dim: int, largest: int = 256) -> None:
    """Head dims the partial kernel takes: powers of two from 16 to 256, to 512 for a latent cache's values."""
    if head_dim < 16 or head_dim > largest or head_dim & (head_dim - 1):
        raise ValueError(f"the head dim must be a power of two from 16 to {largest}, got {head_dim}")


def _check_inputs(q, k_cache, v_cache, seq_len) -> None:
    """Shapes, dtypes, devices and layout; no device-to-host transfer (safe during graph capture)."""
    if q.dim() != 3:
        raise ValueError(f"q must be [D, NH, HD], got shape {tuple(q.shape)}")
    if k_cache.dim() != 3 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be [NKV, S, HD], got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    num_q, num_heads, head_dim = q.shape
    num_kv, max_seq, cache_hd = k_cache.shape
    if cache_hd != head_dim:
        raise ValueError(f"head dim of q ({head_dim}) and of the cache ({cache_hd}) differ")
    if num_heads % num_kv:
        raise ValueError(f"the query heads ({num_heads}) must be a multiple of the KV heads ({num_kv}) (GQA)")
    if num_q > max_seq:
        raise ValueError(f"{num_q} queries do not fit in a cache of {max_seq} positions")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"q, k_cache and v_cache must share a dtype, got {q.dtype}, {k_cache.dtype}, "
                         f"{v_cache.dtype}")
    if not (q.device == k_cache.device == v_cache.device):
        raise ValueError(f"q and the caches must be on one device, got {q.device}, {k_cache.device}, "
                         f"{v_cache.device}")
    if not isinstance(seq_len, torch.Tensor) or seq_len.shape != (1,):
        raise ValueError("seq_len must be a tensor of shape [1] (positions written, pos + D)")
    if seq_len.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"seq_len must be int32 or int64, got {seq_len.dtype}")
    if seq_len.device != q.device:
        raise ValueError(f"seq_len must be on q's device ({q.device}), got {seq_len.device}")


def split_kv_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 seq_len: torch.Tensor, scale: float) -> torch.Tensor:
    """q [D, NH, HD], caches [NKV, S, HD], seq_len [1] = pos + D -> [D, NH * HD] in q's dtype: query i attends
    positions 0 .. seq_len - D + i (SDPA's math backend in float32, explicit boolean mask)."""
    _check_inputs(q, k_cache, v_cache, seq_len)
    num_q, num_heads, head_dim = q.shape
    num_kv, max_seq, _ = k_cache.shape
    n = int(seq_len.item())
    if not num_q <= n <= max_seq:
        raise ValueError(f"seq_len {n} must be between the number of queries ({num_q}) and the cache "
                         f"length ({max_seq})")
    group = num_heads // num_kv
    k = k_cache[:, :n].float().repeat_interleave(group, dim=0)  # [NH, n, HD]: query head h uses h // G
    v = v_cache[:, :n].float().repeat_interleave(group, dim=0)
    pos = torch.arange(n, device=q.device)
    allowed = pos[None, :] <= (n - num_q + torch.arange(num_q, device=q.device))[:, None]  # [D, n]
    with sdpa_kernel([SDPBackend.MATH]):
        out = F.scaled_dot_product_attention(q.float().transpose(0, 1), k, v, attn_mask=allowed, scale=scale)
    return out.transpose(0, 1).reshape(num_q, num_heads * head_dim).to(q.dtype)


if triton is not None:

    @triton.jit
    def _split_kv_partial_kernel(q_ptr, k_ptr, v_ptr, seq_ptr, po_ptr, plse_ptr, qk_scale, S,
                                 D: tl.constexpr, NH: tl.constexpr, G: tl.constexpr, HD: tl.constexpr,
                                 SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                 STAGES: tl.constexpr, PRECISION: tl.constexpr, PE: tl.constexpr = 0,
                                 V_FROM_K: tl.constexpr = False, PDL: tl.constexpr = False):
        """Partial attention of one (M block, split, KV head): rows r = query * G + group member. Rows of q and
        of the key cache are HD + PE wide (PE > 0: a latent cache's rotary key part, scored by its own
        product); V_FROM_K: the values are the key rows' first HD columns (v_ptr unused)."""
        enter(PDL)
        mb = tl.program_id(0)
        split = tl.program_id(1)
        kv = tl.program_id(2)
        seq_len = tl.minimum(tl.load(seq_ptr).to(tl.int32), S)  # clamped: never read past the cache
        chunk = tl.cdiv(tl.cdiv(seq_len, SPLITS), BLOCK_N) * BLOCK_N
        lo = split * chunk
        if lo >= seq_len:
            return  # beyond the written positions: the reduction reads only the active splits
        rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < D * G
        query = rows // G
        head = kv * G + rows % G
        qrow = query * NH + head  # row of q [D * NH, HD], of the partials and of the output
        limit = seq_len - D + query  # last position this row attends
        last_query = tl.minimum((mb * BLOCK_M + BLOCK_M - 1) // G, D - 1)
        hi = tl.minimum(lo + chunk, seq_len - D + last_query + 1)  # this block's rows see nothing past hi
        offs_d = tl.arange(0, HD)
        q = tl.load(q_ptr + qrow[:, None] * (HD + PE) + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        if PE > 0:
            offs_p = tl.arange(0, PE)
            q_pe = tl.load(q_ptr + qrow[:, None] * (HD + PE) + HD + offs_p[None, :], mask=row_ok[:, None], other=0.0)
        kbase = k_ptr + kv.to(tl.int64) * S * (HD + PE)
        vbase = v_ptr + kv.to(tl.int64) * S * HD
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HD], tl.float32)
        for start in tl.range(lo, hi, BLOCK_N, num_stages=STAGES):
            offs_n = start + tl.arange(0, BLOCK_N)
            in_range = offs_n < hi
            k = tl.load(kbase + offs_n[:, None] * (HD + PE) + offs_d[None, :], mask=in_range[:, None], other=0.0)
            if V_FROM_K:
                v = k
            else:
                v = tl.load(vbase + offs_n[:, None] * HD + offs_d[None, :], mask=in_range[:, None], other=0.0)
            if PE > 0:
                k_pe = tl.load(kbase + offs_n[:, None] * (HD + PE) + HD + offs_p[None, :], mask=in_range[:, None],
                               other=0.0)
            if BLOCK_M == 1:  # one row: scores as a column [BLOCK_N, 1], everything elementwise in float32
                s = tl.sum(k.to(tl.float32) * q.to(tl.float32), axis=1, keep_dims=True)
                if PE > 0:
                    s += tl.sum(k_pe.to(tl.float32) * q_pe.to(tl.float32), axis=1, keep_dims=True)
                s = s * qk_scale
                seen = (offs_n[:, None] <= limit[None, :]) & row_ok[None, :]
                s = tl.where(seen, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=0))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp2(m_i - m_safe)
                p = tl.exp2(s - m_safe[None, :])
                l_i = l_i * alpha + tl.sum(p, axis=0)
                acc = acc * alpha[:, None] + tl.sum(p * v.to(tl.float32), axis=0, keep_dims=True)
            else:
                s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
                if PE > 0:
                    s = tl.dot(q_pe, tl.trans(k_pe), s, input_precision=PRECISION)
                s = s * qk_scale
                seen = (offs_n[None, :] <= limit[:, None]) & row_ok[:, None]
                s = tl.where(seen, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing seen yet
                alpha = tl.exp2(m_i - m_safe)
                p = tl.exp2(s - m_safe[:, None])
                l_i = l_i * alpha + tl.sum(p, axis=1)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        empty = l_i == 0.0
        l_safe = tl.where(empty, 1.0, l_i)
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(l_safe))
        tl.store(po_ptr + (qrow[:, None] * SPLITS + split) * HD + offs_d[None, :], acc / l_safe[:, None],
                 mask=row_ok[:, None])
        tl.store(plse_ptr + qrow * SPLITS + split, lse, mask=row_ok)

    @triton.jit
    def _split_kv_reduce_kernel(po_ptr, plse_ptr, seq_ptr, out_ptr, S, HD: tl.constexpr, SPLITS: tl.constexpr,
                                SPLITS_P2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                                PDL: tl.constexpr = False):
        """out[row, d block] = the active splits' partials weighted by 2^(lse - max lse), normalised."""
        enter(PDL)
        row = tl.program_id(0)
        db = tl.program_id(1)
        seq_len = tl.minimum(tl.load(seq_ptr).to(tl.int32), S)
        chunk = tl.cdiv(tl.cdiv(seq_len, SPLITS), BLOCK_N) * BLOCK_N
        active = tl.cdiv(seq_len, tl.maximum(chunk, 1))  # the partial kernel's non-exiting splits
        sp = tl.arange(0, SPLITS_P2)
        ok = sp < active
        lse = tl.load(plse_ptr + row * SPLITS + sp, mask=ok, other=float("-inf"))
        m = tl.max(lse, axis=0)
        w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # 0 for empty and inactive splits
        offs_d = db * BLOCK_D + tl.arange(0, BLOCK_D)
        o = tl.load(po_ptr + (row * SPLITS + sp[:, None]) * HD + offs_d[None, :], mask=ok[:, None], other=0.0)
        den = tl.sum(w, axis=0)
        res = tl.sum(w[:, None] * o, axis=0) / tl.where(den == 0.0, 1.0, den)
        tl.store(out_ptr + row * HD + offs_d, res.to(out_ptr.dtype.element_ty))


def split_kv_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_len: torch.Tensor,
                       scale: float, out: torch.Tensor, workspace: SplitKVWorkspace) -> torch.Tensor:
    """Attention of D causal queries over the written positions of one layer's static cache (module doc).

    q [D, NH, HD] contiguous (queries at positions pos .. pos + D - 1); k_cache, v_cache [NKV, S, HD]
    contiguous, the block's own keys and values already written; seq_len int32/int64 [1] on q's device =
    pos + D; out [D, NH * HD] in q's dtype (written and returned); workspace from `make_split_kv_workspace`
    for (D, NH, HD, S). Allocates nothing and never reads seq_len on the host, so it captures into a CUDA
    graph. On the CPU (no Triton interpreter) it computes the torch reference instead."""
    _check_inputs(q, k_cache, v_cache, seq_len)
    num_q, num_heads, head_dim = q.shape
    num_kv, max_seq, _ = k_cache.shape
    ws = workspace
    if (ws.num_queries, ws.num_heads, ws.head_dim, ws.max_seq_len) != (num_q, num_heads, head_dim, max_seq):
        raise ValueError(f"the workspace is for (D, NH, HD, S) = "
                         f"{(ws.num_queries, ws.num_heads, ws.head_dim, ws.max_seq_len)}, the call is "
                         f"{(num_q, num_heads, head_dim, max_seq)}")
    if ws.partial_out.device != q.device:
        raise ValueError(f"the workspace is on {ws.partial_out.device}, q on {q.device}")
    if out.shape != (num_q, num_heads * head_dim) or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out must be [{num_q}, {num_heads * head_dim}] {q.dtype} on {q.device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    if not (q.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous() and out.is_contiguous()):
        raise ValueError("q, k_cache, v_cache and out must be contiguous")
    _check_head_dim(head_dim)
    if ws.rope_dim:
        raise ValueError("this workspace is for a latent cache (split_kv_latent_attention)")
    if not q.is_cuda and not pdl.interpreting():
        out.copy_(split_kv_attention_reference(q, k_cache, v_cache, seq_len, scale))
        return out
    return _launch(q, k_cache, v_cache, seq_len, scale, out, ws, num_kv, head_dim, 0)


def _launch(q, k_cache, v_cache, seq_len, scale, out, ws: SplitKVWorkspace, num_kv: int, head_dim: int,
            rope_dim: int) -> torch.Tensor:
    """The partial and reduction launches (shared by `split_kv_attention` and `split_kv_latent_attention`)."""
    if triton is None:
        raise ImportError("split-KV attention needs Triton on a CUDA device (pip install triton)")
    num_q, num_heads = q.shape[0], q.shape[1]
    max_seq = ws.max_seq_len
    group = num_heads // num_kv
    if group != ws.num_heads // ws.num_kv_heads:
        raise ValueError(f"the workspace was made for {ws.num_kv_heads} KV heads, the cache has {num_kv}")
    p = ws.launch_params(q.dtype)
    m_blocks = triton.cdiv(num_q * group, p["block_m"])
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # tf32 is ignored for bf16/fp16 operands
    _split_kv_partial_kernel[(m_blocks, ws.num_splits, num_kv)](
        q, k_cache, v_cache, seq_len, ws.partial_out, ws.partial_lse, float(scale) * LOG2E, max_seq,
        D=num_q, NH=num_heads, G=group, HD=head_dim, SPLITS=ws.num_splits, BLOCK_M=p["block_m"],
        BLOCK_N=p["block_n"], STAGES=p["num_stages"], PRECISION=precision, PE=rope_dim, V_FROM_K=rope_dim > 0,
        num_warps=p["num_warps"], num_stages=p["num_stages"], **pdl.options(q))
    splits_p2 = next_pow2(ws.num_splits)
    block_d = min(head_dim, max(16, 4096 // splits_p2))
    _split_kv_reduce_kernel[(num_q * num_heads, head_dim // block_d)](
        ws.partial_out, ws.partial_lse, seq_len, out, max_seq, HD=head_dim, SPLITS=ws.num_splits,
        SPLITS_P2=splits_p2, BLOCK_N=p["block_n"], BLOCK_D=block_d, num_warps=4, **pdl.options(q))
    return out


def split_kv_latent_attention(q: torch.Tensor, latent_cache: torch.Tensor, seq_len: torch.Tensor, scale: float,
                              out: torch.Tensor, workspace: SplitKVWorkspace) -> torch.Tensor:
    """MLA's decode attention over the written positions of one layer's latent cache (module doc, "Latent").

    q [D, NH, R + P] contiguous (absorbed queries at positions pos .. pos + D - 1); latent_cache [S, R + P]
    contiguous, the step's own rows already written; seq_len int32/int64 [1] on q's device = pos + D; out
    [D, NH, R] contiguous in q's dtype (written and returned): softmax(q k^T scale) c per head, query i
    attending positions 0 .. pos + i, c = the first R columns of the rows. workspace: `make_split_kv_workspace`
    (D, NH, R, S, num_kv_heads=1, rope_dim=P). Graph-capturable like `split_kv_attention`; on the CPU (no
    Triton interpreter) the torch version (`specmoe.kernels.mla.mla_decode_attention` with a mask from
    seq_len)."""
    ws = workspace
    rank, rope = ws.head_dim, ws.rope_dim
    num_q, num_heads = ws.num_queries, ws.num_heads
    if not rope or ws.num_kv_heads != 1:
        raise ValueError("a latent workspace has rope_dim > 0 and one KV head (make_split_kv_workspace)")
    if q.shape != (num_q, num_heads, rank + rope) or latent_cache.shape != (ws.max_seq_len, rank + rope):
        raise ValueError(f"the workspace is for q [{num_q}, {num_heads}, {rank + rope}] over a latent cache "
                         f"[{ws.max_seq_len}, {rank + rope}], got {tuple(q.shape)} and {tuple(latent_cache.shape)}")
    if not (q.dtype == latent_cache.dtype == out.dtype) or not (q.device == latent_cache.device == out.device):
        raise ValueError(f"q, the latent cache and out must share a dtype and a device, got {q.dtype} on {q.device}, "
                         f"{latent_cache.dtype} on {latent_cache.device}, {out.dtype} on {out.device}")
    if out.shape != (num_q, num_heads, rank):
        raise ValueError(f"out must be [{num_q}, {num_heads}, {rank}], got {tuple(out.shape)}")
    if not isinstance(seq_len, torch.Tensor) or seq_len.shape != (1,) or seq_len.device != q.device \
            or seq_len.dtype not in (torch.int32, torch.int64):
        raise ValueError("seq_len must be an int32/int64 tensor of shape [1] on q's device (positions written)")
    if not (q.is_contiguous() and latent_cache.is_contiguous() and out.is_contiguous()):
        raise ValueError("q, the latent cache and out must be contiguous")
    if ws.partial_out.device != q.device:
        raise ValueError(f"the workspace is on {ws.partial_out.device}, q on {q.device}")
    if not q.is_cuda and not pdl.interpreting():
        from .mla import mla_decode_attention

        positions = torch.arange(ws.max_seq_len, device=q.device)
        last = seq_len.long() - num_q + torch.arange(num_q, device=q.device)
        mask = torch.where(positions[None, :] <= last[:, None], 0.0, torch.finfo(q.dtype).min).to(q.dtype)
        return out.copy_(mla_decode_attention(q, latent_cache, mask, scale, rank))
    return _launch(q, latent_cache, latent_cache, seq_len, scale, out, ws, 1, rank, rope)


def split_kv_bytes(num_queries: int, num_heads: int, num_kv_heads: int, head_dim: int, seq_len: int,
                   itemsize: int) -> int:
    """Bytes one call must move at least: K and V of the written positions, q and the output."""
    return (2 * num_kv_heads * seq_len + 2 * num_queries * num_heads) * head_dim * itemsize


__all__ = ["SplitKVWorkspace", "block_params", "make_split_kv_workspace", "split_kv_attention",
           "split_kv_attention_reference", "split_kv_bytes", "split_kv_config", "split_kv_latent_attention"]
