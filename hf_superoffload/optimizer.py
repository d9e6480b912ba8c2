"""SuperOffloadOptimizer: a ``torch.optim.Optimizer`` whose AdamW state lives in host memory.

The facade owns the param groups (so LR schedulers and Trainer work unchanged) and delegates all work to
an :class:`~hf_superoffload.runtime.engine.OffloadEngine`, which executes the planner's frozen plan.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from . import ops
from .causal_lm_loss import (
    install_chunked_loss,
    loss_inside_the_model,
    uninstall_chunked_loss,
    uses_default_causal_lm_loss,
)
from .config import SuperOffloadConfig
from .cpu_ext import AdamWHyper
from .planning.calibration import MeasuredStep, calibrate_from_passes
from .planning.hardware import HardwareProfile, cuda_free_bytes, with_known_rates
from .planning.memory_model import PlanLike
from .planning.plan import OffloadPlan
from .planning.planner import (
    CALIBRATION_STEPS,
    Workload,
    calibrated_budget,
    device_holds,
    grow_tail,
    make_plan,
    most_kept_layers,
    refuse_unless_fits,
    shrink_tail,
)
from .planning.thread_trial import IterationSample, ThreadTrial
from .runtime.collectives import ShardGroup
from .runtime.engine import OffloadEngine, StepStats
from .runtime.kept_layers import KeptLayers, checkpointed_layers, layer_checkpointing
from .runtime.validation import GroupHypers, SpeculationGovernor, StepVerdict
from .state import (
    engine_state_dict,
    load_engine_state,
    names_in,
    validate_engine_state,
    validate_whole_state,
    weights_from_masters,
)

__all__ = ["SuperOffloadOptimizer"]

logger = logging.getLogger("hf_superoffload")

_UNSUPPORTED = ("amsgrad", "maximize", "foreach", "capturable", "differentiable", "fused")


class SuperOffloadOptimizer(torch.optim.Optimizer):
    """AdamW with fp32 master weights and Adam state in host memory, stepped on the CPU overlapped with
    the GPU, except for a GPU-resident tail of buckets.

    Semantics: ``torch.nn.utils.clip_grad_norm_(max_grad_norm)`` followed by ``torch.optim.AdamW`` on fp32
    master weights, up to fp32 rounding. A step with any non-finite gradient is skipped and leaves every
    state bit-identical (see ``SuperOffloadConfig.rollback``).

    Usage::

        opt = SuperOffloadOptimizer(model, lr=2e-5, weight_decay=0.1, max_grad_norm=1.0)
        for batch in loader:
            model(**batch).loss.backward()
            opt.step(); opt.zero_grad(); scheduler.step()

    For gradient accumulation run the non-final micro-batches inside ``with opt.no_sync():`` (where the sum lives:
    ``SuperOffloadConfig.accumulate_on_host``).

    Args:
        model: the module to train. Its trainable parameters are converted to bf16 if they are fp32 (the fp32
            values become the master weights).
        params: AdamW-style params or param groups (default: every trainable parameter of ``model``).
        max_grad_norm: global-norm clipping threshold (``None`` or 0: no clipping).
        config: offload settings.
        profile: the hardware facts the planner uses (default: read from the model's device).
        log_plan: log the plan summary at INFO (integrations log it once, on the main process).
        process_group: data parallelism. When ``torch.distributed`` is initialised with more than one rank,
            the optimizer is data parallel over this group (default: the default group) by itself, ZeRO-style:
            gradients are reduce-scattered per bucket during backward, every rank steps 1/N of the optimizer
            state in its own host memory, and the updated weights are all-gathered before the next forward.
            Pass the unwrapped model (no DDP/FSDP). The parameters are broadcast from the group's first rank.
        gradient_divisor: gradients are summed over the group and divided by this (default: the group size,
            i.e. averaged). Sequence parallelism sets it to the number of data-parallel replicas.
        workload: the training step's shape (model config, batch, sequence length, checkpointing, sequence
            parallelism), when known: the planner then keeps the GPU-resident tail small enough for the
            activations (long sequences) and weighs weight flow with the memory model. ``None`` (default) on a
            GPU with a transformers model, one process or plain data parallel: read from the first training batch
            (under data parallel the largest over the ranks), and the engine is planned and built then ([Note:
            workload from the first batch] in docs/design.md); ``plan`` is provisional until then (``planned``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]] | None = None,
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        max_grad_norm: float | None = None,
        config: SuperOffloadConfig | None = None,
        profile: HardwareProfile | None = None,
        log_plan: bool = True,
        process_group: Any = None,
        gradient_divisor: float | None = None,
        workload: Workload | None = None,
        **unsupported: Any,
    ) -> None:
        for key, value in unsupported.items():
            if key in _UNSUPPORTED:
                if value:
                    raise ValueError(f"SuperOffloadOptimizer does not support {key}={value!r}; drop the argument")
            else:
                raise TypeError(f"SuperOffloadOptimizer got an unexpected argument {key!r}")
        if not isinstance(model, torch.nn.Module):
            raise TypeError("SuperOffloadOptimizer(model, ...) takes the model first; pass params= for groups")
        if _wrapped_for_data_parallel(model):
            raise ValueError("pass the unwrapped model: SuperOffloadOptimizer does the data parallelism itself "
                             "(ZeRO-style sharded offload) and does not work under DDP/FSDP wrappers")
        if not lr >= 0:
            raise ValueError(f"lr={lr} is invalid: use a learning rate >= 0")
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"betas={betas} are invalid: both must lie in [0, 1)")
        if not eps > 0:
            raise ValueError(f"eps={eps} is invalid: use a small positive number such as 1e-8")
        if not weight_decay >= 0:
            raise ValueError(f"weight_decay={weight_decay} is invalid: use a value >= 0")
        if max_grad_norm is not None and max_grad_norm < 0:
            raise ValueError(f"max_grad_norm={max_grad_norm} is invalid: use None/0 (off) or a positive norm")
        self.config = config or SuperOffloadConfig()
        self.max_grad_norm = max_grad_norm or None
        if params is None:
            params = [p for p in model.parameters() if p.requires_grad]
            if not params:
                raise ValueError("the model has no trainable parameters (every requires_grad is False)")
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)

        ordered, groups = self._arrival_order(model)
        # [Note: chunked causal-LM loss]: the plan counts the logits memory of the loss the model will run
        self._chunked_loss = self.config.chunked_loss and uses_default_causal_lm_loss(model)
        self._check_params(ordered)
        converted = sum(p.dtype == torch.float32 for p in ordered)
        self.last_grad_norm: float = float("nan")
        self.skipped_steps = 0
        self.clipped_steps = 0
        self._skip_norms: list[float] = []
        """Gradient norms of the skipped steps since the last finite one (``max_consecutive_skips``)."""
        self._last_good_norm: float | None = None
        comm = ShardGroup.from_environment(process_group, gradient_divisor)
        ranks = _local_ranks(comm) if comm is not None else {}
        profile_read = profile is None
        if profile is None:
            profile = with_known_rates(HardwareProfile.read(ordered[0].device), ordered[0].device)
            if workload is not None:
                profile = _count_own_weights_as_free(profile, _own_weight_bytes(model, ordered[0].device),
                                                     ordered[0].device)
        if workload is not None and self._chunked_loss:
            workload = dataclasses.replace(workload, chunked_loss=True)
        self.workload: Workload | None = workload  # what the plan is made for (read from the first batch, or given)
        self._ordered, self._groups, self._model, self._comm = ordered, groups, model, comm
        self._profile, self._ranks, self._log_plan = profile, ranks, log_plan
        self._built: OffloadEngine | None = None
        self._provisional: OffloadPlan | None = None
        self._pending_no_sync = 0
        self._pending_predicate: Callable[[], bool] | None = None
        self._micro_batches: int | None = None  # per optimizer step, when the integration knows it
        self.plan_listeners: list[Callable[[OffloadPlan], None]] = []
        """Called once with the plan when the engine is built (integrations log it on the main process)."""
        self.calibration_listeners: list[Callable[[str], None]] = []
        """Called once with a summary of the calibration after the first steps, when it measured something
        (integrations show it where the plan was shown)."""
        self._batch_hook: Any = None
        self._growth_hook: Any = None
        self._kept: KeptLayers | None = None  # [Note: kept layers]: the layers the plan leaves unchecked
        self._fitted_tokens = 0  # the most tokens per training batch checked against the plan's device memory
        self._fitted: Workload | None = None  # ... and that batch's workload
        self._budget: HardwareProfile | None = None  # the device budget later batches are checked against
        self._steps_taken = 0
        self._forwards = self._step_forwards = 0  # training forwards since the last step, and in it
        self._calibrated = False  # [Note: calibration from the measured peak] in planning/planner.py
        # the last two steps before the calibration: (step number, stats, micro-batches); their stats carry the
        # whole host passes the rate calibration reads ([Note: calibrating the rates])
        self._recent: tuple[tuple[int, StepStats, int], ...] = ()
        self._trial: ThreadTrial | None = None  # [Note: the thread trial] in planning/thread_trial.py
        self.calibration: dict[str, Any] | None = None
        """What the calibration measured and changed (kept layers and device buckets, before and after, and how
        many parameters moved their optimizer state to the device), once it ran on a GPU."""
        self._other_at_plan = 0  # device bytes allocated at the first batch that are not the model's weights
        self._fp32_values: list[torch.Tensor | None] | None = None
        # [Note: a state loaded before the first batch]: validated, copied in once the engine is built
        self._pending_state: dict[str, Any] | None = None
        infer = profile_read and not converted and self._infers_workload()
        if comm is not None:
            # a rank that plans now would never join the others' agreement at the first batch: all or none wait
            infer = _agreed_max(comm, [not infer])[0] == 0
        # a plan that cannot fit raises here, before the parameters are broadcast, converted or hooked
        plan = None if infer else self._make_plan(workload, profile)
        self._loss_installed = False
        if self._chunked_loss:
            install_chunked_loss(model)  # [Note: chunked causal-LM loss]; the plan above counted its memory
            self._loss_installed = True
        if comm is not None:
            _broadcast_params(ordered, comm)
        if converted:
            # fp32 model: the exact fp32 values seed the masters, then the model keeps bf16 copies.
            self._fp32_values = [p.detach().clone() if p.dtype == torch.float32 else None for p in ordered]
            with torch.no_grad():
                for p in ordered:
                    if p.dtype == torch.float32:
                        p.data = p.data.to(torch.bfloat16)
            logger.warning("hf_superoffload: converted %d fp32 parameters to bf16; the fp32 values are the "
                           "master weights on the host", converted)
        if plan is None:
            # [Note: workload from the first batch]: plan once the first training batch shows the step's shape
            self._batch_hook = model.register_forward_pre_hook(self._plan_from_batch, with_kwargs=True, prepend=True)
        else:
            self._build(workload, plan)
        self._state_hook = model.register_state_dict_pre_hook(lambda *a, **k: self.synchronize())

    def _infers_workload(self) -> bool:
        """Whether the plan waits for the first training batch. Only where the inference is sound: the profile read
        from a device that reports its free memory, no workload given, weights not forced to stream (an explicit
        tail still gains kept layers, [Note: kept layers]), one process or plain data parallel (the ranks agree on the batch, see ``_plan_from_batch``;
        sequence parallelism, which divides gradients by fewer than the ranks, shards the sequence the batch
        shows), and a transformers config the memory model reads ([Note: workload from the first batch])."""
        if self.workload is not None or self._profile.device_free_bytes is None:
            return False
        if self._comm is not None and self._comm.grad_divisor != self._comm.world_size:
            return False
        if self.config.weight_placement == "flow":  # streamed weights: nothing the batch shape would change
            return False
        if getattr(self._model, "config", None) is None:
            return False
        try:
            from .planning.memory_model import ModelShape

            ModelShape.from_config(self._model.config)
        except Exception:  # not a decoder the memory model knows: plan without a workload, as configured
            return False
        return True

    def _plan_from_batch(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Forward pre-hook until the engine exists: the first forward that trains fixes the workload."""
        if self._built is not None or not (torch.is_grad_enabled() and module.training):
            return  # evaluation before training (or already planned) says nothing about the training step
        shape = _batch_shape(args, kwargs)
        # a first forward that is not an accumulation boundary shows that micro-batches accumulate
        accumulates = self._pending_no_sync > 0 or (self._pending_predicate is not None
                                                    and not self._pending_predicate())
        ckpt = _checkpointing(module)
        # a loss computed outside the model never runs the chunked loss: the plan prices HF's over every logit
        outside = not loss_inside_the_model(kwargs)
        profile = self._profile_now() if shape is not None or self._comm is not None else None
        if self._comm is not None:
            # Bucket sharding follows the plan, so every rank must make the same one: the largest batch, sequence
            # and free memory the smallest, over the ranks (every rank runs this first forward, so the collective
            # is matched; a rank whose batch shows no shape plans with the others').
            assert profile is not None
            shape, accumulates, ckpt, outside, profile = _agree_on_first_batch(
                self._comm, shape, accumulates, ckpt, outside, profile)
        workload = None
        if shape is not None:
            workload = Workload(self._model.config, shape[0], shape[1], grad_ckpt=ckpt, accumulation=accumulates,
                                chunked_loss=self._chunked_loss and not outside,
                                micro_batches=self._micro_batches if accumulates else None)
        self._build(workload, profile=profile)

    def _profile_now(self) -> HardwareProfile:
        """The construction-time profile with the device memory free now (the model's own weights counted as free)."""
        profile, device = self._profile, self._ordered[0].device
        if device.type != "cuda":
            return profile
        own = _own_weight_bytes(self._model, device)
        self._other_at_plan = max(0, torch.cuda.memory_allocated(device) - own)
        profile = dataclasses.replace(profile, device_free_bytes=cuda_free_bytes(device)[0])
        return _count_own_weights_as_free(profile, own, device)

    def _planning_workload(self, workload: Workload) -> Workload:
        # once kept layers are set the model no longer checkpoints every layer: the optimizer's own doing
        if workload.grad_ckpt and (self._kept is not None or layer_checkpointing(self._model)):
            return dataclasses.replace(workload, layer_checkpointing=True)  # [Note: kept layers]
        return workload

    def _make_plan(self, workload: Workload | None, profile: HardwareProfile) -> OffloadPlan:
        numels = [p.numel() for p in self._ordered]
        planned = None if workload is None else self._planning_workload(workload)
        plan = make_plan(numels, element_size=2, config=self.config, profile=profile, workload=planned, **self._ranks)
        if planned is not None:  # [Note: refused with the frontier]: not a run that fails in its first forward
            refuse_unless_fits(plan, numels, element_size=2, config=self.config, profile=profile, workload=planned,
                               **self._ranks)
        return plan

    def _build(self, workload: Workload | None, plan: OffloadPlan | None = None,
               profile: HardwareProfile | None = None) -> OffloadEngine:
        """Build the engine (once) for ``plan``, or plan first. ``workload``: the step's shape (given, or read from
        the first batch); ``profile``: the one to plan with at the first batch (default: the construction's)."""
        if self._built is not None:
            return self._built
        if self._batch_hook is not None:
            self._batch_hook.remove()
            self._batch_hook = None
        if plan is None:
            if workload is not None and workload is not self.workload:  # read from the first batch
                self.workload = workload
            plan = self._make_plan(workload, profile or self._profile)
        engine = OffloadEngine(
            params=self._ordered,
            param_group=self._groups,
            hypers_fn=self._hypers,
            plan=plan,
            modules=list(self._model.modules()),
            check_finite=self.config.check_finite,
            timeout_s=self.config.worker_timeout_s,
            governor=SpeculationGovernor(enabled=plan.speculation, max_redo_rate=self.config.overrides.max_redo_rate,
                                         window=self.config.overrides.redo_window),
            comm=self._comm,
        )
        engine.max_grad_norm_fn = lambda: self.max_grad_norm
        engine.sync_predicate = self._pending_predicate
        engine.enter_no_sync(self._pending_no_sync)
        if self._fp32_values is not None:
            engine.seed_masters(self._fp32_values)
            self._fp32_values = None
        self._built = engine
        self._provisional = None
        if self._pending_state is not None:  # the masters and moments it holds replace the seeded ones
            pending, self._pending_state = self._pending_state, None
            load_engine_state(engine, pending, validate=False)
        if plan.kept_layers:  # before this forward's layers run: it is the first one that trains
            self._set_kept_layers(plan.kept_layers)
        if self.workload is not None and self._comm is None:
            # [Note: workload from the first batch]: a later, larger batch is checked against this plan's memory
            budget = profile or self._profile
            if budget.device_free_bytes is not None:
                self._fitted_tokens = self.workload.batch_size * self.workload.seq_len
                self._fitted, self._budget = self.workload, budget
                self._growth_hook = self._model.register_forward_pre_hook(self._check_batch, with_kwargs=True,
                                                                          prepend=True)
        if self._log_plan:
            logger.info("%s", plan.summary())
        for listener in self.plan_listeners:
            listener(plan)
        return engine

    def _set_kept_layers(self, kept: int) -> None:
        """[Note: kept layers]: the last ``kept`` decoder layers skip checkpointing."""
        if self._kept is None:
            if not kept:
                return
            self._kept = KeptLayers(checkpointed_layers(self._model), kept)
        self._kept.set(kept)

    def _check_batch(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Forward pre-hook once planned: a training batch with more tokens than any checked so far must fit the
        plan's device memory by the memory model, with fewer kept layers or with device buckets moved to the host
        ([Note: moving the tail to the host]), or it is refused here, before its forward allocates anything (a CUDA
        out-of-memory error mid-step would leave a half-done step; this leaves everything as it was)."""
        if not (torch.is_grad_enabled() and module.training) or self.workload is None:
            return
        if not self._calibrated and self._steps_taken >= CALIBRATION_STEPS:
            self._calibrate()
            self._start_thread_trial()
            if self.calibration is not None:
                text = calibration_summary(self.calibration, CALIBRATION_STEPS)
                for listener in self.calibration_listeners:
                    listener(text)
        shape = _batch_shape(args, kwargs)
        if shape is None or shape[0] * shape[1] <= self._fitted_tokens:
            self._forwards += 1
            return
        larger = dataclasses.replace(self.workload, batch_size=shape[0], seq_len=shape[1])
        ok, why = self._fit(larger, f"a training batch of {shape[0]} x {shape[1]} tokens")
        if not ok:
            w = self.workload
            raise RuntimeError(
                f"hf_superoffload: this training batch ({shape[0]} x {shape[1]} tokens) does not fit the plan made "
                f"for {w.batch_size} x {w.seq_len} ({why}); nothing was run or changed. Plan for the longest batch: "
                f"SuperOffloadOptimizer(..., workload=Workload(model.config, batch_size={shape[0]}, "
                f"seq_len={shape[1]}, grad_ckpt={w.grad_ckpt})), or superoffload_max_seq_len with the Trainer; or cap "
                "the batches' length")
        self._fitted_tokens, self._fitted = shape[0] * shape[1], larger
        self._forwards += 1  # counted once it runs: a refused forward is no micro-batch of the step

    def _calibrate(self) -> None:
        """[Note: calibration from the measured peak] in planning/planner.py: once, before the forward after the
        first ``CALIBRATION_STEPS`` steps, restate the device budget from what this process reserved at its peak,
        then give the room to kept layers and what they leave to the device tail or, if the memory model was
        short, take it back (kept layers first, then device buckets to the host)."""
        self._calibrated = True
        timing = self._calibrate_rates()
        if timing is not None:
            self.calibration = {"timing": timing}
        need = _measured_device_need(self.device, self._other_at_plan)
        if need is None or self._budget is None or self._fitted is None:
            return
        workload = self._planning_workload(self._fitted)
        plan = self.plan
        est = workload.estimate(PlanLike.from_plan(plan))
        self._budget = calibrated_budget(self._budget, predicted_required=est.gpu_required_bytes, measured_need=need,
                                         largest_block=est.largest_block_bytes)
        gib = 1024**3
        logger.info("hf_superoffload: calibrated on the first %d steps: %.1f GiB reserved at the peak, %.1f GiB "
                    "predicted with the allocator's slack", CALIBRATION_STEPS, need / gib,
                    est.gpu_required_bytes / gib)
        before = (self.plan.kept_layers, len(self.plan.device_buckets))
        ok, why = self._fit(self._fitted, "the measured peak")
        if not ok:  # it has trained without running out of memory (the allocator frees its cache and retries
            # before it fails): say so, change nothing
            logger.warning("hf_superoffload: the first %d steps reserved %.1f GiB of device memory, more than the "
                           "plan leaves room for (%s), and no kept layer or device bucket can move; training goes on "
                           "with the plan as it is", CALIBRATION_STEPS, need / gib, why)
        if workload.layer_checkpointing:  # [Note: kept layers]: room the model did not see goes to them
            plan = self.plan
            layers = workload.shape.num_layers
            kept = most_kept_layers(plan, workload, self._budget, 1, layers)
            if kept > plan.kept_layers:
                logger.info("hf_superoffload: the measured peak leaves room: %d decoder layer(s) keep their "
                            "activations instead of %d", kept, plan.kept_layers)
                self._set_kept_layers(kept)
                self._built.amend_plan(dataclasses.replace(plan, kept_layers=kept))
        grown, move_s = self._grow(workload) if ok else (0, 0.0)
        if self.device.type == "cuda" and before != (self.plan.kept_layers, len(self.plan.device_buckets)):
            # the old arenas and the recomputed layers' blocks go back to the driver: the changed layout is laid
            # out fresh, not in their pieces ([Note: calibration from the measured peak])
            torch.cuda.empty_cache()
        self.calibration = {**(self.calibration or {}),
                            "measured_need_bytes": need, "predicted_required_bytes": est.gpu_required_bytes,
                            "kept_layers": (before[0], self.plan.kept_layers),
                            "device_buckets": (before[1], len(self.plan.device_buckets)),
                            "moved_to_device_params": grown, "move_s": move_s}

    def _grow(self, workload: Workload) -> tuple[int, float]:
        """[Note: moving the tail to the device] in runtime/tail_move.py: the room the calibrated budget leaves
        beside the kept layers goes to the device tail where the planner's tail search would put it; returns how
        many parameters moved their optimizer state to the device and the seconds the move took."""
        assert self._built is not None and self._budget is not None
        if not self._built.can_move_to_device:
            return 0, 0.0
        plan = self.plan
        grown = grow_tail(plan, workload, self._budget, numels=[p.numel() for p in self._ordered], element_size=2,
                          config=self.config)
        if grown is None:
            return 0, 0.0
        return self._move_tail(grown, "the measured peak leaves room")

    def _move_tail(self, plan: OffloadPlan, why: str) -> tuple[int, float]:
        """Make ``plan``, a move of the tail the planner chose (runtime/tail_move.py), with the kept layers it comes
        with, and log it; returns how many parameters moved their optimizer state and the seconds that took."""
        assert self._built is not None
        before = len(self.plan.device_buckets)
        to_device = len(plan.device_buckets) > before
        t = time.perf_counter()
        moved = self._built.move_to_device(plan) if to_device else self._built.move_to_host(plan)
        took = time.perf_counter() - t
        self._set_kept_layers(plan.kept_layers)
        logger.info("hf_superoffload: %s: %d parameters (%d bucket(s)) moved their optimizer state to the %s in "
                    "%.1f s", why, moved, abs(len(plan.device_buckets) - before), "device" if to_device else "host",
                    took)
        return moved, took

    def _calibrate_rates(self) -> dict[str, Any] | None:
        """[Note: calibrating the rates] in planning/calibration.py: one of the last two steps against the roofline;
        the device budget takes the restated rates, so every later choice prices with what this machine measured."""
        w, budget = self._fitted, self._budget
        steps = [r for r in self._recent if r[1].iteration_s > 0 and r[1].verdict != StepVerdict.SKIP.value]
        if w is None or budget is None or self._comm is not None or not steps:
            return None
        # of the last two steps the one whose GPU was busy the shortest: a step runs slower than the GPU can, never
        # faster (on an H100 box one of the 3.6B snippet's steps ran 1.087 s beside 0.96 s and restated the GEMM
        # rate x0.84); the verdict does not change the GPU's part, so steps of either verdict compare
        number, stats, micro = min(steps, key=lambda r: r[1].iteration_s - r[1].gpu_idle_s)
        # the passes of the two steps before the last one, each complete by the step after it: the faster counts
        candidates = [MeasuredStep(stats.iteration_s, stats.gpu_idle_s, passed.adam_s if passed is not None else 0.0,
                                   clipped=stats.verdict == StepVerdict.REDO.value,
                                   undid=passed is not None and passed.undid,
                                   micro_batches=micro,
                                   pass_clipped=passed is not None and passed.clipped)
                      for passed in (r[1].host_pass for r in self._recent)]
        w = self._planning_workload(w)
        cal = calibrate_from_passes(budget, plan=self.plan, workload=w, candidates=candidates)
        if cal is None:
            return None
        self._budget = dataclasses.replace(budget, matmul_tflops=cal.profile.matmul_tflops,
                                           cpu_adam_gparams=cal.profile.cpu_adam_gparams)
        factors = ", ".join(f"{name} rate x{f:.2f}" for name, f in (("GEMM", cal.gemm_factor),
                                                                     ("CPU Adam", cal.cpu_factor)) if f is not None)
        logger.info("hf_superoffload: step %d took %.3f s over %d micro-batch(es), %.3f s predicted; %s%s",
                    number, cal.measured_step_s, micro, cal.predicted_step_s,
                    factors or "rates kept", "".join(f"; {n}" for n in cal.notes))
        return {**cal.as_record(), "micro_batches": micro, "step": number}

    def _fit(self, workload: Workload, what: str) -> tuple[bool, str]:
        """Make the plan hold ``workload`` on the device budget: as it is, with fewer kept layers, or with device
        buckets moved to the host ([Note: moving the tail to the host]); ``(False, why)`` if none does (nothing
        changed then)."""
        budget = self._budget
        assert budget is not None and self._built is not None
        ok, why = device_holds(self.plan, workload, budget, 1)
        plan = self.plan
        # checkpoint kept layers again before moving anything: the values are the same, only slower
        if (not ok and self._kept is not None and self._kept.kept
                and device_holds(dataclasses.replace(plan, kept_layers=0), workload, budget, 1)[0]):
            kept = most_kept_layers(plan, workload, budget, 1, self._kept.kept)
            logger.info("hf_superoffload: %s: %d decoder layer(s) keep their activations instead of %d, so that it "
                        "fits", what, kept, self._kept.kept)
            self._kept.set(kept)
            self._built.amend_plan(dataclasses.replace(plan, kept_layers=kept))
            ok = True
        if not ok and self._built.can_move_to_host:
            # [Note: moving the tail to the host] in runtime/tail_move.py: before this forward allocates anything
            shrunk = shrink_tail(plan, self._planning_workload(workload), budget,
                                 numels=[p.numel() for p in self._ordered], element_size=2, config=self.config,
                                 host_arena_numel=self._built.host_arena_numel,
                                 host_arena_capacity=self._built.host_arena_capacity)
            if shrunk is not None:
                self._move_tail(shrunk, f"{what}, so that it fits")
                ok = True
        if not ok and self._built.mid_accumulation and plan.device_numel:
            why = (f"{why}; the device tail moves to the host only at an optimizer step's first micro-batch, and "
                   "this micro-batch follows others whose gradients are summed on the host")
        return ok, why

    @property
    def _engine(self) -> OffloadEngine:
        """The engine; built now, without a workload, when something needs it before the first training batch."""
        if self._built is None:
            logger.info("hf_superoffload: the optimizer is used before the first training batch; planning without "
                        "the step's shape")
            return self._build(None)
        return self._built

    @property
    def planned(self) -> bool:
        """Whether the plan is final (the engine exists). Before the first training batch of an optimizer that
        reads its workload from it, ``plan`` is provisional: the plan it would make without one."""
        return self._built is not None

    @property
    def plan(self) -> OffloadPlan:
        if self._built is not None:
            return self._built.plan
        if self._provisional is None:
            self._provisional = self._make_plan(None, self._profile)
        return self._provisional

    @property
    def device(self) -> torch.device:
        """The device of the trainable parameters."""
        return self._ordered[0].device

    @property
    def comm(self) -> ShardGroup | None:
        """The data-parallel group the optimizer state is sharded over (``None``: one process)."""
        return self._comm

    # ------------------------------------------------------------------------------------------------
    def _arrival_order(self, model: torch.nn.Module) -> tuple[list[torch.nn.Parameter], list[int]]:
        """Trainable parameters of the groups, deduplicated, in expected gradient-arrival order
        (reverse registration order) with their group index."""
        group_of: dict[int, int] = {}
        for g, group in enumerate(self.param_groups):
            for p in group["params"]:
                if id(p) in group_of:
                    raise ValueError("a parameter appears in more than one param group")
                group_of[id(p)] = g
        seen: set[int] = set()
        order: list[torch.nn.Parameter] = []
        for p in model.parameters():
            if id(p) in group_of and id(p) not in seen:
                seen.add(id(p))
                order.append(p)
        if len(order) != len(group_of):
            raise ValueError("every parameter passed in params must belong to the model")
        order.reverse()
        return order, [group_of[id(p)] for p in order]

    @staticmethod
    def _check_params(params: list[torch.nn.Parameter]) -> None:
        if not params:
            raise ValueError("the model has no trainable parameters (requires_grad=True)")
        devices = {p.device for p in params}
        if len(devices) != 1:
            raise ValueError(f"trainable parameters span devices {sorted(map(str, devices))}; move the model to one device")
        for p in params:
            if not p.requires_grad:
                raise ValueError("frozen parameters (requires_grad=False) must not be passed in params")
            if p.dtype not in (torch.bfloat16, torch.float32):
                raise ValueError(
                    f"parameter of dtype {p.dtype} is not supported: load the model in bfloat16 (or float32, which is "
                    "converted to bf16 weights with fp32 masters). fp16 needs loss scaling, which SuperOffload does not do."
                )

    def _hypers(self) -> GroupHypers:
        from .state import refuse_stock_accelerate_wrapper

        refuse_stock_accelerate_wrapper("step", depth=10)  # its constructor did not read our state: refused here
        return _checked_hypers(self.param_groups)

    # ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        try:
            stats = self._engine.step(self.max_grad_norm)
        except BaseException:
            self._engine.abort_step()
            raise
        self.last_grad_norm = stats.grad_norm
        self._steps_taken += 1
        self._step_forwards, self._forwards = self._forwards, 0
        if not self._calibrated:
            self._recent = (*self._recent[-1:], (self._steps_taken, stats, max(1, self._step_forwards)))
        if self._trial is not None:
            self._trial_step(stats)
        elif self._comm is not None and not self._calibrated and self._steps_taken == CALIBRATION_STEPS:
            # data parallel plans once, moves nothing and calibrates nothing: the thread trial starts where the
            # calibration would have run, at the same step on every rank
            self._calibrated = True
            self._start_thread_trial()
        if stats.verdict == StepVerdict.SKIP.value:
            self.skipped_steps += 1
            logger.warning("hf_superoffload: non-finite gradient, step skipped (%d so far)", self.skipped_steps)
            self._check_consecutive_skips(stats.grad_norm)
        else:
            self._skip_norms = []
            self._last_good_norm = stats.grad_norm
            if stats.clip_coef < 1.0:
                self.clipped_steps += 1
        return loss

    def _start_thread_trial(self) -> None:
        """[Note: the thread trial] in planning/thread_trial.py, once the calibration has settled the plan: host
        buckets, the automatic thread count and a core it leaves to the training thread (of the rank's share of
        the host's cores under data parallel, where every rank must be able to, as each step's samples are agreed)."""
        plan = self.plan
        cores = len(plan.cpu_affinity) if plan.cpu_affinity else ops.affinity_cores()
        able = bool(plan.host_numel) and self.config.cpu_threads is None and plan.cpu_threads < cores
        if self._comm is not None:  # all ranks reach this at the same step: they trial together or not at all
            able = _agreed_max(self._comm, [not able])[0] == 0
        if able:
            self._trial = ThreadTrial.after_calibration(self._steps_taken, plan.cpu_threads)

    def _trial_step(self, stats: StepStats) -> None:
        trial = self._trial
        assert trial is not None and self._built is not None
        passed = stats.host_pass
        sample = IterationSample(stats.iteration_s, stats.verdict, max(1, self._step_forwards),
                                 pass_adam_s=None if passed is None else passed.adam_s,
                                 pass_kind=None if passed is None else (passed.clipped, passed.undid),
                                 pass_threads=None if passed is None else passed.threads)
        if self._comm is not None:
            sample = _agreed_sample(self._comm, sample, trial)
        threads = trial.after_step(self._steps_taken, sample)
        if threads is not None and threads != self._built.plan.cpu_threads:
            self._built.set_cpu_threads(threads)
        if trial.chosen is None:
            return
        self._trial = None
        self.calibration = {**(self.calibration or {}), "threads": trial.as_record()}
        text = f"hf_superoffload thread trial: the CPU Adam runs {trial.chosen} threads ({trial.why})"
        logger.info("%s", text)
        for listener in self.calibration_listeners:
            listener(text)

    def _check_consecutive_skips(self, norm: float) -> None:
        """Raise after ``config.max_consecutive_skips`` skipped steps in a row. The skip has already restored the
        state, so the caller may fix the cause and go on; the count restarts so that it raises again only after
        as many more skips."""
        norms = self._skip_norms
        norms.append(norm)
        limit = self.config.max_consecutive_skips
        if not limit or len(norms) < limit:
            return
        self._skip_norms = []
        shown = ", ".join(f"{n:.4g}" for n in norms[-8:])
        good = self._last_good_norm
        before = f"{good:.4g}" if good is not None else "none (no step has succeeded yet)"
        raise RuntimeError(
            f"hf_superoffload: {len(norms)} consecutive optimizer steps were skipped for non-finite gradients "
            f"(gradient norms of the last ones: {shown}; last finite norm: {before}); the optimizer state is as "
            "before them. Check the learning rate (lower it, add warmup), the data (NaN/inf inputs or labels) and "
            "the loss scaling and precision (fp16 overflow, a loss computed in low precision), or raise "
            "SuperOffloadConfig.max_consecutive_skips (0 never raises)"
        )

    @property
    def step_was_skipped(self) -> bool:
        """True when the last step was skipped for a non-finite gradient (Accelerate reads this)."""
        return self._engine.stats.verdict == StepVerdict.SKIP.value

    @property
    def last_step_stats(self) -> StepStats:
        return self._engine.stats

    @property
    def settled(self) -> bool:
        """Whether the first steps' measurements are over: the calibration ran and the thread trial, if there was
        one, has decided ([Note: the thread trial]). The iteration after the step that settles it may still hold
        a host pass at the trial count."""
        return self._calibrated and self._trial is None

    @property
    def profile(self) -> HardwareProfile:
        """The hardware profile the first plan was made with: the one given, else this host's cached measurement or
        the shipped profile of this GPU model ([Note: known rates]). The calibration's restated rates are in
        ``calibration["timing"]``, not here."""
        return self._profile

    @property
    def engine(self) -> OffloadEngine:
        return self._engine

    def abort_step(self) -> None:
        """Drop the step in progress after an exception between backward and ``step()`` (KeyboardInterrupt, an
        out-of-memory error): speculative updates are undone and the state is as before that backward.
        ``zero_grad()`` and ``close()`` do this too."""
        if self._built is not None:
            self._built.abort_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._built is not None and self._built.step_in_progress:
            logger.warning("hf_superoffload: zero_grad() while a step is in progress (an interrupted backward?): "
                           "the step is dropped and the optimizer state is as before it")
            self._engine.abort_step()
        for p in self._ordered:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Non-final micro-batches: gradients accumulate without a step (on the device, or summed on the host with
        ``SuperOffloadConfig.accumulate_on_host``)."""
        # the engine may be built inside the block (its first forward): the depth goes to whichever engine exists
        if self._built is None:
            self._pending_no_sync += 1
        else:
            self._built.enter_no_sync()
        try:
            yield
        finally:
            if self._built is None:
                self._pending_no_sync -= 1
            else:
                self._built.exit_no_sync()

    def set_sync_predicate(self, predicate: Callable[[], bool] | None, micro_batches: int | None = None) -> None:
        """Tell the engine whether the current backward is an accumulation boundary (used by integrations), and how
        many micro-batches make an optimizer step when known: the plan made at the first batch then prices their
        step ([Note: one search over the plan] in planning/planner.py)."""
        if micro_batches is not None and (isinstance(micro_batches, bool) or not isinstance(micro_batches, int)
                                          or micro_batches < 1):
            raise ValueError(f"micro_batches={micro_batches!r}: use the micro-batches per optimizer step (an "
                             "integer >= 1) or None")
        self._pending_predicate = predicate
        self._micro_batches = micro_batches
        if self._built is not None:
            self._built.sync_predicate = predicate

    def synchronize(self) -> None:
        """Block until every parameter on the device holds its final value for the last step."""
        if self._built is not None:  # before the first step every weight is final
            self._built.synchronize()

    @contextmanager
    def materialized(self) -> Iterator[None]:
        """Inside the block every parameter holds its final weights on the device. Needed to read the weights
        in weight-flow mode (docs/weight_flow.md), where they otherwise live on the host between uses."""
        if self._built is None:  # not planned yet: the weights are where the model put them
            yield
            return
        with self._built.materialized():
            yield

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if "_ordered" in vars(self):  # constructed: the plan covers the groups it was built with
            raise ValueError("SuperOffloadOptimizer cannot add param groups after construction; build a new optimizer "
                             "with every group")
        super().add_param_group(param_group)

    # ------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The optimizer state to save (``torch.save``: it writes the arenas without a host copy of the state).

        Its arenas alias the live state, as a torch optimizer's state dict aliases its tensors: save it before the
        next ``step()``. The GPU-resident arenas are in 64 MiB pieces on the GPU (``copy.deepcopy`` would copy them
        there; to keep a snapshot in memory, copy each piece to the host)."""
        base = super().state_dict()
        self._engine.synchronize()
        return {
            "state": {},
            "param_groups": base["param_groups"],
            "superoffload": engine_state_dict(self._engine, skipped_steps=self.skipped_steps,
                                              clipped_steps=self.clipped_steps),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "superoffload" not in state_dict:
            raise ValueError("this state dict was not saved by SuperOffloadOptimizer (no 'superoffload' entry); "
                             "a plain torch optimizer's state cannot seed the offloaded masters")
        sd = state_dict["superoffload"]
        if self._built is None and self._batch_hook is not None and not sd.get("sharding"):
            # [Note: a state loaded before the first batch]: the plan waits for the first batch's shape; building
            # the engine now would plan without it (a resume would run another, slower plan than the run it resumes)
            validate_whole_state(self._ordered, names_in(self._model, self._ordered), sd)
            self._check_groups(state_dict)
            self._pending_state = sd
            weights_from_masters(self._ordered, sd)  # evaluation before the first batch sees the loaded weights
            counters = {k: int(v) for k, v in sd.get("counters", {}).items()}
        else:
            # everything is checked before anything is copied: a refused state leaves the optimizer as it was
            validate_engine_state(self._engine, sd)
            self._check_groups(state_dict)
            self._engine.synchronize()
            counters = load_engine_state(self._engine, sd, validate=False)
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        self.skipped_steps = counters.get("skipped_steps", 0)
        self.clipped_steps = counters.get("clipped_steps", 0)

    def _check_groups(self, state_dict: dict[str, Any]) -> None:
        saved = [len(g["params"]) for g in state_dict.get("param_groups", [])]
        ours = [len(g["params"]) for g in self.param_groups]
        if saved != ours:
            raise ValueError(f"the checkpoint has a different number of parameter groups or group sizes (saved {saved}, "
                             f"now {ours}); resume with the same param groups")

    def close(self) -> None:
        """Stop the worker, remove hooks and give the model its own loss back (``SuperOffloadConfig.chunked_loss``).
        The optimizer cannot step afterwards; a second call does nothing more."""
        self._state_hook.remove()
        if self._loss_installed:
            uninstall_chunked_loss(self._model)
            self._loss_installed = False
        if self._batch_hook is not None:
            self._batch_hook.remove()
            self._batch_hook = None
        if self._growth_hook is not None:
            self._growth_hook.remove()
            self._growth_hook = None
        if self._kept is not None:
            self._kept.restore()
            self._kept = None
        if self._built is not None:
            self._built.close()

    def __del__(self) -> None:
        engine = getattr(self, "_built", None)
        if engine is not None:
            engine.close()


def calibration_summary(record: dict[str, Any], steps: int) -> str:
    """``optimizer.calibration`` in words: what the first ``steps`` steps measured against the plan's predictions and
    what changed."""
    gib, parts = 1024**3, []
    if "measured_need_bytes" in record:
        parts.append(f"peak {record['measured_need_bytes'] / gib:.1f} GiB reserved, "
                     f"{record['predicted_required_bytes'] / gib:.1f} GiB predicted")
    for key, what in (("kept_layers", "kept layers"), ("device_buckets", "device buckets")):
        if key in record:
            before, after = record[key]
            parts.append(f"{what} {before} -> {after}")
    if record.get("moved_to_device_params"):
        parts.append(f"{record['moved_to_device_params'] / 1e6:.1f}M parameters' optimizer state moved to the device"
                     + (f" in {record['move_s']:.1f} s" if "move_s" in record else ""))
    timing = record.get("timing")
    if timing:
        factors = [f"{name} rate x{f:.2f}" for name, f in (("GEMM", timing["gemm_factor"]),
                                                           ("CPU Adam", timing["cpu_factor"])) if f is not None]
        parts.append(f"step {timing['measured_step_s']:.3f} s measured, {timing['predicted_step_s']:.3f} s predicted"
                     + (f" ({', '.join(factors)})" if factors else ""))
    return f"hf_superoffload calibration after {steps} steps: " + "; ".join(parts)


def _measured_device_need(device: torch.device, other_at_plan: int) -> int | None:
    """[Note: calibration from the measured peak]: the device bytes this run has needed at its peak, as the plan
    counts them (``None`` off CUDA): the allocator's reserved high-water mark, less what was allocated at the first
    batch besides the model's weights (the budget already left that out). What it reserves now counts too: the
    caching allocator keeps its peak unless it had to free it, and a caller may have reset the peak statistics."""
    if device.type != "cuda":
        return None
    reserved = max(torch.cuda.max_memory_reserved(device), torch.cuda.memory_reserved(device))
    return max(0, reserved - other_at_plan)


def _own_weight_bytes(model: torch.nn.Module, device: torch.device) -> int:
    """Bytes of the model's parameters resident on ``device`` (shared storages once)."""
    seen: set[int] = set()
    own = 0
    for p in model.parameters():
        if p.device == device and p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            own += p.numel() * p.element_size()
    return own


def _count_own_weights_as_free(profile: HardwareProfile, own: int, device: torch.device) -> HardwareProfile:
    """The memory model counts the model's resident weights (``own`` bytes on ``device``) in a workload's need, so
    the budget it is checked against is the free device memory *plus* what those weights already take (and this
    process's allocator cache, which it can reuse); otherwise the weights would count twice and the GPU tail come
    out too small."""
    if profile.device_free_bytes is None or device.type != "cuda":
        return profile
    cache = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return dataclasses.replace(profile, device_free_bytes=profile.device_free_bytes + own + max(0, cache))


def _agreed_max(comm: ShardGroup, values: list[int]) -> list[int]:
    """The element-wise maximum of ``values`` over the ranks of ``comm`` (one all-reduce on its control group, from
    the training thread, never interleaved with the engine's collectives)."""
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=comm.control)
    return [int(v) for v in t.tolist()]


def _agreed_sample(comm: ShardGroup, sample: IterationSample, trial: ThreadTrial) -> IterationSample:
    """[Note: the thread trial] under data parallel: the slowest rank's iteration and host pass (the collectives
    make every rank wait for it), a pass no rank may lack, the kind of pass any rank had, and the trial count only
    where every rank's pass ran at it, so that every rank feeds its trial the same sample and reaches the same
    verdict at the same step. The verdict and the micro-batches are the same on every rank already (one global
    norm, one loop)."""
    us = 1e6
    kind = sample.pass_kind or (False, False)
    lacks, slowest_s, slowest_pass, clipped, undid, off_trial = _agreed_max(comm, [
        sample.pass_adam_s is None, round(sample.iteration_s * us),
        -1 if sample.pass_adam_s is None else round(sample.pass_adam_s * us), kind[0], kind[1],
        sample.pass_threads != trial.trial,
    ])
    if lacks:
        return dataclasses.replace(sample, iteration_s=slowest_s / us, pass_adam_s=None, pass_kind=None,
                                   pass_threads=None)
    return dataclasses.replace(sample, iteration_s=slowest_s / us, pass_adam_s=slowest_pass / us,
                               pass_kind=(bool(clipped), bool(undid)),
                               pass_threads=trial.planned if off_trial else trial.trial)


def _agree_on_first_batch(
    comm: ShardGroup, shape: tuple[int, int] | None, accumulates: bool, ckpt: bool,
    outside: bool, profile: HardwareProfile,
) -> tuple[tuple[int, int] | None, bool, bool, bool, HardwareProfile]:
    """What every rank plans with ([Note: workload from the first batch]): the largest batch and sequence of the
    ranks' first batches (a rank whose batch showed none takes the others'), accumulation, checkpointing and a
    loss outside the model if any rank has them, and the smallest free device and host memory."""
    unknown = -(2**62)  # a memory size no rank reported: loses every maximum
    free, host = profile.device_free_bytes, profile.host_available_bytes
    agreed = _agreed_max(comm, [
        shape is not None, *(shape or (0, 0)), accumulates, ckpt, outside,
        unknown if free is None else -free, unknown if host is None else -host,
    ])
    has_shape, batch, seq, acc, ck, out, neg_free, neg_host = agreed
    profile = dataclasses.replace(profile, device_free_bytes=None if neg_free == unknown else -neg_free,
                                  host_available_bytes=None if neg_host == unknown else -neg_host)
    return ((batch, seq) if has_shape else None), bool(acc), bool(ck), bool(out), profile


def _batch_shape(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, int] | None:
    """(batch, tokens per sequence) of a causal LM's forward call: from ``input_ids`` (or ``inputs_embeds``),
    passed by keyword as Trainer and most loops do, or as the first positional argument."""
    for key in ("input_ids", "inputs_embeds"):
        t = kwargs.get(key)
        if isinstance(t, torch.Tensor) and t.dim() >= 2:
            return int(t.shape[0]), int(t.shape[1])
    if args and isinstance(args[0], torch.Tensor) and args[0].dim() >= 2:
        return int(args[0].shape[0]), int(args[0].shape[1])
    return None


def _checkpointing(model: torch.nn.Module) -> bool:
    """Whether transformers' activation (gradient) checkpointing is on for ``model``."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        value = getattr(model, name, None)
        if isinstance(value, bool):
            return value
    return False


def _wrapped_for_data_parallel(model: torch.nn.Module) -> bool:
    """DDP, FSDP1 or FSDP2 anywhere in the model: they would reduce gradients a second time."""
    wrappers: tuple[type, ...] = (torch.nn.parallel.DistributedDataParallel,)
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

        wrappers += (FSDPModule, FullyShardedDataParallel)
    except ImportError:  # a torch build without distributed support
        pass
    return any(isinstance(m, wrappers) for m in model.modules())


def _local_ranks(comm: ShardGroup) -> dict[str, int]:
    """World/rank and the ranks sharing this host (they split its cores and RAM): from the launcher's
    ``LOCAL_WORLD_SIZE``/``LOCAL_RANK`` (torchrun, accelerate launch), else by comparing host names."""
    import os
    import socket

    import torch.distributed as dist

    local_world, local_rank = os.environ.get("LOCAL_WORLD_SIZE"), os.environ.get("LOCAL_RANK")
    if comm.world_size == dist.get_world_size() and local_world is not None and local_rank is not None:
        lw, lr = int(local_world), int(local_rank)
    else:
        hosts: list[str] = [""] * comm.world_size
        dist.all_gather_object(hosts, socket.gethostname(), group=comm.group)
        mine = hosts[comm.rank]
        lw = hosts.count(mine)
        lr = hosts[: comm.rank].count(mine)
    return {"world_size": comm.world_size, "rank": comm.rank, "local_world_size": min(lw, comm.world_size),
            "local_rank": min(lr, max(lw, 1) - 1)}


def _broadcast_params(params: list[torch.nn.Parameter], comm: ShardGroup) -> None:
    """Every rank starts from the first rank's values (as DDP does at construction)."""
    import torch.distributed as dist

    src = dist.get_global_rank(comm.group, 0)
    with torch.no_grad():
        for p in params:
            t = p.data if p.data.is_contiguous() else p.data.contiguous()
            dist.broadcast(t, src=src, group=comm.group)
            if t is not p.data:
                p.data.copy_(t)


def _checked_hypers(param_groups: list[dict[str, Any]]) -> GroupHypers:
    """Every group's :class:`AdamWHyper`, validated by it. The engine reads them when a step starts (before any
    bucket is stepped) and again when it validates the step, so a bad value set into ``param_groups`` between steps
    is refused before any optimizer state changes, and the optimizer steps normally once it is fixed (the CPU worker
    would otherwise fail on it mid-step and leave the optimizer unusable)."""
    hypers = []
    for i, g in enumerate(param_groups):
        try:
            beta1, beta2 = g["betas"]
            raw = {"lr": g["lr"], "beta1": beta1, "beta2": beta2, "eps": g["eps"], "weight_decay": g["weight_decay"]}
            for value in raw.values():
                float(value)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"param_groups[{i}] holds an unreadable hyper-parameter ({e!r}): set lr, eps and "
                             "weight_decay to numbers and betas to a pair of numbers") from None
        try:
            hypers.append(AdamWHyper(**raw))  # the values as set: its messages show them as the user wrote them
        except ValueError as e:
            raise ValueError(f"param_groups[{i}] {e} (nothing was stepped: fix the value and step again)") from None
    return tuple(hypers)
