"""Ulysses attention, registered with transformers as ``attn_implementation="superoffload_ulysses"``.

Schedule of one attention call on SP rank ``r`` of P (q: ``[B, H, S/P, D]``, k/v: ``[B, Hkv, S/P, D]``, the
rank's contiguous chunk of the sequence, RoPE already applied with global positions):

1. GQA fit (see :func:`kv_replication`): when ``Hkv`` is not a multiple of P, each KV head is repeated
   ``P / Hkv`` times so that every rank receives exactly the KV head its query heads read.
2. all-to-all: scatter heads, gather sequence -> q ``[B, H/P, S, D]``, k/v ``[B, Hkv'/P, S, D]``. Rank r now
   holds query heads ``[r*H/P, (r+1)*H/P)`` over the whole sequence in global order.
3. Local attention over all S tokens with the inner implementation (``sdpa`` by default, or a
   ``flash_attention_*``); plain causal masking is exact because the sequence is complete and in order.
4. all-to-all back: scatter sequence, gather heads -> ``[B, S/P, H, D]``, the layout the model's
   ``o_proj`` expects from every transformers attention function.

Masks: transformers silently drops the user's mask for an attention implementation without a registered
mask function, so :func:`ulysses_mask` is registered too. It returns ``None`` (plain causal attention) for no
mask or an all-ones one, and refuses a padding mask or packed sequences: a per-rank mask would have to be
gathered along with k/v. :func:`~hf_superoffload.sequence_parallel.batch.shard_batch` turns right padding
into ignored labels and drops the mask, which is exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .all_to_all import all_to_all
from .groups import SequenceParallelGroups

__all__ = [
    "ATTN_IMPLEMENTATION",
    "INNER_IMPLEMENTATIONS",
    "SDPA_CUDNN",
    "active_groups",
    "check_heads",
    "kv_replication",
    "register_ulysses_attention",
    "sdpa_cudnn_attention_forward",
    "set_active_groups",
    "ulysses_attention_forward",
    "ulysses_mask",
]

ATTN_IMPLEMENTATION = "superoffload_ulysses"
SDPA_CUDNN = "superoffload_sdpa_cudnn"
"""SDPA with cuDNN's fused attention first (then flash, memory-efficient, math): on Hopper cuDNN's kernels are
the fastest SDPA backend at long sequences; elsewhere the first backend that supports the inputs runs."""
INNER_IMPLEMENTATIONS = ("sdpa", SDPA_CUDNN, "flash_attention_2", "flash_attention_3", "flash_attention_4")


@dataclass(frozen=True, slots=True)
class _Active:
    groups: SequenceParallelGroups
    inner: str


_ACTIVE: _Active | None = None


def set_active_groups(groups: SequenceParallelGroups | None, inner: str = "sdpa") -> None:
    """Make ``groups`` the sequence-parallel groups every ``superoffload_ulysses`` attention call uses, with
    ``inner`` as the local attention (one of :data:`INNER_IMPLEMENTATIONS`); ``None`` deactivates."""
    global _ACTIVE
    if inner not in INNER_IMPLEMENTATIONS:
        raise ValueError(f"inner attention {inner!r} is not supported under Ulysses: use one of "
                         f"{list(INNER_IMPLEMENTATIONS)} (eager attention needs a materialised mask, which Ulysses "
                         "does not build)")
    _ACTIVE = None if groups is None else _Active(groups, inner)


def active_groups() -> SequenceParallelGroups | None:
    """The groups set by :func:`set_active_groups` (or ``init_sequence_parallel``), or ``None``."""
    return None if _ACTIVE is None else _ACTIVE.groups


def _largest_working_p(num_heads: int, num_kv_heads: int, p: int) -> int:
    return max(q for q in range(1, p + 1) if num_heads % q == 0 and (num_kv_heads % q == 0 or q % num_kv_heads == 0))


def kv_replication(num_heads: int, num_kv_heads: int, sp_size: int) -> int:
    """How many times each KV head is repeated before the all-to-all (1 when ``Hkv`` is a multiple of P).

    Query heads ``[r*H/P, (r+1)*H/P)`` land on rank r. They read one KV head each group of ``H/Hkv``; when
    ``Hkv < P`` that group spans several ranks, so repeating each KV head ``P/Hkv`` times gives every rank
    exactly the one it needs. Raises ``ValueError`` naming the largest P that works otherwise.
    """
    if num_heads % num_kv_heads:
        raise ValueError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}")
    best = _largest_working_p(num_heads, num_kv_heads, sp_size)
    if num_heads % sp_size:
        raise ValueError(f"sequence_parallel_size={sp_size} does not divide num_attention_heads={num_heads}: "
                         f"Ulysses gives each rank H/P heads. The largest sequence_parallel_size <= {sp_size} "
                         f"that works for this model is {best}")
    if num_kv_heads % sp_size == 0:
        return 1
    if sp_size % num_kv_heads == 0:
        return sp_size // num_kv_heads
    raise ValueError(f"sequence_parallel_size={sp_size} cannot split num_key_value_heads={num_kv_heads}: it must "
                     "be a multiple or a divisor of the KV heads. The largest sequence_parallel_size <= "
                     f"{sp_size} that works for this model is {best}")


def check_heads(config: Any, sp_size: int) -> None:
    """Validate a transformers config for Ulysses over ``sp_size`` ranks (``ValueError`` with the fix)."""
    text = getattr(config, "get_text_config", lambda: config)()
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    kv_replication(heads, kv_heads, sp_size)
    if getattr(text, "sliding_window", None) is not None and getattr(text, "use_sliding_window", True):
        raise ValueError(f"sliding_window={text.sliding_window}: sliding-window attention is not supported under "
                         "sequence parallelism (the inner attention sees no window mask); set "
                         "config.sliding_window=None or train without sequence_parallel_size")


class _ModuleView:
    """The attention module as the inner implementation should see it after KV heads were repeated locally."""

    def __init__(self, module: torch.nn.Module, num_key_value_groups: int) -> None:
        self._module = module
        self.num_key_value_groups = num_key_value_groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def ulysses_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attention_mask: torch.Tensor | None, dropout: float = 0.0,
                              scaling: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention function: Ulysses all-to-all around the inner implementation (module docstring)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if _ACTIVE is None:
        raise RuntimeError(f"attn_implementation={ATTN_IMPLEMENTATION!r} needs sequence-parallel groups: call "
                           "hf_superoffload.sequence_parallel.init_sequence_parallel(sp_size) (or "
                           "set_active_groups) in every process before the forward")
    if attention_mask is not None:
        raise ValueError(f"{ATTN_IMPLEMENTATION}: an attention_mask was passed; under sequence parallelism only "
                         "causal attention without a mask is exact. Shard batches with shard_batch(), which turns "
                         "right padding into ignored labels (-100) and drops the mask")
    if kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None:
        raise ValueError(f"{ATTN_IMPLEMENTATION}: sliding_window/softcap attention is not supported")
    if kwargs.get("output_attentions"):
        raise ValueError(f"{ATTN_IMPLEMENTATION}: output_attentions=True is not supported")
    groups, inner = _ACTIVE.groups, _ACTIVE.inner
    p, group = groups.sp_size, groups.sp_group
    heads, kv_heads = query.shape[1], key.shape[1]
    rep = kv_replication(heads, kv_heads, p)
    if rep > 1:  # [B, Hkv, s, D] -> [B, Hkv*rep, s, D], each KV head next to its copies
        key = key.repeat_interleave(rep, dim=1)
        value = value.repeat_interleave(rep, dim=1)
    # (1) sequence-sharded, all heads -> head-sharded, whole sequence (dim 1: heads, dim 2: sequence)
    q = all_to_all(query, group, scatter_dim=1, gather_dim=2)
    k = all_to_all(key, group, scatter_dim=1, gather_dim=2)
    v = all_to_all(value, group, scatter_dim=1, gather_dim=2)
    groups_local = q.shape[1] // k.shape[1]
    view: Any = module if groups_local == getattr(module, "num_key_value_groups", 1) else _ModuleView(
        module, groups_local)
    # Local positions are global ones: the inner function must not read per-rank position_ids as packing.
    inner_kwargs = {k_: v_ for k_, v_ in kwargs.items() if k_ not in ("position_ids", "cu_seq_lens_q",
                                                                       "cu_seq_lens_k", "max_length_q",
                                                                       "max_length_k")}
    inner_kwargs["is_causal"] = getattr(module, "is_causal", True) if kwargs.get("is_causal") is None \
        else kwargs["is_causal"]
    out, _ = ALL_ATTENTION_FUNCTIONS[inner](view, q, k, v, None, dropout=dropout, scaling=scaling,
                                            **inner_kwargs)
    # (2) out: [B, S, H/P, D] -> [B, S/P, H, D] (dim 1: sequence, dim 2: heads)
    out = all_to_all(out, group, scatter_dim=1, gather_dim=2)
    return out, None


def ulysses_mask(*, attention_mask: torch.Tensor | None = None, mask_function: Any = None,
                 **kwargs: Any) -> None:
    """transformers mask function for ``superoffload_ulysses``: no mask (causal attention is done inside);
    ``ValueError`` for a padding mask or packed sequences, which this implementation cannot honour."""
    from transformers.masking_utils import causal_mask_function

    if mask_function is not None and mask_function is not causal_mask_function:
        raise ValueError(f"{ATTN_IMPLEMENTATION}: the model asked for a non-causal mask (packed sequences, "
                         "position_ids restarting inside a row, or a model-specific mask); only plain causal "
                         "attention over contiguous positions is supported under sequence parallelism")
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError(f"{ATTN_IMPLEMENTATION}: an attention_mask with padding was passed; under sequence "
                         "parallelism only causal attention without padding is exact. Shard batches with "
                         "shard_batch(), which turns right padding into ignored labels (-100) and drops the mask")
    return None


def sdpa_cudnn_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                                 value: torch.Tensor, attention_mask: torch.Tensor | None,
                                 **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention with the backends tried in the order cuDNN, flash, memory-efficient, math
    (``torch.nn.attention.sdpa_kernel(..., set_priority=True)``). Backward uses the backend the forward chose."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    with sdpa_kernel(order, set_priority=True):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def register_ulysses_attention() -> None:
    """Register :func:`ulysses_attention_forward` as ``attn_implementation="superoffload_ulysses"`` and
    :func:`ulysses_mask` as its mask function, and :func:`sdpa_cudnn_attention_forward` as
    ``"superoffload_sdpa_cudnn"`` with SDPA's mask (idempotent)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, ulysses_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, ulysses_mask)
    AttentionInterface.register(SDPA_CUDNN, sdpa_cudnn_attention_forward)
    AttentionMaskInterface.register(SDPA_CUDNN, sdpa_mask)

