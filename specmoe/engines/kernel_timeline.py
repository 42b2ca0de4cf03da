"""Where a device-path verification block's time goes: the per-block timeline of a block that runs as one CUDA graph.

The host path times each layer's host step and the GPU's gaps around it (`RunSettings.instrument`,
`DecodeResult.timeline`); the device path has no host step to time, and a block is one graph launch. Its
timeline comes from the GPU's own record of the kernels it ran: a pass over the blocks under torch's profiler
(CUPTI records every kernel of a replayed graph with its start and end), each kernel classed by name
(`KERNEL_PARTS`), summed per class and divided by the blocks. The block's wall time comes from a pass without the
profiler (`timeline`'s step_ms), so the profiler's overhead is not charged to any part; that pass must run before
any profiled one in the process: torch's profiler leaves CUPTI attached, and every later graph launch costs more on
the host (a full-size OLMoE block's launch on the H200: 0.19 ms after a profiled pass, 0.04 ms before). Streams
are not used: a graph with branches runs its kernels on streams of the driver's choosing (a block's kernels showed
up on 17), so what ran beside what is read from the times alone.

Under programmatic dependent launch (`kernels.pdl`, on by default on Hopper) a kernel starts while the one before
it runs and waits for it, and the profiler's record of the kernel holds that wait: summed, the spans count the
same microseconds two or three times. So each kernel counts from when it could run (`running`): its start moved
to the latest end among the kernels that started before it and ended before it did. A kernel truly beside another
(a demand copy beside the pool's MoE, the block prefetch's prediction) that started after a shorter one loses the
overlap with it; the exposed copies are unaffected (the part no other kernel covers), the hidden ones can come
out a little short. Then each instant of the block counts once, for the part of the kernel that started first
among those running (`_owned`).

The parts are `DecodeResult.timeline`'s, so both paths print as one table; they add up to the step:
- "selection": the instants the block selection's kernels (`kernels.device_select`, `device_pool`: the own sets,
  demand, execution, the pool's use, the refill) run;
- "compute": the instants every other kernel but the copies runs (attention, router, grouped MoE, head);
- "copy_wait": the exposed copies: the time a copy kernel runs while no other kernel does (the refill's moves, in
  line; a demand copy the MoE waits for at the join);
- "copy_issue", "copy_checks": 0 (no host copy step on this path);
- "idle_other": the rest of the block's wall time: launch gaps inside the graph, the graph's launch, the host's
  acceptance and the next block's input;
- "copies_hidden": the copy kernels' time beside other kernels (the demand copies under the MoE of the pool's
  experts, the prefetch's copies), not a part of the step; "draft": the drafting charged per block.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import heapq
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


def running(spans: Iterable[KernelSpan]) -> list[KernelSpan]:
    """The spans from when each kernel could run: a kernel's start moved to the latest end of the kernels that
    started before it and ended before it did (module docstring: under programmatic dependent launch a kernel
    starts while the one before it runs and waits for it; the profiler records the wait as the kernel's); in the
    order given."""
    spans = list(spans)
    out: list = [None] * len(spans)
    ends: list[float] = []
    for i in sorted(range(len(spans)), key=lambda i: (spans[i].start_us, spans[i].end_us)):
        s = spans[i]
        j = bisect.bisect_right(ends, s.end_us)
        waited = ends[j - 1] if j else s.start_us
        out[i] = KernelSpan(s.name, min(max(s.start_us, waited), s.end_us), s.end_us)
        bisect.insort(ends, s.end_us)
    return out


def _owned(spans: list[KernelSpan]) -> dict[str, float]:
    """The union of the spans' time (µs), each instant given to the part of the kernel that started first among
    those running then (two kernels at once count once)."""
    order = sorted(range(len(spans)), key=lambda i: (spans[i].start_us, spans[i].end_us))
    bounds = sorted({t for s in spans for t in (s.start_us, s.end_us)})
    owned = dict.fromkeys(("selection", "copy_wait", "compute"), 0.0)
    heap: list[tuple[float, int]] = []
    nxt = 0
    for t0, t1 in zip(bounds, bounds[1:]):
        while nxt < len(order) and spans[order[nxt]].start_us <= t0:
            heapq.heappush(heap, (spans[order[nxt]].start_us, order[nxt]))
            nxt += 1
        while heap and spans[heap[0][1]].end_us <= t0:
            heapq.heappop(heap)
        if heap:
            owned[kernel_part(spans[heap[0][1]].name)] += t1 - t0
    return owned


def busy_us(spans: Iterable[KernelSpan]) -> float:
    """The time (µs) some kernel of `spans` runs, kernels at once counted once."""
    return sum(b - a for a, b in _merged((s.start_us, s.end_us) for s in spans))


def idle_before(spans: Iterable[KernelSpan]) -> list[float]:
    """Per span (in the order given), the GPU's idle time (µs) just before it could run: from the latest end of the
    kernels that could run before it to its start, 0 where one still ran. Give it `running`'s spans (the recorded
    ones hold PDL's waits). The gap before a step's first kernel holds the host's time between steps (a block's
    acceptance and the next block's input, the graph's launch); gaps inside a step are launch gaps (a kernel that
    cannot start early because the one before takes no PDL, or is not in the graph)."""
    spans = list(spans)
    out = [0.0] * len(spans)
    latest = None
    for i in sorted(range(len(spans)), key=lambda i: (spans[i].start_us, spans[i].end_us)):
        s = spans[i]
        if latest is not None:
            out[i] = max(0.0, s.start_us - latest)
        latest = s.end_us if latest is None else max(latest, s.end_us)
    return out


def kernel_table(prof, steps: int, rows: int = 20) -> tuple[str, float, float]:
    """(a markdown table of the kernels of a `torch.profiler.profile` run over `steps` steps, by name: calls per
    step, ms per step as the profiler recorded them and as they could run (`running`: under PDL a kernel's recorded
    span holds its wait for the kernel before, which the profiler's own table counts), µs per call as they ran, the
    GPU's idle µs per call just before them (`idle_before`: where a step's idle time is); kernels per step; the
    GPU's busy ms per step, instants with a kernel running counted once). Memory copies and memsets are left out
    (`profiled_spans`)."""
    spans = profiled_spans(prof)
    ran = running(spans)
    by_name: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    for raw, r, gap in zip(spans, ran, idle_before(ran), strict=True):
        entry = by_name[raw.name]
        entry[0] += 1
        entry[1] += raw.us
        entry[2] += r.us
        entry[3] += gap
    order = sorted(by_name.items(), key=lambda kv: -(kv[1][2] + kv[1][3]))[:rows]  # its share of the step
    lines = ["| kernel | calls per step | recorded ms per step | running ms per step | running µs per call "
             "| idle µs before, per call |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {name[:70]} | {n / steps:.1f} | {raw / 1e3 / steps:.3f} | {r / 1e3 / steps:.3f} | {r / n:.1f} "
              f"| {gap / n:.1f} |" for name, (n, raw, r, gap) in order]
    return "\n".join(lines), len(spans) / steps, busy_us(spans) / 1e3 / steps


def timeline(spans: Iterable[KernelSpan], blocks: int, step_ms: float, draft_ms: float = 0.0) -> dict:
    """The mean per-block timeline (ms, module docstring) of `blocks` blocks whose kernels are `spans`, each block
    taking step_ms of wall time."""
    if blocks < 1:
        raise ValueError(f"a timeline needs at least one block, got {blocks}")
    spans = running(spans)
    if not spans:
        raise ValueError("no kernels in the profile: the pass ran no GPU work (or the profiler had no CUDA "
                         "activity)")
    others = [s for s in spans if kernel_part(s.name) != "copy_wait"]
    owned = _owned(others)
    copies = _merged((s.start_us, s.end_us) for s in spans if kernel_part(s.name) == "copy_wait")
    copy_us = sum(b - a for a, b in copies)
    exposed = copy_us - _overlap(copies, _merged((s.start_us, s.end_us) for s in others))
    ms = 1e-3 / blocks
    out = {"draft": draft_ms, "selection": owned["selection"] * ms, "copy_issue": 0.0, "copy_checks": 0.0,
           "copy_wait": exposed * ms, "compute": owned["compute"] * ms, "copies_hidden": (copy_us - exposed) * ms,
           "step": step_ms}
    out["idle_other"] = step_ms - out["selection"] - out["copy_wait"] - out["compute"]
    return out
