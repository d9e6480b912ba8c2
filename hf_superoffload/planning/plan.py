"""The offload plan: a frozen value the runtime executes. Policy lives in the planner, never here."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

__all__ = ["BucketSpec", "CastSide", "HostAccumulation", "MasterDeferral", "OffloadPlan", "Placement", "PlanError",
           "Rollback", "WeightMode"]


class PlanError(ValueError):
    """The requested run cannot fit; the message gives the numbers and what to change."""


class Placement(enum.Enum):
    """Where a bucket's fp32 master and Adam state live and where its step runs."""

    HOST = "host"
    """fp32 master, exp_avg, exp_avg_sq in host RAM; CPU Adam, overlapped with the GPU."""
    DEVICE = "device"
    """Optimizer state on the model's device; stepped there right after validation (the GPU-resident tail)."""


class WeightMode(enum.Enum):
    STATIONARY = "stationary"
    """bf16 weights stay on the GPU."""
    FLOW = "flow"
    """bf16 weights live on the host and stream in per layer."""


class CastSide(enum.Enum):
    CPU = "cpu"
    """bf16 crosses the link; fp32<->bf16 casts are fused into the CPU Adam pass (PCIe)."""
    GPU = "gpu"
    """fp32 crosses the link; the GPU casts (fast chip-to-chip links)."""


class Rollback(enum.Enum):
    DOUBLE_BUFFER = "double_buffer"
    """Two copies of the host state; a step reads one and writes the other: bit-exact, free undo, +12 B/param."""
    INVERSE = "inverse"
    """Algebraic inverse of AdamW: no extra memory, fp32-rounding-exact undo."""


class MasterDeferral(enum.Enum):
    """Which verdict-known host passes leave the fp32 master to the commit ([Note: adaptive master deferral])."""

    OFF = "off"
    """Every pass stores p (20 B/param critical, 18 B/param commit)."""
    ALL = "all"
    """Every pass writes the bf16 weights only (16 B/param critical, 26 B/param commit)."""
    ADAPTIVE = "adaptive"
    """The runtime moves the split step by step so that the commits just fit the worker's idle time."""
    SHARE = "share"
    """A fixed share: the first ``OffloadPlan.master_buckets`` host buckets (chosen from a fraction of the parameters)."""


class HostAccumulation(enum.Enum):
    """Where gradient accumulation over micro-batches sums host buckets' gradients ([Note: host accumulation])."""

    OFF = "off"
    """On the device, in ``param.grad``; only the boundary micro-batch offloads (device tail: always)."""
    FP32 = "fp32"
    """Every micro-batch offloads; the CPU worker sums into an fp32 arena (+4 B/param host RAM)."""
    LANDING = "landing"
    """Every micro-batch offloads; the CPU worker sums into the landing buffer itself, in its dtype (bf16 with CPU
    models: the rounding of torch's own bf16 ``.grad`` accumulation). Later micro-batches land
    in a small ring of bucket-sized pinned buffers: no per-parameter host RAM."""




@dataclass(frozen=True, slots=True)
class BucketSpec:
    """One bucket: consecutive trainable parameters in gradient-arrival (backward) order.

    Attributes:
        index: position in arrival order (0 arrives first in backward: the last layers).
        param_indices: indices into the engine's parameter list, in arrival order.
        numel: total elements.
        placement: where its optimizer state lives.
        offset: element offset of this rank's shard inside its placement's flat arenas.
        shard: elements of the bucket each data-parallel rank owns (``ceil(numel / world_size)``; the
            bucket is padded to ``shard * world_size``). ``numel`` on a single process.
        lo: first element (bucket coordinates) of this rank's shard.
    """

    index: int
    param_indices: tuple[int, ...]
    numel: int
    placement: Placement
    offset: int
    shard: int = -1
    lo: int = 0

    def __post_init__(self) -> None:
        if self.shard < 0:
            object.__setattr__(self, "shard", self.numel)

    @property
    def length(self) -> int:
        """Real (unpadded) elements of this rank's shard; the rest of ``shard`` is padding."""
        return max(0, min(self.shard, self.numel - self.lo))


