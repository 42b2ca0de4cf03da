"""What the drafters' static-cache paths share (`static_ar`, `static_dflash`): the attention choice and its
device check, the layers' kernels (the target decoders' fused Triton kernels, `specmoe.kernels.norm_rope` and
`greedy`, or their torch references, chosen and checked at build time), one step function launched as a CUDA
graph or called eagerly, and host/device buffer pairs.

The drafters on the GPU follow the engine's decoder (gpt-fast's style): weights taken from the transformers
model once, a static KV cache of `max_seq_len` positions, and a step function whose every input (tokens,
positions, lengths) is read from a device tensor, so the same captured graph serves every position. On the
CPU the same step functions run eagerly (the tests compare them there with the transformers drafters).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specmoe.kernels import BACKENDS, decode_attention, norm_rope, pdl, triton_available
from specmoe.kernels.checks import TOLERANCE, relative_error
from specmoe.kernels.greedy import greedy_torch, greedy_triton
from specmoe.kernels.split_kv import make_split_kv_workspace, split_kv_attention

from .base import ATTENTIONS, DrafterError


def default_rope_theta(config) -> float:
    """`norm_rope.default_rope_theta` with the static drafters' error (DrafterError)."""
    return norm_rope.default_rope_theta(config, "the static-cache drafter", DrafterError)


# -- the layers' kernels: fused (Triton, the target decoders' kernels) or their torch references ------------
def choose_kernels(owner, backend: str, check) -> bool:
    """Whether `owner` (a static drafter: .device, .notes) runs its layers on the fused Triton kernels: backend
    "triton", or "auto" on CUDA with Triton, and check() (`specmoe.kernels.checks.check_drafter_kernels` at its
    shapes) passes on the device (`specmoe.models.decoder.verified`: a failure notes why, and the torch ops run)."""
    from specmoe.models.decoder import verified

    if backend not in BACKENDS:
        raise DrafterError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch" or (backend == "auto" and not (owner.device.type == "cuda" and triton_available())):
        owner.notes.append("layers: torch ops (the fused kernels' reference)")
        return False
    fused = verified(owner, "fused Triton kernels of the layers", "torch ops", check)
    if fused:
        owner.notes.append(pdl.status(owner.device)[1])
    return fused


def add_norm(fused: bool, h: torch.Tensor, x: torch.Tensor, weight, eps: float, style: str) -> torch.Tensor:
    """h += the norm of x (a post-norm's residual add, in place); returns h."""
    if fused:
        return norm_rope.rmsnorm_triton(x, weight, eps, None, style=style, add_to=h)
    return h.add_(norm_rope.rmsnorm_torch(x, weight, eps, style=style))


def prologue(fused: bool, qkv: torch.Tensor, *args, **flags) -> None:
    """`norm_rope.qkv_prologue_triton` where fused, else `qkv_prologue_torch` (same arguments)."""
    (norm_rope.qkv_prologue_triton if fused else norm_rope.qkv_prologue_torch)(qkv, *args, **flags)


def greedy(fused: bool, logits: torch.Tensor, tokens: torch.Tensor, probs: torch.Tensor, index=None) -> None:
    """Greedy tokens of logits [D, V] and their probabilities into rows index, index + 1, ... (`kernels.greedy`)."""
    (greedy_triton if fused else greedy_torch)(logits, tokens, probs, index)


