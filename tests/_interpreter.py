"""Running a Triton kernel check in Triton's interpreter on the CPU (a subprocess with TRITON_INTERPRET=1)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PRELUDE = r"""
import numpy as np
try:
    int(np.ones(1))
except TypeError:
    # NumPy >= 2.4 refuses int() of a 1-element array, which Triton's interpreter uses for tensor loop bounds
    # (triton-lang/triton#9171); convert through a scalar instead. The compiled kernel is unaffected.
    import triton.runtime.interpreter as ti
    if hasattr(ti, "_patch_lang_tensor"):
        _orig = ti._patch_lang_tensor
        def _patch(tensor, scope):
            _orig(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
        ti._patch_lang_tensor = _patch
"""


def run_in_interpreter(script: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `script` (after PRELUDE) in a fresh interpreter with TRITON_INTERPRET=1, from the repository root."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    return subprocess.run([sys.executable, "-c", PRELUDE + script], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
