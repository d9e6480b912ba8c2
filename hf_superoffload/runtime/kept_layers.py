"""Kept layers: the plan's share of decoder layers that skip activation checkpointing ([Note: kept layers] in
planning/planner.py).

transformers checkpoints per decoder layer (``GradientCheckpointingLayer.gradient_checkpointing``), so leaving the
last ``k`` layers unchecked keeps their activations for backward instead of recomputing them. The values computed
are the same; only memory and time change. The object owns the flags it changed and puts them back on ``restore``.
"""

from __future__ import annotations

import torch

__all__ = ["KeptLayers", "checkpointed_layers", "layer_checkpointing"]


def checkpointed_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers that checkpoint themselves (transformers' ``GradientCheckpointingLayer`` with
    checkpointing on), in forward order; empty when checkpointing is not per layer or transformers lacks it."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        return []
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]


def layer_checkpointing(model: torch.nn.Module) -> bool:
    """Whether every decoder layer of ``model`` (``config.num_hidden_layers``) checkpoints itself, so the runtime
    may keep some of them (the planner's ``Workload.layer_checkpointing``)."""
    layers = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    return isinstance(layers, int) and layers > 0 and len(checkpointed_layers(model)) == layers


class KeptLayers:
    """The last ``kept`` of ``layers`` skip checkpointing until :meth:`restore` (or a new :meth:`set`)."""

    def __init__(self, layers: list[torch.nn.Module], kept: int) -> None:
        if not 0 <= kept <= len(layers):
            raise ValueError(f"kept={kept}: use 0 to {len(layers)} (the model's checkpointed decoder layers)")
        self.layers = layers
        self.kept = 0
        self.set(kept)

    def set(self, kept: int) -> None:
        """Keep the activations of the last ``kept`` layers; checkpoint again those this object kept before. Only
        the flags this object changed are touched (a layer the user turned off since stays off)."""
        kept, n = max(0, min(kept, len(self.layers))), len(self.layers)
        for k in range(n - max(kept, self.kept), n):
            self.layers[k].gradient_checkpointing = k < n - kept
        self.kept = kept

    def restore(self) -> None:
        """The kept layers checkpoint again, as the model had them."""
        self.set(0)
