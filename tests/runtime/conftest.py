"""Fixtures shared by the runtime tests (test modules cannot import each other in importlib mode)."""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from hf_superoffload import SuperOffloadOptimizer
from hf_superoffload import optimizer as optimizer_module
from hf_superoffload.planning import hardware
from hf_superoffload.planning.plan import BucketSpec
from hf_superoffload.runtime import layout
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


class StagingWatch:
    """See :func:`staging_watch`."""

    def __init__(self, stage: Callable[[torch.Tensor, Sequence[BucketSpec]], torch.Tensor],
                 alone: Callable[[int, torch.device], torch.Tensor]) -> None:
        self._stage, self._alone = stage, alone
        self._refs: list[weakref.ref[torch.Tensor]] = []
        self.most_alive = 0
        self.elements: list[int] = []
        self.old_arenas: list[weakref.ref[torch.Tensor]] = []
        self.old_alive_at_alloc: list[int] = []

    def __call__(self, arena: torch.Tensor, pieces: Sequence[BucketSpec]) -> torch.Tensor:
        self.old_arenas.append(weakref.ref(arena))
        held = self._stage(arena, pieces)
        self._refs.append(weakref.ref(held))
        self.elements.append(held.numel())
        self.most_alive = max(self.most_alive, self.alive)
        return held

    def allocate(self, numel: int, device: torch.device) -> torch.Tensor:
        self.old_alive_at_alloc.append(sum(r() is not None for r in self.old_arenas))
        return self._alone(numel, device)

    @property
    def alive(self) -> int:
        return sum(r() is not None for r in self._refs)


@pytest.fixture
def staging_watch(monkeypatch: pytest.MonkeyPatch) -> StagingWatch:
    """On a device that cannot hold an old and a new device arena at once (``layout.allocate_beside`` finds no
    room), the host copies a move of the device tail stages its arenas through (``layout.stage_on_host``), each
    tracked by a weak reference: ``most_alive`` is the most alive at once (counted as each is made), ``alive`` now,
    ``elements`` what each held; ``old_alive_at_alloc``: the staged old device arenas still alive as each new one is
    allocated (none: the device never holds an old and a new arena at once)."""
    watch = StagingWatch(layout.stage_on_host, layout.allocate_alone)
    monkeypatch.setattr(layout, "allocate_beside", lambda numel, device: None)
    monkeypatch.setattr(layout, "stage_on_host", watch)
    monkeypatch.setattr(layout, "allocate_alone", watch.allocate)
    return watch


class BesideWatch:
    """See :func:`beside_watch`."""

    def __init__(self, allocate: Callable[[int, torch.device], torch.Tensor | None]) -> None:
        self._allocate = allocate
        self.old: list[weakref.ref[torch.Tensor]] = []
        self.old_alive_at_call: list[int] = []

    def watch_arenas(self, tensors: Sequence[torch.Tensor]) -> None:
        self.old = [weakref.ref(t) for t in tensors]

    def __call__(self, numel: int, device: torch.device) -> torch.Tensor | None:
        self.old_alive_at_call.append(sum(r() is not None for r in self.old))
        return self._allocate(numel, device)


@pytest.fixture
def beside_watch(monkeypatch: pytest.MonkeyPatch) -> BesideWatch:
    """Each device arena a move allocates beside the old ones (``layout.allocate_beside``): for each call, how many
    of the arenas given to ``watch_arenas`` were still alive."""
    watch = BesideWatch(layout.allocate_beside)
    monkeypatch.setattr(layout, "allocate_beside", watch)
    return watch
