"""``SuperOffloadTrainer``: ``transformers.Trainer`` training through :class:`SuperOffloadOptimizer`.

Usage::

    from hf_superoffload.integrations.transformers import SuperOffloadArguments, SuperOffloadTrainer

    args = SuperOffloadArguments(output_dir="out", learning_rate=2e-5, max_grad_norm=1.0, bf16=True,
                                 superoffload_bucket_size_mb=32)
    trainer = SuperOffloadTrainer(model=model, args=args, train_dataset=ds, processing_class=tok)
    trainer.train()

What it changes in Trainer (transformers 5.17-5.24; every other behaviour is Trainer's):

- ``create_optimizer``: a ``SuperOffloadOptimizer`` over HF's decay/no-decay groups
  (``get_decay_parameter_names``), hyper-parameters from the args, wrapped in
  :class:`~._common.SuperOffloadAcceleratedOptimizer` (no state moved to the GPU by ``accelerator.prepare``;
  ``step_was_skipped`` forwarded so the LR scheduler does not advance on a skipped step). The optimizer's
  sync predicate is ``accelerator.sync_gradients``, so gradients are offloaded only on the boundary micro-batch.
- ``_clip_grad_norm``/``_get_grad_norm`` (private hooks, 5.17+): the optimizer clips inside ``step()``
  (exactly ``clip_grad_norm_``), so Trainer never clips; the reported ``grad_norm`` is the optimizer's global
  norm before clipping, delivered through a tensor filled at ``step()``.
- ``_save_optimizer_and_scheduler``/``_load_optimizer_and_scheduler``: ``optimizer.pt`` holds our state dict
  (host tensors), written atomically; it is loaded with ``weights_only=True`` on the CPU and copied into the
  existing host buffers (the model's weights are refreshed from the loaded fp32 masters).
- ``save_model``: waits for the last step's weights first (``optimizer.synchronize()``); so does the end of
  ``train()``. (During training, each layer's next forward waits for its own weights; code that reads
  ``param.data`` directly in a callback should call ``trainer.superoffload_optimizer.synchronize()`` first.)
- ``log``: training log lines get the offload telemetry averaged over the logging window
  (``superoffload/cpu_adam_s``, ``gpu_wait_s``, ``gpu_idle_s``, ``overlap``, ``link_gb``, ``clip_coef``, ``speculative``, ...)
  plus skipped/clipped step counts and the redo rate, so every ``report_to`` integration receives them.
  The plan summary is shown once on the main process when the plan is made (at the first training forward):
  through the stdlib logger ``hf_superoffload`` when logging is configured to show its INFO records, else printed
  on stdout (see :func:`show_plan`; an explicit ``args.log_level`` above info silences it); it is also kept in
  ``state.log_history`` (``{"superoffload/plan": text, "step": ...}``, saved in ``trainer_state.json``).
  Trainer's progress bar shows the loss, tokens/s (the input tokens of all processes) and the GPU wait of the
  latest logging window beside the step count.

Decision on ``Trainer(args=SuperOffloadArguments(...))`` (the plain Trainer): it is **refused** with a
``TypeError`` naming ``SuperOffloadTrainer``, raised from ``Trainer.__init__`` (through the documented
``TrainingArguments.place_model_on_device`` override point). A plain Trainer cannot be correct: ``optim=``
cannot name a third-party optimizer (so it would silently build torch AdamW; ``optimizer_cls_and_kwargs`` is a
Trainer argument, not a TrainingArguments one); its ``accelerator.clip_grad_norm_`` would run over gradients
that were already offloaded (reporting ``grad_norm`` 0, and clipping the still-resident gradients of
partially-filled buckets by a partial norm: double clipping); ``AcceleratedOptimizer(device_placement=True)``
round-trips the host optimizer state through the GPU (measured on an H200: a 12 B/param peak; an OOM for large
models); and the stock wrapper does not
forward ``step_was_skipped``, so the LR would advance on skipped steps. Failing at construction is better than
any of these silently.

Multi-process runs (``accelerate launch --num_processes N``, ``torchrun``): the optimizer does the data
parallelism itself (ZeRO-style sharded offload, [Note: data parallel sharding]), so the model is prepared
without a DDP wrapper (device placement and autocast only); each rank saves its own optimizer shard
(``optimizer_rank{r}.pt``), and a checkpoint resumes into any number of processes (the shards are merged when
the count changed).

Preemption: inside ``train()`` a SIGTERM finishes the step in flight, saves it and returns (a second SIGTERM ends
the process); with several processes the ranks agree at every optimizer-step boundary, so a signal that reaches
one rank stops them all after the same step ([Note: preemption agreement] in ``_preemption.py``).
"""

