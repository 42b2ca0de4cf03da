"""Launch parameters of the Triton MoE kernels and of the one-row linear layers (`gemv`), tuned once per device
and shape and kept in a cache file.

An engine on CUDA runs its MoE kernels with the launch parameters (block sizes, warps, stages) that were
fastest on this device: the first build measures the kernel's candidates (`fastest`: each timed in a CUDA
graph of launches that read past the L2, `graph_ms` and `rotation`) and writes the choice to the cache file;
later builds read it and measure nothing. An entry's key is the device (name and compute capability), the torch
and Triton versions, the kernel and its shape and dtype (`cache_key`), so a new GPU, a new torch or Triton, or
another model shape is tuned again.

`tune` (`EngineConfig.tune`, `Decoder.use_kernels`): "auto" (default: the cached entry, else tune once and
cache it), True (tune now and overwrite the entry), False (the kernel's fixed defaults, for exact
reproduction: launch parameters change the order of float32 sums, so outputs may differ in the last bits
from one choice to another). Off CUDA nothing is tuned: the defaults run.

The file: $SPECMOE_TUNING_CACHE if set, else $XDG_CACHE_HOME/specmoe/kernel_tuning.json, else
~/.cache/specmoe/kernel_tuning.json; delete it to tune everything again. A file that cannot be read, is not
JSON or not this format is ignored (a note says so) and replaced at the next write, as is an entry whose
parameters are not among the kernel's current candidates. Writes go through a temporary file and a rename:
a crash never leaves half a file; of two processes tuning at once the last write wins, and the other's
entry is tuned again by a later build.
"""

from __future__ import annotations

import datetime
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from specmoe.files import write_text_atomic

TUNE_MODES = ("auto", True, False)
CACHE_ENV = "SPECMOE_TUNING_CACHE"
FORMAT = "specmoe kernel tuning"
VERSION = 2  # 2: every entry timed in a CUDA graph past the L2 (`fastest`); version 1 files are tuned again


def next_pow2(n: int) -> int:
    """The smallest power of two at least n (1 for n <= 1): the padded sizes of launch shapes, on hosts with or
    without Triton (whose `next_power_of_2` gives 0 for 0)."""
    return 1 << max(n - 1, 0).bit_length()


@dataclass(frozen=True)
class LaunchChoice:
    """The launch parameters a kernel runs with and where they came from: "cache", "tuned" (measured now)
    or "defaults" (tune=False, or not on CUDA); `notes` for the decoder's notes."""

    params: dict
    source: str
    notes: tuple[str, ...] = ()


def check_tune(tune) -> str | bool:
    """`tune` if it is one of TUNE_MODES, else a ValueError that lists them."""
    if tune is True or tune is False or (isinstance(tune, str) and tune == "auto"):
        return tune
    raise ValueError(f"tune must be 'auto' (cached, else tuned once on CUDA), True (tune again now) or False "
                     f"(fixed defaults), got {tune!r}")


def cache_path() -> Path:
    """The cache file (module docstring)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "specmoe" / "kernel_tuning.json"


def device_identity(device) -> dict | None:
    """What a tuned choice depends on besides the kernel and shape: the CUDA device's name and compute
    capability, torch's and Triton's versions. None off CUDA (nothing is tuned there)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:  # pragma: no cover - no Triton, no Triton kernels to tune
        triton_version = None
    major, minor = torch.cuda.get_device_capability(device)
    return {"device": torch.cuda.get_device_name(device), "capability": f"{major}.{minor}",
            "torch": torch.__version__, "triton": triton_version}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def cache_key(identity: dict, kernel: str, shape: dict) -> str:
    """One entry's key: device identity, kernel name and shape as canonical JSON (sorted keys)."""
    return json.dumps({**identity, "kernel": kernel, "shape": shape}, sort_keys=True, separators=(",", ":"))


