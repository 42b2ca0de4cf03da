"""Memory checks made before large allocations, so that a run that cannot fit fails at once with a message
that says how much was needed, how much there is, and what to change."""

from __future__ import annotations

GiB = 1024**3


class OffloadError(RuntimeError):
    """The expert store or the slot buffers cannot be built: too little memory, or missing expert weights."""


def host_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (psutil's figure where /proc is missing)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError as exc:  # pragma: no cover - neither /proc nor psutil
        raise OffloadError("cannot tell how much host memory is free: no /proc/meminfo and no psutil") from exc


def device_available_bytes(device) -> int:
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return host_available_bytes()


def check_fits(what: str, needed: int, available: int, where: str, hint: str, headroom: int = GiB // 2) -> None:
    """Raise OffloadError unless `needed` bytes (plus `headroom`) fit in `available`."""
    if needed + headroom > available:
        raise OffloadError(
            f"{what} needs {needed / GiB:.2f} GiB of {where} but only {available / GiB:.2f} GiB is available "
            f"(with {headroom / GiB:.1f} GiB kept free). {hint}"
        )
