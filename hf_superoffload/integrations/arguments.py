"""``SuperOffloadArguments``: ``TrainingArguments`` plus the offload settings, for ``SuperOffloadTrainer``.

Offload settings are ordinary, flat ``superoffload_*`` fields, one per
:class:`~hf_superoffload.config.SuperOffloadConfig` field (``superoffload_bucket_size_mb`` ->
``bucket_size_mb``...). That is the clearest shape for HF users: they show up in ``--help`` of
``HfArgumentParser``, they travel in the same JSON/YAML file as every other training argument
(``parser.parse_yaml_file``/``parse_json_file``), they are saved with ``training_args.bin`` and in
``to_dict()``/W&B/TensorBoard hparams, and they need no nested parsing. Defaults are ``SuperOffloadConfig``'s.

The optimizer hyper-parameters are the usual ``TrainingArguments`` ones: ``learning_rate``, ``adam_beta1``,
``adam_beta2``, ``adam_epsilon``, ``weight_decay`` (HF's decay/no-decay groups) and ``max_grad_norm`` (clipping
happens inside the optimizer, exactly ``clip_grad_norm_``; 0 turns it off).

Combinations that cannot work are refused at construction with the fix: DeepSpeed or FSDP (they own the
optimizer and the gradient flow), fp16 (needs loss scaling; use bf16 or nothing, the weights are bf16
anyway), and an ``optim`` other than AdamW (``adamw_torch``/``adamw_torch_fused`` are accepted and both mean
SuperOffload's AdamW).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, get_args

from transformers import TrainingArguments

from ..config import (
    TRI_STATE_FIELDS,
    AccumulationDtype,
    CastSide,
    Rollback,
    SuperOffloadConfig,
    WeightPlacement,
    tri_state_from_text,
)

__all__ = ["SuperOffloadArguments", "superoffload_config_from_args"]

logger = logging.getLogger("hf_superoffload")

_D = SuperOffloadConfig()
_ADAMW = ("adamw_torch", "adamw_torch_fused")
PREFIX = "superoffload_"
# superoffload_ arguments that describe the run (the planner's workload), not a SuperOffloadConfig field
_RUN_SHAPE_FIELDS = frozenset({"superoffload_max_seq_len"})
# SuperOffloadConfig fields that take True, False or "auto" (strings on the command line)
_AUTO_OR_INT_FIELDS = ("gpu_resident_buckets", "d2h_lead_buckets")

# True while SuperOffloadTrainer.__init__ runs Trainer.__init__: a plain Trainer given these args is refused.
_IN_SUPEROFFLOAD_TRAINER: ContextVar[bool] = ContextVar("hf_superoffload_in_trainer", default=False)


@contextmanager
def building_superoffload_trainer() -> Iterator[None]:
    """While active, ``SuperOffloadArguments.place_model_on_device`` lets ``Trainer.__init__`` through."""
    token = _IN_SUPEROFFLOAD_TRAINER.set(True)
    try:
        yield
    finally:
        _IN_SUPEROFFLOAD_TRAINER.reset(token)


def _help(text: str) -> dict[str, str]:
    return {"help": text.replace("%", "%%")}


def _has_accelerator() -> bool:
    import torch

    return torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())


@dataclass
class SuperOffloadArguments(TrainingArguments):
    """``TrainingArguments`` for :class:`~hf_superoffload.integrations.transformers.SuperOffloadTrainer`.

    Every ``superoffload_<name>`` field maps to ``SuperOffloadConfig.<name>`` (see
    ``hf_superoffload/config.py`` for the full semantics); :meth:`to_superoffload_config` converts them.

    Attributes:
        superoffload_bucket_size_mb: Gradient MB per bucket (unit of device->host copy, CPU Adam work and
            host->device copy).
        superoffload_gpu_resident_buckets: ``"auto"`` or an integer: how many of the last-arriving buckets (the
            first layers) keep their optimizer state on the GPU.
        superoffload_gpu_resident_fraction: With ``"auto"`` and unknown free device memory (CPU runs): fraction
            of trainable parameters kept in the device tail.
        superoffload_device_memory_fraction: With ``"auto"`` on a GPU: share of free device memory the tail may
            fill.
        superoffload_speculation: Start CPU Adam per bucket before the global gradient norm is known, then
            validate (commit, redo with the clip coefficient, or skip).
        superoffload_rollback: How a speculative step is undone (``SuperOffloadConfig.rollback``): ``"auto"``,
            the bit-exact double copy (+12 B/param host RAM) or ``"inverse"`` (no extra memory, fp32 rounding).
        superoffload_nonspeculative_in_place: With the double copy, steps that speculate nothing update the
            committed copy in place (faster; a failed deferred commit then marks the state inconsistent).
        superoffload_max_redo_rate: Speculation pauses while more than this share of recent steps needed a redo.
        superoffload_redo_window: Window, in optimizer steps, for ``superoffload_max_redo_rate``.
        superoffload_cast_side: Where fp32<->bf16 casts happen: ``"auto"``, ``"cpu"`` or ``"gpu"``.
        superoffload_weight_placement: ``"auto"``, ``"stationary"`` (bf16 weights stay on the GPU) or ``"flow"``.
        superoffload_cpu_threads: CPU Adam threads; ``None``: the affinity mask's cores minus one (independent
            of ``OMP_NUM_THREADS``, which ``accelerate launch`` sets to 1).
        superoffload_pin_memory: Page-lock the host buffers that DMA touches.
        superoffload_worker_timeout_s: Longest wait for one bucket before an error that names it.
        superoffload_check_finite: Skip the whole step (bit-exact) on any non-finite gradient.
        superoffload_max_consecutive_skips: After this many consecutive skipped (non-finite) steps the optimizer
            raises, naming the last gradient norms (0: never).
        superoffload_accumulate_on_host: ``"auto"``, ``True``/``"true"`` or ``False``/``"false"``: with
            gradient_accumulation_steps > 1, sum the micro-batches' gradients on the host (every micro-batch is
            offloaded) instead of in ``param.grad`` on the device. ``"auto"``: on in weight-flow mode.
        superoffload_host_accumulation_dtype: ``"auto"``, ``"fp32"`` (separate fp32 sum, +4 B/param host RAM) or
            ``"landing"`` (sum in the landing buffer, bf16 with CPU casts).
        superoffload_defer_moments: ``"auto"``, ``"true"`` or ``"false"``: a CPU pass whose verdict is known stores
            the Adam moments later, off the critical path (+2 B/param pinned). ``"auto"``: the planner decides.
        superoffload_max_seq_len: The longest training sequence in tokens; when given, the GPU-resident share of
            the optimizer state is sized from the memory model for this batch shape (a planner ``Workload``).
        sequence_parallel_size: Ulysses sequence parallelism: ranks per sequence (1 = off).
        tiled_mlp_tokens: Run each decoder layer's MLP this many tokens at a time, forward and backward (0 = off;
            ``sequence_parallel.enable_tiled_mlp``, docs/long_context.md).
        keep_attention_checkpointing: With gradient checkpointing, keep each layer's attention output instead of
            recomputing attention in backward (``sequence_parallel.enable_checkpointing_keep_attention``): at long
            sequences attention is most of the FLOPs; costs the outputs' memory, which the planner counts.
    """

    superoffload_bucket_size_mb: float = field(
        default=_D.bucket_size_mb,
        metadata=_help("SuperOffload: gradient MB per bucket, the unit of device->host copy, CPU Adam work and "
                       "host->device copy."))
    superoffload_gpu_resident_buckets: str = field(
        default=str(_D.gpu_resident_buckets),
        metadata=_help("SuperOffload: 'auto' or an integer >= 0: how many of the last buckets to arrive in "
                       "backward (the first layers) keep fp32 master and Adam state on the GPU."))
    superoffload_gpu_resident_fraction: float = field(
        default=_D.gpu_resident_fraction,
        metadata=_help("SuperOffload: with gpu_resident_buckets='auto' when free device memory is unknown (CPU "
                       "runs): fraction of trainable parameters kept on the device."))
    superoffload_device_memory_fraction: float = field(
        default=_D.device_memory_fraction,
        metadata=_help("SuperOffload: with gpu_resident_buckets='auto' on a GPU: share of the free device memory "
                       "the GPU-resident tail may fill (16 B/param)."))
    superoffload_speculation: bool = field(
        default=_D.speculation,
        metadata=_help("SuperOffload: start each bucket's CPU Adam before the global gradient norm is known and "
                       "validate afterwards (speculation-then-validation)."))
    superoffload_rollback: Rollback = field(
        default=_D.rollback,
        metadata=_help(f"SuperOffload: how a speculative step is undone, one of {list(get_args(Rollback))}: the "
                       "bit-exact kind costs +12 B/param host RAM, 'inverse' none (fp32 rounding); 'auto' takes the "
                       "bit-exact one when host RAM allows."))
    superoffload_nonspeculative_in_place: bool = field(
        default=_D.nonspeculative_in_place,
        metadata=_help("SuperOffload: with the bit-exact double copy, a step that speculates nothing (speculation "
                       "off or paused) updates the committed copy in place, moving less host memory; false writes "
                       "the other copy every step; see [Note: speculation and rollback]."))
    superoffload_max_redo_rate: float = field(
        default=_D.max_redo_rate,
        metadata=_help("SuperOffload: pause speculation while more than this fraction of the last "
                       "superoffload_redo_window steps needed a clip-and-redo."))
    superoffload_redo_window: int = field(
        default=_D.redo_window,
        metadata=_help("SuperOffload: window, in optimizer steps, for superoffload_max_redo_rate."))
    superoffload_cast_side: CastSide = field(
        default=_D.cast_side,
        metadata=_help("SuperOffload: where the fp32 master becomes bf16 weights (gradients cross in bf16 either "
                       "way): 'cpu' (fused into the CPU Adam, bf16 weights over the link, right for PCIe), 'gpu' "
                       "(the fp32 master over the link, no host staging arena, right for chip-to-chip links or short "
                       "host RAM) or 'auto'."))
    superoffload_weight_placement: WeightPlacement = field(
        default=_D.weight_placement,
        metadata=_help("SuperOffload: 'stationary' keeps bf16 weights on the GPU, 'flow' streams them per layer, "
                       "'auto' decides from the memory budget."))
    superoffload_cpu_threads: int | None = field(
        default=_D.cpu_threads,
        metadata=_help("SuperOffload: CPU Adam threads (default: the cores of this process's affinity mask minus "
                       "one, independent of OMP_NUM_THREADS)."))
    superoffload_pin_memory: bool = field(
        default=_D.pin_memory,
        metadata=_help("SuperOffload: page-lock the host buffers that DMA touches (exact size)."))
    superoffload_worker_timeout_s: float = field(
        default=_D.worker_timeout_s,
        metadata=_help("SuperOffload: longest wait, in seconds, for one bucket before raising an error that "
                       "names it."))
    superoffload_check_finite: bool = field(
        default=_D.check_finite,
        metadata=_help("SuperOffload: skip the whole step, bit-exactly, when any gradient is non-finite (the LR "
                       "schedule does not advance either)."))
    superoffload_max_consecutive_skips: int = field(
        default=_D.max_consecutive_skips,
        metadata=_help("SuperOffload: after this many consecutive skipped (non-finite) steps, stop with an error "
                       "naming the last gradient norms instead of training nothing (0: never)."))
    superoffload_accumulate_on_host: str = field(
        default=str(_D.accumulate_on_host),
        metadata=_help("SuperOffload: 'auto', 'true' or 'false': sum gradient-accumulation micro-batches on the host "
                       "(each micro-batch's gradients are offloaded) instead of on the device; 'auto': on in "
                       "weight-flow mode."))
    superoffload_host_accumulation_dtype: AccumulationDtype = field(
        default=_D.host_accumulation_dtype,
        metadata=_help("SuperOffload: with host accumulation, 'fp32' (a separate fp32 sum, +4 B/param host RAM), "
                       "'landing' (the sum lives in the bf16 landing buffer) or 'auto' (fp32 when host RAM allows)."))
    superoffload_defer_moments: str = field(
        default=str(_D.defer_moments),
        metadata=_help("SuperOffload: 'auto', 'true' or 'false': a CPU Adam pass whose verdict is already known (no "
                       "speculation, clipping certain, a redo) writes p and the bf16 weights only and stores the Adam "
                       "moments later, off the critical path (+2 B/param pinned host RAM); 'auto': the planner "
                       "decides."))
    superoffload_defer_master: str = field(
        default=str(_D.defer_master),
        metadata=_help("SuperOffload: 'auto', 'true' or 'false': with deferred moment stores and the CPU cast, a "
                       "verdict-known CPU pass writes the bf16 weights only and the fp32 master is stored later too; "
                       "'auto': for as many host buckets as the engine measures the later stores to fit; a fraction "
                       "such as '0.4': the host buckets holding that share of the host parameters."))
    superoffload_d2h_lead_buckets: str = field(
        default=str(_D.d2h_lead_buckets),
        metadata=_help("SuperOffload: how many host buckets' gradient copies the backward may run ahead of (0: each "
                       "bucket's hook waits for its own copy; 'auto': 4 when the host holds most of the optimizer "
                       "state, else 0); see [Note: D2H lead] in docs/design.md."))
    superoffload_upload_thread: bool = field(
        default=_D.upload_thread,
        metadata=_help("SuperOffload: issue the host buckets' weight uploads from a thread of their own so the CPU "
                       "Adam worker never waits on them (CUDA, one process); see [Note: upload thread]."))
    superoffload_d2h_gate: bool = field(
        default=_D.d2h_gate,
        metadata=_help("SuperOffload: with a D2H lead, queue a host bucket's CPU Adam only once its gradient copy "
                       "has landed, so the worker commits deferred state meanwhile (one process); see [Note: D2H "
                       "gate]."))
    superoffload_max_seq_len: int | None = field(
        default=None,
        metadata=_help("SuperOffload: the longest sequence (tokens) a training batch holds. When given, the planner "
                       "sizes the GPU-resident optimizer state with the memory model for per_device_train_batch_size "
                       "x this length (all the memory the activations leave; everything when it all fits) instead of "
                       "a fixed share of free GPU memory. Longer batches than declared may run out of memory."))
    # ---- sequence parallelism (issue #11; hf_superoffload/sequence_parallel, integrations/_sequence_parallel.py)
    sequence_parallel_size: int = field(
        default=1,
        metadata=_help("Ulysses sequence parallelism: how many ranks share each sequence (1 = off). Must divide "
                       "the number of processes and the model's attention heads; see docs/sequence_parallel.md."))
    tiled_mlp_tokens: int = field(
        default=0,
        metadata=_help("Run every decoder layer's MLP this many tokens at a time, forward and backward (0 = off): "
                       "bounds the MLP's activation memory to one tile for one more MLP forward per layer; for "
                       "very long sequences, see docs/long_context.md."))

    keep_attention_checkpointing: bool = field(
        default=False,
        metadata=_help("With gradient checkpointing: keep every layer's attention output instead of recomputing "
                       "attention in backward (long sequences: attention is most of the FLOPs). Costs the outputs' "
                       "memory; see docs/sequence_parallel.md."))

    def __post_init__(self) -> None:
        if self.keep_attention_checkpointing and not (vars(self).get("activation_checkpointing")
                                                      or vars(self).get("gradient_checkpointing")):
            raise ValueError("SuperOffloadArguments.keep_attention_checkpointing=True is a form of gradient "
                             "checkpointing: set gradient_checkpointing=True too (or drop keep_attention_checkpointing)")
        if self.keep_attention_checkpointing:
            from ..sequence_parallel.checkpointing import check_checkpoint_kwargs

            ck = _checkpoint_kwargs(self)
            if isinstance(ck, dict):  # (a JSON string is parsed by TrainingArguments; checked again at train start)
                check_checkpoint_kwargs(ck)
        if isinstance(self.sequence_parallel_size, bool) or not isinstance(self.sequence_parallel_size, int) \
                or self.sequence_parallel_size < 1:
            raise ValueError(f"SuperOffloadArguments.sequence_parallel_size={self.sequence_parallel_size!r} is "
                             "invalid: use an integer >= 1 (1 turns sequence parallelism off)")
        t = self.tiled_mlp_tokens
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ValueError(f"SuperOffloadArguments.tiled_mlp_tokens={t!r} is invalid: use the tokens per MLP tile "
                             "(e.g. 8192), or 0 to leave the MLP untiled")
        m = self.superoffload_max_seq_len
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise ValueError(f"SuperOffloadArguments.superoffload_max_seq_len={m!r} is invalid: use the longest "
                             "training sequence in tokens (e.g. 4096), or None to size the GPU tail without it")
        _refuse_incompatible(self)
        if self.bf16 and not self.use_cpu and not _has_accelerator():
            # bf16 weights are what SuperOffload trains; on a machine without a GPU the run is a CPU run (Trainer
            # would refuse bf16 there without use_cpu), so the README's GPU snippet runs as written
            logger.info("hf_superoffload: no GPU found: training on the CPU (use_cpu=True)")
            self.use_cpu = True
        super().__post_init__()
        if self.mixed_precision == "fp16":  # from ACCELERATE_MIXED_PRECISION (accelerate launch/config)
            raise ValueError(
                "SuperOffloadArguments: mixed precision is fp16 (ACCELERATE_MIXED_PRECISION=fp16, e.g. from an "
                "accelerate config). SuperOffload trains bf16 weights without loss scaling: use "
                "mixed_precision bf16 or no in the accelerate config, or pass bf16=True."
            )
        self.superoffload_gpu_resident_buckets = str(self.superoffload_gpu_resident_buckets)
        for name in TRI_STATE_FIELDS:
            setattr(self, PREFIX + name, str(getattr(self, PREFIX + name)).lower())
        self.to_superoffload_config()  # validate now, not at the first train() call

    # ------------------------------------------------------------------------------------------------
    @property
    def place_model_on_device(self) -> bool | None:
        """Trainer's documented override point, read once in ``Trainer.__init__``: here it refuses any Trainer
        that is not a ``SuperOffloadTrainer`` (a plain Trainer would silently build torch AdamW)."""
        if not _IN_SUPEROFFLOAD_TRAINER.get():
            raise TypeError(
                "SuperOffloadArguments were given to a Trainer that is not a SuperOffloadTrainer. A plain Trainer "
                "would build torch AdamW (optim= cannot name SuperOffload), clip gradients that were already "
                "offloaded, move the optimizer state to the GPU and report grad_norm 0. Use\n"
                "    from hf_superoffload.integrations.transformers import SuperOffloadTrainer\n"
                "    trainer = SuperOffloadTrainer(model=model, args=args, ...)\n"
                "(same arguments as Trainer)."
            )
        return None

    @property
    def n_gpu(self) -> int:
        """At most 1: SuperOffload trains on one GPU per process, never through ``nn.DataParallel``."""
        n = super().n_gpu
        if n > 1:
            if not getattr(self, "_superoffload_warned_n_gpu", False):
                self._superoffload_warned_n_gpu = True
                logger.warning("hf_superoffload: %d GPUs are visible to one process; training uses one (no "
                               "DataParallel). Set CUDA_VISIBLE_DEVICES to choose it.", n)
            return 1
        return n

    def to_superoffload_config(self) -> SuperOffloadConfig:
        """The :class:`SuperOffloadConfig` these arguments describe (``ValueError`` with the fix if invalid)."""
        return superoffload_config_from_args(self)

    def superoffload_fields(self) -> dict[str, Any]:
        """The ``superoffload_*`` fields as ``SuperOffloadConfig`` keyword arguments (JSON-friendly)."""
        return {f.name[len(PREFIX):]: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name.startswith(PREFIX) and f.name not in _RUN_SHAPE_FIELDS}


def superoffload_config_from_args(args: SuperOffloadArguments) -> SuperOffloadConfig:
    """Convert the ``superoffload_*`` fields of ``args`` into a validated :class:`SuperOffloadConfig`.

    Raises ``ValueError`` naming the argument and the fix, e.g.
    ``SuperOffloadArguments.superoffload_bucket_size_mb=-1 is invalid: use a positive size such as 32``.
    """
    kw = args.superoffload_fields()
    for name in _AUTO_OR_INT_FIELDS:  # 'auto' / '3' / 3 -> "auto" / 3 / 3
        value = kw[name]
        if isinstance(value, str):
            value = value.strip().lower()
            try:
                value = value if value == "auto" else int(value)
            except ValueError:
                raise ValueError(f"SuperOffloadArguments.{PREFIX}{name}={kw[name]!r} is invalid: use 'auto' or an "
                                 "integer >= 0") from None
        kw[name] = value
    for name in TRI_STATE_FIELDS:  # 'auto' / 'true' / 'false' (defer_master: also '0.5') -> "auto" / True / 0.5
        try:
            kw[name] = tri_state_from_text(name, str(kw[name]))
        except ValueError as e:
            raise ValueError(f"SuperOffloadArguments.{PREFIX}{name}={kw[name]!r} is invalid: {e}") from None
    try:
        return SuperOffloadConfig(**kw)
    except ValueError as e:
        raise ValueError(str(e).replace("SuperOffloadConfig.", f"SuperOffloadArguments.{PREFIX}")) from None


def _checkpoint_kwargs(args: Any) -> Any:
    """The user's checkpointing options (``activation_checkpointing_kwargs``, or the older name)."""
    return vars(args).get("activation_checkpointing_kwargs") or vars(args).get("gradient_checkpointing_kwargs")