def read_cache(path: Path) -> tuple[dict, str | None]:
    """The cache file's entries (key -> {"params", "times_ms", "tuned"}) and a note if the file exists but
    cannot be used (then no entries); ({}, None) for a missing file."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return {}, None
    except (OSError, UnicodeDecodeError) as exc:
        return {}, f"kernel tuning cache {path} unreadable ({type(exc).__name__}: {exc}); ignored"
    try:
        data = json.loads(text)
    except ValueError:
        return {}, f"kernel tuning cache {path} is not valid JSON; ignored (replaced at the next tuning)"
    if not (isinstance(data, dict) and data.get("format") == FORMAT and data.get("version") == VERSION
            and isinstance(data.get("entries"), dict)):
        return {}, (f"kernel tuning cache {path} is not a {FORMAT!r} file of version {VERSION}; ignored "
                    "(replaced at the next tuning)")
    return data["entries"], None


def write_entry(path: Path, key: str, entry: dict) -> None:
    """Add or replace one entry of the cache file (the others kept; an unusable file is replaced)."""
    entries, _ = read_cache(path)
    entries[key] = entry
    write_text_atomic(path, json.dumps({"format": FORMAT, "version": VERSION, "entries": entries}, indent=1,
                                       sort_keys=True) + "\n")


def graph_ms(fn) -> float:
    """Median ms of `fn` (a tuner's batch of launches) replayed in a CUDA graph (triton's do_bench_cudagraph): the
    kernels run back to back as in the decoder's step graph, each starting while the one before finishes
    (programmatic dependent launch), with no host latency between them. A decode step's kernels take 2-60 µs,
    of the order of an eager launch's host latency, which do_bench's events include: timed eagerly, the grouped
    down kernel's candidates at D = 17 took 46-123 µs on the H200 against 28 µs in the decoder's graph
    (BENCHMARKS.md). Every tuner times with this (`fastest`); a batch must read more memory than the L2 holds
    (`rotation`), or the graph times the L2."""
    from triton.testing import do_bench_cudagraph

    return float(do_bench_cudagraph(fn, rep=20, return_mode="median"))


def l2_bytes(device) -> int:
    """The L2 cache's size of a CUDA device (0 elsewhere)."""
    device = torch.device(device)
    return int(torch.cuda.get_device_properties(device).L2_cache_size) if device.type == "cuda" else 0


def rotation(nbytes: int, device, most: int = 512) -> int:
    """How many distinct operands of `nbytes` each a tuner's batch of launches rotates through so that the batch
    reads at least twice the device's L2 (`l2_bytes`): one launch's operand is then no longer in L2 when the
    batch comes back to it, as a decode step's weights are not (every layer's others stream in between). At
    least 1, at most `most` (a router's 0.25 MB weight: 400 copies on the H200's 50 MB L2)."""
    return max(1, min(most, -(-2 * l2_bytes(device) // max(1, int(nbytes)))))


def fastest(candidates, run, what: str, bench=None, launches: int = 1) -> tuple[dict, dict]:
    """The candidate launch parameters with which `run(params)` is fastest on this device: (params, {candidate
    index: median ms per launch}), a `run` timed by `bench(fn)` (default `graph_ms`) over the `launches` it
    makes. `run` should launch a batch that reads past the L2 (`rotation`). Candidates the compiler rejects are
    skipped."""
    bench = bench or graph_ms
    times = {}
    for i, cand in enumerate(candidates):
        try:
            run(cand)
            times[i] = float(bench(lambda: run(cand))) / launches  # noqa: B023
        except Exception:  # a candidate the compiler rejects on this device is simply not used
            continue
    if not times:
        raise RuntimeError(f"no {what} configuration compiled on this device")
    best = min(times, key=times.get)
    return dict(candidates[best]), times


def launch_params(tune, kernel: str, shape: dict, identity: dict | None, candidates, defaults: dict, tuner,
                  path: Path | None = None) -> LaunchChoice:
    """The launch parameters of `kernel` at `shape` on the device of `identity` (`device_identity`):
    tune=False or identity None -> `defaults`; "auto" -> the cache file's entry if it names one of
    `candidates`, else `tuner()` -> (params, {candidate index: ms}), written to the cache; True -> `tuner()`
    always, overwriting the entry. The cache file: `path`, else `cache_path()`."""
    tune = check_tune(tune)
    if tune is False:
        return LaunchChoice(dict(defaults), "defaults")
    if identity is None:
        notes = (f"{kernel}: fixed launch parameters (tuning needs CUDA)",) if tune is True else ()
        return LaunchChoice(dict(defaults), "defaults", notes)
    path = Path(path) if path is not None else cache_path()
    key = cache_key(identity, kernel, shape)
    notes = []
    if tune == "auto":
        entries, note = read_cache(path)
        if note:
            notes.append(note)
        entry = entries.get(key)
        if entry is not None:
            params = entry.get("params") if isinstance(entry, dict) else None
            if any(params == dict(c) for c in candidates):
                notes.append(f"{kernel} launch parameters {params} read from the tuning cache {path}")
                return LaunchChoice(dict(params), "cache", tuple(notes))
            notes.append(f"{kernel}: the tuning cache's entry {params!r} is not one of the current candidates; "
                         "tuned again")
    params, times = tuner()
    entry = {"params": params, "times_ms": {str(i): t for i, t in times.items()},
             "tuned": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    try:
        write_entry(path, key, entry)
        notes.append(f"{kernel} tuned: {params} (candidate ms: {times}); written to the tuning cache {path}")
    except OSError as exc:
        notes.append(f"{kernel} tuned: {params} (candidate ms: {times}); the tuning cache {path} could not be "
                     f"written ({type(exc).__name__}: {exc})")
    return LaunchChoice(dict(params), "tuned", tuple(notes))


__all__ = ["CACHE_ENV", "LaunchChoice", "TUNE_MODES", "cache_key", "cache_path", "check_tune", "device_identity",
           "dtype_name", "fastest", "graph_ms", "l2_bytes", "launch_params", "read_cache", "rotation", "write_entry"]
