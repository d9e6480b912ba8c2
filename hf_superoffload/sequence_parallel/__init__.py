"""Ulysses sequence parallelism: shard long sequences over ranks, all-to-all around attention.

Usage, one process per GPU (``torchrun``)::

    from hf_superoffload import sequence_parallel as sp

    groups = sp.init_sequence_parallel(sp_size)          # (dp, sp) mesh, activates the attention
    model = LlamaForCausalLM(config)                       # any transformers model that supports SDPA
    sp.enable_sequence_parallel(model, groups)            # attn_implementation="superoffload_ulysses"
    shard = sp.shard_batch(batch, groups)                  # this rank's chunk + pre-shifted labels
    out = sp.causal_lm_loss(model, shard, groups)          # chunked LM head, loss / group token count
    out.loss.backward()                                    # SP ranks' gradients sum to the full-sequence one

At 512k tokens and more, ``sp.enable_tiled_mlp(model, tile_tokens=8192)`` also runs each layer's MLP in tiles of
tokens, forward and backward (see :mod:`.tiled_mlp`, docs/long_context.md), and
``sp.enable_checkpointing_keep_attention(model)`` checkpoints every layer but attention (see :mod:`.checkpointing`).

See docs/sequence_parallel.md.
"""

from __future__ import annotations

from typing import Any

import torch

from .all_to_all import all_to_all
from .attention import (
    ATTN_IMPLEMENTATION,
    INNER_IMPLEMENTATIONS,
    SDPA_CUDNN,
    active_groups,
    check_heads,
    kv_replication,
    register_ulysses_attention,
    set_active_groups,
    ulysses_attention_forward,
)
from .batch import IGNORE_INDEX, shard_batch, shift_labels
from .checkpointing import enable_checkpointing_keep_attention
from .groups import SequenceParallelGroups
from .groups import init_sequence_parallel as _init_groups
from .loss import SequenceParallelLoss, causal_lm_loss, chunked_cross_entropy, sequence_parallel_loss
from .tiled_mlp import disable_tiled_mlp, enable_tiled_mlp, find_decoder_mlps

__all__ = [
    "ATTN_IMPLEMENTATION",
    "IGNORE_INDEX",
    "INNER_IMPLEMENTATIONS",
    "SDPA_CUDNN",
    "SequenceParallelGroups",
    "SequenceParallelLoss",
    "active_groups",
    "all_to_all",
    "causal_lm_loss",
    "check_heads",
    "chunked_cross_entropy",
    "disable_tiled_mlp",
    "enable_checkpointing_keep_attention",
    "enable_sequence_parallel",
    "enable_tiled_mlp",
    "find_decoder_mlps",
    "init_sequence_parallel",
    "kv_replication",
    "register_ulysses_attention",
    "sequence_parallel_loss",
    "set_active_groups",
    "shard_batch",
    "shift_labels",
    "ulysses_attention_forward",
]

register_ulysses_attention()


def init_sequence_parallel(sp_size: int, *, device_type: str | None = None,
                           inner_attention: str = "sdpa") -> SequenceParallelGroups:
    """Build the ``(dp, sp)`` mesh (see :mod:`.groups`) and make it the one ``superoffload_ulysses`` attention
    uses, with ``inner_attention`` as the local attention. ``ValueError`` if ``sp_size`` does not divide the
    world size."""
    set_active_groups(None, inner_attention)  # validates inner_attention before any process group is built
    groups = _init_groups(sp_size, device_type=device_type)
    set_active_groups(groups, inner_attention)
    return groups


def enable_sequence_parallel(model: torch.nn.Module, groups: SequenceParallelGroups, *,
                             inner_attention: str | None = None) -> Any:
    """Switch a transformers model to Ulysses attention over ``groups`` (validated first, ``ValueError``).

    The model's current implementation becomes the inner (local) attention when it is SDPA or flash
    attention; otherwise (eager, unset) SDPA. Returns ``model``.
    """
    check_heads(model.config, groups.sp_size)
    current = getattr(model.config, "_attn_implementation", None)
    if inner_attention is None:
        if current == ATTN_IMPLEMENTATION and active_groups() is not None:
            from .attention import _ACTIVE

            inner_attention = _ACTIVE.inner if _ACTIVE is not None else "sdpa"
        else:
            inner_attention = current if current in INNER_IMPLEMENTATIONS else "sdpa"
    set_active_groups(groups, inner_attention)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return model
