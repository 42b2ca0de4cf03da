"""What an engine records while it decodes, kept out of the decode loop: per step the routing it saw
(logits, selections), the output token, wall time, host time on the critical path split into its parts,
copies by class and the exposed copy wait; per layer, with instrumentation, GPU events around the copy
wait. `result()` assembles the `DecodeResult`."""

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
    stream (its counters are read at the start and end of every step)."""

    def __init__(self, num_steps: int, num_layers: int, num_experts: int, top_k: int, copies,
                 instrument: bool = False, cuda_stream=None):
        n, shape = num_steps, (num_steps, num_layers, num_experts)
        self.copies = copies
        self.router_logits = np.zeros(shape, np.float32)
        self.pregate_logits = np.zeros(shape, np.float32)
        self.selected = np.zeros((n, num_layers, top_k), np.int64)
        self.inputs = np.zeros(n, np.int64)
        self.outputs = np.zeros(n, np.int64)
        self.ms = np.zeros(n)
        self.host_ns = np.zeros((n, len(HOST_PARTS)), np.int64)
        self.copy_counts = np.zeros((n, len(COPY_FIELDS)), np.int64)
        self.wait_ms = np.zeros(n)
        self.steps = 0
        self._parts = np.zeros(len(HOST_PARTS), np.int64)
        self._last = 0
        self.stream = cuda_stream
        self.events = None
        self.gpu_mark = _noop
        if instrument and cuda_stream is not None:
            self.events = [[[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(num_layers)]
                           for _ in range(n)]
            self.gpu_mark = self._gpu_mark

    # -- inside a step -----------------------------------------------------------------------------------
    def begin(self, t: int, token: int) -> None:
        self.inputs[t] = token
        self._parts[:] = 0
        self._stats = self.copies.stats.as_array()
        self._wait = self.copies.wait_s
        self._start = time.perf_counter()

    def tick(self, part: int = -1) -> None:
        """Host time since the previous tick goes to `part` (ROUTING, COPY_ISSUE, COPY_CHECKS; -1: none)."""
        now = time.perf_counter_ns()
        if part >= 0:
            self._parts[part] += now - self._last
        self._last = now

    def _gpu_mark(self, t: int, layer: int, which: int) -> None:
        self.events[t][layer][which].record(self.stream)

    def end(self, t: int, output_token: int) -> None:
        self.ms[t] = (time.perf_counter() - self._start) * 1e3
        self.host_ns[t] = self._parts
        self.copy_counts[t] = self.copies.stats.as_array() - self._stats
        self.wait_ms[t] = (self.copies.wait_s - self._wait) * 1e3
        self.outputs[t] = output_token
        self.steps = t + 1

    # -- after the run -----------------------------------------------------------------------------------
    def result(self, timed_from: int, logits: np.ndarray | None, info: dict) -> DecodeResult:
        n = self.steps
        host_parts = self.host_ns[:n] / 1e3
        result = DecodeResult(
            input_tokens=self.inputs[:n], output_tokens=self.outputs[:n].copy(), selected=self.selected[:n],
            router_logits=self.router_logits[:n], pregate_logits=self.pregate_logits[:n],
            timed=np.arange(n) >= timed_from, ms=self.ms[:n], host_us=host_parts.sum(axis=1),
            copies=self.copy_counts[:n], wait_ms=None if self.stream is not None else self.wait_ms[:n],
            logits=None if logits is None else logits[:n], unused_at_end=int(self.copies.fresh.sum()),
            host_parts_us=host_parts, info=info)
        if self.events is not None:  # GPU idle time between graph A's end and graph B's start, and its wait
            torch.cuda.synchronize()
            num_layers = len(self.events[0])
            gap, wait = np.zeros((n, num_layers)), np.zeros((n, num_layers))
            for t in range(n):
                for layer, (done, wait_start, moe_start) in enumerate(self.events[t]):
                    gap[t, layer] = done.elapsed_time(moe_start) * 1e3
                    wait[t, layer] = wait_start.elapsed_time(moe_start) * 1e3
            result.gap_us, result.wait_us = gap, wait
        return result
