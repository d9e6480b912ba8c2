"""Moving optimizer state between the device tail and the host: the first device buckets to the host, for a later
batch the device tail leaves too little memory for; the last host buckets to the device, when the measured peak
leaves room. The checks that a new plan is such a move, and the moves themselves over the layout's arenas.

The planner chooses the new plan (``planner.shrink_tail``, ``planner.grow_tail``); the engine calls
:func:`move_to_host` or :func:`move_to_device` at a quiet point and then tells the stages that keep per-bucket
state about the new layout.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..planning.plan import OffloadPlan, Placement
from .bucket import DeviceBucket, HostBucket
from .layout import BucketLayout, check_plan

__all__ = ["check_move", "check_move_to_device", "move_to_device", "move_to_host"]

# [Note: moving the tail to the host]
# A later batch longer than the one the plan was made for may need more activation memory than the device tail
# leaves. Before its forward runs, the optimizer asks for the plan with the fewest device buckets moved to the host
# that still fits (the first device buckets in gradient-arrival order become the last host buckets; bucket
# boundaries and the switches that shape the host arenas stay: rollback, cast side, host accumulation; the deferred
# stores, the D2H lead and gate, the upload thread and the accumulation buffers follow the new host share), and the
# engine moves their fp32 master and moments at that quiet point. The plan is exactly the one ``make_plan`` gives
# for that tail size with those switches, so training on equals a run started with it from the same state, bit for
# bit (not one started with it from the first step: before the move the tail's buckets stepped with the device
# AdamW, which rounds differently from the CPU Adam). The move runs in the forward pre-hook, between steps, after
# every upload; not under data parallelism or weight flow (the batch is refused as before). The host arenas grow
# into the room reserved past them ([Note: reserved room in the host arenas] below; after a move to the device they
# may already hold the new share), and the device arenas are reallocated at their new size ([Note: restaging the
# device arenas] below).
#
# Under host accumulation ([Note: host accumulation] in docs/weight_flow.md) the move runs only at an optimizer
# step's first micro-batch, where nothing is summed on the host yet: the accumulator's buffers hold no state then,
# so they are dropped before the host arenas regrow and allocated again for the new plan (the fp32 arena at the
# new ``host_numel``; the landing ring at the new ``OffloadPlan.landing_ring``, which follows the largest host
# shards), and every host bucket's sum is bound afresh. The accumulation mode itself is a switch the move keeps.
# A later micro-batch of the step finds partial sums laid out for the old host share, and a bucket that changed
# sides would have summed its earlier micro-batches where the new plan does not (in ``param.grad`` on the device,
# or on the host), so a longer batch there is refused in one line that says so and names the workload to plan
# for (the engine's ``mid_accumulation``); the next step's first micro-batch may move.


# [Note: moving the tail to the device]
# The reverse move. When the calibration ([Note: calibration from the measured peak] in planning/planner.py) finds
# room that kept layers do not take (every layer kept, or none can be: no per-layer checkpointing), the last host
# buckets in gradient-arrival order become the first device buckets: ``planner.grow_tail`` picks how many the way
# the planner's own tail search would (the largest tail the calibrated budget holds, unless the roofline predicts a
# smaller one faster), with the same switches kept as above, so the plan is again ``make_plan``'s for that tail and
# training on equals a run started with it from the state at the move, bit for bit (before the move those buckets
# stepped with the CPU Adam). At the same quiet point as the move to the host, after every upload and every
# deferred store: the committed host state copy of the moved buckets is copied into the device arenas, reallocated
# at their new size ([Note: restaging the device arenas] below). The host arenas keep their size ([Note: the host
# arenas keep their size] below). The deferred stores, the D2H lead and gate, the master share, the upload
# thread and host accumulation's buffers follow the smaller host share, at a step's first micro-batch as above; a
# gate thread or upload thread a plan without host buckets no longer asks for stays idle. Host accumulation keeps
# at least one host bucket (a plan without host buckets accumulates on the device: a switch the move keeps).


# [Note: restaging the device arenas]
# Either move reallocates the three fp32 device arenas (master, exp_avg, exp_avg_sq) at the new tail's size, one at
# a time (``BucketLayout._restage_device_arena``). Each new arena is first allocated beside the old one
# (``layout.allocate_beside``) and the staying buckets' state copied device to device: the move runs at a quiet
# point, where the activations' memory is free, so the device usually holds both of one kind. Only where it does
# not (the allocator, having given back its unused blocks, still cannot) does the old arena's staying state wait on
# the host (``layout.stage_on_host``: 4 B per staying parameter, one arena at a time, so the device never holds the
# old and the new arena at once); ``planner.grow_tail`` and ``planner.shrink_tail`` price that host copy, the worst
# case. The host path moved 1.78B parameters' arenas of the 8B bs16 tail through pageable memory in 16.4 s on the
# H200 box (646577d, 2026-12-05), a copy the device makes at its own bandwidth.


# [Note: the host arenas keep their size]
# A move to the device leaves the host arenas as they are: the moved buckets' slices go unused, and the host holds
# what the plan before the move held, which it had room for. Freeing them would mean a new arena per kind at the
# smaller size, its pages touched and page-locked again, and the old contents copied over: on an 8B model with
# 4.1B parameters' state on the host (about 70 GB of arenas), the step holding a move of 0.1B parameters to the
# device took 67.7 s on an H100 box instead of 1.3 s, to give back 1.6 GB, while the move itself is 1.2 GB over
# the link. A move that leaves no host bucket frees them (there is nothing to copy). A later move to the host reuses
# the room (no arena is regrown while it holds the new host share). The checkpointed state is the plan's
# ``host_numel`` elements of each arena (``BucketLayout.flat_state``); ``BucketLayout.host_arena_numel`` says what
# the arenas hold; ``planner.shrink_tail`` prices a later move to the host with it, and the benchmarks predict host
# memory from it.


# [Note: reserved room in the host arenas]
# A move to the host needs host arenas of the larger share. Regrowing one means a new arena beside the old one, its
# pages touched (and page-locked, for the DMA-touched ones) and the old contents copied: on an H100 box the 8B
# batch-8 snippet's calibration moved one 32 MB bucket (16M parameters) to the host, and its peak RSS was 96.7 GB
# against the 82.6 GB its plan holds, about one 4.35B-element fp32 arena (17 GB) more. So a process that can move
# its tail (one process, stationary weights) allocates each host state arena with address space for every device
# bucket past the host share (``HostBuffer(reserve=...)``): pages nobody has written are not resident, so the room
# costs no RSS until a move writes the moved buckets' state into it, and the move grows each arena in place, its
# contents where they were. A page-locked arena is registered again over its whole grown range (one registration:
# a bucket whose copy crossed from the old pages into the new would span two), at the move's quiet point where no
# copy is in flight. A host that refuses the address space, or charges it as allocated (``vm.overcommit_memory=2``,
# where the room would take from the commit limit what later allocations need), gets arenas of the exact share,
# which a move regrows as before; ``planner.shrink_tail`` prices that regrowth only where the room does not hold
# the new share (``BucketLayout.host_arena_capacity``).


def _check_movable(old: OffloadPlan, new: OffloadPlan, what: str, build: str) -> None:
    """What both moves need: one process, stationary weights, the same bucket boundaries and the engine's switches
    (host accumulation's mode among them; its landing ring follows the host shards)."""
    if not old.tail_movable:
        raise ValueError(f"moving the device tail {what} needs one process and stationary weights")
    places = [(s.param_indices, s.numel) for s in old.buckets], [(s.param_indices, s.numel) for s in new.buckets]
    if places[0] != places[1]:
        raise ValueError("the new plan cuts the buckets differently; only the device tail's size may change")
    switches = ("weight_mode", "cast_side", "rollback", "speculation", "cpu_threads", "pin_memory",
                "nonspeculative_in_place", "world_size", "rank", "cpu_affinity", "host_accumulation")
    changed = [f for f in switches if getattr(old, f) != getattr(new, f)]
    if changed:
        raise ValueError(f"a move {what} keeps the engine's switches; the new plan changes {changed}: build it "
                         f"with planner.{build}")
    check_plan(new, comm=None)  # among others: a landing ring slot as large as the largest host shard


def check_move(old: OffloadPlan, new: OffloadPlan) -> None:
    """Refuse a ``new`` plan that does more than move ``old``'s first device buckets to the host with the same
    bucket boundaries (what ``planner.shrink_tail`` returns; the engine is built for everything else)."""
    _check_movable(old, new, "to the host", "shrink_tail")
    n_host = len(old.host_buckets)
    moved = len(new.host_buckets) - n_host
    if moved <= 0 or new.buckets[:n_host] != old.buckets[:n_host] or any(
            s.placement is not Placement.HOST for s in new.buckets[: n_host + moved]):
        raise ValueError("the new plan must move the first device buckets to the host, and keep the host buckets")


def check_move_to_device(old: OffloadPlan, new: OffloadPlan) -> None:
    """Refuse a ``new`` plan that does more than move ``old``'s last host buckets to the device with the same
    bucket boundaries (what ``planner.grow_tail`` returns)."""
    _check_movable(old, new, "to the device", "grow_tail")
    n_host = len(new.host_buckets)
    if n_host >= len(old.host_buckets) or new.buckets[:n_host] != old.buckets[:n_host] or any(
            s.placement is not Placement.DEVICE for s in new.buckets[n_host:]):
        raise ValueError("the new plan must move the last host buckets to the device, and keep the other host "
                         "buckets where they are")


@torch.no_grad()
def move_to_host(layout: BucketLayout, plan: OffloadPlan) -> list[HostBucket]:
    """[Note: moving the tail to the host]: make ``plan``, which moves the first device buckets of ``layout``'s plan
    to the host and changes nothing else the layout holds, concrete. Their fp32 master and moments are copied bit
    for bit into every host state copy (staging: their bf16 weights); the device arenas are reallocated at the
    tail's new size, so the moved buckets' device memory is freed. Quiet point only: no step in flight, every
    upload done, no moment store pending. Returns the new host buckets."""
    check_move(layout.plan, plan)
    moved = [s.index for s in plan.buckets if s.placement is not layout.plan.buckets[s.index].placement]
    leaving = {b.index: b for b in layout.device_buckets if b.index in moved}
    layout.fit_host_arenas(plan)  # the layout's plan is ``plan`` from here on
    host_new = [HostBucket(plan.buckets[i], leaving[i].params) for i in moved]
    for b in host_new:
        layout.bind_host(b)
        _copy_to_host(leaving[b.index], b)
    layout.shrink_device_tail([b for b in layout.device_buckets if b.index not in leaving])
    layout.add_host_buckets(host_new)
    return host_new


@torch.no_grad()
def move_to_device(layout: BucketLayout, plan: OffloadPlan) -> list[DeviceBucket]:
    """[Note: moving the tail to the device]: make ``plan``, which moves the last host buckets of ``layout``'s plan to
    the device and changes nothing else the layout holds, concrete. Their committed fp32 master and moments are
    copied bit for bit into the grown device arenas; the host arenas keep their size ([Note: the host arenas keep
    their size]).
    Quiet point only: no step in flight, every upload done, no moment store pending. Returns the new device
    buckets."""
    check_move_to_device(layout.plan, plan)
    leaving = [b for b in layout.host_buckets if plan.buckets[b.index].placement is Placement.DEVICE]
    arriving = [DeviceBucket(plan.buckets[b.index], b.params) for b in leaving]
    layout.grow_device_tail(plan, arriving)
    for d, h in zip(arriving, leaving, strict=True):
        _copy_to_device(h.pmv[layout.cur], d)
    layout.remove_host_buckets(leaving)
    layout.fit_host_arenas(plan)  # the layout's plan is ``plan`` from here on
    return arriving


# Each copy runs in a function of its own: a loop variable left in the mover's frame would hold a view of the last
# bucket's old arena (an ``exp_avg_sq`` of the device, on a move to the host) while that arena is reallocated, and
# with it the whole old arena: the device then holds the old and the new ``exp_avg_sq`` at once, what
# [Note: restaging the device arenas] promises it never does (an 8B Trainer row on an H100 ran out of memory
# allocating a new arena with the old one's bytes still taken, as this would).
def _copy_to_host(d: DeviceBucket, b: HostBucket) -> None:
    """``d``'s fp32 master and moments into every host state copy of ``b`` (a double buffer's other copy is written
    before it is read) and its staging; then ``d`` forgets its views of the device arenas."""
    for pmv in b.pmv:
        for dst, src in zip(pmv, (d.master, d.exp_avg, d.exp_avg_sq), strict=True):
            dst.copy_(src)
    if b.staging is not None:
        b.staging.copy_(b.pmv[0][0])
    d.drop_state()


def _copy_to_device(state: Sequence[torch.Tensor], d: DeviceBucket) -> None:
    """A host bucket's committed fp32 master and moments (``state``) into ``d``'s views of the grown device arenas."""
    for dst, src in zip((d.master, d.exp_avg, d.exp_avg_sq), state, strict=True):
        dst.copy_(src)
