"""The step recorder's instrumentation: GPU events exist for every step, but a prompt chunk is one step that
records them on its last row only; the result reads the rows that were recorded (reading the others is what
`torch.cuda.Event.elapsed_time` refuses: "Both events must be recorded")."""

import numpy as np

from specmoe.engines.recorder import ATTENTION_DONE, MOE_START, WAIT_START, StepRecorder
from specmoe.engines.results import COPY_FIELDS


class FakeEvent:
    """A CUDA event's interface on the CPU: elapsed_time refuses events never recorded, as CUDA's do."""

    clock = 0.0

    def __init__(self):
        self.at = None

    def record(self, stream=None):
        FakeEvent.clock += 1.0
        self.at = FakeEvent.clock

    def elapsed_time(self, other):
        if self.at is None or other.at is None:
            raise ValueError("Both events must be recorded before calculating elapsed time.")
        return other.at - self.at


class FakeCopies:
    class stats:
        @staticmethod
        def as_array():
            return np.zeros(len(COPY_FIELDS), np.int64)

    wait_s = 0.0
    fresh = np.zeros(1)


def test_instrumented_prompt_chunk_rows_are_nan_and_steps_are_timed():
    layers, steps = 2, 6
    rec = StepRecorder(steps, layers, 4, 2, FakeCopies())
    rec.events = [[[FakeEvent() for _ in range(3)] for _ in range(layers)] for _ in range(steps)]
    rec.gpu_mark = rec._gpu_mark
    rec.begin_chunk(0, [5, 6, 7, 8], 0)  # rows 0..3: one step, marked on row 3
    for layer in range(layers):
        for which in (ATTENTION_DONE, WAIT_START, MOE_START):
            rec.gpu_mark(layer, which)
    rec.end_chunk(0, np.array([6, 7, 8, 9]))
    for t in (4, 5):  # one position per step
        rec.begin(t, 9, t)
        for layer in range(layers):
            for which in (ATTENTION_DONE, WAIT_START, MOE_START):
                rec.gpu_mark(layer, which)
        rec.end(t, 9)
    result = rec.result(4, None, {})
    assert np.isnan(result.gap_us[:3]).all() and np.isnan(result.wait_us[:3]).all()
    # three marks a layer, 1 ms apart on the fake clock; the result holds µs
    assert (result.gap_us[3:] == 2000.0).all() and (result.wait_us[3:] == 1000.0).all()
    assert result.summary()["gpu_gap_us_per_layer"] == 2000.0
