"""hf_superoffload: SuperOffload for Hugging Face.

Full-parameter training with fp32 master weights and Adam states in host memory, a SIMD CPU Adam
overlapped with the GPU (speculation-then-validation), a GPU-resident tail of buckets, and casts placed
where the link makes them cheapest. The HF adapters are imported lazily (no transformers import here).
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from .config import SuperOffloadConfig
from .optimizer import SuperOffloadOptimizer
from .planning.plan import OffloadPlan
from .runtime.engine import module_weights

__version__ = "0.1.0"

__all__ = [
    "OffloadPlan",
    "SuperOffloadArguments",
    "SuperOffloadConfig",
    "SuperOffloadOptimizer",
    "SuperOffloadPlugin",
    "SuperOffloadTrainer",
    "__version__",
    "export_checkpoint",
    "module_weights",
    "prepare_superoffload",
]

_LAZY = {
    "SuperOffloadArguments": ".integrations.arguments",
    "SuperOffloadTrainer": ".integrations.transformers",
    "SuperOffloadPlugin": ".integrations.accelerate",
    "prepare_superoffload": ".integrations.accelerate",
    "export_checkpoint": ".export",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
