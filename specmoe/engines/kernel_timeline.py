"""Where a device-path verification block's time goes: the per-block timeline of a block that runs as one CUDA graph.

The host path times each layer's host step and the GPU's gaps around it (`RunSettings.instrument`,
`DecodeResult.timeline`); the device path has no host step to time, and a block is one graph launch. Its
timeline comes from the GPU's own record of the kernels it ran: a pass over the blocks under torch's profiler
(CUPTI records every kernel of a replayed graph with its start and end), each kernel classed by name
(`KERNEL_PARTS`), summed per class and divided by the blocks. The block's wall time comes from a pass without the
profiler (`timeline`'s step_ms), so the profiler's overhead is not charged to any part. Streams are not used: a
graph with branches runs its kernels on streams of the driver's choosing (a block's kernels showed up on 17), so
what ran beside what is read from the times alone.

The parts are `DecodeResult.timeline`'s, so both paths print as one table; they add up to the step:
- "selection": the block selection's kernels (`kernels.device_select`: the positions' own sets, demand,
  execution, the pool's use, the refill), their time;
- "compute": every other kernel but the copies (attention, router, grouped MoE, head), their time;
- "copy_wait": the exposed copies: the time a copy kernel runs while no other kernel does (the refill's moves, in
  line; a demand copy the MoE waits for at the join);
- "copy_issue", "copy_checks": 0 (no host copy step on this path);
- "idle_other": the rest of the block's wall time: launch gaps inside the graph, the graph's launch, the host's
  acceptance and the next block's input (less the time two non-copy kernels ran at once, e.g. the block
  prefetch's prediction beside the layer's kernels);
- "copies_hidden": the copy kernels' time beside other kernels (the demand copies under the MoE of the pool's
  experts, the prefetch's copies), not a part of the step; "draft": the drafting charged per block.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

SELECTION_KERNELS = ("_own_kernel", "_demand_kernel", "_execute_kernel", "_use_kernel", "_prefetch_kernel",
                     "_refill_kernel")
COPY_KERNELS = ("_expert_copy_kernel",)
KERNEL_PARTS = {"selection": SELECTION_KERNELS, "copy_wait": COPY_KERNELS}


@dataclasses.dataclass(frozen=True)
class KernelSpan:
    """One kernel the GPU ran: its name and its start and end (µs on the GPU's clock)."""
    name: str
    start_us: float
    end_us: float

    @property
    def us(self) -> float:
        return self.end_us - self.start_us


def kernel_part(name: str) -> str:
    """The timeline part a kernel of this name belongs to ("compute" unless `KERNEL_PARTS` names it)."""
    for part, names in KERNEL_PARTS.items():
        if any(n in name for n in names):
            return part
    return "compute"


def profiled_spans(prof) -> list[KernelSpan]:
    """The kernels of a `torch.profiler.profile` run (CUDA activity): memory copies and memsets left out."""
    import torch

    spans = []
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA or ev.name.startswith(("Memcpy", "Memset")):
            continue
        spans.append(KernelSpan(ev.name, float(ev.time_range.start), float(ev.time_range.end)))
    return spans


def _merged(intervals) -> list[tuple[float, float]]:
    """Overlapping or touching [start, end) intervals joined, in order."""
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two merged interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def timeline(spans: Iterable[KernelSpan], blocks: int, step_ms: float, draft_ms: float = 0.0) -> dict:
    """The mean per-block timeline (ms, module docstring) of `blocks` blocks whose kernels are `spans`, each block
    taking step_ms of wall time."""
    if blocks < 1:
        raise ValueError(f"a timeline needs at least one block, got {blocks}")
    spans = list(spans)
    if not spans:
        raise ValueError("no kernels in the profile: the pass ran no GPU work (or the profiler had no CUDA "
                         "activity)")
    sums = {"selection": 0.0, "copy_wait": 0.0, "compute": 0.0}
    for s in spans:
        sums[kernel_part(s.name)] += s.us
    others = _merged((s.start_us, s.end_us) for s in spans if kernel_part(s.name) != "copy_wait")
    copies = _merged((s.start_us, s.end_us) for s in spans if kernel_part(s.name) == "copy_wait")
    exposed = sum(b - a for a, b in copies) - _overlap(copies, others)
    ms = 1e-3 / blocks
    out = {"draft": draft_ms, "selection": sums["selection"] * ms, "copy_issue": 0.0, "copy_checks": 0.0,
           "copy_wait": exposed * ms, "compute": sums["compute"] * ms,
           "copies_hidden": (sums["copy_wait"] - exposed) * ms, "step": step_ms}
    out["idle_other"] = step_ms - out["selection"] - out["copy_wait"] - out["compute"]
    return out