def pinned_pair(shape, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A host buffer (pinned where the device is CUDA) and its device twin, both zero."""
    host = torch.zeros(shape, dtype=dtype, pin_memory=device.type == "cuda")
    return host, torch.zeros(shape, dtype=dtype, device=device)


def sync(device: torch.device) -> None:
    """Wait for the current stream (the drafter's one host synchronisation per block)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class WrittenAttention:
    """Attention of a step's queries over the positions 0 .. n - 1 of one layer's static cache [NKV, S, HD],
    n from a device tensor (so a graph serves every length): causal (query i of D sees positions up to
    n - D + i: the AR drafter) or block (every query sees all n: DFlash's block).

    "split_kv" is the engine's Triton kernel, which reads only the written positions; a block of B queries
    goes in as one query of B * NH heads ordered KV head-major (so every head of the block maps to its own KV
    head and sees all n positions). "sdpa" is torch SDPA over the whole cache with an additive mask (the
    reference, the CPU path). `choose` checks the kernel against SDPA on the device first."""

    def __init__(self, num_queries: int, num_heads: int, num_kv_heads: int, head_dim: int, max_seq_len: int,
                 causal: bool, dtype: torch.dtype, device: torch.device):
        self.shape = (num_queries, num_heads, num_kv_heads, head_dim, max_seq_len)
        self.causal, self.dtype, self.device = causal, dtype, device
        self.scale = head_dim ** -0.5
        self.kind, self.workspace = "sdpa", None
        self.positions = torch.arange(max_seq_len, device=device)
        self.mask = torch.zeros(num_queries, max_seq_len, dtype=dtype, device=device)
        self.out = torch.zeros(num_queries, num_heads * head_dim, dtype=dtype, device=device)

    def choose(self, attention: str) -> str:
        """Use `attention` ("auto", "split_kv", "sdpa"); returns a note saying what is used and why."""
        if attention not in ATTENTIONS:
            raise DrafterError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
        cuda = self.device.type == "cuda"
        if attention == "sdpa" or (attention == "auto" and not (cuda and triton_available())):
            self.kind = "sdpa"
            return "attention: SDPA over the masked static cache"
        d, nh, nkv, hd, s = self.shape
        rows, heads = (d, nh) if self.causal else (1, d * nh)
        try:
            self.workspace = make_split_kv_workspace(rows, heads, hd, s, self.device, num_kv_heads=nkv)
            self.kind = "split_kv"
            self._check()
        except Exception as exc:  # a compile error, a CUDA error or a wrong result must not cost the run
            if cuda:
                torch.cuda.synchronize()
            self.kind, self.workspace = "sdpa", None
            return f"split-KV attention unusable ({type(exc).__name__}: {exc}); SDPA used"
        where = torch.cuda.get_device_name(self.device) if cuda else "the CPU"
        return f"split-KV attention checked against SDPA on {where}; used"

    def _check(self) -> None:
        d, nh, nkv, hd, s = self.shape
        g = torch.Generator(device=self.device).manual_seed(3)
        q = torch.randn(d, nh, hd, device=self.device, generator=g).to(self.dtype)
        k, v = (torch.randn(nkv, s, hd, device=self.device, generator=g).to(self.dtype) for _ in range(2))
        n = torch.tensor([min(s, max(d, 2 * s // 3 + 1))], device=self.device)
        out = self(q, k, v, n).clone()
        kind, self.kind = self.kind, "sdpa"
        ref = self(q, k, v, n).clone()
        self.kind = kind
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        err = relative_error(ref, out)
        if not err < TOLERANCE:
            raise RuntimeError(f"split-KV attention differs from SDPA: relative error {err:.3g}")

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 written: torch.Tensor) -> torch.Tensor:
        """q [D, NH, HD] -> [D, NH * HD] (a buffer reused by the next call); written: [1] positions written."""
        d, nh, nkv, hd, _ = self.shape
        if self.kind == "split_kv":
            if self.causal:
                return split_kv_attention(q.contiguous(), k_cache, v_cache, written, self.scale, self.out,
                                          self.workspace)
            group = nh // nkv
            flat = q.view(d, nkv, group, hd).permute(1, 0, 2, 3).reshape(1, nkv * d * group, hd)
            out = split_kv_attention(flat, k_cache, v_cache, written, self.scale, self.out.view(1, -1),
                                     self.workspace)
            return out.view(nkv, d, group, hd).permute(1, 0, 2, 3).reshape(d, nh * hd)
        if self.causal:
            last = written - d + torch.arange(d, device=written.device)
        else:
            last = (written - 1).expand(d)
        visible = self.positions[None, :] <= last[:, None]
        self.mask.copy_(torch.where(visible, 0.0, torch.finfo(self.dtype).min))
        return decode_attention(q, k_cache, v_cache, self.mask, self.scale)


def chunk_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: int) -> torch.Tensor:
    """Eager causal attention of D queries at positions start .. start + D - 1 over the cache's first
    start + D positions (prefill chunks: shapes change, no graph). q [D, NH, HD] -> [D, NH * HD]."""
    d, nh, hd = q.shape
    end = start + d
    keys = torch.arange(end, device=q.device)
    mask = keys[None, :] <= (start + torch.arange(d, device=q.device))[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k_cache[None, :, :end], v_cache[None, :, :end],
                                         attn_mask=mask[None, None], scale=hd ** -0.5,
                                         enable_gqa=nh != k_cache.shape[0])
    return out[0].transpose(0, 1).reshape(d, nh * hd)


class Launcher:
    """`fn()` (no arguments; every input in device buffers) as one CUDA graph, or eager calls (CPU, or
    cuda_graphs=False). Before capture it runs twice eagerly on a side stream (kernel compilation, cuBLAS
    handles), each time after `neutral()` has written a harmless input; the drafter's state is reset after."""

    def __init__(self, fn, device: torch.device, cuda_graphs: bool, neutral):
        self.fn, self.graph = fn, None
        if device.type != "cuda" or not cuda_graphs:
            return
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.no_grad(), torch.cuda.stream(side):
            for _ in range(2):
                neutral()
                fn()
        torch.cuda.current_stream(device).wait_stream(side)
        torch.cuda.synchronize(device)
        neutral()
        torch.cuda.synchronize(device)
        self.graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(self.graph):
            fn()
        torch.cuda.synchronize(device)

    def __call__(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.fn()
