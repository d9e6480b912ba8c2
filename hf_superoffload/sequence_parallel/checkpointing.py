"""Gradient checkpointing that keeps attention's outputs: every layer is recomputed in backward except attention.

See docs/sequence_parallel.md ("Checkpointing that keeps attention"). At long sequences attention is most of a
layer's FLOPs (8B at 256k tokens: 81% of the model FLOPs), and plain checkpointing runs its forward twice.
Selective activation checkpointing (``torch.utils.checkpoint.create_selective_checkpoint_contexts``) saves the
outputs of the fused attention ops during the forward and hands them back during the recompute, so only the cheap
parts (norms, projections, MLP, RoPE, the Ulysses all-to-alls) run again. Cost: each layer also keeps its attention output and
log-sum-exp (``2 q_width + 4 heads`` bytes per token; with Ulysses the same bytes per rank), which the memory model
counts (``Workload.keep_attention``).

Only fused attention kernels are kept (SDPA's cuDNN, flash, memory-efficient and CPU-flash ops, and flash-attn's
custom ops when that package is loaded); SDPA's math fallback is made of ordinary ops and is recomputed as before.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

__all__ = ["attention_ops", "check_checkpoint_kwargs", "enable_checkpointing_keep_attention"]

_ATEN_ATTENTION = (
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_flash_attention_forward",
    "_efficient_attention_forward",
)
# flash-attn registers its kernels as torch custom ops (flash_attn >= 2.6; FA3's hopper build)
_CUSTOM_ATTENTION = (("flash_attn", "_flash_attn_forward"), ("flash_attn", "_flash_attn_varlen_forward"),
                     ("flash_attn_3", "fwd"))


def attention_ops() -> frozenset[Any]:
    """The overloads whose outputs are kept: the fused attention forwards this torch build (and any loaded
    flash-attn) provides."""
    ops: set[Any] = set()
    for name in _ATEN_ATTENTION:
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None:
            ops.add(packet.default)
    for namespace, name in _CUSTOM_ATTENTION:
        try:
            packet = getattr(getattr(torch.ops, namespace), name)
        except (AttributeError, RuntimeError):
            continue
        ops.update(getattr(packet, o) for o in packet.overloads())
    return frozenset(ops)


def check_checkpoint_kwargs(checkpoint_kwargs: Mapping[str, Any] | None) -> None:
    """``ValueError`` (with the fix) for checkpointing options that keeping attention cannot honour."""
    kw = dict(checkpoint_kwargs or {})
    if kw.get("use_reentrant") is True:
        raise ValueError("keeping attention's outputs needs non-reentrant checkpointing (selective checkpointing): "
                         "drop use_reentrant=True from the checkpointing kwargs")
    if "context_fn" in kw:
        raise ValueError("keeping attention's outputs sets the checkpoint's context_fn itself: drop context_fn from "
                         "the checkpointing kwargs, or do not keep attention")


def enable_checkpointing_keep_attention(model: torch.nn.Module,
                                        checkpoint_kwargs: Mapping[str, Any] | None = None) -> torch.nn.Module:
    """Turn on gradient checkpointing on a transformers model, keeping attention's outputs (see the module doc).

    ``checkpoint_kwargs``: the rest of the checkpointing options, as transformers takes them
    (``activation_checkpointing_kwargs``: ``every_n_layers``, ``offload`` and ``torch.utils.checkpoint``
    keywords); they are kept. Checkpointing is non-reentrant (selective checkpointing needs it). Composes with
    Ulysses (:func:`~hf_superoffload.sequence_parallel.enable_sequence_parallel`, before or after) and the tiled
    MLP. ``ValueError`` if the model does not support gradient checkpointing or the options conflict. Returns
    ``model``.
    """
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"{type(model).__name__} does not support gradient checkpointing; keeping attention's "
                         "outputs needs it (use a transformers model with supports_gradient_checkpointing=True)")
    check_checkpoint_kwargs(checkpoint_kwargs)
    kw = dict(checkpoint_kwargs or {})
    layout = {k: kw.pop(k) for k in ("every_n_layers", "offload") if k in kw}  # transformers' own, not checkpoint's
    kept = attention_ops()  # looked up per call: a flash-attn imported since an earlier call counts too

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in kept else CheckpointPolicy.PREFER_RECOMPUTE

    def context_fn() -> Any:
        return create_selective_checkpoint_contexts(policy)

    kw.update(use_reentrant=False, context_fn=context_fn)
    if hasattr(model, "activation_checkpointing_enable"):  # transformers' new name (the old one warns)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw, **layout)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw, **layout)
    return model
