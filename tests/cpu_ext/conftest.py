"""Fixtures of the CPU Adam tests: the compiled library and each SIMD path forced in turn."""

from __future__ import annotations

import os
import platform

import pytest
import torch

from hf_superoffload import cpu_ext

_X86 = platform.machine().lower() in ("x86_64", "amd64")
ISAS: tuple[str, ...] = ("scalar", "avx2", "avx512", "avx512_bf16") if _X86 else ("scalar", "neon", "sve")
"""The paths of this architecture; those the CPU cannot run are skipped with a reason."""


@pytest.fixture(scope="session")
def compiled() -> None:
    """The compiled op library; a build failure fails the test (the fallback has its own tests)."""
    if os.environ.get(cpu_ext.DISABLE_ENV, "").strip() not in ("", "0"):
        pytest.skip(f"{cpu_ext.DISABLE_ENV} is set")
    state = cpu_ext.load_state()
    assert state.loaded, f"the CPU Adam extension did not load: {state.reason}"


@pytest.fixture(params=ISAS)
def isa(request: pytest.FixtureRequest, compiled: None, monkeypatch: pytest.MonkeyPatch) -> str:
    """Forces one SIMD path through HF_SUPEROFFLOAD_CPU_ADAM_ISA for the duration of the test."""
    name: str = request.param
    if name not in torch.ops.hf_superoffload.cpu_adam_supported_isas():
        pytest.skip(f"this CPU cannot run the {name} path")
    monkeypatch.setenv(cpu_ext.ISA_ENV, name)
    return name