from __future__ import annotations

import inspect
import logging
import os
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import PreTrainedModel, ProgressCallback, Trainer, TrainerCallback
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME
from transformers.trainer_pt_utils import reissue_pt_warnings
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..optimizer import SuperOffloadOptimizer
from ..planning.plan import OffloadPlan
from ._common import (
    MODEL_SHARD_SIZE,
    SuperOffloadAcceleratedOptimizer,
    TelemetryWindow,
    atomic_torch_save,
    last_complete_checkpoint,
    progress_postfix,
    read_optimizer_state,
    refuse_other_model,
    remove_stale_temp_files,
    save_optimizer_state,
    show_plan,
    training_outputs_in_model_dtype,
    warn_if_threads_throttled,
)
from ._preemption import Preemption
from ._streamed_save import streamed_model_files
from .arguments import (
    SuperOffloadArguments,
    _checkpoint_kwargs,
    building_superoffload_trainer,
    superoffload_config_from_args,
)

__all__ = ["SuperOffloadArguments", "SuperOffloadTrainer", "superoffload_config_from_args"]

logger = logging.getLogger(__name__)


def _workload_from_args(model: Any, args: Any) -> Any:
    """The planner's ``Workload`` when ``superoffload_max_seq_len`` declares the batch shape, else ``None``."""
    if not getattr(args, "superoffload_max_seq_len", None):
        return None
    from ..causal_lm_loss import CHUNK_TOKENS
    from ..planning.planner import Workload

    sp = args.sequence_parallel_size
    ckpt = bool(getattr(args, "activation_checkpointing", False) or vars(args).get("gradient_checkpointing", False))
    return Workload(model.config, args.per_device_train_batch_size, args.superoffload_max_seq_len, ckpt,
                    sequence_parallel=sp, loss_chunk_tokens=CHUNK_TOKENS if sp > 1 else None,
                    mlp_tile_tokens=args.tiled_mlp_tokens or None,
                    keep_attention=ckpt and args.keep_attention_checkpointing)


@contextmanager
def bounded_model_shards(model: Any) -> Iterator[None]:
    """While it lasts, model files are streamed to disk ([Note: bounded model shards]) and ``model.save_pretrained``
    writes shards of at most ``MODEL_SHARD_SIZE`` unless the caller names a size (another model, a PEFT wrapper
    writing its adapters, keeps its own shards)."""
    with streamed_model_files():
        if not isinstance(model, PreTrainedModel) or "save_pretrained" in vars(model):
            yield
            return
        save = model.save_pretrained

        def bounded(*args: Any, **kwargs: Any) -> Any:
            kwargs.setdefault("max_shard_size", MODEL_SHARD_SIZE)
            return save(*args, **kwargs)

        model.save_pretrained = bounded  # type: ignore[method-assign]
        try:
            yield
        finally:
            del model.save_pretrained


