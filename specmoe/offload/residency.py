"""The expert-residency unit: everything that makes host-resident experts executable on the device, in one
object that engines receive rather than build.

`ExpertResidency` holds the expert store (every expert in pinned host memory), the slot buffers (C slots per
MoE layer on the device) and the one ordered copy stream that fills them, with its prefetch queue and copy
accounting. One process can run several engines on one unit, alternately (an autoregressive engine and a
speculative engine, or engines with different policies): there is one pinned copy of the experts and one
copy stream, and each run starts by loading its own warm set into the slots (`load_warm`), which copies only
the slots whose bytes differ.
"""

from __future__ import annotations

import numpy as np
import torch

from .copies import CopyStream, SlotBuffers
from .store import ExpertStore


class ExpertResidency:
    """An expert store, `num_slots` slots per layer on `device` and the copy stream between them."""

    def __init__(self, store: ExpertStore, num_slots: int, device, *, memory_limit: int | None = None):
        """memory_limit: bytes of device memory to assume free (default: ask the device); the slot buffers
        must fit, else OffloadError."""
        if not 1 <= num_slots <= store.num_experts:
            raise ValueError(f"{num_slots} slots per layer: need 1 .. E={store.num_experts}")
        self.store = store
        self.slots = SlotBuffers(store.num_layers, num_slots, store.width, store.dtype, torch.device(device),
                                 memory_limit)
        self.copies = CopyStream(store, self.slots)

    @property
    def num_slots(self) -> int:
        return self.slots.capacity

    @property
    def device(self) -> torch.device:
        return self.slots.data.device

    def configure(self, max_in_flight: int = 2, skip_copies: bool = False,
                  copy_delay: tuple[float, float] | None = None, delay_seed: int = 0) -> None:
        """The copy stream's run settings (see `CopyStream.configure`)."""
        self.copies.configure(max_in_flight, skip_copies, copy_delay, delay_seed)

    def load_warm(self, warm: np.ndarray) -> int:
        """Sequence start: warm [L, c] (c <= num_slots) into slots 0 .. c-1, waited for; returns the number of
        copies (prompt processing, never timed)."""
        return self.copies.reset_to(warm)

    def check_fits(self, num_layers: int, num_experts: int, width: int, dtype: torch.dtype, capacity: int) -> None:
        """ValueError unless a model of this geometry with `capacity` logical slots can run on this unit."""
        s = self.store
        row = s.geometry.expert_width if s.fp8 else s.width  # an FP8 row holds 3 I H weights, dequantised on the fly
        if (s.num_layers, s.num_experts, row) != (num_layers, num_experts, width):
            raise ValueError(f"the expert store ({s.num_layers} layers x {s.num_experts} experts, row {row}) "
                             f"does not match the decoder ({num_layers} x {num_experts}, row {width})")
        if s.dtype != dtype and not s.fp8:
            raise ValueError(f"the expert store holds {s.dtype}, the decoder computes in {dtype}")
        if capacity > self.num_slots:
            raise ValueError(f"capacity C={capacity} exceeds the {self.num_slots} slots per layer of the expert "
                             "residency unit")