@dataclass(frozen=True, slots=True)
class OffloadPlan:
    """Everything the runtime needs to know; nothing it may decide itself.

    Attributes:
        buckets: in gradient-arrival order. The next forward needs them in reverse order.
        weight_mode: where the bf16 weights live between uses.
        cast_side: which side of the link casts.
        rollback: how a speculative step is undone.
        nonspeculative_in_place: with the double buffer, steps that speculate nothing update the committed copy
            in place ([Note: speculation and rollback]); always in place with the inverse rollback.
        speculation: whether CPU buckets may step before validation.
        cpu_threads: threads of the CPU Adam.
        pin_memory: page-lock the DMA buffers (exact size).
        host_numel / device_numel: elements whose optimizer state lives on each side (this rank's shards).
        world_size / rank: data parallelism: each rank owns the slice ``[lo, lo + shard)`` of every bucket
            ([Note: data parallel sharding]); 1 / 0 on a single process.
        cpu_affinity: cores this rank's CPU Adam runs on (ranks sharing a host split them); ``None``: any.
        host_accumulation: where gradient accumulation sums the host buckets' gradients.
        landing_ring: with ``HostAccumulation.LANDING``, the elements of each pinned slot that receives a later
            micro-batch's gradients (the planner sizes them: ``planner.landing_ring_slots``).
        defer_moments: a host bucket stepped with the verdict known stores its moments later, off the critical
            path; the landing arena is doubled ([Note: deferred moments] in docs/design.md).
        defer_master: with ``defer_moments`` (and the CPU cast), which verdict-known passes write the bf16
            weights only and leave the fp32 master to the commit: none, all, an adaptive or a fixed share of the
            host buckets ([Note: adaptive master deferral] in docs/design.md).
        deferred_speculation: with the inverse rollback, speculation, ``defer_moments`` and the CPU cast, a
            speculative pass writes the bf16 weights only and leaves p, m, v to a whole-step commit, so skip and redo
            need no algebraic undo ([Note: deferred speculation] in docs/design.md).
        master_buckets: with ``MasterDeferral.SHARE``, how many host buckets (the first in arrival order) defer their
            master: those holding the configured fraction of the host parameters, to the nearest whole bucket.
        d2h_lead_buckets: host buckets' gradient copies that may be in flight past the backward ([Note: D2H lead]).
        upload_thread: the H2D weight uploads are issued by a thread of their own, not the CPU worker ([Note:
            upload thread]; the engine uses it on CUDA with stationary weights in a single process).
        d2h_gate: a host bucket's first CPU task is queued only once its gradient copy has landed ([Note: D2H
            gate]; with a D2H lead in a single process).
        kept_layers: under activation checkpointing, how many decoder layers (the last ones) keep their
            activations instead of recomputing them in backward: device memory the offload freed, spent on
            speed ([Note: kept layers] in planning/planner.py); 0 leaves checkpointing as the model has it.
        bucket_size_mb: the bucket size the parameters were partitioned with (``SuperOffloadConfig.bucket_size_mb``,
            or the plan search's pick for ``"auto"``: [Note: bucket size] in docs/design.md); a move of the tail
            keeps it, so the buckets keep their boundaries.
        notes: human-readable reasons for the choices (printed with the summary).
    """

    buckets: tuple[BucketSpec, ...]
    weight_mode: WeightMode
    cast_side: CastSide
    rollback: Rollback
    speculation: bool
    cpu_threads: int
    pin_memory: bool
    host_numel: int
    device_numel: int
    notes: tuple[str, ...] = field(default=())
    world_size: int = 1
    rank: int = 0
    cpu_affinity: tuple[int, ...] | None = None
    host_accumulation: HostAccumulation = HostAccumulation.OFF
    landing_ring: tuple[int, ...] = ()
    defer_moments: bool = False
    defer_master: MasterDeferral = MasterDeferral.OFF
    deferred_speculation: bool = False
    d2h_lead_buckets: int = 0
    upload_thread: bool = False
    d2h_gate: bool = False
    nonspeculative_in_place: bool = False
    master_buckets: int = 0
    kept_layers: int = 0
    bucket_size_mb: float = 32.0
    # the buckets split by placement, filled on first use: the planner's search reads them on every candidate plan
    # (thousands per ``make_plan``), and ``dataclasses.replace`` starts a new plan without them
    _split: tuple[tuple[BucketSpec, ...], tuple[BucketSpec, ...]] | None = field(
        default=None, init=False, repr=False, compare=False)

    def _by_placement(self) -> tuple[tuple[BucketSpec, ...], tuple[BucketSpec, ...]]:
        if self._split is None:
            split = (tuple(b for b in self.buckets if b.placement is Placement.HOST),
                     tuple(b for b in self.buckets if b.placement is Placement.DEVICE))
            object.__setattr__(self, "_split", split)
            return split
        return self._split

    @property
    def host_buckets(self) -> tuple[BucketSpec, ...]:
        return self._by_placement()[0]

    @property
    def device_buckets(self) -> tuple[BucketSpec, ...]:
        return self._by_placement()[1]

    @property
    def tail_movable(self) -> bool:
        """Whether device buckets may move between the device and the host mid-run ([Note: moving the tail to the
        host] in runtime/tail_move.py): one process, stationary weights."""
        return self.world_size == 1 and self.weight_mode is WeightMode.STATIONARY

    @property
    def host_arena_room(self) -> int:
        """Elements of untouched address space each host state arena keeps past ``host_numel``, which a move to the
        host grows into ([Note: reserved room in the host arenas] in runtime/tail_move.py): the device tail's, where
        it may move."""
        return self.device_numel if self.tail_movable else 0

    def host_bytes(self) -> int:
        """Host RAM for optimizer state and the DMA buffers."""
        # p/m/v, then the bf16 landing, and bf16 staging with the CPU cast (the GPU cast uploads the fp32 master)
        per = 12 + (4 if self.cast_side is CastSide.CPU else 2) + (12 if self.rollback is Rollback.DOUBLE_BUFFER else 0)
        full_weights = 0  # weight flow + data parallel: the whole bf16 weights of the host buckets on every rank
        if self.weight_mode is WeightMode.FLOW and self.world_size > 1:
            full_weights = 2 * sum(b.numel for b in self.host_buckets)
        return self.host_numel * per + full_weights + self.accumulation_bytes() + self.deferred_landing_bytes()

    def deferred_landing_bytes(self) -> int:
        """Host RAM (pinned) of the second (bf16) landing arena that deferred moment stores need."""
        return 2 * self.host_numel if self.defer_moments else 0

    def accumulation_bytes(self) -> int:
        """Host RAM of the gradient accumulation buffers (fp32 arena, or the landing mode's pinned ring)."""
        if self.host_accumulation is HostAccumulation.FP32:
            return 4 * self.host_numel
        if self.host_accumulation is HostAccumulation.LANDING and self.host_numel:
            return 2 * sum(self.landing_ring)
        return 0

    def device_bytes(self) -> int:
        """Device memory for the GPU-resident tail's fp32 master and Adam state."""
        return self.device_numel * 12

    def summary(self) -> str:
        gib = 1024**3
        lines = [
            "hf_superoffload plan:",
            f"  buckets: {len(self.buckets)} ({len(self.host_buckets)} host, {len(self.device_buckets)} device tail) "
            f"of at most {self.bucket_size_mb:g} MB (a small model gets smaller ones), or one larger parameter each",
            f"  optimizer state: {self.host_numel / 1e6:.1f}M params on host ({self.host_bytes() / gib:.2f} GiB), "
            f"{self.device_numel / 1e6:.1f}M on device ({self.device_bytes() / gib:.2f} GiB)",
            f"  weights: {self.weight_mode.value}; casts on {self.cast_side.value}; rollback: {self.rollback.value}"
            f"{' (steps that speculate nothing: in place)' if self.nonspeculative_in_place else ''}; "
            f"speculation: {'on' if self.speculation else 'off'}; cpu threads: {self.cpu_threads}; "
            f"pinned: {self.pin_memory}",
            f"  gradient accumulation: {_ACCUM_SUMMARY[self.host_accumulation]}",
            f"  deferred moment stores: {'on (second landing arena)' if self.defer_moments else 'off'}"
            f"{_MASTER_SUMMARY[self.defer_master] if self.defer_moments else ''}",
        ]
        if self.host_buckets:
            lines.append(f"  D2H lead: {self.d2h_lead_buckets} bucket(s)"
                         + (" (each host bucket's hook waits for its own gradient copy)" if not self.d2h_lead_buckets
                            else " in flight past the backward; first CPU tasks in arrival order until the verdict"
                            + (", each queued once its copy has landed" if self.d2h_gate else "")))
            lines.append(f"  uploads: issued by {'a thread of their own' if self.upload_thread else 'the CPU worker'}")
        if self.kept_layers:
            lines.append(f"  activation checkpointing: the last {self.kept_layers} decoder layer(s) keep their "
                         "activations (no recompute); the others are checkpointed")
        if self.world_size > 1:
            cores = f"cores {_ranges(self.cpu_affinity)}" if self.cpu_affinity else "all cores"
            lines.append(f"  data parallel: rank {self.rank} of {self.world_size} owns 1/{self.world_size} of every "
                         f"bucket's optimizer state; CPU Adam on {cores}")
        lines += [f"  - {n}" for n in self.notes]
        return "\n".join(lines)


_MASTER_SUMMARY = {
    MasterDeferral.OFF: "",
    MasterDeferral.ALL: "; master weights too",
    MasterDeferral.ADAPTIVE: "; master weights too for an adaptive share of the buckets (the moments' share adapts too)",
    MasterDeferral.SHARE: "; master weights too for a fixed share of the buckets",  # (the count: in the notes)
}

_ACCUM_SUMMARY = {
    HostAccumulation.OFF: "on the device (param.grad)",
    HostAccumulation.FP32: "on the host, fp32 arena",
    HostAccumulation.LANDING: "on the host, in the landing buffer",
}


def _ranges(cores: tuple[int, ...]) -> str:
    """``(0, 1, 2, 5)`` -> ``"0-2,5"``."""
    out: list[str] = []
    start = prev = None
    for c in sorted(cores):
        if prev is not None and c == prev + 1:
            prev = c
            continue
        if start is not None:
            out.append(f"{start}-{prev}" if prev != start else f"{start}")
        start = prev = c
    if start is not None:
        out.append(f"{start}-{prev}" if prev != start else f"{start}")
    return ",".join(out)