class SuperOffloadTrainer(Trainer):
    """``Trainer`` whose optimizer is :class:`SuperOffloadOptimizer` (see the module docstring).

    Takes exactly Trainer's arguments; ``args`` must be :class:`SuperOffloadArguments`, and ``optimizers`` /
    ``optimizer_cls_and_kwargs`` must not be given (the optimizer is built from the args).
    """

    def __init__(self, model: Any = None, args: SuperOffloadArguments | None = None, *rest: Any, **kwargs: Any) -> None:
        if args is None:
            args = SuperOffloadArguments(output_dir="tmp_trainer")
        if not isinstance(args, SuperOffloadArguments):
            raise TypeError(
                f"SuperOffloadTrainer needs SuperOffloadArguments, got {type(args).__name__}. Build them with the "
                "same keywords: SuperOffloadArguments(output_dir=..., learning_rate=..., ...)."
            )
        # bound against the next __init__ in the MRO: a subclass composed with another trainer (TRL's SFTTrainer)
        # takes that trainer's arguments (peft_config, formatting_func, ...), which Trainer's signature lacks
        base_init = super().__init__
        given = inspect.signature(base_init).bind_partial(model, args, *rest, **kwargs).arguments
        passed = (given.get("optimizers") or (None,))[0]
        if isinstance(passed, SuperOffloadOptimizer) and isinstance(model, torch.nn.Module):
            refuse_other_model(passed, model, "SuperOffloadTrainer(optimizers=(...))")
        if any(o is not None for o in (given.get("optimizers") or ())):
            raise ValueError("SuperOffloadTrainer builds its optimizer and scheduler from the args: drop "
                             "optimizers=(...) and set learning_rate / lr_scheduler_type / warmup_steps instead.")
        if given.get("optimizer_cls_and_kwargs") is not None:
            raise ValueError("SuperOffloadTrainer always uses SuperOffloadOptimizer: drop optimizer_cls_and_kwargs.")
        root = logging.getLogger("hf_superoffload")
        if args.log_level != "passive" and root.level == logging.NOTSET:  # mirror an explicit --log_level
            root.setLevel(args.get_process_log_level())
        self._superoffload: SuperOffloadOptimizer | None = None
        self._telemetry = TelemetryWindow()
        self._tokens_seen = 0  # this process's input tokens since construction, for the progress bar's rate
        with building_superoffload_trainer():
            super().__init__(model, args, *rest, **kwargs)
        _route_prepare_model(self)
        self._callback = _SuperOffloadCallback(self)
        self.add_callback(self._callback)
        # ---- sequence parallelism (issue #11): Ulysses attention + a training step over the SP group ----
        self._sp_groups = None
        if self.args.sequence_parallel_size > 1:
            from ._sequence_parallel import setup_sequence_parallel

            self._sp_groups = setup_sequence_parallel(self.model, self.args.sequence_parallel_size)
        if self.args.tiled_mlp_tokens:
            from ..sequence_parallel import enable_tiled_mlp

            enable_tiled_mlp(self.model, tile_tokens=self.args.tiled_mlp_tokens)

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        ids = inputs.get("input_ids") if isinstance(inputs, dict) else None
        self._tokens_seen += ids.numel() if isinstance(ids, torch.Tensor) else 0  # shape only: no device sync
        if self._sp_groups is None:
            return super().training_step(model, inputs, num_items_in_batch)
        from ._sequence_parallel import sequence_parallel_training_step

        return sequence_parallel_training_step(self, model, inputs, self._sp_groups)

    def prediction_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._sp_groups is not None:
            raise ValueError("evaluation/prediction is not supported with sequence_parallel_size > 1 (batches are "
                             "not sharded there); evaluate in a separate run with sequence_parallel_size=1")
        return super().prediction_step(*args, **kwargs)
    # ---- end sequence parallelism ----

    # ---- optimizer ---------------------------------------------------------------------------------
    @property
    def superoffload_optimizer(self) -> SuperOffloadOptimizer | None:
        """The :class:`SuperOffloadOptimizer` (``None`` before ``create_optimizer``)."""
        return self._superoffload

    def create_optimizer(self, model: Any = None) -> torch.optim.Optimizer:
        """Build the SuperOffloadOptimizer over HF's decay/no-decay param groups (trainable parameters only)."""
        if self.optimizer is not None:
            return self.optimizer
        opt_model = self.model if model is None else model
        decay = set(self.get_decay_parameter_names(opt_model))
        named = [(n, p) for n, p in opt_model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the model has no trainable parameters (every requires_grad is False)")
        groups = [
            {"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
        ]
        groups = [g for g in groups if g["params"]]
        args = self.args
        if self._superoffload is not None:  # model_init re-created the model: drop the old engine
            self._superoffload.close()
        opt = SuperOffloadOptimizer(
            opt_model, groups, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
            eps=args.adam_epsilon, weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm or None,
            config=superoffload_config_from_args(args), log_plan=False,
            # sequence parallelism: the SP ranks of a group hold parts of the same samples' gradients (summed);
            # only the data-parallel replicas are averaged
            gradient_divisor=(args.world_size // args.sequence_parallel_size) if args.world_size > 1 else None,
            workload=_workload_from_args(opt_model, args),
        )
        opt.set_sync_predicate(lambda: self.accelerator.sync_gradients,
                               micro_batches=args.gradient_accumulation_steps)
        warn_if_threads_throttled(opt)
        self._superoffload = opt
        self.optimizer = SuperOffloadAcceleratedOptimizer(opt)
        return self.optimizer

    def _clip_grad_norm(self, model: Any) -> torch.Tensor:
        # The optimizer clips inside step() (clip_grad_norm_ semantics on the global norm): never clip here.
        return self._deferred_norm()

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
        return grad_norm if grad_norm is not None else self._deferred_norm()

    def _deferred_norm(self) -> torch.Tensor:
        if not isinstance(self.optimizer, SuperOffloadAcceleratedOptimizer):
            raise RuntimeError("SuperOffloadTrainer.optimizer was replaced; it must stay the one create_optimizer built")
        return self.optimizer.deferred_grad_norm()

    # ---- checkpoints -------------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if self._superoffload is not None:
            self._superoffload.synchronize()  # the device weights of the last step are final
        with bounded_model_shards(self.accelerator.unwrap_model(self.model, keep_torch_compile=False)):
            super().save_model(output_dir, _internal_call=_internal_call)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self._superoffload is None:
            return
        if self._superoffload.engine.comm is not None:  # every rank writes its shard, then they meet
            save_optimizer_state(self._superoffload, output_dir, OPTIMIZER_NAME)
            self.accelerator.wait_for_everyone()
        elif self.args.should_save:
            save_optimizer_state(self._superoffload, output_dir, OPTIMIZER_NAME)
        if not self.args.should_save:
            return
        if self.lr_scheduler is not None:
            with warnings.catch_warnings(record=True) as caught:
                atomic_torch_save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
            reissue_pt_warnings(caught)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or self._superoffload is None:
            return
        remove_stale_temp_files(checkpoint)  # partial files of a save into this folder that was interrupted
        sched_file = os.path.join(checkpoint, SCHEDULER_NAME)
        opt_file, state = read_optimizer_state(self._superoffload, checkpoint, OPTIMIZER_NAME)
        if state is None:
            logger.warning("hf_superoffload: %s has no %s (saved with save_only_model?): the optimizer restarts "
                           "from the checkpoint's bf16 weights with fresh Adam state", checkpoint, OPTIMIZER_NAME)
            return
        try:
            self._superoffload.load_state_dict(state)  # copies into the existing host buffers
        except ValueError as e:
            raise ValueError(f"{opt_file}: {e}") from e
        del state
        if os.path.isfile(sched_file) and self.lr_scheduler is not None:
            with warnings.catch_warnings(record=True) as caught:
                self.lr_scheduler.load_state_dict(torch.load(sched_file, map_location="cpu", weights_only=True))
            reissue_pt_warnings(caught)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        if resume_from_checkpoint is True:
            resume_from_checkpoint = last_complete_checkpoint(self.args.output_dir, prefix=PREFIX_CHECKPOINT_DIR,
                                                              marker=TRAINER_STATE_NAME)
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:  # a run that raised never reaches on_train_end: SIGTERM must end the process again
            self._callback.preemption.restore()

    # ---- logging -----------------------------------------------------------------------------------
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and self._superoffload is not None and self._telemetry.steps:
            logs.update(self._telemetry.as_log(self._superoffload))
        super().log(logs, start_time)


def _route_prepare_model(trainer: SuperOffloadTrainer) -> None:
    """``accelerator.prepare(model, optimizer)`` runs after the optimizer exists (instance only):

    - the optimizer reduces gradients itself (several processes), so the model gets device placement and autocast
      but never a DDP wrapper (``evaluation_mode`` is accelerate's switch for exactly that);
    - weight flow: the weights live on the host between uses, so the model is not moved again (Trainer placed it
      on the device before the optimizer was built; a ``.to()`` now would read released storage).
    """
    accelerator = trainer.accelerator
    original = accelerator.prepare_model

    def prepare_model(model: Any, device_placement: bool | None = None, evaluation_mode: bool = False) -> Any:
        opt = trainer.superoffload_optimizer
        if opt is not None and opt.planned and opt.plan.weight_mode.value == "flow":
            device_placement = False
        prepared = original(model, device_placement=device_placement, evaluation_mode=True)
        if _loss_from_the_model(trainer):  # [Note: no fp32 copy of the logits] in _common.py
            training_outputs_in_model_dtype(prepared)
        return prepared

    accelerator.prepare_model = prepare_model


def _loss_from_the_model(trainer: SuperOffloadTrainer) -> bool:
    """Whether the training loss is the model's own (computed inside its forward) and nothing reads the logits:
    Trainer's ``compute_loss`` as it is, no label smoother, no ``compute_loss_func``."""
    return (type(trainer).compute_loss is Trainer.compute_loss and trainer.label_smoother is None
            and trainer.compute_loss_func is None)


class _SuperOffloadCallback(TrainerCallback):
    """Logs the plan at train start (main process only), collects per-step telemetry, turns SIGTERM into "finish
    the step, save, stop", and waits for the last step's weights at train end."""

    def __init__(self, trainer: SuperOffloadTrainer) -> None:
        self._trainer = trainer
        self.preemption = Preemption()
        self._rate_from = (0.0, 0)  # (perf_counter, tokens seen) at the last log: the bar's tokens/s window

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        """Loss, tokens/s and GPU wait on the Trainer's progress bar, refreshed at every training log."""
        if not logs or "loss" not in logs:
            return
        now, tokens = time.perf_counter(), self._trainer._tokens_seen
        (since, tokens_before), self._rate_from = self._rate_from, (now, tokens)
        bar = next((cb.training_bar for cb in self._trainer.callback_handler.callbacks
                    if isinstance(cb, ProgressCallback) and cb.training_bar is not None), None)
        if bar is not None:
            rate = (tokens - tokens_before) * args.world_size / max(now - since, 1e-9)
            bar.set_postfix_str(progress_postfix(float(logs["loss"]), rate, logs.get("superoffload/gpu_wait_s")))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.preemption.should_stop():  # every rank, every step: [Note: preemption agreement]
            control.should_save = True
            control.should_training_stop = True

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if args.keep_attention_checkpointing:  # Trainer has just enabled plain checkpointing: replace its policy
            from ..sequence_parallel import enable_checkpointing_keep_attention

            enable_checkpointing_keep_attention(self._trainer.accelerator.unwrap_model(self._trainer.model),
                                                _checkpoint_kwargs(args))
        opt = self._trainer.superoffload_optimizer
        if opt is not None and state.is_world_process_zero:
            from .. import ops

            def log_plan(plan: OffloadPlan) -> None:
                text = f"{plan.summary()}\n  CPU Adam backend: {ops.backend()}"
                # kept in trainer_state.json with the run's other logs (not sent through Trainer.log: report_to
                # integrations take scalars, and the console printer would dump the multi-line text as a repr)
                state.log_history.append({"superoffload/plan": text, "step": state.global_step})
                show_plan(text)

            if opt.planned:
                log_plan(opt.plan)
            else:  # [Note: workload from the first batch]: planned at the first training forward
                opt.plan_listeners.append(log_plan)

            def log_calibration(text: str) -> None:  # [Note: calibration from the measured peak]: once, early
                state.log_history.append({"superoffload/calibration": text, "step": state.global_step})
                show_plan(text)

            opt.calibration_listeners.append(log_calibration)
        self._trainer._telemetry.reset()
        self._rate_from = (time.perf_counter(), self._trainer._tokens_seen)
        self.preemption.install()

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        opt = self._trainer.superoffload_optimizer
        if opt is not None:
            self._trainer._telemetry.add(opt.last_step_stats)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.preemption.restore()
        if self.preemption.stopping:
            logger.warning("hf_superoffload: stopped after a SIGTERM (%s) at step %d; checkpoint-%d holds it (resume "
                           "with resume_from_checkpoint=True)", "this process" if self.preemption.requested
                           else "another rank", state.global_step, state.global_step)
        opt = self._trainer.superoffload_optimizer
        if opt is not None:
            opt.synchronize()  # train() returns with the last step's weights in place
