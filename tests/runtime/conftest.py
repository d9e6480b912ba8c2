"""Fixtures shared by the runtime tests (test modules cannot import each other in importlib mode)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch

from hf_superoffload import SuperOffloadOptimizer
from hf_superoffload import optimizer as optimizer_module
from hf_superoffload.planning import hardware
from hf_superoffload.testing import pretend_profile


@pytest.fixture
def device_budget(monkeypatch: pytest.MonkeyPatch) -> Callable[[int | None], None]:
    """Pretend the device has ``budget`` bytes free (what ``HardwareProfile.read`` reports on a GPU)."""

    def set_budget(budget: int | None) -> None:
        monkeypatch.setattr(hardware.HardwareProfile, "read", classmethod(lambda cls, device: pretend_profile(budget)))

    return set_budget


class SimulatedDevice:
    """See :func:`sim_device`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self._monkeypatch = monkeypatch
        self.opt: SuperOffloadOptimizer | None = None
        self.reads = 0

    def budget(self, free: int, device_type: str = "cpu") -> None:
        """The free memory the first batch's plan sees (on CUDA too: the driver's figure, the known rates and the
        model's own weights are left out)."""
        mp, profile = self._monkeypatch, dataclasses.replace(pretend_profile(free), device_type=device_type)
        mp.setattr(hardware.HardwareProfile, "read", classmethod(lambda cls, device: profile))
        mp.setattr(optimizer_module, "cuda_free_bytes", lambda device: (free, free))
        mp.setattr(optimizer_module, "with_known_rates", lambda profile, device: profile)
        mp.setattr(optimizer_module, "_count_own_weights_as_free", lambda profile, own, device: profile)

    def measure(self, fn: Any) -> None:
        """What the calibration reads as this run's peak: ``fn(opt)`` (nothing while ``opt`` is ``None``)."""

        def measured(device: torch.device, other: int) -> int | None:
            self.reads += 1
            return None if self.opt is None else fn(self.opt)

        self._monkeypatch.setattr(optimizer_module, "_measured_device_need", measured)


@pytest.fixture
def sim_device(monkeypatch: pytest.MonkeyPatch) -> SimulatedDevice:
    """A simulated device for the calibration and tail-move tests ([Note: calibration from the measured peak]):
    ``budget(bytes)`` and ``measure(fn)``; ``reads`` counts the measurements."""
    return SimulatedDevice(monkeypatch)