def _refuse_incompatible(args: SuperOffloadArguments) -> None:
    """Refuse, with the fix, combinations SuperOffload cannot honour (raw values, before HF normalises them)."""
    if args.deepspeed:
        raise ValueError(
            "SuperOffloadArguments: deepspeed is set. DeepSpeed and SuperOffload both own the optimizer and the "
            "gradient flow, so they cannot be combined. Remove --deepspeed (SuperOffload already keeps the fp32 "
            "master weights and Adam state on the host), or use plain TrainingArguments for a DeepSpeed run."
        )
    if args.fsdp not in (None, False, "", []):
        raise ValueError(
            f"SuperOffloadArguments: fsdp={args.fsdp!r} is set. FSDP shards parameters and gradients itself, "
            "which conflicts with SuperOffload's gradient hooks. Remove --fsdp/--fsdp_config: SuperOffload "
            "trains on one GPU per process."
        )
    if args.fp16 or args.fp16_full_eval:
        raise ValueError(
            "SuperOffloadArguments: fp16 is not supported: fp16 training needs loss scaling, and scaled "
            "gradients would reach the speculative CPU step. Use bf16=True (or leave mixed precision off: the "
            "trainable weights are bf16 with fp32 masters on the host either way)."
        )
    optim = getattr(args.optim, "value", args.optim)
    if str(optim) not in _ADAMW:
        raise ValueError(
            f"SuperOffloadArguments: optim={optim!r} cannot be used: SuperOffloadTrainer always trains with "
            "SuperOffloadOptimizer (AdamW with fp32 masters and Adam state on the host, hyper-parameters from "
            "learning_rate, adam_beta1/2, adam_epsilon, weight_decay, max_grad_norm). Remove --optim (or use "
            "adamw_torch)."
        )
    if args.optim_args:
        raise ValueError("SuperOffloadArguments: optim_args is not read by SuperOffloadOptimizer; remove it and use "
                         "adam_beta1, adam_beta2, adam_epsilon and weight_decay.")
