"""The data-parallel collectives of one engine: gradients reduce-scattered, weights all-gathered.

All traffic goes through ``torch.distributed`` (NCCL on GPUs, gloo on CPUs); nothing here is a transport.
[Note: data parallel sharding] in docs/design.md says who issues which collective, and why the order is the
same on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ShardGroup"]

# torch 2.13 renamed the flat collectives (`*_single`); 2.11 only has `*_tensor`.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True, slots=True)
class ShardGroup:
    """The process group the optimizer state is sharded over.

    The optimizer talks over a private copy of the user's group: its collectives are issued from the
    backward, the training and the gatherer threads, and must never interleave with the user's own collectives
    (a loss all-reduce, Trainer's metric gathers), whose timing differs between ranks.

    Attributes:
        group: the optimizer's private process group (the same ranks as the user's).
        control: a second private group, gloo, for the training thread's small agreements while the engine's
            threads use ``group`` (the thread trial's samples after ``step()``, when the gatherer is all-gathering:
            two threads issuing on one group would interleave differently on different ranks).
        world_size, rank: of this process in ``group``.
        grad_divisor: gradients are summed over ``group`` and divided by this (the number of data-parallel
            replicas: ``world_size``, or ``world_size / sequence_parallel_size`` when sequence-parallel ranks
            each hold a part of the same samples' loss).
    """

    group: Any
    world_size: int
    rank: int
    grad_divisor: float
    control: Any

    @classmethod
    def from_environment(cls, group: Any = None, grad_divisor: float | None = None) -> ShardGroup | None:
        """The initialised default group (or ``group``) when it has more than one rank, else ``None``."""
        if not (dist.is_available() and dist.is_initialized()):
            if group is not None:
                raise ValueError("process_group was given but torch.distributed is not initialised; call "
                                 "torch.distributed.init_process_group first (accelerate launch / torchrun do)")
            return None
        world = dist.get_world_size(group)
        if world == 1:
            return None
        divisor = float(world if grad_divisor is None else grad_divisor)
        if not divisor > 0:
            raise ValueError(f"gradient_divisor={grad_divisor!r} is invalid: use the number of data-parallel replicas")
        ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        private = dist.new_group(ranks=ranks)
        control = dist.new_group(ranks=ranks, backend="gloo")
        return cls(private, world, dist.get_rank(private), divisor, control)

    def reduce_scatter(self, shard: torch.Tensor, full: torch.Tensor, *, async_op: bool = False) -> Any:
        """``shard := sum over ranks of full[rank * n : (rank + 1) * n]``."""
        return _reduce_scatter(shard, full, op=dist.ReduceOp.SUM, group=self.group, async_op=async_op)

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor, *, async_op: bool = False) -> Any:
        return _all_gather(full, shard, group=self.group, async_op=async_op)

    def all_reduce_sum(self, t: torch.Tensor) -> None:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
