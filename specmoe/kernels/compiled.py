"""Triton kernels compiled for a GPU on a machine without one: the front end's type rules (`compile_for_gpu`),
and with `full` the PTX and ptxas's report (registers, spills; `ptxas_usage`, `mma_kind`); `compile_launches`
compiles every launch a block of host code makes instead of running it, and `launch_cache_step` /
`launch_block_selection` make each launch form of the device cache and the block selection once. Tests use
them to catch what Triton's interpreter does not enforce and what only the machine code shows (docs/checks.md)."""

from __future__ import annotations

import contextlib
import re

import torch


_POINTER_TYPES = {torch.int64: "*i64", torch.int32: "*i32", torch.float64: "*fp64", torch.float32: "*fp32",
                  torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.uint8: "*u8", torch.int8: "*i8"}


def _arg_type(arg) -> str:
    """A launch argument's type in a kernel signature: a tensor's pointer type, a Python int as i32 where it fits
    (as a launch types it), else i64."""
    if isinstance(arg, torch.Tensor):
        return _POINTER_TYPES[arg.dtype]
    return "i32" if -2 ** 31 <= int(arg) < 2 ** 31 else "i64"


def compile_for_gpu(kernel, args: tuple, constants: dict, num_warps: int, arch: int = 90, full: bool = False,
                    **options) -> dict | None:
    """Run a Triton kernel's front end for a CUDA GPU of compute capability `arch` (default 90: Hopper) without
    one: its Python source to Triton IR, where the language's type rules apply (a loop-carried variable that
    changes type, pointer arithmetic of mixed types), which Triton's interpreter on the CPU does not enforce; such
    a kernel raises here as its first launch would on the device. args: the launch's non-constexpr arguments in
    parameter order (tensors by dtype, Python ints as 32-bit integers where they fit, as a launch types them);
    constants: its constexprs by name. With `full`, the whole pipeline runs (layouts, PTX, and Triton's bundled
    ptxas on the PTX) and returns `ptxas_usage` of it, the launch's "warps" and the PTX's `mma_kind`: registers and
    spills, which only the machine code shows (a comparison tile too wide for the registers compiles, then runs
    several times slower); else None."""
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend

    names = [name for name in kernel.arg_names if name not in constants]
    if len(names) != len(args):
        raise ValueError(f"{len(args)} arguments for the kernel's {len(names)} non-constexpr parameters")
    signature = {name: "constexpr" for name in constants} | {name: _arg_type(arg) for name, arg in zip(names, args)}
    signature = {name: signature[name] for name in kernel.arg_names}
    constexprs = {(kernel.arg_names.index(name),): value for name, value in constants.items()}
    source = ASTSource(kernel, signature, constexprs)
    target = GPUTarget("cuda", arch, 32)
    if full:
        import triton

        ptx = triton.compile(source, target=target, options=dict(options, num_warps=num_warps)).asm["ptx"]
        return dict(ptxas_usage(ptx, arch), warps=num_warps, mma=mma_kind(ptx))
    backend = make_backend(target)
    parsed = backend.parse_options(dict(options, num_warps=num_warps))
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    source.make_ir(target, parsed, backend.get_codegen_implementation(parsed), backend.get_module_map(), context)
    return None


def mma_kind(ptx: str) -> str:
    """The tensor-core product a kernel's PTX uses: "wgmma" (Hopper's warpgroup product, operands from shared
    memory), "mma.sync" (the per-warp product, operands in registers) or "" (none)."""
    return "wgmma" if "wgmma.mma_async" in ptx else "mma.sync" if "mma.sync" in ptx else ""


