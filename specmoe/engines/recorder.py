"""What an engine records while it decodes, kept out of the decode loop: per step the output token, wall time,
host time on the critical path split into its parts, copies by class, the exposed copy wait, the step's first
position and accepted drafts; per position of an autoregressive run the routing it saw (logits, selections);
per layer, with instrumentation, GPU events around the copy wait. `result()` assembles the `DecodeResult`."""

from __future__ import annotations

import time

import numpy as np
import torch

from .results import COPY_FIELDS, HOST_PARTS, DecodeResult

ROUTING, COPY_ISSUE, COPY_CHECKS = range(len(HOST_PARTS))
ATTENTION_DONE, WAIT_START, MOE_START = range(3)  # GPU events of a layer (instrumented runs)


def _noop(*args) -> None:
    return None


class StepRecorder:
    """Records of a run of up to `num_steps` steps over an `L x E x K` model; `copies` is the engine's copy
    stream (its counters are read at the start and end of every step). positions: keep the routing of each
    step's position (autoregressive runs, one position per step)."""

    def __init__(self, num_steps: int, num_layers: int, num_experts: int, top_k: int, copies,
                 instrument: bool = False, cuda_stream=None, positions: bool = True):
        n = num_steps
        shape = (n if positions else 0, num_layers, num_experts)
        self.num_layers = num_layers
        self.copies = copies
        self.router_logits = np.zeros(shape, np.float32)
        self.pregate_logits = np.zeros(shape, np.float32)
        self.selected = np.zeros(shape[:2] + (top_k,), np.int64)
        self.positions = positions
        self.inputs = np.zeros(n, np.int64)
        self.outputs = np.zeros(n, np.int64)
        self.roots = np.zeros(n, np.int64)
        self.accepted = np.zeros(n, np.int64)
        self.draft_ms = np.zeros(n)
        self.ms = np.zeros(n)
        self.host_ns = np.zeros((n, len(HOST_PARTS)), np.int64)
        self.copy_counts = np.zeros((n, len(COPY_FIELDS)), np.int64)
        self.wait_ms = np.zeros(n)
        self.steps = 0
        self._parts = np.zeros(len(HOST_PARTS), np.int64)
        self._last = 0
        self._t = 0
        self.stream = cuda_stream
        self.events = None
        self.gpu_mark = _noop
        if instrument and cuda_stream is not None:
            self.events = [[[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(num_layers)]
                           for _ in range(n)]
            self.gpu_mark = self._gpu_mark
        self.marked = np.zeros(n, bool)  # rows whose events were recorded (a prompt chunk marks its last row only)

    # -- inside a step -----------------------------------------------------------------------------------
    def begin(self, t: int, token: int, position: int) -> None:
        self._t = t
        self.inputs[t] = token
        self.roots[t] = position
        self._parts[:] = 0
        self._stats = self.copies.stats.as_array()
        self._wait = self.copies.wait_s
        self._start = time.perf_counter()

    def begin_chunk(self, t: int, tokens, position: int) -> None:
        """A prompt chunk: rows t .. t + D - 1 (one step; its time and copies go to its last row)."""
        d = len(tokens)
        self.inputs[t:t + d] = tokens
        self.roots[t:t + d] = np.arange(position, position + d)
        self.begin(t + d - 1, tokens[-1], position + d - 1)

    def end_chunk(self, t: int, outputs: np.ndarray) -> None:
        d = len(outputs)
        self.outputs[t:t + d] = outputs
        self.end(t + d - 1, int(outputs[-1]))

    def tick(self, part: int = -1) -> None:
        """Host time since the previous tick goes to `part` (ROUTING, COPY_ISSUE, COPY_CHECKS; -1: none)."""
        now = time.perf_counter_ns()
        if part >= 0:
            self._parts[part] += now - self._last
        self._last = now

    def _gpu_mark(self, layer: int, which: int) -> None:
        self.events[self._t][layer][which].record(self.stream)
        self.marked[self._t] = True

    def end(self, t: int, output_token: int, accepted: int = 0) -> None:
        self.ms[t] = (time.perf_counter() - self._start) * 1e3
        self.host_ns[t] = self._parts
        self.copy_counts[t] = self.copies.stats.as_array() - self._stats
        self.wait_ms[t] = (self.copies.wait_s - self._wait) * 1e3
        self.outputs[t] = output_token
        self.accepted[t] = accepted
        self.steps = t + 1

    def position_routing(self, t: int, logits: np.ndarray, selected: np.ndarray) -> None:
        """Row t's routing from a step that routed on the device: logits [L, 1, 2E] (router logits, then the next
        layer's pre-gate), selected [L, 1, K]; as the host loop records them."""
        e = logits.shape[-1] // 2
        self.router_logits[t] = logits[:, 0, :e]
        self.pregate_logits[t, 1:] = logits[:-1, 0, e:]
        self.selected[t] = selected[:, 0]

    # -- after the run -----------------------------------------------------------------------------------
    def result(self, timed_from: int, logits: np.ndarray | None, info: dict, k: int = 0,
               wait_seen: bool | None = None, **fields) -> DecodeResult:
        """The run's `DecodeResult`; steps before `timed_from` are not timed. wait_seen: whether the host sees
        the copy wait (default: on the CPU only)."""
        n = self.steps
        host_parts = self.host_ns[:n] / 1e3
        seen = self.stream is None if wait_seen is None else wait_seen
        p = n if self.positions else 0
        result = DecodeResult(
            ms=self.ms[:n], copies=self.copy_counts[:n], timed=np.arange(n) >= timed_from, roots=self.roots[:n],
            accepted=self.accepted[:n], draft_ms=self.draft_ms[:n], host_us=host_parts.sum(axis=1),
            num_layers=self.num_layers, k=k, wait_ms=self.wait_ms[:n] if seen else None,
            host_parts_us=host_parts,
            input_tokens=self.inputs[:p], output_tokens=self.outputs[:p].copy(), selected=self.selected[:p],
            router_logits=self.router_logits[:p], pregate_logits=self.pregate_logits[:p],
            logits=None if logits is None else logits[:n], unused_at_end=int(self.copies.fresh.sum()), info=info,
            **fields)
        if self.events is not None:  # GPU idle time between graph A's end and graph B's start, and its wait
            if self.stream is not None:  # the events were recorded on it
                torch.cuda.synchronize()
            gap, wait = np.full((n, self.num_layers), np.nan), np.full((n, self.num_layers), np.nan)
            for t in np.flatnonzero(self.marked[:n]):  # a prompt chunk's other rows have no events: NaN
                for layer, (done, wait_start, moe_start) in enumerate(self.events[t]):
                    gap[t, layer] = done.elapsed_time(moe_start) * 1e3
                    wait[t, layer] = wait_start.elapsed_time(moe_start) * 1e3
            result.gap_us, result.wait_us = gap, wait
        return result


class _NoRecord:
    """The recorder of a prefill step: nothing is kept."""

    @staticmethod
    def tick(part: int = -1) -> None:
        return None

    @staticmethod
    def gpu_mark(layer: int, which: int) -> None:
        return None


NO_RECORD = _NoRecord()
