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


def run_in_interpreter(script: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run `script` (after PRELUDE) in a fresh interpreter with TRITON_INTERPRET=1, from the repository root
    (which goes first on the path, so the checkout's package is imported)."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", PRELUDE + script], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
