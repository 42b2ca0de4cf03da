"""Slot buffers on the device, the one ordered copy stream that fills them, and the copy accounting.

The logical cache (specmoe.routing) decides which expert each slot holds; this module makes the bytes follow
(Section 4.2 of the paper). Every logical insertion becomes one copy of one expert row from the expert store
into its slot:
- demand copies (part 2 inserted an expert the layer executes) are issued at once;
- prefetch copies (part 1 inserted a pre-gate candidate) are queued and issued by `pump` at layer
  boundaries with at most `max_in_flight` prefetches in flight; a queued prefetch whose slot was reassigned
  before it was issued is dropped; a queued prefetch that its layer executes is issued when the layer needs
  it (and counts as late).
All copies go through one ordered stream, so a later copy into a slot completes after an earlier one, and
each slot records the event of its latest copy. The compute stream waits only on the events of the slots it
executes (`need` + `wait`).

Accounting: demand; prefetch in time (complete when its layer first executes it), late (queued or still in
flight then), unused (evicted, or left at the end of the sequence, without executing; `dropped` counts those
of them that were never transferred); `issued` counts copies that went over the link while decoding.

On the CPU the copies are synchronous, unless `delay` simulates a link: then each copy completes `delay`
seconds after the one before it, and its bytes land only at completion (or when waited for), so a layer
that forgot to wait would compute on stale weights and the tests would see it.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass

import numpy as np
import torch

from .memory import check_fits, device_available_bytes
from .store import ExpertStore

CYCLES_PER_SECOND = 1.5e9  # for torch.cuda._sleep, which counts GPU clock cycles (delay injection only)


@dataclass
class CopyStats:
    """Copy counters, accumulated until `CopyStream.stats` is replaced."""

    demand: int = 0
    prefetch: int = 0  # prefetch insertions (part 1)
    prefetch_in_time: int = 0
    prefetch_late: int = 0
    prefetch_unused: int = 0
    dropped: int = 0  # unused prefetches that were never issued
    issued: int = 0  # copies transferred while decoding (demand + issued prefetches)
    skipped: int = 0  # copies not transferred in copies-skipped mode
    warm: int = 0  # copies of the warm set at sequence start (prompt processing)

    FIELDS = ("demand", "prefetch", "prefetch_in_time", "prefetch_late", "prefetch_unused", "dropped", "issued",
              "skipped", "warm")

    def as_array(self) -> np.ndarray:
        return np.array([getattr(self, f) for f in self.FIELDS], dtype=np.int64)

    def to_dict(self) -> dict:
        return asdict(self)


class SlotBuffers:
    """Per MoE layer, C slots of one expert row each, on the device: one tensor [L, C, W]."""

    def __init__(self, num_layers: int, capacity: int, width: int, dtype: torch.dtype, device,
                 memory_limit: int | None = None):
        itemsize = torch.empty((), dtype=dtype).element_size()
        needed = num_layers * capacity * width * itemsize
        available = device_available_bytes(device) if memory_limit is None else int(memory_limit)
        check_fits(f"the slot buffers (C={capacity} slots x {num_layers} layers x {width * itemsize / 1e6:.1f} MB)",
                   needed, available, f"memory on {device}", "Lower the capacity C.",
                   headroom=min(1024**3, needed // 8 + 16 * 1024**2))
        self.data = torch.zeros((num_layers, capacity, width), dtype=dtype, device=device)
        self.capacity = capacity

    def layer(self, layer: int) -> torch.Tensor:
        return self.data[layer]


class _RuntimeCopies:
    """Issues each expert copy and its event record as two CUDA runtime calls (cuda-python) on the copy stream.

    torch's `copy_(non_blocking=True)` from pinned memory also does per-copy bookkeeping for its caching host
    allocator (measured on the H200: 10-21 µs of host time per call); the expert store's pinned rows live as
    long as the engine, so that bookkeeping is not needed. The events are torch's own (created here by one
    record each), so torch's `query` and `wait_event` see these copies. Used where cuda-python is installed;
    `create` returns None otherwise (the torch path is used)."""

    def __init__(self, runtime, stream, events, dst, src):
        self.rt = runtime
        self.kind = runtime.cudaMemcpyKind.cudaMemcpyHostToDevice
        self.stream = runtime.cudaStream_t(stream.cuda_stream)
        self.events = [[runtime.cudaEvent_t(e.cuda_event) for e in row] for row in events]
        self.dst = [[t.data_ptr() for t in row] for row in dst]
        self.src = [[t.data_ptr() for t in row] for row in src]
        self.nbytes = dst[0][0].numel() * dst[0][0].element_size()

    @classmethod
    def create(cls, stream, events, dst, src) -> "_RuntimeCopies | None":
        try:
            from cuda.bindings import runtime
        except ImportError:
            return None
        for row in events:  # torch creates an event's handle at its first record
            for event in row:
                event.record(stream)
        stream.synchronize()
        return cls(runtime, stream, events, dst, src)

    def copy(self, layer: int, slot: int, expert: int) -> None:
        (err,) = self.rt.cudaMemcpyAsync(self.dst[layer][slot], self.src[layer][expert], self.nbytes, self.kind,
                                         self.stream)
        if err != self.rt.cudaError_t.cudaSuccess:
            raise RuntimeError(f"cudaMemcpyAsync of expert {expert} into slot {slot} of layer {layer} failed: {err}")
        (err,) = self.rt.cudaEventRecord(self.events[layer][slot], self.stream)
        if err != self.rt.cudaError_t.cudaSuccess:
            raise RuntimeError(f"cudaEventRecord failed: {err}")


class CopyStream:
    """One ordered copy stream from an ExpertStore into SlotBuffers, with the prefetch queue and accounting."""

    def __init__(self, store: ExpertStore, slots: SlotBuffers, max_in_flight: int = 2, skip: bool = False,
                 delay: tuple[float, float] | None = None, seed: int = 0):
        self.store, self.slots = store, slots
        self.max_in_flight = max_in_flight
        self.skip = skip
        self.delay = delay
        self.rng = np.random.default_rng(seed)
        self.cuda = slots.data.is_cuda
        num_layers, capacity = slots.data.shape[:2]
        self.owner = np.full((num_layers, capacity), -1, dtype=np.int64)  # logically assigned expert
        self.content = np.full((num_layers, capacity), -1, dtype=np.int64)  # bytes there once issued copies land
        self.gen = np.zeros((num_layers, capacity), dtype=np.int64)
        self.queued = np.zeros((num_layers, capacity), dtype=np.bool_)
        self.busy = np.zeros((num_layers, capacity), dtype=np.bool_)  # latest issued copy may be incomplete
        self.fresh = np.zeros((num_layers, capacity), dtype=np.bool_)  # prefetched, not executed since
        self.pending = np.zeros(num_layers, dtype=np.bool_)  # False: no slot of the layer is fresh or busy
        self.queue: deque = deque()
        self.inflight: deque = deque()
        self.stats = CopyStats()
        self.wait_s = 0.0  # CPU: time spent waiting for simulated copies
        self._dst = [[slots.data[l, s] for s in range(capacity)] for l in range(num_layers)]
        self._src = [[store.layers[l][e] for e in range(store.num_experts)] for l in range(num_layers)]
        if self.cuda:
            self.stream = torch.cuda.Stream(device=slots.data.device)
            self.events = [[torch.cuda.Event() for _ in range(capacity)] for _ in range(num_layers)]
            self.runtime = _RuntimeCopies.create(self.stream, self.events, self._dst, self._src)
            self.issue_path = "cuda-python" if self.runtime else "torch"
        else:
            self.done_at = np.zeros((num_layers, capacity))
            self.landing: deque = deque()
            self._last_done = 0.0

    # -- the link ------------------------------------------------------------------------------------
    def _issue(self, items: list[tuple[int, int]]) -> None:
        if not items:
            return
        for layer, slot in items:
            self.queued[layer, slot] = False
        if self.skip:
            for layer, slot in items:
                self.content[layer, slot] = self.owner[layer, slot]
            self.stats.skipped += len(items)
            return
        if self.cuda and self.runtime is not None and self.delay is None:
            for layer, slot in items:
                self.runtime.copy(layer, slot, int(self.owner[layer, slot]))
        elif self.cuda:
            with torch.cuda.stream(self.stream):
                for layer, slot in items:
                    if self.delay is not None:
                        torch.cuda._sleep(int(self.rng.uniform(*self.delay) * CYCLES_PER_SECOND))
                    self._dst[layer][slot].copy_(self._src[layer][self.owner[layer, slot]], non_blocking=True)
                    self.events[layer][slot].record(self.stream)
        else:
            now = time.perf_counter()
            for layer, slot in items:
                done = max(now, self._last_done) + (self.rng.uniform(*self.delay) if self.delay else 0.0)
                self._last_done = done
                self.done_at[layer, slot] = done
                self.landing.append((done, layer, slot, int(self.owner[layer, slot])))
            self._land(now if self.delay else np.inf)
        for layer, slot in items:
            self.content[layer, slot] = self.owner[layer, slot]
            self.busy[layer, slot] = True
            self.pending[layer] = True
        self.stats.issued += len(items)

    def _land(self, until: float) -> None:
        """CPU: write the bytes of simulated copies that have completed by `until`, in issue order."""
        while self.landing and self.landing[0][0] <= until:
            _, layer, slot, expert = self.landing.popleft()
            self._dst[layer][slot].copy_(self._src[layer][expert])

    def slot_done(self, layer: int, slot: int) -> bool:
        """Whether the latest copy into the slot has completed (so the slot holds its assigned expert)."""
        if not self.busy[layer, slot]:
            return True
        if self.cuda:
            done = self.events[layer][slot].query()
        else:
            now = time.perf_counter()
            done = self.done_at[layer, slot] <= now
            if done:
                self._land(now)
        if done:
            self.busy[layer, slot] = False
        return done

    def synchronize(self) -> None:
        """Wait for every issued copy."""
        if self.cuda:
            self.stream.synchronize()
        else:
            self._land(np.inf)
        self.busy[:] = False
        self.pending[:] = self.fresh.any(axis=1)

    # -- what the engine calls -----------------------------------------------------------------------
    def assign(self, layer: int, slots: np.ndarray, experts: np.ndarray, prefetch: bool,
               issue_now: bool = False) -> None:
        """Logical insertions of `experts` into `slots` of `layer`: demand copies are issued at once,
        prefetches queued (or issued at once with issue_now, the physical-cache mode)."""
        issue = []
        for slot, expert in zip(slots.tolist(), experts.tolist()):
            if self.fresh[layer, slot]:  # the slot's previous expert was prefetched and never executed
                self.stats.prefetch_unused += 1
                self.stats.dropped += int(self.queued[layer, slot])
            self.gen[layer, slot] += 1
            self.owner[layer, slot] = expert
            self.queued[layer, slot] = False
            self.fresh[layer, slot] = prefetch
            self.pending[layer] |= prefetch
            if prefetch and not issue_now:
                self.queued[layer, slot] = True
                self.queue.append((layer, slot, self.gen[layer, slot]))
            else:
                issue.append((layer, slot))
        if prefetch:
            self.stats.prefetch += len(experts)
            self.inflight.extend(issue)
        else:
            self.stats.demand += len(experts)
        self._issue(issue)

    def in_flight(self) -> int:
        """Prefetch copies issued and not yet complete (retiring the completed ones, oldest first)."""
        while self.inflight and self.slot_done(*self.inflight[0]):
            self.inflight.popleft()
        return len(self.inflight)

    def pump(self) -> None:
        """Layer boundary: issue queued prefetches, oldest first, while fewer than max_in_flight are in flight;
        drop those whose slot was reassigned since they were queued."""
        room = self.max_in_flight - self.in_flight()
        issue = []
        while self.queue and len(issue) < room:
            layer, slot, gen = self.queue.popleft()
            if gen == self.gen[layer, slot] and self.queued[layer, slot]:
                issue.append((layer, slot))
        self.inflight.extend(issue)
        self._issue(issue)

    def need(self, layer: int, slots: np.ndarray) -> list[int]:
        """The layer is about to execute `slots`: classify first uses of prefetched slots (in time / late),
        issue the ones still queued, and return the slots whose copies are not complete yet."""
        if not self.pending[layer]:  # the common case with few copies: nothing of this layer in flight
            return []
        fresh = self.fresh[layer, slots]
        if not fresh.any() and not self.busy[layer, slots].any():
            self.pending[layer] = self.fresh[layer].any() or self._any_busy(layer)
            return []
        if fresh.any():
            late_issue = []
            for slot in slots[fresh].tolist():
                self.fresh[layer, slot] = False
                if self.queued[layer, slot]:
                    self.stats.prefetch_late += 1
                    late_issue.append((layer, slot))
                elif self.slot_done(layer, slot):
                    self.stats.prefetch_in_time += 1
                else:
                    self.stats.prefetch_late += 1
            self.inflight.extend(late_issue)
            self._issue(late_issue)
        return [slot for slot in slots.tolist() if not self.slot_done(layer, slot)]

    def _any_busy(self, layer: int) -> bool:
        """Whether a copy into the layer may still be in flight (retiring the completed ones)."""
        return any(not self.slot_done(layer, int(slot)) for slot in np.flatnonzero(self.busy[layer]))

    def wait(self, layer: int, slots: list[int], compute_stream=None) -> None:
        """Make the computation of `layer` wait for the copies into `slots` (from `need`)."""
        if not slots:
            return
        if self.cuda:
            for slot in slots:
                compute_stream.wait_event(self.events[layer][slot])
            return
        until = max(self.done_at[layer, slot] for slot in slots)
        start = time.perf_counter()
        if until > start:
            time.sleep(until - start)
        self._land(until)
        for slot in slots:
            self.busy[layer, slot] = False
        self.wait_s += time.perf_counter() - start

    def reset_to(self, warm: np.ndarray) -> int:
        """Sequence start: unexecuted prefetches count as unused, the queue is dropped, and the warm set
        warm [L, C] is copied into the slots that do not hold it yet (always, also in copies-skipped mode).
        Returns the number of warm copies; waits until all have landed."""
        self.stats.prefetch_unused += int(self.fresh.sum())
        self.stats.dropped += int((self.fresh & self.queued).sum())
        self.queue.clear()
        self.inflight.clear()
        self.queued[:] = False
        self.fresh[:] = False
        self.synchronize()
        self.owner[:] = warm
        missing = np.argwhere(self.content != warm)
        skip, self.skip = self.skip, False
        before = self.stats.issued
        self._issue([(int(l), int(s)) for l, s in missing])
        self.stats.issued = before
        self.skip = skip
        self.stats.warm += len(missing)
        self.synchronize()
        return len(missing)
