"""A GPU run whose Triton cannot be imported says so once, loudly, and falls back to the eager twins."""

from __future__ import annotations

import types
import warnings

import pytest
import torch

from hf_superoffload import triton_kernels as tk


def test_a_broken_triton_on_cuda_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tk, "_import_tried", True)
    monkeypatch.setattr(tk, "_kmod", None)
    monkeypatch.setattr(tk, "_import_error", "ImportError: libcuda.so.1 not found")
    monkeypatch.setattr(tk, "_warned_no_native", False)
    monkeypatch.delenv("HF_SUPEROFFLOAD_DISABLE_TRITON", raising=False)
    on_gpu = types.SimpleNamespace(device=torch.device("cuda", 0))  # only the device is read
    with pytest.warns(RuntimeWarning, match="Triton cannot be imported .*libcuda.*pip install"):
        assert tk.backend_for(on_gpu) == "reference"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: a second call is silent
        assert tk.backend_for(on_gpu) == "reference"
    on_cpu = types.SimpleNamespace(device=torch.device("cpu"))
    monkeypatch.setattr(tk, "_warned_no_native", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the CPU path never expected the native kernels
        assert tk.backend_for(on_cpu) == "reference"
