"""Expert offloading: the expert store in pinned host memory, slot buffers on the device, the ordered copy
stream with its prefetch queue, copy accounting, and the residency unit that engines share (`ExpertResidency`)."""

from specmoe.models.checkpoint import CheckpointReader  # the store's checkpoint reader (a models tool)

from .copies import CopyStats, CopyStream, SlotBuffers
from .memory import OffloadError, device_available_bytes, host_available_bytes
from .residency import ExpertResidency
from .store import ExpertStore

__all__ = ["CheckpointReader", "CopyStats", "CopyStream", "ExpertResidency", "ExpertStore",
           "OffloadError",
           "SlotBuffers", "device_available_bytes", "host_available_bytes"]
