"""What the device kernels' tests share (`test_device_cache.py`, `test_device_select.py`): the router scoring of
a named case, and an interpreter speed-up for kernels that call many jit functions."""

import numpy as np

from specmoe.routing import RouterScoring


def case_scoring(name: str, num_layers: int, num_experts: int, seed: int, scale: float, groups: tuple[int, int]):
    """The scoring of case `name`: "softmax", "softmax_renorm" (renormalised, scaled 1.5), "sigmoid" or
    "sigmoid_groups" (renormalised, scaled by `scale`, a seeded bias with four equal entries so that tied logits give
    tied selection scores; "sigmoid_groups" with group-limited choice `groups`)."""
    if name == "softmax":
        return RouterScoring("softmax")
    if name == "softmax_renorm":
        return RouterScoring("softmax", renormalise=True, scale=1.5)
    bias = np.random.default_rng(seed).normal(0.0, 0.1, (num_layers, num_experts))
    bias[:, 10:14] = bias[:, 10:11]  # equal biases: equal selection scores where the logits tie
    n_group, topk_group = groups if name == "sigmoid_groups" else (1, 1)
    return RouterScoring("sigmoid", renormalise=True, scale=scale, bias=bias, n_group=n_group, topk_group=topk_group)


# Interpreter-only speed-up: the interpreter patches triton.language again at every call of a jit function from
# another (about 1.5 ms each, hundreds per step); patching once per module and launch is equivalent.
FAST_CALLS = r"""
_patched = set()
_launch = ti.GridExecutor.__call__
def _grid_call(self, *args, **kwargs):
    _patched.clear()
    return _launch(self, *args, **kwargs)
def _device_call(self, *args, **kwargs):
    if id(self.fn.__globals__) not in _patched:
        ti._patch_lang(self.fn)
        _patched.add(id(self.fn.__globals__))
    fn = self.rewrite()
    try:
        return fn(*args, **kwargs)
    except Exception as e:
        raise ti.InterpreterError(repr(e)) from e
ti.GridExecutor.__call__ = _grid_call
ti.InterpretedFunction.__call__ = _device_call
"""
