"""Hugging Face adapters: thin translations onto :class:`~hf_superoffload.SuperOffloadOptimizer`.

- :mod:`.transformers`: ``SuperOffloadArguments`` + ``SuperOffloadTrainer`` (``transformers.Trainer``);
- :mod:`.accelerate`: ``SuperOffloadPlugin`` + ``prepare_superoffload`` (custom Accelerate loops), ``Preemption``
  (SIGTERM: save and stop after the step in flight), and the packaged accelerate YAMLs (``accelerate_config_path``).

Names are imported lazily, so ``import hf_superoffload.integrations`` does not import transformers.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__all__ = [
    "Preemption",
    "SuperOffloadAcceleratedOptimizer",
    "SuperOffloadArguments",
    "SuperOffloadPlugin",
    "SuperOffloadTrainer",
    "accelerate_config_path",
    "prepare_superoffload",
    "superoffload_config_from_args",
]

_WHERE = {
    "Preemption": "._preemption",
    "SuperOffloadAcceleratedOptimizer": "._common",
    "SuperOffloadArguments": ".arguments",
    "superoffload_config_from_args": ".arguments",
    "SuperOffloadTrainer": ".transformers",
    "SuperOffloadPlugin": ".accelerate",
    "accelerate_config_path": ".accelerate",
    "prepare_superoffload": ".accelerate",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(import_module(_WHERE[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
