"""A differentiable all-to-all that moves one tensor dimension's shards across a process group.

``all_to_all(x, group, scatter_dim, gather_dim)`` splits ``x`` into P equal chunks along ``scatter_dim``,
sends chunk ``j`` to rank ``j`` of ``group`` and concatenates what it receives along ``gather_dim`` in rank
order. Ulysses uses it twice per attention: sequence-sharded ``[B, H, S/P, D]`` -> head-sharded
``[B, H/P, S, D]`` (scatter heads, gather sequence) and back. The operation is a permutation of the elements
across ranks, so its backward is the same all-to-all with the two dimensions swapped.

Transport is ``torch.distributed.all_to_all_single`` (NCCL on GPU, gloo on CPU) on one contiguous buffer.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["all_to_all"]


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    p = dist.get_world_size(group)
    if p == 1:
        return x
    if x.shape[scatter_dim] % p:
        raise ValueError(f"all_to_all: dimension {scatter_dim} of shape {tuple(x.shape)} is not divisible by the "
                         f"group size {p}")
    # [.., P*c, ..] -> [P, .., c, ..]: chunk j (for rank j) is the contiguous slab j of the send buffer.
    send = x.unflatten(scatter_dim, (p, -1)).movedim(scatter_dim, 0).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # recv[i] came from rank i: put the source index in front of gather_dim and merge them (rank order).
    return recv.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, scatter_dim: int,
                gather_dim: int) -> torch.Tensor:
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _all_to_all(grad, ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


def all_to_all(x: torch.Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Differentiable all-to-all: scatter ``x`` along ``scatter_dim`` over ``group``, gather along ``gather_dim``.

    Dimensions must be non-negative; ``x.shape[scatter_dim]`` must be divisible by the group size.
    """
    if scatter_dim < 0 or gather_dim < 0 or scatter_dim == gather_dim:
        raise ValueError(f"all_to_all: scatter_dim={scatter_dim}, gather_dim={gather_dim}: use two different "
                         "non-negative dimensions")
    return _AllToAll.apply(x, group, scatter_dim, gather_dim)
