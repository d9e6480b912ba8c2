"""The plan made concrete: the host and device arenas, the buckets viewing them, the gradient statistics.

The first stage of the data flow (plan -> hooks -> buckets -> host pass -> commit -> upload): everything here is
allocated at construction from the frozen :class:`OffloadPlan`, and again only when a later plan moves buckets
between the device tail and the host (runtime/tail_move.py); later stages only read and write views.
[Note: casts] and [Note: spread statistics] in docs/design.md say why the arenas look the way they do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..planning.plan import (
    BucketSpec,
    CastSide,
    HostAccumulation,
    MasterDeferral,
    OffloadPlan,
    Placement,
    Rollback,
    WeightMode,
)
from ..triton_kernels import scatter_flat_, spread_stats_rows
from .bucket import DeviceBucket, HostBucket
from .collectives import ShardGroup
from .host_memory import HostBuffer

__all__ = ["BucketLayout", "allocate_beside", "check_plan", "stage_on_host"]


def allocate_beside(numel: int, device: torch.device) -> torch.Tensor | None:
    """A new fp32 device arena of ``numel`` elements while the old one is still alive, or ``None`` when the device
    cannot hold both (the caching allocator has already given back its unused blocks and tried again): the old
    arena then waits on the host instead ([Note: restaging the device arenas] in runtime/tail_move.py)."""
    try:
        return torch.empty(numel, dtype=torch.float32, device=device)
    except torch.OutOfMemoryError:
        return None


def allocate_alone(numel: int, device: torch.device) -> torch.Tensor:
    """A new fp32 device arena of ``numel`` elements where the old one is freed: its staying state waits on the host
    ([Note: restaging the device arenas] in runtime/tail_move.py)."""
    return torch.empty(numel, dtype=torch.float32, device=device)


def stage_on_host(arena: torch.Tensor, pieces: Sequence[BucketSpec]) -> torch.Tensor:
    """The ``pieces`` (each spec's ``[offset, offset + shard)``) of a device ``arena``, one after another in a new
    host tensor: what waits on the host while the arena is reallocated (a pageable copy: a move is rare)."""
    held = torch.empty(sum(s.shard for s in pieces), dtype=arena.dtype, device="cpu")
    at = 0
    for s in pieces:
        held[at : at + s.shard].copy_(arena[s.offset : s.offset + s.shard])
        at += s.shard
    return held


def check_plan(plan: OffloadPlan, *, comm: ShardGroup | None) -> None:
    """Refuse a plan for another rank, or a hand-built plan whose switches the runtime cannot combine (``make_plan``
    never builds one). ``comm``: the data-parallel group, if any."""
    if ((comm.world_size, comm.rank) if comm else (1, 0)) != (plan.world_size, plan.rank):
        raise ValueError(f"the plan is for rank {plan.rank} of {plan.world_size} but the process group says "
                         f"{(comm.rank, comm.world_size) if comm else (0, 1)}")
    data_parallel = comm is not None
    if (plan.host_accumulation is HostAccumulation.LANDING and plan.host_numel
            and max(plan.landing_ring, default=0) < max(b.shard for b in plan.host_buckets)):
        raise ValueError("host accumulation in the landing buffer needs a ring slot as large as the largest host "
                         "bucket (OffloadPlan.landing_ring); build the plan with make_plan")
    if plan.defer_moments and (data_parallel or plan.host_accumulation is not HostAccumulation.OFF):
        raise ValueError("deferred moment stores are single-process and without host accumulation (the planner "
                         "turns them off otherwise); build the plan with make_plan")
    if plan.defer_master is not MasterDeferral.OFF and not (plan.defer_moments and plan.cast_side is CastSide.CPU):
        raise ValueError("deferred master stores need deferred moment stores and the CPU cast (the GPU cast "
                         "uploads the master itself); build the plan with make_plan")
    if plan.deferred_speculation and not (plan.speculation and plan.rollback is Rollback.INVERSE
                                          and plan.defer_moments and plan.cast_side is CastSide.CPU):
        raise ValueError("deferred speculation needs speculation, the inverse rollback, deferred moment stores and "
                         "the CPU cast; build the plan with make_plan")
    if plan.upload_thread and (data_parallel or plan.weight_mode is WeightMode.FLOW):
        raise ValueError("the upload thread is single-process with stationary weights (the planner turns it off "
                         "otherwise); build the plan with make_plan")
    if plan.d2h_gate and data_parallel:
        raise ValueError("the D2H gate is single-process (the planner turns it off otherwise); build the plan "
                         "with make_plan")
    if plan.host_accumulation is not HostAccumulation.OFF and data_parallel:
        raise ValueError("host gradient accumulation is single-process only (the planner refuses it with "
                         "data parallelism); build the plan with make_plan")
    if plan.weight_mode is WeightMode.FLOW and plan.cast_side is not CastSide.CPU:
        raise ValueError("weight flow streams the bf16 staging arena: it needs CastSide.CPU (the planner "
                         "ensures it; build the plan with make_plan)")


class BucketLayout:
    """Owns the arenas and the buckets of one engine, and which host state copy is committed.

    Attributes:
        arenas: every host arena by name (``master{k}``/``exp_avg{k}``/``exp_avg_sq{k}`` per state copy ``k``,
            ``landing`` (+ ``landing1``), ``staging``, ``weights``); kept for their page registration and for
            ``pinned_bytes`` (the host accumulation's buffers are its own).
        copies: host state copies (2: double buffer, 1: in place / inverse undo).
        cur: the host state copy that holds the committed state.
        cast_on_cpu: [Note: casts]: the CPU Adam writes bf16 staging (else the fp32 master is the upload source).
        full_home: weight flow with data parallelism: each rank keeps the whole bf16 weights of the host buckets.
        dev_master, dev_exp_avg, dev_exp_avg_sq: fp32 ``[device_numel]`` arenas of the GPU-resident tail.
        grad_stats: ``[buckets, rows, 2]`` fp32 on the device: per-bucket (sum of squares, non-finite count)
            spread over rows, one per flatten program ([Note: spread statistics]).
        grad_stats_host: the host buckets' rows as the CPU worker reads them (a pinned mirror on CUDA).
    """

    plan: OffloadPlan
    params: list[torch.nn.Parameter]
    device: torch.device
    dtype: torch.dtype
    arenas: dict[str, HostBuffer]
    copies: int
    cur: int
    cast_on_cpu: bool
    full_home: bool
    _pin: bool
    """Whether the DMA-touched host arenas are page-locked."""
    dev_master: torch.Tensor
    dev_exp_avg: torch.Tensor
    dev_exp_avg_sq: torch.Tensor
    host_buckets: list[HostBucket]
    device_buckets: list[DeviceBucket]
    buckets: list[HostBucket | DeviceBucket]
    bucket_of: list[HostBucket | DeviceBucket]
    """The bucket of each parameter (by index into ``params``)."""
    host_rank: dict[int, int]
    """A bucket's position among the host buckets: the master share's order and the idle commits' priority."""
    grad_stats: torch.Tensor
    grad_stats_buf: HostBuffer
    grad_stats_host: torch.Tensor

    def __init__(self, *, plan: OffloadPlan, params: Sequence[torch.nn.Parameter], is_cuda: bool,
                 data_parallel: bool) -> None:
        self.plan, self.params = plan, list(params)
        self.device, self.dtype = self.params[0].device, self.params[0].dtype
        dev = self.device
        pin = plan.pin_memory and dev.type == "cuda"
        n_host = plan.host_numel
        self.cast_on_cpu = plan.cast_side is CastSide.CPU
        self.copies = copies = 2 if plan.rollback is Rollback.DOUBLE_BUFFER else 1
        self._pin = pin
        self.arenas = {name: HostBuffer(n_host, dtype, pin=pinned, name=what, reserve=self.plan.host_arena_room)
                       for name, (dtype, pinned, what) in self._host_arena_kinds().items()}
        # weight flow + data parallel: staging holds this rank's shard only; the streamed weights need every
        # rank's, so each rank keeps the whole bf16 weights of the host buckets ([Note: data parallel sharding])
        self.full_home = plan.weight_mode is WeightMode.FLOW and data_parallel
        if self.full_home:
            full = sum(spec.numel for spec in plan.host_buckets)
            self.arenas["weights"] = HostBuffer(full, self.dtype, pin=pin, name="bf16 weights (weight flow)")
        self.cur = 0
        # The device tail's state is allocated by allocate_device_state(): under weight flow only once the
        # streamer has released the host buckets' weights, which the plan counted as free device memory (an 8B
        # model under a 24 GiB cap otherwise holds all 16 GB of its bf16 weights beside the tail's 10 GB of state).
        self.dev_master = self.dev_exp_avg = self.dev_exp_avg_sq = torch.empty(0, dtype=torch.float32, device=dev)
        self._device_state = False
        for k in range(copies):
            self.arenas[f"exp_avg{k}"].tensor.zero_()
            self.arenas[f"exp_avg_sq{k}"].tensor.zero_()

        self.host_buckets, self.device_buckets, self.buckets = [], [], []
        home_offset = 0
        self.bucket_of = [None] * len(self.params)  # type: ignore[list-item]
        for spec in plan.buckets:
            ps = [self.params[i] for i in spec.param_indices]
            b: HostBucket | DeviceBucket
            if spec.placement is Placement.HOST:
                b = HostBucket(spec, ps)
                self.bind_host(b)
                if self.full_home:
                    b.home = self.arenas["weights"].tensor[home_offset : home_offset + spec.numel]
                    home_offset += spec.numel
                self.host_buckets.append(b)
            else:
                b = DeviceBucket(spec, ps)
                self.device_buckets.append(b)
            self.buckets.append(b)
        self._index_buckets()
        # A bucket's statistics are its rows' column sums. Host buckets' rows are also copied to the host with
        # their gradients so the worker can refuse to speculate on a non-finite bucket.
        rows = max(spread_stats_rows(self.device, b.sizes) for b in self.buckets) if self.buckets else 1
        self.grad_stats = torch.zeros(len(self.buckets), rows, 2, dtype=torch.float32, device=self.device)
        # The HostBuffer is kept: its page registration ends with it (a pageable row makes every flush's
        # non-blocking copy synchronous).
        self.grad_stats_buf = HostBuffer(len(self.buckets) * rows * 2, torch.float32, pin=pin,
                                         name="gradient statistics")  # fmt: skip
        self.grad_stats_host = self.grad_stats_buf.tensor.view(-1, rows, 2) if is_cuda else self.grad_stats
        with torch.no_grad():
            self.load_masters_from_params(self.host_buckets)
        if plan.weight_mode is not WeightMode.FLOW:
            self.allocate_device_state()

    def _host_arena_kinds(self) -> dict[str, tuple[torch.dtype, bool, str]]:
        """Each host arena of ``host_numel`` elements the plan needs: (dtype, page-locked, what it holds).

        [Note: casts]: gradients always cross in the model dtype (the fused CPU Adam upcasts in registers). CPU cast
        -> a bf16 staging arena written by the Adam pass; GPU cast -> the fp32 master itself is the (pinned) upload
        source, and the GPU casts: no staging arena (2 B/param less host RAM)."""
        pin, kinds = self._pin, {}
        for k in range(self.copies):
            kinds[f"master{k}"] = (torch.float32, pin and not self.cast_on_cpu, f"fp32 master (copy {k})")
            kinds[f"exp_avg{k}"] = (torch.float32, False, f"exp_avg (copy {k})")
            kinds[f"exp_avg_sq{k}"] = (torch.float32, False, f"exp_avg_sq (copy {k})")
        kinds["landing"] = (self.dtype, pin, "gradient landing")
        if self.plan.defer_moments:  # a deferred step's gradient outlives the next step's D2H ([Note: deferred moments])
            kinds["landing1"] = (self.dtype, pin, "gradient landing (second)")
        if self.cast_on_cpu:
            kinds["staging"] = (self.dtype, pin, "weight staging")
        return kinds

    def bind_host(self, b: HostBucket) -> None:
        """Point ``b``'s state, landing and staging views at its slice of the host arenas."""
        a = {k: v.tensor for k, v in self.arenas.items()}
        sl = slice(b.spec.offset, b.spec.offset + b.spec.shard)
        b.pmv = [(a[f"master{k}"][sl], a[f"exp_avg{k}"][sl], a[f"exp_avg_sq{k}"][sl]) for k in range(self.copies)]
        b.landings = tuple(a[k][sl] for k in ("landing", "landing1") if k in a)
        b.landing = b.grad = b.landings[0]
        b.staging = b.home = a["staging"][sl] if self.cast_on_cpu else None

    def allocate_device_state(self) -> None:
        """Allocate the device tail's fp32 master and Adam moments and seed the masters from its parameters
        (resident under either weight mode). Idempotent."""
        if self._device_state:
            return
        self._device_state = True
        self._allocate_device_arenas()
        for b in self.device_buckets:
            b.exp_avg.zero_()
            b.exp_avg_sq.zero_()
        with torch.no_grad():
            self.load_masters_from_params(self.device_buckets)

    def _allocate_device_arenas(self) -> None:
        n_dev, dev = self.plan.device_numel, self.device
        self.dev_master = torch.empty(n_dev, dtype=torch.float32, device=dev)
        self.dev_exp_avg = torch.empty(n_dev, dtype=torch.float32, device=dev)
        self.dev_exp_avg_sq = torch.empty(n_dev, dtype=torch.float32, device=dev)
        self._bind_device_views()

    def _bind_device_views(self) -> None:
        """Point every device bucket's state views at its slice of the device arenas."""
        for b in self.device_buckets:
            sl = slice(b.spec.offset, b.spec.offset + b.spec.shard)
            b.master = self.dev_master[sl]
            b.exp_avg, b.exp_avg_sq = self.dev_exp_avg[sl], self.dev_exp_avg_sq[sl]

    @property
    def device_state_bytes(self) -> int:
        """Bytes of the device tail's fp32 master and moments (what a move to the host returns to the device)."""
        return sum(t.untyped_storage().nbytes() for t in (self.dev_master, self.dev_exp_avg, self.dev_exp_avg_sq))

    # -- what a move of the tail changes (runtime/tail_move.py composes these) -------------------------------------
    def fit_host_arenas(self, plan: OffloadPlan) -> None:
        """Take ``plan``, whose host buckets are the current ones, more (a move to the host) or fewer (a move to the
        device) of them, and bind the host buckets again. An arena too small for ``plan``'s ``host_numel`` grows
        into its reserved room ([Note: reserved room in the host arenas] in runtime/tail_move.py), or where that is
        too small is reallocated at it with its contents in front, one arena at a time; one that holds it keeps its
        size and its pages ([Note: the host arenas keep their size]); one ``plan`` no longer needs, and every one
        when no host bucket is left, is freed. Idle host buckets only."""
        for b in self.host_buckets:
            b.drop_views()  # each old arena is freed as soon as its resized copy holds its contents
        before = self._host_arena_kinds()
        self.plan = plan
        kinds = self._host_arena_kinds()
        for name in before.keys() - kinds.keys():  # the second landing arena, when deferred stores turn off
            del self.arenas[name]
        for name, (dtype, pinned, what) in kinds.items():
            if not plan.host_numel:  # nothing stays on the host: freeing costs nothing, there is nothing to copy
                self.arenas[name] = HostBuffer(0, dtype, pin=pinned, name=what)
            elif name not in self.arenas or not self.arenas[name].grow(plan.host_numel):
                self._regrow_host_arena(name, plan.host_numel, dtype, pinned, what)
        for b in self.host_buckets:
            self.bind_host(b)

    def _regrow_host_arena(self, name: str, numel: int, dtype: torch.dtype, pinned: bool, what: str) -> None:
        """One arena at ``numel`` elements with the old one's contents in front (as many as it holds); the old one
        is freed on return (this frame holds the only other reference)."""
        grown = HostBuffer(numel, dtype, pin=pinned, name=what, reserve=self.plan.host_arena_room)
        old = self.arenas.get(name)
        if old is not None:
            n = min(numel, old.tensor.numel())
            grown.tensor[:n].copy_(old.tensor[:n])
        self.arenas[name] = grown

    @property
    def host_arena_numel(self) -> int:
        """Elements each host state arena holds: the plan's ``host_numel``, or more after a move to the device."""
        return self.arenas["master0"].tensor.numel()

    @property
    def host_arena_capacity(self) -> int:
        """Elements every host state arena can grow to in place: the plan's share and the room reserved past it
        ([Note: reserved room in the host arenas] in runtime/tail_move.py)."""
        return min(self.arenas[name].capacity for name in self._host_arena_kinds())

    def _restage_device_arenas(self, numel: int, staying: Sequence[tuple[DeviceBucket, BucketSpec]]) -> None:
        """Reallocate the device arenas at ``numel`` elements, the ``staying`` buckets' state moved from their old
        spec (the pair's second) to their current one; the other device buckets' views are left for the caller to
        fill. One arena at a time, each beside the old one on the device where it holds both, else through host
        memory ([Note: restaging the device arenas] in runtime/tail_move.py)."""
        for name in ("dev_master", "dev_exp_avg", "dev_exp_avg_sq"):
            self._restage_device_arena(name, numel, staying)  # each binds the views to its new arena

    def _restage_device_arena(self, name: str, numel: int, staying: Sequence[tuple[DeviceBucket, BucketSpec]]) -> None:
        old_arena = getattr(self, name)
        grown = allocate_beside(numel, self.device)
        if grown is not None:  # a device-to-device copy; the old arena is freed when this frame returns
            sources = [old_arena[old.offset : old.offset + old.shard] for _, old in staying]
        else:  # the staying state waits on the host while the device holds neither arena
            held = stage_on_host(old_arena, [old for _, old in staying])
            del old_arena
            setattr(self, name, torch.empty(0, dtype=torch.float32, device=self.device))
            self._bind_device_views()  # the old arena's views go with it
            grown = allocate_alone(numel, self.device)
            sources = list(held.split([old.shard for _, old in staying]))
        for (b, _), src in zip(staying, sources, strict=True):
            grown[b.spec.offset : b.spec.offset + b.spec.shard].copy_(src)
        setattr(self, name, grown)
        self._bind_device_views()  # the old arena's views go with it, before the next arena is allocated

    def shrink_device_tail(self, staying: Sequence[DeviceBucket]) -> None:
        """Keep only ``staying`` of the device buckets, at their offsets in ``self.plan``, with their state
        (:meth:`_restage_device_arenas`)."""
        moves = [(b, b.spec) for b in staying]
        for b in staying:
            b.spec = self.plan.buckets[b.index]
        self.device_buckets = list(staying)
        self._restage_device_arenas(self.plan.device_numel, moves)

    def grow_device_tail(self, plan: OffloadPlan, arriving: Sequence[DeviceBucket]) -> None:
        """Put ``arriving`` (``plan``'s device buckets that are host buckets now) in front of the device buckets,
        every device bucket at its offset in ``plan``: the device arenas are reallocated at ``plan``'s
        ``device_numel`` with the current buckets' state (:meth:`_restage_device_arenas`), the arriving buckets'
        views left for the caller to fill. The host arenas stay as they are."""
        moves = [(b, b.spec) for b in self.device_buckets]
        for b, _ in moves:
            b.spec = plan.buckets[b.index]
        self.device_buckets = sorted([*arriving, *(b for b, _ in moves)], key=lambda b: b.index)
        self._restage_device_arenas(plan.device_numel, moves)

    def remove_host_buckets(self, leaving: Sequence[HostBucket]) -> None:
        """Forget ``leaving`` (host buckets the device buckets now stand for) and index every bucket again."""
        gone = {b.index for b in leaving}
        for b in leaving:
            b.drop_views()
        self.host_buckets = [b for b in self.host_buckets if b.index not in gone]
        self.buckets = sorted(self.host_buckets + self.device_buckets, key=lambda b: b.index)
        self._index_buckets()

    def add_host_buckets(self, buckets: Sequence[HostBucket]) -> None:
        """Append bound host buckets that were device buckets and index every bucket again."""
        self.host_buckets += buckets
        self.buckets = sorted(self.host_buckets + self.device_buckets, key=lambda b: b.index)
        self._index_buckets()

    def _index_buckets(self) -> None:
        for b in self.buckets:
            for i in b.spec.param_indices:
                self.bucket_of[i] = b
        self.host_rank = {b.index: k for k, b in enumerate(self.host_buckets)}

    def need_order(self, b: HostBucket | DeviceBucket) -> int:
        """Priority: the next forward needs the last-arriving bucket first."""
        return len(self.buckets) - 1 - b.index

    def advance_steps(self, param_steps: list[int]) -> None:
        """A validated step: each parameter that got a gradient takes its run's step count."""
        for b in self.buckets:
            for r in b.bucket_runs:
                offset = 0
                for i, n in zip(b.spec.param_indices, b.sizes):
                    if r.start <= offset < r.end:
                        param_steps[i] = r.step
                    offset += n

    def master(self, b: HostBucket | DeviceBucket, copy: int | None = None) -> torch.Tensor:
        """The fp32 master of ``b`` (host buckets: in state copy ``copy``, default the committed one)."""
        if isinstance(b, DeviceBucket):
            return b.master
        return b.pmv[self.cur if copy is None else copy][0]

    def load_masters_from_params(self, buckets: Sequence[HostBucket | DeviceBucket] | None = None) -> None:
        """fp32 master := the parameters' current values (exact for fp32 models); staging := bf16 of it. Over
        ``buckets`` (default: all)."""
        for b in self.buckets if buckets is None else buckets:
            master = self.master(b)
            if b.spec.length < b.spec.shard:
                master[b.spec.length :].zero_()  # padding of the last rank's shard: never stepped
            for k, start, end, at in b.pieces():
                master[at : at + end - start].copy_(b.params[k].detach().reshape(-1)[start:end])
            if isinstance(b, HostBucket) and b.staging is not None:
                b.staging.copy_(master)
            if isinstance(b, HostBucket) and b.home is not None and b.home is not b.staging:
                offset = 0
                for p, n in zip(b.params, b.sizes):
                    b.home[offset : offset + n].copy_(p.detach().reshape(-1))
                    offset += n

    @torch.no_grad()
    def write_weights(self, *, gather: Callable[[HostBucket | DeviceBucket, torch.Tensor], torch.Tensor | None] | None,
                      streamed: bool) -> None:
        """staging := bf16(master) and parameters := bf16(master), from the committed masters. ``gather`` (data
        parallel): every rank's shards, or ``None`` where it wrote the bucket's weight-flow home itself;
        ``streamed`` (weight flow): host parameters are fetched from staging, not written."""
        for b in self.buckets:
            master = self.master(b)
            if isinstance(b, HostBucket) and b.staging is not None:
                b.staging.copy_(master)
            if gather is not None:
                full = gather(b, master)
                if full is not None:
                    scatter_flat_(full, b.params)
            elif not streamed or isinstance(b, DeviceBucket):  # weight flow: staging is their home
                scatter_flat_(master, b.params)

    def weight_sources(self) -> dict[int, tuple[torch.nn.Parameter, torch.Tensor, HostBucket]]:
        """Weight flow: each host parameter's bf16 home (by ``id``) and its bucket, for the streamer."""
        sources: dict[int, tuple[torch.nn.Parameter, torch.Tensor, HostBucket]] = {}
        for b in self.host_buckets:
            assert b.home is not None
            offset = 0
            for p, n in zip(b.params, b.sizes):
                sources[id(p)] = (p, b.home[offset : offset + n], b)
                offset += n
        return sources

    def flat_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """The live flat arenas of the committed state (callers store pending deferred moments first)."""
        return {
            "host": {k: self.arenas[f"{k}{self.cur}"].tensor[: self.plan.host_numel]
                     for k in ("master", "exp_avg", "exp_avg_sq")},
            "device": {"master": self.dev_master, "exp_avg": self.dev_exp_avg, "exp_avg_sq": self.dev_exp_avg_sq},
        }

    def param_location(self, i: int) -> tuple[Placement, int]:
        """(placement, element offset in that placement's arenas) of parameter ``i`` (whole, one process)."""
        b = self.bucket_of[i]
        offset = b.spec.offset
        for j, n in zip(b.spec.param_indices, b.sizes):
            if j == i:
                return b.spec.placement, offset
            offset += n
        raise AssertionError(i)

    def param_pieces(self, i: int) -> list[tuple[Placement, int, int, int]]:
        """``(placement, arena offset, start, end)``: elements ``[start, end)`` of parameter ``i`` (flattened)
        that this rank holds, at that offset of its placement's arenas (the whole parameter on one process)."""
        b = self.bucket_of[i]
        k = b.spec.param_indices.index(i)
        return [(b.spec.placement, b.spec.offset + at, start, end) for kk, start, end, at in b.pieces() if kk == k]

    def seed_masters(self, values: Sequence[torch.Tensor | None]) -> None:
        """Overwrite the committed masters of the parameters with a value (``None``: keep), this rank's pieces
        (callers store pending deferred moments first and refresh the weights after)."""
        flat = self.flat_state()
        with torch.no_grad():
            for i, v in enumerate(values):
                if v is not None:
                    for pl, off, start, end in self.param_pieces(i):
                        side = "host" if pl is Placement.HOST else "device"
                        flat[side]["master"][off : off + end - start].copy_(v.reshape(-1)[start:end])

    @property
    def pinned_bytes(self) -> int:
        return sum(a.nbytes for a in self.arenas.values() if a.pinned)
