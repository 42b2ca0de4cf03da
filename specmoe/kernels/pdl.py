"""Programmatic dependent launch (PDL): a decode step's next kernel starts while the one before it finishes.

A decode step is a chain of short kernels (a one-row GEMV takes 2-20 µs on the H200, a norm 1.5 µs), and
between two of them the GPU drains the first, flushes its writes and only then schedules the second's
thread blocks: about a microsecond per boundary in which no byte moves, some 190 boundaries per OLMoE token.
On Hopper and later a kernel launched with the programmatic-serialization attribute may be scheduled as soon
as every block of the kernel before it has signalled (`griddepcontrol.launch_dependents`) or exited; it must
then wait (`griddepcontrol.wait`) before it touches anything an earlier kernel writes or reads, and that wait
returns only when the kernel before has completed and its writes are visible. CUDA graph capture records
such launches as programmatic edges, so the one-graph token keeps the overlap.

The rule every kernel here follows (`enter`): signal the dependents, then wait, before any other memory
access. The only exception is the GEMV (`specmoe.kernels.gemv`), which loads its first tile of weights before
the wait: weights are written by no kernel of a step, so that load is safe, and it is the point of the
overlap (the next projection's weights stream in while the norm or reduction before it runs). A kernel that
waits first is correct whatever launches before or after it; a launch without the attribute waits for the
whole previous kernel as always. So PDL changes when kernels start, never what they compute: outputs are
the same bit for bit with it on or off (tested).

`options(t)`: the launch arguments (`PDL=True` for the kernel's constexpr, `launch_pdl=True` for Triton's
launcher) where PDL is on for t's device, else none. On: a CUDA device of compute capability 9.0 or later on
which a probe passed (eight dependent launches, eager and captured in a CUDA graph, give the chain's sum),
unless the environment sets SPECMOE_PDL=0 (for an A/B run or a driver that misbehaves). Off: the CPU, Triton's
interpreter (`interpreting`), older GPUs; there the kernels run as they always did.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - depends on the environment (Triton before 3.3 has no GDC calls)
    triton = None

ENV = "SPECMOE_PDL"
_state: dict[int, tuple[bool, str]] = {}  # device index -> (on, why)


if triton is not None:

    @triton.jit
    def enter(PDL: tl.constexpr):
        """A kernel's first step (module docstring): with PDL, let the next kernel launch, then wait for the one
        before to complete."""
        if PDL:
            gdc_launch_dependents()
            gdc_wait()

    @triton.jit
    def _probe_kernel(x_ptr, y_ptr, N, BLOCK: tl.constexpr, PDL: tl.constexpr):
        enter(PDL)
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < N
        tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=m) + 1.0, mask=m)


def interpreting() -> bool:
    """Whether Triton's interpreter runs the kernels (TRITON_INTERPRET set: the CPU tests of the kernels)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _probe(device: torch.device) -> tuple[bool, str]:
    """Eight dependent launches (each reads what the one before wrote) eagerly and captured in a CUDA graph;
    on if both give the sum of the chain."""
    n, block, depth = 1 << 16, 1024, 8
    bufs = [torch.zeros(n, device=device) for _ in range(depth + 1)]

    def chain():
        for a, b in zip(bufs, bufs[1:]):
            _probe_kernel[(triton.cdiv(n, block),)](a, b, n, BLOCK=block, PDL=True, launch_pdl=True)

    try:
        chain()
        ok = bool((bufs[-1] == depth).all())
        for b in bufs[1:]:
            b.zero_()
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            chain()
        graph.replay()
        torch.cuda.synchronize(device)
        ok = ok and bool((bufs[-1] == depth).all())
    except Exception as exc:  # an old driver or Triton: run without PDL
        torch.cuda.synchronize(device)
        return False, f"programmatic dependent launch unusable ({type(exc).__name__}: {exc})"
    if not ok:
        return False, "programmatic dependent launch gave wrong results in its probe; not used"
    return True, "programmatic dependent launch: kernels start while the one before finishes"


def status(device) -> tuple[bool, str]:
    """(on, why) for a device (module docstring); the probe runs once per device, never inside a graph capture
    (there PDL counts as off until a probe outside one has run)."""
    device = torch.device(device)
    if device.type != "cuda" or triton is None or interpreting():
        return False, "programmatic dependent launch: not on this device"
    if os.environ.get(ENV, "1") == "0":
        return False, f"programmatic dependent launch off ({ENV}=0)"
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _state:
        if torch.cuda.get_device_capability(index) < (9, 0):
            _state[index] = False, "programmatic dependent launch: needs compute capability 9.0"
        elif torch.cuda.is_current_stream_capturing():
            return False, "programmatic dependent launch: not probed yet"
        else:
            _state[index] = _probe(torch.device("cuda", index))
    return _state[index]


def enabled(device) -> bool:
    return status(device)[0]


def options(t: torch.Tensor) -> dict:
    """Launch arguments of a PDL kernel for a launch on t's device (module docstring)."""
    return {"PDL": True, "launch_pdl": True} if t.is_cuda and enabled(t.device) else {}


__all__ = ["ENV", "enabled", "enter", "interpreting", "options", "status"]
