"""Shard a causal-LM batch over the ranks of a sequence-parallel group.

Each rank keeps a contiguous chunk ``[r*s, (r+1)*s)`` of every sequence, ``s = ceil(S/P)``.

- Labels are shifted *before* sharding (``shift_labels[t] = labels[t + 1]``, the last one ignored): the
  token that follows a chunk boundary lives on the next rank, so a model that shifted its local labels would
  lose one target per boundary and predict the wrong token for the last position of every chunk.
- ``position_ids`` are the rank's slice of ``arange(S)``: RoPE sees global positions.
- ``S % P != 0``: the sequence is padded on the right to ``P*s`` (input id ``pad_token_id``, label -100,
  positions continuing). Causal attention never lets a real token see a later one, so the padding changes no
  real token's output, and its labels are ignored: the result is exact.
- A 2-D ``attention_mask`` is accepted only for right padding (ones then zeros per row): its zeros become
  ignored labels and the mask is dropped, which is exact for the same reason. Left padding or holes are refused.
- Packed sequences (``position_ids`` restarting inside a row) are refused: Ulysses runs plain causal attention.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .groups import SequenceParallelGroups

__all__ = ["IGNORE_INDEX", "shard_batch", "shift_labels"]

IGNORE_INDEX = -100


def shift_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """``out[:, t] = labels[:, t + 1]``, ``out[:, -1] = ignore_index`` (what HF's causal-LM loss does inside)."""
    out = torch.full_like(labels, ignore_index)
    out[:, :-1] = labels[:, 1:]
    return out


def shard_batch(batch: Mapping[str, Any], groups: SequenceParallelGroups | None, *, pad_token_id: int = 0,
                ignore_index: int = IGNORE_INDEX) -> dict[str, Any]:
    """This rank's share of ``batch`` (``input_ids [B, S]``, optional ``labels``/``shift_labels``,
    ``attention_mask``, ``position_ids``): ``input_ids``, ``position_ids`` and ``shift_labels`` of ``[B, s]``.

    Give the sharded ``input_ids``/``position_ids`` to the model and ``shift_labels`` to
    :func:`~hf_superoffload.sequence_parallel.loss.sequence_parallel_loss`. Other tensors whose first two
    dimensions are ``[B, S]`` are refused (``ValueError`` naming them); anything else passes through.
    """
    p = 1 if groups is None else groups.sp_size
    r = 0 if groups is None else groups.sp_rank
    if "input_ids" not in batch:
        raise ValueError("shard_batch needs input_ids [batch, seq] (inputs_embeds are not supported)")
    ids = batch["input_ids"]
    if ids.ndim != 2:
        raise ValueError(f"shard_batch: input_ids must be [batch, seq], got shape {tuple(ids.shape)}")
    b, s_full = ids.shape
    known = {"input_ids", "labels", "shift_labels", "attention_mask", "position_ids"}
    for key, val in batch.items():
        if key not in known and isinstance(val, torch.Tensor) and val.ndim >= 2 and tuple(val.shape[:2]) == (b, s_full):
            raise ValueError(f"shard_batch: batch[{key!r}] has the sequence dimension but is not known to the "
                             "sequence-parallel sharder; remove it from the batch (known: "
                             f"{sorted(known)})")
    if "labels" in batch and "shift_labels" in batch:
        raise ValueError("shard_batch: give labels (unshifted, HF convention) or shift_labels, not both")
    mask = batch.get("attention_mask")
    labels = batch.get("labels")
    shifted = batch.get("shift_labels")
    if mask is not None:
        mask = mask.to(torch.bool)
        if mask.shape != ids.shape:
            raise ValueError(f"shard_batch: attention_mask shape {tuple(mask.shape)} != input_ids {tuple(ids.shape)}")
        if s_full > 1 and bool((mask[:, 1:] & ~mask[:, :-1]).any()):
            raise ValueError("shard_batch: attention_mask is not right-padded (a 0 is followed by a 1). Under "
                             "sequence parallelism only right padding is supported: set the tokenizer's "
                             "padding_side='right'")
        if labels is not None:
            labels = labels.masked_fill(~mask, ignore_index)
        if shifted is not None:  # the target of position t is token t+1: ignore it when that token is padding
            shifted = shifted.masked_fill(~torch.cat([mask[:, 1:], mask.new_zeros(b, 1)], dim=1), ignore_index)
    pos = batch.get("position_ids")
    if pos is not None:
        expect = torch.arange(s_full, device=pos.device).expand(pos.shape[0], -1)
        if pos.shape[-1] != s_full or not torch.equal(pos, expect):
            raise ValueError("shard_batch: position_ids must be arange(seq) per row; packed sequences (positions "
                             "restarting inside a row) are not supported under sequence parallelism")
    if labels is not None:
        shifted = shift_labels(labels, ignore_index)

    chunk = -(-s_full // p)
    pad = chunk * p - s_full
    if pad:
        ids = torch.nn.functional.pad(ids, (0, pad), value=pad_token_id)
        if shifted is not None:
            shifted = torch.nn.functional.pad(shifted, (0, pad), value=ignore_index)
    sl = slice(r * chunk, (r + 1) * chunk)
    out: dict[str, Any] = {k: v for k, v in batch.items() if k not in known}
    out["input_ids"] = ids[:, sl].contiguous()
    out["position_ids"] = torch.arange(r * chunk, (r + 1) * chunk, device=ids.device).unsqueeze(0).expand(b, -1)
    if shifted is not None:
        out["shift_labels"] = shifted[:, sl].contiguous()
    return out
