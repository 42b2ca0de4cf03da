"""Running a Triton kernel check in Triton's interpreter on the CPU (a subprocess with TRITON_INTERPRET=1).

PRELUDE patches two interpreter bugs (the interpreter only; compiled kernels are unaffected):
- NumPy >= 2.4 refuses int() of a 1-element array, which the interpreter uses for tensor loop bounds
  (triton-lang/triton#9171): convert through a scalar instead;
- the interpreter multiplies the bit patterns of bfloat16 operands of tl.dot (it stores bfloat16 as uint16 and
  converts only 8-bit floats before np.matmul; triton-lang/triton#11584): convert them to float32 as its casts do;
- the interpreter's float32 -> bfloat16 cast (`x.to(tl.bfloat16)`) truncates the mantissa where compiled Triton
  and torch round to nearest even: round to nearest even, so that kernels with bfloat16 rounding points can be
  compared with torch bit for bit.
"""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PRELUDE = r"""
import numpy as np
import triton.language as tl
import triton.runtime.interpreter as ti
try:
    int(np.ones(1))
except TypeError:
    if hasattr(ti, "_patch_lang_tensor"):
        _orig = ti._patch_lang_tensor
        def _patch(tensor, scope):
            _orig(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
        ti._patch_lang_tensor = _patch
_dot = ti.InterpreterBuilder.create_dot
def _f32(h):
    if h.dtype == tl.bfloat16:
        return ti.TensorHandle(ti._convert_float(h.data, tl.bfloat16, tl.float32, None).view(np.float32), tl.float32)
    return h
ti.InterpreterBuilder.create_dot = lambda self, a, b, d, *args: _dot(self, _f32(a), _f32(b), d, *args)
_cast = ti.InterpreterBuilder.cast_impl
def _cast_rne(self, src, dst_type):
    if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
        bits = np.asarray(src.data, dtype=np.float32).view(np.uint32).astype(np.uint64)
        return ti.TensorHandle(((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16), tl.bfloat16)
    return _cast(self, src, dst_type)
ti.InterpreterBuilder.cast_impl = _cast_rne
"""


# Decoder steps with given routes (the host's part replaced by fixed route rows), for scripts that compare a
# decoder's kernels with its torch path: `routes = random_routes(...)`, then `run_routed(decoder, bufs, ...)`.
ROUTED_DECODE = r"""
def random_routes(positions, num_layers, k, num_slots, rng):
    # [positions, layers, 2K] route rows: K distinct slots, then K weights (float32 bits) summing to 1
    routes = np.zeros((positions, num_layers, 2 * k), np.int32)
    for i in range(positions):
        for layer in range(num_layers):
            routes[i, layer, :k] = rng.choice(num_slots, k, replace=False)
            routes[i, layer].view(np.float32)[k:] = rng.dirichlet(np.ones(k))
    return routes


def run_routed(decoder, bufs, ids, routes, seq, d):
    # the logits of `ids` through `decoder` in steps of d positions, each layer's MoE over bufs[layer] at `routes`
    out = []
    with torch.no_grad():
        step = decoder.step(d)
        for start in range(0, len(ids), d):
            step.set_input(ids[start: start + d], start, seq)
            for layer in range(len(bufs)):
                decoder.attention_router(step, layer)
                step.route_np[layer] = routes[start: start + d, layer]
                decoder.moe(step, layer, bufs[layer])
            decoder.head(step)
            out.append(step.out_logits.clone())
    return torch.cat(out)
"""


def run_in_interpreter(script: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run `script` (after PRELUDE) in a fresh interpreter with TRITON_INTERPRET=1, from the repository root
    (which goes first on the path, so the checkout's package is imported)."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", PRELUDE + script], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
