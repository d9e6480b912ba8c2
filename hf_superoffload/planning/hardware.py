"""What the planner knows about the machine. Read cheaply here; measured bandwidths come later."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

__all__ = ["HardwareProfile", "available_host_bytes", "default_cpu_threads"]


def default_cpu_threads() -> int:
    """Cores in this process's affinity mask, minus one for the Python thread that feeds the GPU.

    Deliberately independent of ``OMP_NUM_THREADS``: ``accelerate launch`` exports 1 there.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    return max(1, cores - 1)


def available_host_bytes() -> int | None:
    """``MemAvailable`` from /proc/meminfo, or ``None`` where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


@dataclass(frozen=True, slots=True)
class HardwareProfile:
    """Facts about the machine. Every field can be overridden for tests or to simulate another machine.

    Attributes:
        device_type: ``"cuda"`` or ``"cpu"`` (the model's device).
        device_free_bytes: free device memory; ``None`` when unknown (CPU).
        host_available_bytes: host RAM available to this process; ``None`` when unknown.
        cpu_threads: threads the CPU Adam may use.
    """

    device_type: str
    device_free_bytes: int | None
    host_available_bytes: int | None
    cpu_threads: int

    @classmethod
    def read(cls, device: torch.device) -> HardwareProfile:
        free = None
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
        return cls(
            device_type=device.type,
            device_free_bytes=free,
            host_available_bytes=available_host_bytes(),
            cpu_threads=default_cpu_threads(),
        )
