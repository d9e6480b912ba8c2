"""The free device memory the planner sees honours ``torch.cuda.set_per_process_memory_fraction``."""

from __future__ import annotations

import pytest
import torch

from hf_superoffload.planning import hardware

GiB = 1024**3


@pytest.mark.parametrize(("fraction", "reserved", "expected"), [(1.0, 5 * GiB, 100 * GiB), (0.2, 4 * GiB, 24 * GiB),
                                                                  (0.01, 4 * GiB, 0)])
def test_a_per_process_cap_bounds_the_free_memory(monkeypatch: pytest.MonkeyPatch, fraction: float, reserved: int,
                                                  expected: int) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 * GiB, 140 * GiB))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: fraction)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved)
    free, total = hardware.cuda_free_bytes(torch.device("cuda", 0))
    assert total == 140 * GiB
    assert free == expected


def test_a_device_without_an_index_is_the_current_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """``HardwareProfile.measure("cuda")`` and ``hf-superoffload plan --profile measure`` pass ``cuda`` with no index;
    ``torch.cuda.get_per_process_memory_fraction`` raises for one (as torch does), so the current device is asked."""
    asked: list[torch.device] = []

    def fraction(device: torch.device) -> float:
        if torch.device(device).index is None:
            raise ValueError("Expected a torch.device with a specified index or an integer, but got:cuda")
        asked.append(torch.device(device))
        return 1.0

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 * GiB, 140 * GiB))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", fraction)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert hardware.cuda_free_bytes(torch.device("cuda")) == (100 * GiB, 140 * GiB)
    assert hardware.cuda_free_bytes("cuda") == (100 * GiB, 140 * GiB)
    assert asked == [torch.device("cuda", 3)] * 2
