"""Shared helpers for the Hugging Face integration tests (CPU, tiny models, a few steps each)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from hf_superoffload.testing import TokenDataset, master_of

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.pop("ACCELERATE_MIXED_PRECISION", None)

VOCAB = 128  # hf_superoffload.testing.tiny_llama's vocabulary
SMALL_BUCKETS = dict(superoffload_bucket_size_mb=0.004, superoffload_gpu_resident_buckets="2")
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def example(name: str) -> ModuleType:
    """``examples/<name>.py`` imported as the module ``name`` (registered in ``sys.modules``: dataclasses look
    their module up there)."""
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def train_kwargs(output_dir: Any, **overrides: Any) -> dict[str, Any]:
    """TrainingArguments keywords shared by the tests: CPU, no reporting, per-step logs, no checkpoints."""
    kw: dict[str, Any] = dict(
        output_dir=str(output_dir), use_cpu=True, report_to="none", disable_tqdm=True, logging_steps=1,
        save_strategy="no", per_device_train_batch_size=2, per_device_eval_batch_size=4, learning_rate=1e-3,
        weight_decay=0.1, lr_scheduler_type="linear", max_grad_norm=1.0, seed=0, dataloader_num_workers=0,
        dataloader_pin_memory=False,
    )
    kw.update(overrides)
    return kw


@pytest.fixture(scope="session")
def hf() -> SimpleNamespace:
    """Helpers for the tests in this folder (test modules cannot import each other in importlib mode)."""
    return SimpleNamespace(TokenDataset=TokenDataset, train_kwargs=train_kwargs, master_of=master_of,
                           example=example, SMALL_BUCKETS=SMALL_BUCKETS, VOCAB=VOCAB)


@pytest.fixture
def fresh_accelerate_state():
    """Reset accelerate's process-wide singletons around a test that builds its own Accelerator."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
