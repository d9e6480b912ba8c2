"""Fixtures shared by the runtime tests (test modules cannot import each other in importlib mode)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from hf_superoffload.planning import hardware
from hf_superoffload.testing import pretend_profile


@pytest.fixture
def device_budget(monkeypatch: pytest.MonkeyPatch) -> Callable[[int | None], None]:
    """Pretend the device has ``budget`` bytes free (what ``HardwareProfile.read`` reports on a GPU)."""

    def set_budget(budget: int | None) -> None:
        monkeypatch.setattr(hardware.HardwareProfile, "read", classmethod(lambda cls, device: pretend_profile(budget)))

    return set_budget