def ptxas_usage(ptx: str, arch: int = 90) -> dict:
    """ptxas's report on one kernel's PTX, assembled for sm_{arch}a by the ptxas Triton ships: {"registers",
    "spill_stores", "spill_loads", "stack"} (the last three in bytes)."""
    import pathlib
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "kernel.ptx"
        path.write_text(ptx)
        done = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name=sm_{arch}a", str(path), "-o", str(path) + ".o"],
                              capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ptxas failed on the kernel's PTX: {done.stderr[-2000:]}")
    found = {key: re.search(pattern, done.stderr) for key, pattern in (
        ("registers", r"Used (\d+) registers"), ("spill_stores", r"(\d+) bytes spill stores"),
        ("spill_loads", r"(\d+) bytes spill loads"), ("stack", r"(\d+) bytes stack frame"))}
    if found["registers"] is None:
        raise RuntimeError(f"ptxas -v reported no register use: {done.stderr[-2000:]}")
    return {key: int(m.group(1)) if m else 0 for key, m in found.items()}


def launch_cache_step(cache, scoring, device="cpu"):
    """A `DeviceCache` over `cache` making one launch of each kind the engine makes per layer (layer 0's route from
    router logits, layer 1's part 1 from pre-gate logits; zero logits, token 0): inside `compile_launches`,
    every cache-step kernel of the policy compiles. Returns the DeviceCache."""
    from .device_cache import DeviceCache

    dev = DeviceCache(cache, scoring, device)
    token = torch.zeros(1, dtype=torch.int64, device=device)
    logits = torch.zeros(cache.num_experts, dtype=torch.float32, device=device)
    dev.step(token, 0, router_logits=logits)
    dev.step(token, 1, pregate_logits=logits)
    return dev


def launch_block_selection(pool, selector, scoring, positions: int, prefetch: int = 0, device="cpu"):
    """A `DevicePool` over `pool` making each launch form once for a block of `positions`: with a prefetch budget
    layer 1's block prefetch, layer 1's selection from logits rows of stride 2E into route rows (the engine's
    form), layer 0's plain selection, the refill; zero logits, unit weights. Inside `compile_launches`, every
    block-selection kernel of the selector compiles. Returns the DevicePool."""
    from .device_select import DevicePool

    dev = DevicePool(pool, selector, scoring, positions, device, prefetch=prefetch)
    e = pool.num_experts
    z = torch.zeros(positions, 2 * e, dtype=torch.float32, device=device)[:, :e]
    alpha = torch.ones(positions, dtype=torch.float64, device=device)
    if prefetch:
        dev.predict(1, z, alpha)
    dev.select(1, z, alpha, torch.zeros(positions, 2 * pool.top_k, dtype=torch.int32, device=device))
    dev.select(0, z, alpha)
    dev.end_block()
    return dev


@contextlib.contextmanager
def compile_launches(arch: int = 90, full: bool = False):
    """Within the block, every Triton launch (`kernel[grid](...)`) runs `compile_for_gpu` on its arguments instead
    of the kernel, once per kernel and specialisation (constexprs and argument types), and returns; nothing runs
    and no output is written, so only code whose host side reads no kernel output can run inside. Yields the list
    of (kernel name, constexprs) compiled; with `full`, (kernel name, constexprs, `ptxas_usage`) from the whole
    pipeline. Not under Triton's interpreter (its kernels are not compiled)."""
    import inspect

    from triton.runtime.jit import JITFunction

    original, compiled, seen = JITFunction.run, [], set()

    def run(self, *args, grid, warmup, **kwargs):
        bound = inspect.signature(self.fn).bind_partial(*args, **{k: v for k, v in kwargs.items()
                                                                   if k in self.arg_names})
        bound.apply_defaults()
        values = dict(bound.arguments)
        options = {k: v for k, v in kwargs.items() if k not in self.arg_names}
        constants = {p.name: values[p.name] for p in self.params if p.is_constexpr}
        launch = tuple(values[p.name] for p in self.params if not p.is_constexpr)
        key = (self.fn.__qualname__, tuple(sorted(constants.items())), tuple(sorted(options.items())),
               tuple(_arg_type(a) for a in launch))
        if key not in seen:
            seen.add(key)
            usage = compile_for_gpu(self, launch, constants, options.pop("num_warps", 4), arch, full, **options)
            compiled.append((self.fn.__name__, constants) + ((usage,) if full else ()))

    JITFunction.run = run
    try:
        yield compiled
    finally:
        JITFunction.run = original
