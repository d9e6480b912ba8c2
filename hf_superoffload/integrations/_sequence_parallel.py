"""``sequence_parallel_size`` for SuperOffloadTrainer: Ulysses over the ranks of each sequence group.

Data: accelerate shards the dataset over every process as usual, so each rank receives its own batch. One
training step of an SP group gathers the P batches of its ranks and trains on each of them in turn, all P
ranks together (each holding a chunk of the sequence), with ``loss / P`` per batch. Summed over the SP ranks
the gradients are the mean of the P batches' full-sequence gradients; the optimizer's reduction (SUM over all
ranks / dp) then gives the mean over all world_size batches, exactly what plain data parallelism computes,
and no sample is dropped or repeated. Ragged batches are right-padded to the longest one (ignored labels).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist

from .. import sequence_parallel as sp
from ..causal_lm_loss import CHUNK_TOKENS

__all__ = ["gather_group_batches", "sequence_parallel_training_step", "setup_sequence_parallel"]


def setup_sequence_parallel(model: torch.nn.Module, sp_size: int) -> sp.SequenceParallelGroups:
    """Validate, build the ``(dp, sp)`` mesh and switch ``model`` to Ulysses attention."""
    sp.check_heads(model.config, sp_size)
    if not dist.is_initialized():
        raise ValueError(f"sequence_parallel_size={sp_size} needs one process per GPU: launch with torchrun or "
                         f"accelerate launch --num_processes <multiple of {sp_size}>")
    inner = getattr(model.config, "_attn_implementation", None)
    inner = inner if inner in sp.INNER_IMPLEMENTATIONS else "sdpa"
    groups = sp.init_sequence_parallel(sp_size, inner_attention=inner)
    sp.enable_sequence_parallel(model, groups, inner_attention=inner)
    return groups


def _pad_right(batch: dict[str, torch.Tensor], length: int, pad_token_id: int) -> dict[str, torch.Tensor]:
    ids = batch["input_ids"]
    pad = length - ids.shape[1]
    mask = batch.get("attention_mask")
    mask = torch.ones_like(ids) if mask is None else mask
    out = {"input_ids": torch.nn.functional.pad(ids, (0, pad), value=pad_token_id),
           "attention_mask": torch.nn.functional.pad(mask, (0, pad), value=0)}
    if "labels" in batch:
        out["labels"] = torch.nn.functional.pad(batch["labels"], (0, pad), value=sp.IGNORE_INDEX)
    return out


def gather_group_batches(inputs: dict[str, Any], groups: sp.SequenceParallelGroups) -> list[dict[str, Any]]:
    """The batches of every rank of this SP group, in SP-rank order, on this rank's device."""
    keys = ("input_ids", "labels", "attention_mask")
    extra = [k for k, v in inputs.items() if k not in keys and isinstance(v, torch.Tensor)]
    if extra:
        raise ValueError(f"sequence_parallel_size>1: batch keys {extra} are not supported (only {list(keys)}); "
                         "remove them in the data collator")
    device = inputs["input_ids"].device
    local = {k: inputs[k].detach().cpu() for k in keys if k in inputs}
    gathered: list[Any] = [None] * groups.sp_size
    dist.all_gather_object(gathered, local, group=groups.sp_group)
    longest = max(b["input_ids"].shape[1] for b in gathered)
    return [{k: v.to(device) for k, v in _pad_right(b, longest, 0).items()} for b in gathered]


def sequence_parallel_training_step(trainer: Any, model: torch.nn.Module, inputs: dict[str, Any],
                                    groups: sp.SequenceParallelGroups, *, chunk_size: int = CHUNK_TOKENS) -> torch.Tensor:
    """``Trainer.training_step`` under sequence parallelism (module docstring). Returns the detached mean
    loss of the P batches, already divided by the gradient-accumulation steps like Trainer's."""
    model.train()
    inputs = trainer._prepare_inputs(inputs)
    if "labels" not in inputs:
        raise ValueError("sequence_parallel_size>1 trains causal LMs: the batch needs labels")
    batches = gather_group_batches(inputs, groups)
    ga = trainer.current_gradient_accumulation_steps
    total = torch.zeros((), device=inputs["input_ids"].device)
    opt = getattr(trainer, "superoffload_optimizer", None)
    for k, batch in enumerate(batches):
        shard = sp.shard_batch(batch, groups)
        # the optimizer offloads gradients on the last backward of the step only
        last = k == len(batches) - 1
        with contextlib.nullcontext() if last or opt is None else opt.no_sync():
            with trainer.compute_loss_context_manager():
                out = sp.causal_lm_loss(trainer.accelerator.unwrap_model(model), shard, groups, chunk_size=chunk_size)
            trainer.accelerator.backward(out.loss / (len(batches) * ga))
        total += out.global_loss / len(batches)
    return total / ga
