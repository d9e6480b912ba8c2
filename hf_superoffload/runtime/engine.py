"""OffloadEngine: executes an :class:`OffloadPlan` for one set of parameters.

Schedule of one optimizer step (see docs/design.md for the notes named here):

1. Backward. Each parameter's post-accumulate-grad hook counts towards its bucket. On the last
   micro-batch of an accumulation (``sync_gradients``), a complete bucket is *flushed*: its gradients are
   flattened on the compute stream together with their statistics (sum of squares, non-finite count),
   copied to the page-locked landing buffer on the D2H stream, and released. A host bucket's CPU task is
   queued; a device (tail) bucket keeps its flat gradient on the device.
2. The CPU worker waits on exactly that bucket's D2H event and, if speculation is on and no non-finite
   gradient was seen, steps AdamW speculatively (writing the bf16 weights into staging in the same pass).
   With host accumulation (``plan.host_accumulation``, [Note: host accumulation]) host buckets are flushed in
   every micro-batch: the CPU worker sums them (``runtime/accumulation.py``) and the boundary micro-batch's
   statistics are those of the sum, computed on the host.
3. ``step()`` flushes the buckets that did not complete (parameters without gradients), reads the global
   norm and non-finite count (the one host sync of the step), and decides COMMIT / REDO / SKIP
   ([Note: speculation and rollback]).
4. Each host bucket, once final, is copied host to device on the H2D stream and scattered into its
   parameters; its ``ready`` flag and H2D event release the next forward of the layers that own it
   ([Note: stream ordering]). Device-tail buckets step on the compute stream right after validation.
   With ``plan.defer_moments`` a pass whose verdict is known stores p and the bf16 weights only; the worker
   stores the moments when it is idle, at the latest at the bucket's next CPU task ([Note: deferred moments]).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from .. import ops
from ..planning.plan import (
    CastSide,
    HostAccumulation,
    MasterDeferral,
    OffloadPlan,
    Placement,
    Rollback,
    WeightMode,
)
from ..triton_kernels import adamw_flat_, flatten_grads_with_stats_, scatter_flat_, spread_stats_rows
from .accumulation import HostAccumulator
from .bucket import BucketState, DeviceBucket, HostBucket
from .collectives import ShardGroup
from .cpu_worker import CpuWorker
from .host_memory import HostBuffer
from .host_step import HostStepMixin, _StepContext
from .master_deferral import COMMIT_BYTES, DeferralObservation, next_share
from .sharding import DataParallelMixin, _add_stats_
from .streams import Handoff, StreamSet
from .validation import Hyper, SpeculationGovernor, StepVerdict, Verdict, decide
from .weight_flow import WeightStreamer, forward_roots

__all__ = ["OffloadEngine", "StepStats", "module_weights"]

logger = logging.getLogger("hf_superoffload")

# The live engine whose hooks drive each parameter (by id; the value is checked with `is` before use).
_ENGINE_OF_PARAM: weakref.WeakValueDictionary[int, OffloadEngine] = weakref.WeakValueDictionary()


@dataclass(slots=True)
class StepStats:
    """Telemetry of one training iteration (from one ``step()`` to the next, host clock)."""

    grad_norm: float = float("nan")
    verdict: str = ""
    clip_coef: float = 1.0
    speculative: bool = False
    cpu_s: float = 0.0
    """Seconds the CPU worker spent in Adam (incl. undo/redo) during this iteration: the critical passes."""
    commit_s: float = 0.0
    """Seconds spent storing deferred moments ([Note: deferred moments]) during this iteration (off the critical
    path: when the worker is idle, at a bucket's next CPU task, or when a reader such as ``state_dict`` needs them)."""
    wait_s: float = 0.0
    """Seconds the training thread blocked on buckets during this iteration (the GPU waiting for the CPU)."""
    iteration_s: float = 0.0
    """Wall time of the iteration."""
    d2h_bytes: int = 0
    h2d_bytes: int = 0
    speculated_buckets: int = 0
    """Host buckets stepped before validation."""
    wasted_buckets: int = 0
    """Speculated buckets that had to be undone (redo or skip)."""
    master_deferred_buckets: int = 0
    """The share in force for this step: how many host buckets' verdict-known passes leave the fp32 master to the
    commit ([Note: adaptive master deferral]; 0 without deferred moments)."""
    pass_s: float = 0.0
    """Wall seconds of the host pass that ran in this iteration: from the previous ``step()``'s verdict until the CPU
    worker had finished every host bucket of that step (pending commits it had to store first, undo and redo, Adam,
    handing over the uploads). The next forward overlaps it; ``wait_s`` is what it could not hide. The share of that
    pass is the previous step's ``master_deferred_buckets``. 0 after a skipped step, on the first step, and when the
    pass had not finished by this ``step()``."""

    @property
    def overlap(self) -> float:
        """Share of the CPU Adam time hidden behind GPU work (1.0: fully hidden)."""
        return 1.0 - min(self.wait_s, self.cpu_s) / self.cpu_s if self.cpu_s > 0 else 1.0

    def as_log(self, prefix: str = "superoffload/") -> dict[str, float]:
        return {
            f"{prefix}cpu_adam_s": round(self.cpu_s, 4),
            f"{prefix}moment_commit_s": round(self.commit_s, 4),
            f"{prefix}gpu_wait_s": round(self.wait_s, 4),
            f"{prefix}overlap": round(self.overlap, 4),
            f"{prefix}link_gb": round((self.d2h_bytes + self.h2d_bytes) / 1e9, 6),
            f"{prefix}clip_coef": round(self.clip_coef, 6),
            f"{prefix}speculative": float(self.speculative),
            f"{prefix}master_deferred_buckets": float(self.master_deferred_buckets),
            f"{prefix}pass_s": round(self.pass_s, 4),
        }


def module_weights(module: torch.nn.Module) -> contextlib.AbstractContextManager[None]:
    """A context in which ``module``'s parameters hold their final weights on the device, for code that reads
    them without calling the module (a chunked LM-head loss): what the module's forward hooks would do. Weight
    flow streams them in; stationary weights wait for their buckets' update (its upload, on the current stream).
    A no-op for modules no engine owns."""
    for p in module.parameters():
        engine = _ENGINE_OF_PARAM.get(id(p))
        if engine is not None and not engine._closed:
            return engine.module_weights(module)
    return contextlib.nullcontext()


class OffloadEngine(HostStepMixin, DataParallelMixin):
    """Wires plan, buckets, hooks, streams and the CPU worker for one optimizer."""

    def __init__(
        self,
        *,
        params: Sequence[torch.nn.Parameter],
        param_group: Sequence[int],
        hyper_fn: Callable[[], Hyper],
        plan: OffloadPlan,
        modules: Sequence[torch.nn.Module],
        check_finite: bool,
        timeout_s: float,
        governor: SpeculationGovernor,
        comm: ShardGroup | None = None,
    ) -> None:
        """
        Args:
            params: trainable parameters, deduplicated, in gradient-arrival order (plan indices refer to it).
            param_group: the optimizer param group of each parameter.
            hyper_fn: reads the live per-group hyper-parameters (LR schedulers change them).
            modules: modules whose forward must wait for their parameters (every module of the model).
            comm: data parallelism: the group the optimizer state is sharded over ([Note: data parallel
                sharding]); the plan's ``world_size``/``rank`` must match it.
        """
        self.params = list(params)
        self.param_group = list(param_group)
        self.param_steps = [0] * len(self.params)
        self.plan = plan
        self.hyper_fn = hyper_fn
        self.check_finite = check_finite
        self.timeout_s = timeout_s
        self.governor = governor
        self.comm = comm
        ranks = (comm.world_size, comm.rank) if comm else (1, 0)
        if ranks != (plan.world_size, plan.rank):
            raise ValueError(f"the plan is for rank {plan.rank} of {plan.world_size} but the process group says "
                             f"{(comm.rank, comm.world_size) if comm else (0, 1)}")
        self._div = comm.grad_divisor if comm else 1.0
        """Gradients are summed over the ranks and divided by this (folded into the Adam's grad scale)."""
        self.device = self.params[0].device
        self.dtype = self.params[0].dtype
        self.streams = StreamSet.create(self.device)
        self._lock = threading.Lock()
        self._ctx: _StepContext | None = None
        self._no_sync_depth = 0
        self.sync_predicate: Callable[[], bool] | None = None
        self.max_grad_norm_fn: Callable[[], float | None] = lambda: None
        self.stats = StepStats()
        self._acc = StepStats()  # accumulates from the last step() on; guarded by self._lock
        self._last_step_t = time.perf_counter()
        self._pass_ctx: _StepContext | None = None
        """The last validated step's context: its pass runs until the next ``step()`` (StepStats.pass_s)."""
        self._closed = False
        self.consistent = True
        """False once a worker failure left a validated step half applied (the state must not be saved)."""

        for p in self.params:
            other = _ENGINE_OF_PARAM.get(id(p))
            if other is not None and not other._closed and any(q is p for q in other.params):
                logger.warning("hf_superoffload: these parameters are still driven by an earlier SuperOffloadOptimizer "
                               "that was not closed; closing it now (call opt.close() before building a new one)")
                other.close()
        if self.plan.host_numel:
            # Build/load the CPU Adam library now, not inside the first step (a first JIT build takes ~15 s).
            logger.info("hf_superoffload: CPU Adam backend %s, %d threads", ops.backend(), self.plan.cpu_threads)
        if plan.defer_moments and (comm is not None or plan.host_accumulation is not HostAccumulation.OFF):
            raise ValueError("deferred moment stores are single-process and without host accumulation (the planner "
                             "turns them off otherwise); build the plan with make_plan")
        if plan.defer_master is not MasterDeferral.OFF and not (plan.defer_moments and plan.cast_side is CastSide.CPU):
            raise ValueError("deferred master stores need deferred moment stores and the CPU cast (the GPU cast "
                             "uploads the master itself); build the plan with make_plan")
        if plan.upload_thread and (comm is not None or plan.weight_mode is WeightMode.FLOW):
            raise ValueError("the upload thread is single-process with stationary weights (the planner turns it off "
                             "otherwise); build the plan with make_plan")
        if plan.d2h_gate and comm is not None:
            raise ValueError("the D2H gate is single-process (the planner turns it off otherwise); build the plan "
                             "with make_plan")
        self._defer = plan.defer_moments
        """[Note: deferred moments]: a verdict-known CPU pass leaves m/v unstored; they are stored later."""
        self._master_mode = plan.defer_master
        """... and the fp32 master too for the first ``_master_count`` host buckets (the pass writes the bf16 weights
        only; the commit re-runs the step): all, none, or a share moved each step ([Note: adaptive master
        deferral])."""
        self.commit_when_idle = True
        """[Note: deferred moments]: after a step's pass the worker stores the moments whenever it has nothing more
        urgent (lowest priority, in the next backward's arrival order). ``False``: only at the bucket's next CPU
        task or a reader's request (white-box tests of the pending path use it)."""
        self._build_buckets()
        self._host_rank = {b.index: k for k, b in enumerate(self.host_buckets)}
        """A bucket's position among the host buckets: the master share's order and the idle commits' priority."""
        self._host_shards = [b.spec.shard for b in self.host_buckets]
        self._master_count = len(self.host_buckets) if self._master_mode is MasterDeferral.ALL else plan.master_buckets
        self._commit_clock = [0.0, 0.0]
        """Seconds and bytes of commit work since the last verdict (under the lock): the measured commit rate."""
        self._commit_rate = 0.0
        self._commits_done_at: float | None = None
        """When the last idle-commit chain finished (None: still running, or it committed nothing)."""
        self._install_hooks(modules)
        self._flow: WeightStreamer | None = None
        if self.plan.weight_mode is WeightMode.FLOW:
            self._flow = self._build_streamer(modules)
            self._hooked = None  # the streamer's hooks own the weights: an unhooked read finds them released
        self._accum: HostAccumulator | None = None
        self._worker = CpuWorker(device=self.device, on_error=self._wake_all, affinity=plan.cpu_affinity,
                                 gated=plan.d2h_gate)
        if plan.host_accumulation is not HostAccumulation.OFF:
            if comm is not None:
                raise ValueError("host gradient accumulation is single-process only (the planner refuses it with "
                                 "data parallelism); build the plan with make_plan")
            self._accum = HostAccumulator(
                mode=plan.host_accumulation, buckets=self.host_buckets, host_numel=plan.host_numel,
                landing_dtype=self._arenas["landing"].tensor.dtype, pin=plan.pin_memory and self.streams.is_cuda,
                worker=self._worker, timeout_s=timeout_s, num_threads=plan.cpu_threads)
            for k, buf in enumerate(self._accum.buffers):
                self._arenas[f"accumulation{k}"] = buf
        # data parallel: one thread issues the all-gathers, in need order, so every rank issues them alike
        self._gatherer = (CpuWorker(device=self.device, on_error=self._wake_all, name="superoffload-gather")
                          if comm else None)
        self._gather_seq = 0
        # [Note: upload thread]: the H2D uploads leave the worker's critical path (the plan: stationary, one process)
        self._uploader = (CpuWorker(device=self.device, on_error=self._wake_all, name="superoffload-upload")
                          if plan.upload_thread else None)
        self._upload_seq = 0
        self._present = [0] * len(self.buckets)
        for p in self.params:
            _ENGINE_OF_PARAM[id(p)] = self

    # ------------------------------------------------------------------------------------------------
    # construction
    def _build_buckets(self) -> None:
        plan, dev = self.plan, self.device
        pin = plan.pin_memory and dev.type == "cuda"
        n_host, n_dev = plan.host_numel, plan.device_numel
        # [Note: casts]: gradients always cross in the model dtype (the fused CPU Adam upcasts in registers).
        # CPU cast -> a bf16 staging arena written by the Adam pass; GPU cast -> the fp32 master itself is the
        # (pinned) upload source, and the GPU casts: no staging arena (2 B/param less host RAM).
        self._cast_on_cpu = plan.cast_side is CastSide.CPU
        copies = 2 if plan.rollback is Rollback.DOUBLE_BUFFER else 1
        self._arenas: dict[str, HostBuffer] = {}
        for k in range(copies):
            self._arenas[f"master{k}"] = HostBuffer(n_host, torch.float32, pin=pin and not self._cast_on_cpu,
                                                    name=f"fp32 master (copy {k})")
            self._arenas[f"exp_avg{k}"] = HostBuffer(n_host, torch.float32, pin=False, name=f"exp_avg (copy {k})")
            self._arenas[f"exp_avg_sq{k}"] = HostBuffer(n_host, torch.float32, pin=False, name=f"exp_avg_sq (copy {k})")
        self._arenas["landing"] = HostBuffer(n_host, self.dtype, pin=pin, name="gradient landing")
        if plan.defer_moments:  # a deferred step's gradient outlives the next step's D2H ([Note: deferred moments])
            self._arenas["landing1"] = HostBuffer(n_host, self.dtype, pin=pin, name="gradient landing (second)")
        if self._cast_on_cpu:
            self._arenas["staging"] = HostBuffer(n_host, self.dtype, pin=pin, name="weight staging")
        # weight flow + data parallel: staging holds this rank's shard only; the streamed weights need every
        # rank's, so each rank keeps the whole bf16 weights of the host buckets ([Note: data parallel sharding])
        self._full_home = plan.weight_mode is WeightMode.FLOW and self.comm is not None
        if self._full_home:
            full = sum(spec.numel for spec in plan.host_buckets)
            self._arenas["weights"] = HostBuffer(full, self.dtype, pin=pin, name="bf16 weights (weight flow)")
        self._copies = copies
        self._cur = 0  # the host state copy that holds the committed state
        self._dev_master = torch.empty(n_dev, dtype=torch.float32, device=dev)
        self._dev_exp_avg = torch.zeros(n_dev, dtype=torch.float32, device=dev)
        self._dev_exp_avg_sq = torch.zeros(n_dev, dtype=torch.float32, device=dev)
        a = {k: v.tensor for k, v in self._arenas.items()}
        for k in range(copies):
            a[f"exp_avg{k}"].zero_()
            a[f"exp_avg_sq{k}"].zero_()

        self.host_buckets: list[HostBucket] = []
        self.device_buckets: list[DeviceBucket] = []
        self.buckets: list[HostBucket | DeviceBucket] = []
        home_offset = 0
        self._bucket_of: list[HostBucket | DeviceBucket] = [None] * len(self.params)  # type: ignore[list-item]
        for spec in plan.buckets:
            ps = [self.params[i] for i in spec.param_indices]
            sl = slice(spec.offset, spec.offset + spec.shard)
            if spec.placement is Placement.HOST:
                b = HostBucket(spec, ps)
                b.pmv = [(a[f"master{k}"][sl], a[f"exp_avg{k}"][sl], a[f"exp_avg_sq{k}"][sl]) for k in range(copies)]
                b.landings = tuple(a[k][sl] for k in ("landing", "landing1") if k in a)
                b.landing = b.landings[0]
                b.grad = b.landing
                b.staging = a["staging"][sl] if self._cast_on_cpu else None
                b.home = b.staging
                if self._full_home:
                    b.home = a["weights"][home_offset : home_offset + spec.numel]
                    home_offset += spec.numel
                self.host_buckets.append(b)
            else:
                b = DeviceBucket(spec, ps)
                b.master = self._dev_master[sl]
                b.exp_avg, b.exp_avg_sq = self._dev_exp_avg[sl], self._dev_exp_avg_sq[sl]
                self.device_buckets.append(b)
            self.buckets.append(b)
            for i in spec.param_indices:
                self._bucket_of[i] = b
        self._arrived: list[set[int]] = [set() for _ in self.buckets]
        self._flushed = [False] * len(self.buckets)
        # Per-bucket [sum of squares, non-finite count], spread over rows (one per flatten program: [Note: spread
        # statistics]); a bucket's statistics are its rows' column sums. Host buckets' rows are also copied to
        # the host with their gradients so the worker can refuse to speculate on a non-finite bucket.
        rows = max(spread_stats_rows(self.device, b.sizes) for b in self.buckets) if self.buckets else 1
        self._grad_stats = torch.zeros(len(self.buckets), rows, 2, dtype=torch.float32, device=self.device)
        # The HostBuffer is kept: its page registration ends with it (a pageable row makes every flush's
        # non-blocking copy synchronous).
        self._grad_stats_buf = HostBuffer(len(self.buckets) * rows * 2, torch.float32, pin=pin,
                                          name="gradient statistics")  # fmt: skip
        self._grad_stats_host = (
            self._grad_stats_buf.tensor.view(-1, rows, 2) if self.streams.is_cuda else self._grad_stats
        )
        with torch.no_grad():
            self._load_masters_from_params()

    def _master(self, b: HostBucket | DeviceBucket, copy: int | None = None) -> torch.Tensor:
        """The fp32 master of ``b`` (host buckets: in state copy ``copy``, default the committed one)."""
        if isinstance(b, DeviceBucket):
            return b.master
        return b.pmv[self._cur if copy is None else copy][0]

    def _load_masters_from_params(self) -> None:
        """fp32 master := the parameters' current values (exact for fp32 models); staging := bf16 of it."""
        for b in self.buckets:
            master = self._master(b)
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

    def _install_hooks(self, modules: Sequence[torch.nn.Module]) -> None:
        self._handles: list[Any] = []
        for i, p in enumerate(self.params):
            self._handles.append(p.register_post_accumulate_grad_hook(self._make_grad_hook(i)))
        owner: dict[int, HostBucket] = {id(p): b for b in self.host_buckets for p in b.params}
        self._host_bucket_of = owner
        index_of = self._index_of = {id(p): i for i, p in enumerate(self.params)}
        for m in modules:
            mine = [p for p in m.parameters(recurse=False) if id(p) in owner]
            if mine:
                ordered = sorted({owner[id(p)] for p in mine}, key=lambda b: b.index)
                indices = frozenset(index_of[id(p)] for p in mine)
                self._handles.append(m.register_forward_pre_hook(self._make_pre_forward(ordered, indices)))
        self._hooked: set[int] | None = set()
        """[Note: unhooked reads]: host parameters whose module's forward hook ran in the first step (``None``
        once that step is over and the lesson is drawn)."""
        self._unhooked: set[int] = set()
        """... and host parameters that got a gradient in it without one: read by code that does not call their
        module."""
        self._early_waits: list[HostBucket] = []
        """Their buckets, waited for at the start of every later forward."""
        self._roots = forward_roots(modules[0]) if modules else []
        self._unwaited: set[int] = set()
        self._d2h_in_flight: collections.deque[Handoff] = collections.deque()
        """Host buckets' gradient copies issued by the backward and not waited for yet ([Note: D2H lead])."""

    def _make_grad_hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            self._on_grad(i)

        return hook

    def _make_pre_forward(self, buckets: list[HostBucket], indices: frozenset[int]) -> Callable[..., None]:
        def pre_forward(module: torch.nn.Module, args: Any) -> None:
            if self._hooked is not None:
                self._hooked.update(indices)
            if not self._unwaited:
                return
            if self._early_waits:
                self._wait_early()
            for b in buckets:
                if b.index in self._unwaited:
                    self.wait_bucket(b)

        return pre_forward

    def _wait_early(self, *_: Any) -> None:
        for b in self._early_waits:
            if b.index in self._unwaited:
                self.wait_bucket(b)

    def _learn_unhooked_reads(self) -> None:
        """[Note: unhooked reads]: after the first step, the host parameters that got a gradient although their
        module's forward hook never ran were read some other way (``F.linear(h, model.lm_head.weight)`` in a fused
        loss): no hook waits for their update, so a later forward could read them half updated. From now on
        their buckets are waited for when any root or hooked module starts a forward."""
        assert self._hooked is not None
        self._hooked = None
        if not self._unhooked:
            return
        names = {id(p): n for n, p in self._roots[0].named_parameters()} if self._roots else {}
        unhooked = sorted(self._unhooked)
        self._early_waits = sorted({self._bucket_of[i] for i in unhooked}, key=lambda b: b.index)  # type: ignore[misc]
        for r in self._roots:
            self._handles.append(r.register_forward_pre_hook(self._wait_early))
        shown = [names.get(id(self.params[i]), f"parameter {i}") for i in unhooked]
        logger.warning(
            "hf_superoffload: %d parameter(s) (%s) got gradients although the forward of the module owning them "
            "never ran: code reads them without calling their module. Their %d bucket(s) are now waited for at the "
            "start of every forward, which hides less CPU work; read them inside "
            "`with hf_superoffload.module_weights(module):` to wait only where they are read.",
            len(unhooked), ", ".join(shown[:4]) + (", ..." if len(shown) > 4 else ""), len(self._early_waits))

    @contextmanager
    def module_weights(self, module: torch.nn.Module) -> Iterator[None]:
        """See the module-level :func:`module_weights`: the forward pre-hooks' wait, for every parameter of
        ``module`` (recursively), without calling it."""
        if self._flow is not None:
            with self._flow.using(module):
                yield
            return
        mine = [p for p in module.parameters() if id(p) in self._host_bucket_of]
        if self._hooked is not None:  # [Note: unhooked reads]: a guarded read
            self._hooked.update(self._index_of[id(p)] for p in mine)
        if self._early_waits:
            self._wait_early()
        for b in sorted({self._host_bucket_of[id(p)] for p in mine}, key=lambda b: b.index):
            if b.index in self._unwaited:
                self.wait_bucket(b)
        yield

    # ------------------------------------------------------------------------------------------------
    # weight flow (WeightMode.FLOW only)
    def _build_streamer(self, modules: Sequence[torch.nn.Module]) -> WeightStreamer:
        if not self._cast_on_cpu:
            raise ValueError("weight flow streams the bf16 staging arena: it needs CastSide.CPU (the planner "
                             "ensures it; build the plan with make_plan)")
        sources: dict[int, tuple[torch.nn.Parameter, torch.Tensor, HostBucket]] = {}
        for b in self.host_buckets:
            assert b.home is not None
            offset = 0
            for p, n in zip(b.params, b.sizes):
                sources[id(p)] = (p, b.home[offset : offset + n], b)
                offset += n

        def on_h2d(nbytes: int) -> None:
            with self._lock:
                self._acc.h2d_bytes += nbytes

        return WeightStreamer(root=modules[0], sources=sources, staging_final=self._staging_final,
                              stream=self.streams.weights, on_h2d=on_h2d, synchronize=self.synchronize)

    def _staging_final(self, b: HostBucket, block: bool) -> bool:
        """Whether ``b``'s staging holds its final weights for the current step (weight flow reads them there).

        A bucket is flushed (and may then be stepped speculatively, overwriting staging) only after every one
        of its parameters got its gradient, i.e. after their last use in this step's backward. A forward in
        the window between that and ``step()`` would read a half-updated step: it is refused.
        """
        if b.state in (BucketState.IDLE, BucketState.UPLOADED) and b.ready.is_set():
            return True
        ctx = self._ctx
        if ctx is not None and ctx.verdict is None:
            raise RuntimeError(
                f"weight flow: {b.describe()} is needed between backward() and optimizer.step(), after its "
                "gradients were offloaded; its host weights are being updated. Call optimizer.step() before the "
                "next forward (for gradient accumulation run the non-final micro-batches inside "
                "`with optimizer.no_sync():`)."
            )
        if not block:
            return False
        self.wait_bucket(b, for_stream=False)
        return True

    @contextmanager
    def materialized(self) -> Iterator[None]:
        """Inside the block every parameter holds its final weights on the device (all modes)."""
        self.synchronize()
        if self._flow is None:
            yield
            return
        with self._flow.materialized():
            yield

    # ------------------------------------------------------------------------------------------------
    # gradient accumulation boundary
    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward inside is not an accumulation boundary: gradients accumulate on the device (host buckets: on
        the host, with host accumulation) and nothing is stepped."""
        self.enter_no_sync()
        try:
            yield
        finally:
            self.exit_no_sync()

    def enter_no_sync(self, depth: int = 1) -> None:
        """Open ``depth`` accumulation blocks (the facade's ``no_sync`` may have opened one before the engine
        existed)."""
        self._no_sync_depth += depth

    def exit_no_sync(self) -> None:
        self._no_sync_depth -= 1

    def _is_sync(self) -> bool:
        if self._no_sync_depth:
            return False
        return self.sync_predicate() if self.sync_predicate is not None else True

    # ------------------------------------------------------------------------------------------------
    # backward: flush
    def _on_grad(self, i: int) -> None:
        sync = self._is_sync()
        b = self._bucket_of[i]
        if self._hooked is not None and i not in self._hooked and isinstance(b, HostBucket):
            self._unhooked.add(i)
        if not sync and (self._accum is None or isinstance(b, DeviceBucket)):
            return  # accumulates in param.grad on the device
        if self._flushed[b.index]:
            raise RuntimeError(
                f"parameter {i} received a gradient after its bucket was offloaded in this step. "
                "For gradient accumulation, run the non-final micro-batches inside `with optimizer.no_sync():` "
                "(Trainer and Accelerate do this for you); call optimizer.step() before the next backward."
            )
        arrived = self._arrived[b.index]
        if i in arrived:
            return  # host accumulation: a gradient that grew on the device while its bucket waited for the rest
        arrived.add(i)
        self._present[b.index] += i + 1
        if len(arrived) == len(b.params):
            try:
                if sync:
                    self._flush(b)
                else:
                    self._accumulate(b)  # type: ignore[arg-type]
            except BaseException:
                self.abort_step()
                raise

    def _ensure_ctx(self) -> _StepContext:
        if self._ctx is None:
            self._worker.raise_if_failed()
            if self._gatherer is not None:  # the last step's all-gathers precede this step's reduce-scatters
                self._gatherer.drain(self.timeout_s)
            self._grad_stats.zero_()
            speculative = self.plan.speculation and self.governor.speculate_next()
            # [Note: speculation and rollback]: a step that speculates nothing is never undone, so with the plan's
            # consent it updates the committed copy in place (less host traffic than writing the other copy)
            in_place = not speculative and self.plan.nonspeculative_in_place
            self._ctx = _StepContext(speculative=speculative, spec_hyper=self.hyper_fn(),
                                     max_grad_norm=self.max_grad_norm_fn(), src=self._cur,
                                     dst=self._cur if in_place else (self._cur + 1) % self._copies)
        return self._ctx

    def _flush(self, b: HostBucket | DeviceBucket) -> None:
        ctx = self._ensure_ctx()
        self._flushed[b.index] = True
        grads = [p.grad for p in b.params]
        has = [g is not None for g in grads]
        summed = self._accum.summed(b) if self._accum is not None and isinstance(b, HostBucket) else 0
        if summed:
            has = [x or y for x, y in zip(has, self._accum.has(b), strict=True)]  # type: ignore[union-attr, arg-type]
        b.bucket_runs = b.plan_runs(has, [self.param_group[i] for i in b.spec.param_indices],
                                    [self.param_steps[i] for i in b.spec.param_indices])
        runs = b.clip_runs(b.bucket_runs)  # this rank's shard
        stats_row = self._grad_stats[b.index]
        with torch.profiler.record_function("superoffload::flush"):
            if isinstance(b, DeviceBucket) and self.comm is not None:
                shard = self._reduce_scatter(b, grads, async_op=False)
                _add_stats_(shard, stats_row)
                b.grad, b.runs = shard, runs
            elif isinstance(b, DeviceBucket):
                flat = torch.empty(b.spec.numel, dtype=self.dtype, device=self.device)
                flatten_grads_with_stats_(grads, b.sizes, flat, stats_row)
                b.grad, b.runs = flat, runs
            else:
                self.wait_bucket(b, for_stream=False)  # last step's H2D must be done with staging/landing
                if summed:  # the statistics are those of the sum, computed by the worker's boundary add
                    assert self._accum is not None
                    dest, slot = self._accum.target(b)
                    d2h = self._offload_grads(b, grads, None, dest)
                    self._accum.submit(b, d2h, slot, [g is not None for g in grads], final=True)
                    b.grad = self._accum.grad(b)
                else:  # (host accumulation: the ring's slots bound the copies in flight)
                    d2h = self._offload_grads(b, grads, stats_row, b.next_landing())
                    b.grad = b.landing
                    self._limit_d2h_lead(d2h)
                b.accumulated = bool(summed)
                b.to_offloaded(runs, d2h)
                self._unwaited.add(b.index)
                self._acc.d2h_bytes += b.landing.numel() * b.landing.element_size()
                # [Note: D2H gate]: queued once the copy has landed (host accumulation's sum: by the boundary add)
                gate = d2h.wait_host if self.plan.d2h_gate and not summed else None
                self._worker.submit(self._task_order(b), f"CPU Adam of {b.describe()}", lambda: self._run_host(b, ctx),
                                    tag=b, gate=gate)
        for p in b.params:
            p.grad = None

    def _accumulate(self, b: HostBucket) -> None:
        """Host accumulation, non-boundary micro-batch: offload ``b``'s gradients for the worker to add; free them."""
        assert self._accum is not None
        self._ensure_ctx()
        self._arrived[b.index] = set()
        grads = [p.grad for p in b.params]
        with torch.profiler.record_function("superoffload::flush_accumulate"):
            self.wait_bucket(b, for_stream=False)  # the last step is done with its landing and sum
            dest, slot = self._accum.target(b)
            d2h = self._offload_grads(b, grads, None, dest)
            self._accum.submit(b, d2h, slot, [g is not None for g in grads], final=False)
            self._acc.d2h_bytes += dest.numel() * dest.element_size()
        for p in b.params:
            p.grad = None

    def _offload_grads(self, b: HostBucket, grads: list[torch.Tensor | None], stats_row: torch.Tensor | None,
                       dest: torch.Tensor) -> Handoff:
        """Flatten ``b``'s gradients (adding their statistics to ``stats_row``, if any) and copy them into ``dest``
        (the landing buffer, or a host-accumulation ring slot)."""
        s = self.streams
        if self.comm is not None:
            assert stats_row is not None and dest is b.landing
            return self._offload_shard(b, grads, stats_row)
        if not s.is_cuda:
            flatten_grads_with_stats_(grads, b.sizes, dest, stats_row)
            return Handoff(dest, None)
        compute = torch.cuda.current_stream(self.device)
        flat = torch.empty(b.spec.numel, dtype=dest.dtype, device=self.device)
        flatten_grads_with_stats_(grads, b.sizes, flat, stats_row)
        s.d2h.wait_stream(compute)
        if b.h2d_event is not None:  # the previous upload still reads staging/landing's neighbours
            s.d2h.wait_event(b.h2d_event)
        with torch.cuda.stream(s.d2h):
            dest.copy_(flat, non_blocking=True)
            if stats_row is not None:
                self._grad_stats_host[b.index].copy_(stats_row, non_blocking=True)
            event = s.record(s.d2h)
        flat.record_stream(s.d2h)
        return Handoff(dest, event)

    def _need_order(self, b: HostBucket | DeviceBucket) -> int:
        """Priority: the next forward needs the last-arriving bucket first."""
        return len(self.buckets) - 1 - b.index

    def _task_order(self, b: HostBucket) -> int:
        """Priority of a bucket's first CPU task, queued by the backward ([Note: D2H lead]). With no lead its
        gradients are on the host when it is queued: the forward-need order. With a lead the newest bucket's copy
        may still be in flight: arrival order (the oldest copy is the likeliest done), ahead of every finishing
        task; ``step()`` puts the ones still waiting back in need order once the verdict is known."""
        if self.plan.d2h_lead_buckets == 0:
            return self._need_order(b)
        return b.index - len(self.buckets)

    def _limit_d2h_lead(self, d2h: Handoff) -> None:
        """The rate limiter of [Note: D2H lead]: at most ``plan.d2h_lead_buckets`` copies stay in flight past the
        backward; the hook waits for the oldest one beyond that (the GPU keeps the work queued behind it)."""
        if d2h.event is None:
            return
        self._d2h_in_flight.append(d2h)
        while len(self._d2h_in_flight) > self.plan.d2h_lead_buckets:
            self._d2h_in_flight.popleft().wait_host()

    def _adapt_master_share(self) -> None:
        """[Note: adaptive master deferral]: move the share of master-deferring buckets before this step's pass,
        from the commit work still pending now and how early the last commits finished."""
        now = time.perf_counter()
        pending_bytes = 0.0
        for b in self.host_buckets:
            c = b.pending  # read without the commit lock: an estimate (the worker may be storing it right now)
            if c is not None:
                pending_bytes += b.spec.shard * COMMIT_BYTES[c.master is not None]
        with self._lock:
            seconds, nbytes = self._commit_clock
            self._commit_clock = [0.0, 0.0]
            done_at = self._commits_done_at
        if nbytes > 0:
            self._commit_rate = seconds / nbytes
        # slack counts only after commits that did something (a speculative step's empty chain says nothing)
        slack = now - done_at if (done_at is not None and nbytes > 0 and not pending_bytes) else 0.0
        self._master_count = next_share(self._host_shards, self._master_count,
                                        DeferralObservation(pending_bytes, slack, self._commit_rate))

    def defers_master(self, b: HostBucket) -> bool:
        """Whether ``b``'s verdict-known pass of this step leaves the fp32 master to the commit."""
        return self._defer and self._host_rank[b.index] < self._master_count

    def _wake_all(self) -> None:
        if self._accum is not None:
            self._accum.wake_all()
        for b in self.host_buckets:
            b.uploaded.set()
            b.ready.set()

    # ------------------------------------------------------------------------------------------------
    # training thread: waits
    @property
    def step_in_progress(self) -> bool:
        """Between the first offloaded gradient of a step and its ``step()``."""
        return self._ctx is not None

    def wait_bucket(self, b: HostBucket, *, for_stream: bool = True) -> None:
        """Block until ``b``'s parameters are final; then order the current stream after its upload.

        Before the verdict the device still holds the previous, valid weights (nothing is uploaded before
        validation), so a forward in the middle of a step does not wait.
        """
        if self._ctx is not None and self._ctx.verdict is None and for_stream:
            return
        if not b.ready.is_set():
            t0 = time.perf_counter()
            with torch.profiler.record_function("superoffload::wait_cpu"):
                finished = b.ready.wait(self.timeout_s)
            with self._lock:
                self._acc.wait_s += time.perf_counter() - t0
            self._worker.raise_if_failed()
            if not finished:
                raise TimeoutError(
                    f"hf_superoffload: {b.describe()} was not ready after {self.timeout_s:.0f}s "
                    f"(worker alive: {self._worker.alive}). Raise SuperOffloadConfig.worker_timeout_s if the "
                    "CPU is this slow, or report a bug."
                )
        self._worker.raise_if_failed()
        for helper in (self._gatherer, self._uploader):
            if helper is not None:
                helper.raise_if_failed()
        if for_stream and not b.stream_waited:
            if b.fwd_event is not None:
                torch.cuda.current_stream(self.device).wait_event(b.fwd_event)
            b.stream_waited = True
            self._unwaited.discard(b.index)

    def synchronize(self) -> None:
        """Wait until every bucket's parameters on the device are final (before saving or reading weights).

        In the middle of a step (before ``step()``) the device weights are the previous step's, already final.
        """
        if self.step_in_progress:
            return
        if self._worker.failed:
            if not self.consistent:
                self._worker.raise_if_failed()
            return  # abort_step undid the failed step in this thread: nothing is in flight or will be uploaded
        self._worker.drain(self.timeout_s)
        for helper in (self._gatherer, self._uploader):  # the worker queued them: drained after it
            if helper is not None:
                helper.drain(self.timeout_s)
        for b in self.host_buckets:
            self.wait_bucket(b)

    # ------------------------------------------------------------------------------------------------
    # step
    def step(self, max_grad_norm: float | None) -> StepStats:
        """Validate this step's gradients and finish the update. Returns the step's telemetry."""
        self._worker.raise_if_failed()
        if self._uploader is not None:
            self._uploader.raise_if_failed()
        ctx = self._ensure_ctx()
        for b in self.buckets:
            if not self._flushed[b.index]:
                self._flush(b)
        with torch.profiler.record_function("superoffload::validate"):
            if self.comm is None:
                sumsq, nonfinite = self._grad_stats.view(-1, 2).sum(dim=0).tolist()  # the one host sync of the step
                if self._accum is not None:  # host-accumulated buckets: the sum's statistics, from the worker
                    for b in self.host_buckets:
                        if b.accumulated:
                            s_, n_ = self._accum.stats(b)
                            sumsq, nonfinite = sumsq + s_, nonfinite + n_
            else:
                sumsq, nonfinite = self._global_stats()
        verdict = decide(sumsq=sumsq, nonfinite=nonfinite > 0, max_grad_norm=max_grad_norm, hyper=self.hyper_fn(),
                         spec_hyper=ctx.spec_hyper, check_finite=self.check_finite, grad_divisor=self._div)
        if self._master_mode is MasterDeferral.ADAPTIVE and verdict.kind is not StepVerdict.SKIP:
            # before the verdict is published: a worker task that sees it finishes with this step's share
            self._adapt_master_share()
        with self._lock:
            failed = ctx.failed
            if not failed:
                ctx.verdict_at = time.perf_counter()
                ctx.verdict = verdict
            pending = [b for b in self.host_buckets if b.state in (BucketState.SPECULATED, BucketState.DEFERRED)]
            states = {b.index: b.state for b in pending}
        if failed:  # a CPU task failed before validation: wait until the worker records it, then raise it
            with contextlib.suppress(TimeoutError):
                self._worker.drain(self.timeout_s)
            self._worker.raise_if_failed()
            raise RuntimeError("hf_superoffload: a CPU task of this step failed")  # not reached: the worker failed
        pending.sort(key=self._need_order)  # the worker may start on the first one before the rest are queued
        self._d2h_in_flight.clear()  # the backward is over: nothing left to hold back (the worker waits per copy)
        if self.plan.d2h_lead_buckets:  # first tasks still waiting: the next forward's need order from now on
            self._worker.reprioritize(lambda b: self._need_order(b) if isinstance(b, HostBucket) else None)
        try:
            for b in pending:
                self._worker.submit(self._need_order(b), f"finishing {b.describe()}",
                                    lambda b=b: self._finish_task(b, ctx, verdict, states[b.index] is BucketState.SPECULATED))
            with torch.profiler.record_function("superoffload::device_adam"):
                self._step_device(verdict)
            if self._gatherer is not None and verdict.kind is not StepVerdict.SKIP:
                for b in sorted(self.host_buckets, key=self._need_order):  # the same order on every rank
                    self._gather_seq += 1
                    self._gatherer.submit(self._gather_seq, f"all-gather of {b.describe()}",
                                          lambda b=b: self._gather(b))
        except BaseException:
            if verdict.kind is not StepVerdict.SKIP:
                self.consistent = False  # host buckets are being committed with this verdict: it cannot be undone
            raise
        if self._defer and self.commit_when_idle and verdict.kind is not StepVerdict.SKIP:
            self._queue_idle_commits()
        if verdict.kind is not StepVerdict.SKIP:
            self._cur = ctx.dst  # the buckets still finishing write this copy; readers drain them first
            for b in self.buckets:
                for r in b.bucket_runs:
                    offset = 0
                    for i, n in zip(b.spec.param_indices, b.sizes):
                        if r.start <= offset < r.end:
                            self.param_steps[i] = r.step
                        offset += n
        self.governor.record(speculated=ctx.speculative, verdict=verdict.kind)
        now = time.perf_counter()
        with self._lock:
            st, self._acc = self._acc, StepStats()
            prev, self._pass_ctx = self._pass_ctx, (ctx if verdict.kind is not StepVerdict.SKIP else None)
            if prev is not None and prev.pass_done_at is not None:
                st.pass_s = prev.pass_done_at - prev.verdict_at
        st.grad_norm, st.verdict, st.speculative = verdict.grad_norm, verdict.kind.value, ctx.speculative
        st.master_deferred_buckets = self._master_count if self._defer else 0
        st.clip_coef, st.iteration_s = verdict.grad_scale * self._div, now - self._last_step_t
        self._last_step_t = now
        self.stats = st
        self._ctx = None
        self._reset_arrivals()
        if self._hooked is not None:
            self._learn_unhooked_reads()
        return st

    def _reset_arrivals(self) -> None:
        """A new optimizer step: no bucket has gradients yet (no accumulation add may be in flight)."""
        self._arrived = [set() for _ in self.buckets]
        self._flushed = [False] * len(self.buckets)
        self._present = [0] * len(self.buckets)
        if self._accum is not None:
            self._accum.reset()

    def _step_device(self, verdict: Verdict) -> None:
        for b in self.device_buckets:
            if verdict.kind is not StepVerdict.SKIP:
                assert b.grad is not None
                for r in b.runs:
                    lr, beta1, beta2, eps, wd = verdict.hyper[r.group]
                    sl = slice(r.start, r.end)
                    adamw_flat_(
                        b.master[sl], b.grad[sl], b.exp_avg[sl], b.exp_avg_sq[sl], step=r.step, lr=lr,
                        beta1=beta1, beta2=beta2, eps=eps, weight_decay=wd, grad_scale=verdict.grad_scale,
                    )
                if self.comm is not None:
                    self._gather_device(b)  # every rank, even one whose shard had nothing to step
                elif b.runs:
                    scatter_flat_(b.master, b.params)
            b.grad = None

    # ------------------------------------------------------------------------------------------------
    # lifecycle
    def abort_step(self) -> None:
        """Drop a step in progress (after an error): speculative updates are undone, nothing is applied.

        If the worker itself failed, the undo runs here, in the calling thread. A bucket whose CPU step
        raised part-way (state RUNNING) cannot be restored and is named in the log.
        """
        if self._ctx is None:
            return
        self._d2h_in_flight.clear()
        if self._ctx.verdict is not None:
            # step() already published its verdict and queued the buckets with it: let them finish, undo nothing
            # (step() marked the engine inconsistent unless the verdict was SKIP)
            with contextlib.suppress(BaseException):
                self._worker.drain(self.timeout_s)
            for b in self.device_buckets:
                b.grad = None
            self._ctx = None
            self._reset_arrivals()
            return
        skip = Verdict(StepVerdict.SKIP, 1.0, self._ctx.spec_hyper, float("nan"))
        with self._lock:
            self._ctx.verdict = skip
            pending = [(b, b.state is BucketState.SPECULATED) for b in self.host_buckets
                       if b.state in (BucketState.SPECULATED, BucketState.DEFERRED)]
            broken = [b for b in self.host_buckets if b.state is BucketState.RUNNING]
        ctx = self._ctx
        if self._worker.failed:
            for b, spec in pending:
                self._finish_task(b, ctx, skip, spec)
            for b in broken:
                logger.error("hf_superoffload: %s failed inside its CPU step; its state may be partly updated", b.describe())
                if ctx.dst == ctx.src:
                    self.consistent = False  # stepped in place: the committed state itself may be half updated
                elif b.staging is not None:
                    b.staging.copy_(b.pmv[ctx.src][0])  # double buffer: the committed copy is intact
                b.ready.set()
        else:
            for b, spec in pending:
                self._worker.submit(self._need_order(b), f"aborting {b.describe()}",
                                    lambda b=b, spec=spec: self._finish_task(b, ctx, skip, spec))
            self._worker.drain(self.timeout_s)
        for b in self.device_buckets:
            b.grad = None
        if self._accum is not None and not self._worker.failed:
            self._worker.drain(self.timeout_s)  # accumulation adds still in flight
        self._ctx = None
        self._reset_arrivals()

    def close(self) -> None:
        """Finish the last step (or undo one interrupted mid-backward), then stop the worker and remove hooks."""
        if self._closed:
            return
        try:
            if self.step_in_progress:
                self.abort_step()  # e.g. KeyboardInterrupt in backward: back to the state before that step
            elif not self._worker.failed:
                self._worker.drain(self.timeout_s)  # the last step's buckets are final before the worker stops
                for helper in (self._gatherer, self._uploader):
                    if helper is not None and not helper.failed:
                        helper.drain(self.timeout_s)
        finally:
            self._closed = True
            if self._flow is not None:  # the model keeps its final weights on the device
                try:
                    self._flow.close(materialize=self.consistent and not self._worker.failed)
                except BaseException:
                    logger.exception("hf_superoffload: could not bring the streamed weights back to the device")
            for p in self.params:
                if _ENGINE_OF_PARAM.get(id(p)) is self:
                    del _ENGINE_OF_PARAM[id(p)]
            for h in self._handles:
                h.remove()
            self._worker.close()
            for helper in (self._gatherer, self._uploader):
                if helper is not None:
                    helper.close()

    # ------------------------------------------------------------------------------------------------
    # state
    def param_location(self, i: int) -> tuple[Placement, int]:
        """(placement, element offset in that placement's arenas) of parameter ``i`` (one process only: with
        data parallelism a parameter may straddle shards, see :meth:`param_pieces`)."""
        if self.comm is not None:
            raise RuntimeError("param_location() is for a single process; use param_pieces() with data parallelism")
        b = self._bucket_of[i]
        offset = b.spec.offset
        for j, n in zip(b.spec.param_indices, b.sizes):
            if j == i:
                return b.spec.placement, offset
            offset += n
        raise AssertionError(i)

    def flat_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """The live flat arenas: ``{"host": {...}, "device": {...}}`` with master, exp_avg, exp_avg_sq (pending
        deferred moments are stored first)."""
        self.commit_moments()
        return {
            "host": {k: self._arenas[f"{k}{self._cur}"].tensor for k in ("master", "exp_avg", "exp_avg_sq")},
            "device": {"master": self._dev_master, "exp_avg": self._dev_exp_avg, "exp_avg_sq": self._dev_exp_avg_sq},
        }

    def param_pieces(self, i: int) -> list[tuple[Placement, int, int, int]]:
        """``(placement, arena offset, start, end)``: elements ``[start, end)`` of parameter ``i`` (flattened)
        that this rank holds, at that offset of its placement's arenas (the whole parameter on one process)."""
        b = self._bucket_of[i]
        k = b.spec.param_indices.index(i)
        return [(b.spec.placement, b.spec.offset + at, start, end) for kk, start, end, at in b.pieces() if kk == k]

    def seed_masters(self, values: Sequence[torch.Tensor | None]) -> None:
        """Overwrite the masters of parameters with exact values (fp32 models), then refresh the weights."""
        flat = self.flat_state()
        with torch.no_grad():
            for i, v in enumerate(values):
                if v is not None:
                    for pl, off, start, end in self.param_pieces(i):
                        side = "host" if pl is Placement.HOST else "device"
                        flat[side]["master"][off : off + end - start].copy_(v.reshape(-1)[start:end])
        self.refresh_params_from_masters()

    def refresh_params_from_masters(self) -> None:
        """After loading state: staging := bf16(master) and parameters := bf16(master).

        Data parallel: a collective (every rank's shards are gathered); every rank must call it.
        """
        with torch.no_grad():
            for b in self.buckets:
                master = self._master(b)
                if isinstance(b, HostBucket) and b.staging is not None:
                    b.staging.copy_(master)
                if self.comm is not None:
                    shard = master.to(device=self.device, dtype=self.dtype)
                    full = torch.empty(b.spec.shard * self.comm.world_size, dtype=self.dtype, device=self.device)
                    self.comm.all_gather(full, shard)
                    if isinstance(b, HostBucket) and self._full_home:
                        b.home.copy_(full[: b.spec.numel])
                    else:
                        scatter_flat_(full[: b.spec.numel], b.params)
                elif self._flow is None or isinstance(b, DeviceBucket):  # weight flow: staging is their home
                    scatter_flat_(master, b.params)
            if self._flow is not None:
                self._flow.release_all()  # the next use fetches the new staging
        if self.streams.is_cuda:
            torch.cuda.current_stream(self.device).synchronize()

    @property
    def pinned_bytes(self) -> int:
        return sum(a.nbytes for a in self._arenas.values() if a.pinned)
