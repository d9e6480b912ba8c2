"""The 2-D device mesh ``(dp, sp)``: which ranks share one sequence and which hold different ones.

Ranks ``[dp_rank * sp_size, (dp_rank + 1) * sp_size)`` form one sequence-parallel (SP) group: they hold the
contiguous chunks of the same sequences, in rank order. Ranks with the same SP rank across SP groups form a
data-parallel (DP) group. Consecutive ranks share a sequence so that, on a multi-node job, the all-to-all of
every layer stays inside one node (NVLink) while the data-parallel gradient reduction crosses nodes once per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["SequenceParallelGroups", "init_sequence_parallel"]


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class SequenceParallelGroups:
    """The process groups of one sequence-parallel run (built by :func:`init_sequence_parallel`)."""

    mesh: DeviceMesh
    """The ``(dp, sp)`` mesh over all ranks, dimension names ``("dp", "sp")``."""
    sp_group: dist.ProcessGroup
    """This rank's sequence-parallel group: the ranks that hold the chunks of the same sequences."""
    dp_group: dist.ProcessGroup
    """This rank's data-parallel group: the ranks with the same chunk index of different sequences."""
    sp_size: int
    """Ranks per sequence (P)."""
    sp_rank: int
    """This rank's chunk index inside its sequences, ``0 <= sp_rank < sp_size``."""
    dp_size: int
    """Number of sequence groups, ``world_size // sp_size``."""
    dp_rank: int
    """Which sequence group this rank belongs to."""


def init_sequence_parallel(sp_size: int, *, device_type: str | None = None) -> SequenceParallelGroups:
    """Build the ``(dp, sp)`` mesh with ``sp_size`` ranks per sequence over the whole world.

    Initialises the default process group from the usual ``torchrun`` environment variables when it is not
    initialised yet (NCCL on CUDA, gloo on CPU). ``device_type`` defaults to ``"cuda"`` when CUDA is available.
    Raises ``ValueError`` when ``sp_size`` does not divide the world size.
    """
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if not isinstance(sp_size, int) or isinstance(sp_size, bool) or sp_size < 1:
        raise ValueError(f"sequence_parallel_size={sp_size!r} is invalid: use an integer >= 1 that divides the "
                         "number of processes")
    world = dist.get_world_size() if dist.is_initialized() else _env_world_size()
    if world % sp_size:
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        raise ValueError(f"sequence_parallel_size={sp_size} does not divide the world size {world}: use one of "
                         f"{divisors}, or launch a multiple of {sp_size} processes")
    mesh = init_device_mesh(device_type, (world // sp_size, sp_size), mesh_dim_names=("dp", "sp"))
    return SequenceParallelGroups(
        mesh=mesh, sp_group=mesh.get_group("sp"), dp_group=mesh.get_group("dp"),
        sp_size=sp_size, sp_rank=mesh.get_local_rank("sp"),
        dp_size=world // sp_size, dp_rank=mesh.get_local_rank("dp"),
    )


def _env_world_size() -> int:
    import os

    return int(os.environ.get("WORLD_SIZE", "1"))
