"""Slot buffers on the device, the one ordered copy stream that fills them, and the copy accounting.

The logical cache (specmoe.routing) decides which expert each slot holds; this module makes the bytes follow
(Section 4.2 of the paper). Every logical insertion becomes one copy of one expert row from the expert store
into its slot:
- demand copies (part 2 inserted an expert the layer executes) are issued at once;
- prefetch copies (part 1 inserted a pre-gate candidate) are queued and issued by `pump` at layer
  boundaries with at most `max_in_flight` prefetches in flight; a queued prefetch whose slot was reassigned
  before it was issued is dropped; a queued prefetch that its layer executes is issued when the layer needs
  it (and counts as late).
All copies go through one ordered stream, so a later copy into a slot completes after an earlier one; copies
go out in numbered batches with one event each, and the compute stream waits only for the latest batch among
the slots it executes (`need` + `wait`).

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
from dataclasses import dataclass

import numpy as np
import torch
from numba import njit

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
    moved: int = 0  # device-to-device slot moves (speculative decoding's pool refill), not over the link

    FIELDS = ("demand", "prefetch", "prefetch_in_time", "prefetch_late", "prefetch_unused", "dropped", "issued",
              "skipped", "warm", "moved")

    def as_array(self) -> np.ndarray:
        return np.array([getattr(self, f) for f in self.FIELDS], dtype=np.int64)


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
    """Issues expert copies and event records as CUDA runtime calls (cuda-python) on the copy stream.

    torch's `copy_(non_blocking=True)` from pinned memory also does per-copy bookkeeping for its caching host
    allocator (measured on the H200: 10-21 µs of host time per call); the expert store's pinned rows live as
    long as the engine, so that bookkeeping is not needed. A batch of several copies goes out in one
    `cudaMemcpyBatchAsync` call (CUDA 12.8+) where the runtime has it and a probe copy through it lands
    (`batched`; else one `cudaMemcpyAsync` each, and `note` says why). The events are torch's own (created
    by one record each in `create`), so torch's `query` and `wait_event` see these copies. Used where
    cuda-python is installed; `create` returns None otherwise (the torch path is used)."""

    def __init__(self, runtime, stream, events, dst, src):
        self.rt = runtime
        self.ok = runtime.cudaError_t.cudaSuccess
        self.kind = runtime.cudaMemcpyKind.cudaMemcpyHostToDevice
        self.stream = runtime.cudaStream_t(stream.cuda_stream)
        self.events = [runtime.cudaEvent_t(e.cuda_event) for e in events]
        self.dst = [[t.data_ptr() for t in row] for row in dst]
        self.src = [[t.data_ptr() for t in row] for row in src]
        self.nbytes = dst[0][0].numel() * dst[0][0].element_size()
        self.batched, self.note = False, "cudaMemcpyBatchAsync not in this cuda-python"
        if hasattr(runtime, "cudaMemcpyBatchAsync"):
            self.attrs = [runtime.cudaMemcpyAttributes()]
            self.attrs[0].srcAccessOrder = runtime.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
            self.batched, self.note = True, ""

    @classmethod
    def create(cls, stream, events, dst, src) -> "_RuntimeCopies | None":
        try:
            from cuda.bindings import runtime
        except ImportError:
            return None
        for event in events:  # torch creates an event's handle at its first record
            event.record(stream)
        stream.synchronize()
        copies = cls(runtime, stream, events, dst, src)
        copies._probe_batch(stream, dst, src)
        return copies

    def _probe_batch(self, stream, dst, src) -> None:
        """One batch of two copies into the first slots of layer 0 (the warm set overwrites them later):
        keep the batched path only if the call succeeds and the bytes land."""
        if not self.batched or len(dst[0]) < 2:
            self.batched = False
            return
        experts = [len(src[0]) - 1, 0]
        try:
            self.copy_many(0, [0, 1], experts)
            stream.synchronize()
            landed = all(torch.equal(dst[0][s], src[0][e].to(dst[0][s].device)) for s, e in enumerate(experts))
        except (RuntimeError, TypeError, ValueError) as exc:
            self.batched, self.note = False, f"cudaMemcpyBatchAsync failed ({exc})"
            return
        if not landed:
            self.batched, self.note = False, "cudaMemcpyBatchAsync returned success but the bytes did not land"

    def copy_many(self, layer: int, slots: list[int], experts: list[int]) -> None:
        """Copy `experts` of `layer` into `slots`, on the copy stream."""
        dst, src = self.dst[layer], self.src[layer]
        if self.batched and len(slots) > 1:
            n = len(slots)
            err = self.rt.cudaMemcpyBatchAsync([dst[s] for s in slots], [src[e] for e in experts], [self.nbytes] * n,
                                               n, self.attrs, [0], 1, self.stream)[0]
            if err != self.ok:
                raise RuntimeError(f"cudaMemcpyBatchAsync of {n} experts failed: {err}")
            return
        for slot, expert in zip(slots, experts):
            (err,) = self.rt.cudaMemcpyAsync(dst[slot], src[expert], self.nbytes, self.kind, self.stream)
            if err != self.ok:
                raise RuntimeError(f"cudaMemcpyAsync of expert {expert} into slot {slot} of layer {layer} "
                                   f"failed: {err}")

    def record(self, index: int) -> None:
        (err,) = self.rt.cudaEventRecord(self.events[index], self.stream)
        if err != self.ok:
            raise RuntimeError(f"cudaEventRecord failed: {err}")


# The per-slot bookkeeping runs on the host's critical path between a layer's two CUDA graphs, a few slots at
# a time: numba kernels over the state arrays [L, C] cost one call each instead of a numpy call per slot.
@njit(cache=True)
def _assign(owner, gen, queued, fresh, layer, slots, experts, prefetch, queue_them):
    """Logical insertions of experts into slots of one layer; returns (unused, dropped): previous experts
    that were prefetched and never executed, and those of them never transferred."""
    unused = dropped = 0
    for j in range(slots.shape[0]):
        s = slots[j]
        if fresh[layer, s]:
            unused += 1
            if queued[layer, s]:
                dropped += 1
        gen[layer, s] += 1
        owner[layer, s] = experts[j]
        queued[layer, s] = queue_them
        fresh[layer, s] = prefetch
    return unused, dropped


@njit(cache=True)
def _mark_issued(owner, content, batch, queued, layer, slots, number):
    for j in range(slots.shape[0]):
        s = slots[j]
        queued[layer, s] = False
        content[layer, s] = owner[layer, s]
        batch[layer, s] = number


@njit(cache=True)
def _first_uses(fresh, queued, batch, layer, slots, done_batch, late, unknown):
    """The executed slots' first uses of prefetches (fresh cleared): still queued -> late[:n_late]; copy
    batch known complete -> in time; else -> unknown[:n_unknown] (the caller asks the events). Returns
    (in_time, n_late, n_unknown, the latest copy batch among the slots)."""
    in_time = n_late = n_unknown = latest = 0
    for j in range(slots.shape[0]):
        s = slots[j]
        if fresh[layer, s]:
            fresh[layer, s] = False
            if queued[layer, s]:
                late[n_late] = s
                n_late += 1
            elif batch[layer, s] <= done_batch:
                in_time += 1
            else:
                unknown[n_unknown] = s
                n_unknown += 1
        latest = max(latest, batch[layer, s])
    return in_time, n_late, n_unknown, latest


@njit(cache=True)
def _layer_pending(fresh, batch, layer, done_batch):
    """Whether a slot of the layer holds an unexecuted prefetch or a copy not known complete."""
    for s in range(fresh.shape[1]):
        if fresh[layer, s] or batch[layer, s] > done_batch:
            return True
    return False


class CopyStream:
    """One ordered copy stream from an ExpertStore into SlotBuffers, with the prefetch queue and accounting.

    Copies are issued in batches (the demand copies of a layer; the late prefetches a layer needs; each
    pumped prefetch alone), numbered 1, 2, ... in issue order, and one event is recorded after each batch.
    The stream is ordered, so batch b complete implies every batch before it complete: the stream keeps a
    watermark `done_batch` below which nothing is queried again, a layer waits on the one event of the
    latest batch among its slots, and in-time / late is exact per copy because a batch holds only copies
    needed at the same moment. Events live in a ring of RING batches: when batch b + RING reuses the event
    of batch b, questions about b are answered for the later batch, which is only conservative (b complete
    when b + RING is; waiting for b waits for b + RING), so correctness never depends on the ring's size."""

    RING = 1024

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
        self.batch = np.zeros((num_layers, capacity), dtype=np.int64)  # batch of the slot's latest copy
        self.fresh = np.zeros((num_layers, capacity), dtype=np.bool_)  # prefetched, not executed since
        self.pending = np.zeros(num_layers, dtype=np.bool_)  # False: no slot of the layer is fresh or in flight
        self.last_batch = 0  # batches issued so far
        self.done_batch = 0  # every batch up to this one has completed
        self.queue: deque = deque()
        self.inflight: deque = deque()  # batches of the prefetch copies issued and not known complete
        self._late = np.empty(capacity, dtype=np.int64)  # `need`'s scratch
        self._unknown = np.empty(capacity, dtype=np.int64)
        self.stats = CopyStats()
        self.wait_s = 0.0  # CPU: time spent waiting for simulated copies
        self._dst = [[slots.data[l, s] for s in range(capacity)] for l in range(num_layers)]
        self._src = [[store.layers[l][e] for e in range(store.num_experts)] for l in range(num_layers)]
        if self.cuda:
            self.stream = torch.cuda.Stream(device=slots.data.device)
            self.events = [torch.cuda.Event() for _ in range(self.RING)]
            self.runtime = _RuntimeCopies.create(self.stream, self.events, self._dst, self._src)
        else:
            self.done_at = np.zeros(self.RING)  # CPU: completion time of each batch of the ring
            self.landing: deque = deque()
            self._last_done = 0.0

    def configure(self, max_in_flight: int, skip: bool, delay: tuple[float, float] | None, seed: int) -> None:
        """Settings that may change between runs: prefetches in flight at once, copies skipped (the slot
        "holds" its expert at once, nothing is transferred), and a random delay (lo, hi) seconds before each
        copy from a generator seeded with `seed` (tests of timing independence)."""
        self.max_in_flight, self.skip, self.delay = max_in_flight, skip, delay
        self.rng = np.random.default_rng(seed)

    @property
    def issue_path(self) -> str:
        """How copies go out: "cpu" (synchronous or simulated), "torch" (`copy_`), or the CUDA runtime
        through cuda-python, batched or one call per copy (with the reason)."""
        if not self.cuda:
            return "cpu"
        if self.runtime is None:
            return "torch"
        return "cuda-python, batched" if self.runtime.batched else f"cuda-python ({self.runtime.note})"

    # -- the link ------------------------------------------------------------------------------------
    def _issue(self, layer: int, slots: np.ndarray) -> int:
        """Issue the copies into `slots` (int array) of `layer` as one batch; returns its number (0: none)."""
        n = len(slots)
        if n == 0:
            return 0
        if self.skip:  # the slot "holds" its expert at once; nothing goes over the link
            self.queued[layer, slots] = False
            self.content[layer, slots] = self.owner[layer, slots]
            self.stats.skipped += n
            return 0
        self.last_batch = number = self.last_batch + 1
        ring = number % self.RING
        experts = self.owner[layer, slots].tolist()
        if self.cuda and self.runtime is not None and self.delay is None:
            self.runtime.copy_many(layer, slots.tolist(), experts)
            self.runtime.record(ring)
        elif self.cuda:
            with torch.cuda.stream(self.stream):
                for slot, expert in zip(slots.tolist(), experts):
                    if self.delay is not None:
                        torch.cuda._sleep(int(self.rng.uniform(*self.delay) * CYCLES_PER_SECOND))
                    self._dst[layer][slot].copy_(self._src[layer][expert], non_blocking=True)
                self.events[ring].record(self.stream)
        else:
            now = time.perf_counter()
            for slot, expert in zip(slots.tolist(), experts):
                done = max(now, self._last_done) + (self.rng.uniform(*self.delay) if self.delay else 0.0)
                self._last_done = done
                self.landing.append((done, layer, slot, expert))
            self.done_at[ring] = self._last_done
            self._land(now if self.delay else np.inf)
        _mark_issued(self.owner, self.content, self.batch, self.queued, layer, slots, number)
        self.pending[layer] = True
        self.stats.issued += n
        return number

    def _land(self, until: float) -> None:
        """CPU: write the bytes of simulated copies that have completed by `until`, in issue order."""
        while self.landing and self.landing[0][0] <= until:
            _, layer, slot, expert = self.landing.popleft()
            self._dst[layer][slot].copy_(self._src[layer][expert])

    def batch_done(self, batch: int) -> bool:
        """Whether copy batch `batch` (and so every earlier one) has completed."""
        if batch <= self.done_batch:
            return True
        if self.cuda:
            done = self.events[batch % self.RING].query()
        else:
            now = time.perf_counter()
            done = self.done_at[batch % self.RING] <= now
            if done:
                self._land(now)
        if done:
            self.done_batch = batch
        return done

    def slot_done(self, layer: int, slot: int) -> bool:
        """Whether the latest copy into the slot has completed (so the slot holds its assigned expert)."""
        return self.batch_done(int(self.batch[layer, slot]))

    def synchronize(self) -> None:
        """Wait for every issued copy."""
        if self.cuda:
            self.stream.synchronize()
        else:
            self._land(np.inf)
        self.done_batch = self.last_batch
        self.pending[:] = self.fresh.any(axis=1)

    # -- what the engine calls -----------------------------------------------------------------------
    def assign(self, layer: int, slots: np.ndarray, experts: np.ndarray, prefetch: bool,
               issue_now: bool = False) -> None:
        """Logical insertions of `experts` into `slots` of `layer`: demand copies are issued at once (one
        batch), prefetches queued (or issued at once with issue_now, the physical-cache mode)."""
        queue_them = prefetch and not issue_now
        unused, dropped = _assign(self.owner, self.gen, self.queued, self.fresh, layer, slots, experts, prefetch,
                                  queue_them)
        if unused:
            self.stats.prefetch_unused += unused
            self.stats.dropped += dropped
        if not prefetch:
            self.stats.demand += len(experts)
            self._issue(layer, slots)
            return
        self.pending[layer] = True
        self.stats.prefetch += len(experts)
        for slot in slots.tolist():
            if queue_them:
                self.queue.append((layer, slot, int(self.gen[layer, slot])))
            else:
                self.inflight.append(self._issue(layer, np.array([slot])))

    def move(self, layer: int, src_slots: np.ndarray, dst_slots: np.ndarray) -> int:
        """Device-to-device moves of whole slots of `layer`, src_slots[i] -> dst_slots[i] (disjoint sets):
        speculative decoding's pool refill, where experts entering the pool leave their union slot for a freed
        pool slot (`ExpertPool.end_block`). The bytes really move, so the slot buffer keeps following the
        pool's slot table. On CUDA the moves go out on the copy stream as one batch, ordered after every
        earlier copy (the ones that filled the union slots) and before every later one (the next block's
        copies into those union slots); the caller must have finished the computation that reads the
        destination slots (the engine waits for the block's head first). On the CPU the sources are waited
        for (simulated link) and the moves are synchronous. Copies-skipped mode moves the bookkeeping only.
        Returns the batch number (0: none or CPU/skipped); counted in `stats.moved`, not in `issued`."""
        src = np.asarray(src_slots, dtype=np.int64)
        dst = np.asarray(dst_slots, dtype=np.int64)
        if src.shape != dst.shape or src.ndim != 1 or np.intersect1d(src, dst).size:
            raise ValueError(f"move needs equal-length disjoint slot lists, got {src.tolist()} -> {dst.tolist()}")
        if src.size == 0:
            return 0
        self.stats.moved += int(src.size)
        number = 0
        if not self.skip:
            if self.cuda:
                self.last_batch = number = self.last_batch + 1
                with torch.cuda.stream(self.stream):
                    data = self.slots.data[layer]
                    data[torch.as_tensor(dst, device=data.device)] = data[torch.as_tensor(src, device=data.device)]
                    self.events[number % self.RING].record(self.stream)
                self.batch[layer, dst] = number
                self.pending[layer] = True
            else:
                self.wait(layer, int(self.batch[layer, src].max()))
                data = self.slots.data[layer]
                data[torch.from_numpy(dst)] = data[torch.from_numpy(src)]
                self.batch[layer, dst] = self.batch[layer, src]
        self.owner[layer, dst] = self.owner[layer, src]
        self.content[layer, dst] = self.content[layer, src]
        self.gen[layer, dst] += 1
        self.queued[layer, dst] = False
        self.fresh[layer, dst] = False
        return number

    def retire(self, layer: int, slots: np.ndarray) -> None:
        """The prefetches in `slots` of `layer` that were never executed will not be: count them unused now
        (speculative decoding's block prefetch, whose union slots are free again after the block), dropping
        any still queued. Slots executed or reassigned since are not counted."""
        fresh = self.fresh[layer, slots]
        if fresh.any():
            self.stats.prefetch_unused += int(fresh.sum())
            self.stats.dropped += int((fresh & self.queued[layer, slots]).sum())
            self.queued[layer, slots] = False
            self.fresh[layer, slots] = False

    def in_flight(self) -> int:
        """Prefetch copies issued and not yet complete (retiring the completed ones, oldest first)."""
        while self.inflight and self.batch_done(self.inflight[0]):
            self.inflight.popleft()
        return len(self.inflight)

    def pump(self) -> None:
        """Layer boundary: issue queued prefetches, oldest first, while fewer than max_in_flight are in flight;
        drop those whose slot was reassigned since they were queued."""
        if not self.queue:
            return
        room = self.max_in_flight - self.in_flight()
        while self.queue and room > 0:
            layer, slot, gen = self.queue.popleft()
            if gen == self.gen[layer, slot] and self.queued[layer, slot]:
                self.inflight.append(self._issue(layer, np.array([slot])))
                room -= 1

    def need(self, layer: int, slots: np.ndarray) -> int:
        """The layer is about to execute `slots`: classify first uses of prefetched slots (in time / late),
        issue the ones still queued, and return the copy batch the layer must wait for (0: none)."""
        if not self.pending[layer]:  # the common case with few copies: nothing of this layer in flight
            return 0
        in_time, n_late, n_unknown, latest = _first_uses(self.fresh, self.queued, self.batch, layer, slots,
                                                         self.done_batch, self._late, self._unknown)
        late = n_late
        for slot in self._unknown[:n_unknown].tolist():
            if self.slot_done(layer, slot):
                in_time += 1
            else:
                late += 1
        if in_time or late:
            self.stats.prefetch_in_time += in_time
            self.stats.prefetch_late += late
        if n_late:
            latest = self._issue(layer, self._late[:n_late]) or latest
            self.inflight.extend([latest] * n_late)
        if latest and not self.batch_done(latest):
            return latest
        self.pending[layer] = _layer_pending(self.fresh, self.batch, layer, self.done_batch)
        return 0

    def wait(self, layer: int, batch: int, compute_stream=None) -> None:
        """Make the computation of `layer` wait for copy batch `batch` (from `need`) and all before it."""
        if not batch:
            return
        if self.cuda:
            compute_stream.wait_event(self.events[batch % self.RING])
            return
        until = self.done_at[batch % self.RING]
        start = time.perf_counter()
        if until > start:
            time.sleep(until - start)
        self._land(until)
        self.done_batch = max(self.done_batch, batch)
        self.wait_s += time.perf_counter() - start

    def reset_to(self, warm: np.ndarray) -> int:
        """Sequence start: unexecuted prefetches count as unused, the queue is dropped, and the warm set
        warm [L, c] is copied into the first c slots where they do not hold it yet (always, also in
        copies-skipped mode); slots from c on keep their bytes. Returns the number of warm copies; waits until
        all have landed."""
        self.stats.prefetch_unused += int(self.fresh.sum())
        self.stats.dropped += int((self.fresh & self.queued).sum())
        self.queue.clear()
        self.inflight.clear()
        self.queued[:] = False
        self.fresh[:] = False
        self.synchronize()
        num_warm = warm.shape[1]
        if num_warm > self.owner.shape[1]:
            raise ValueError(f"a warm set of {num_warm} experts per layer does not fit {self.owner.shape[1]} slots")
        self.owner[:, :num_warm] = warm
        self.owner[:, num_warm:] = self.content[:, num_warm:]
        skip, self.skip = self.skip, False
        before, copies = self.stats.issued, 0
        for layer in range(warm.shape[0]):
            missing = np.flatnonzero(self.content[layer, :num_warm] != warm[layer])
            self._issue(layer, missing)
            copies += len(missing)
        self.stats.issued = before
        self.skip = skip
        self.stats.warm += copies
        self.synchronize()
        return copies
