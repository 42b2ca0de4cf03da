"""Where a device-path verification block's time goes: the per-block timeline of a block that runs as one CUDA graph.

The host path times each layer's host step and the GPU's gaps around it (`RunSettings.instrument`,
`DecodeResult.timeline`); the device path has no host step to time, and a block is one graph launch. Its
timeline comes from the GPU's own record of the kernels it ran: a pass over the blocks under torch's profiler
(CUPTI records every kernel of a replayed graph with its stream and start and end times), each kernel classed
by name (`KERNEL_PARTS`), summed per class and stream and divided by the blocks. The block's wall time comes from
a pass without the profiler (`timeline`'s step_ms), so the profiler's overhead is not charged to any part.

The parts are `DecodeResult.timeline`'s, so both paths print as one table:
- "selection": the block selection's kernels (`kernels.device_select`: the positions' own sets, demand,
  execution, the pool's use, the refill) on the compute stream;
- "copy_issue", "copy_checks": 0 (no host copy step on this path);
- "copy_wait": the copy kernel on the compute stream (demand copies and the refill's moves: they run in line,
  so all of their time is exposed);
- "compute": every other kernel on the compute stream (attention, router, grouped MoE, head);
- "idle_other": the block's wall time less the compute stream's kernels: launch gaps inside the graph, the
  graph's launch, the wait for the prefetch branch's join, the host's acceptance and the next block's input;
- "branch": kernel time on other streams (the block prefetch's prediction and copies), beside the compute stream,
  so not a part of the step; "draft": the drafting charged per block.
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
    """One kernel the GPU ran: its name, its stream and its start and end (µs on the GPU's clock)."""
    name: str
    stream: int
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
        spans.append(KernelSpan(ev.name, int(ev.device_resource_id), float(ev.time_range.start),
                                float(ev.time_range.end)))
    return spans


def timeline(spans: Iterable[KernelSpan], blocks: int, step_ms: float, draft_ms: float = 0.0) -> dict:
    """The mean per-block timeline (ms, module docstring) of `blocks` blocks whose kernels are `spans`, each block
    taking step_ms of wall time. The compute stream is the stream with the most kernel time."""
    if blocks < 1:
        raise ValueError(f"a timeline needs at least one block, got {blocks}")
    spans = list(spans)
    if not spans:
        raise ValueError("no kernels in the profile: the pass ran no GPU work (or the profiler had no CUDA "
                         "activity)")
    per_stream: dict[int, float] = {}
    for s in spans:
        per_stream[s.stream] = per_stream.get(s.stream, 0.0) + s.us
    main = max(per_stream, key=per_stream.get)
    parts = {"selection": 0.0, "copy_wait": 0.0, "compute": 0.0}
    for s in spans:
        if s.stream == main:
            parts[kernel_part(s.name)] += s.us
    busy = sum(parts.values())
    out = {"draft": draft_ms, "selection": parts["selection"] / 1e3 / blocks, "copy_issue": 0.0,
           "copy_checks": 0.0, "copy_wait": parts["copy_wait"] / 1e3 / blocks,
           "idle_other": step_ms - busy / 1e3 / blocks, "compute": parts["compute"] / 1e3 / blocks,
           "step": step_ms, "branch": (sum(per_stream.values()) - per_stream[main]) / 1e3 / blocks}
    return out
