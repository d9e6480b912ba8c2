"""``SuperOffloadArguments``: ``TrainingArguments`` plus the offload settings, for ``SuperOffloadTrainer``.

Offload settings come from one source, :class:`~hf_superoffload.config.SuperOffloadConfig`: the
``superoffload_config`` argument takes them as a dict, a JSON string or a JSON/YAML file (the shapes
``TrainingArguments.deepspeed`` takes), and every user option of the config also gets a flat
``superoffload_<option>`` argument, *generated* from the config's fields (type, default and ``--help`` line), so it
shows up in ``HfArgumentParser``'s ``--help``, travels in the same JSON/YAML file as every other training argument
and is saved with ``training_args.bin`` and in ``to_dict()``. A ``superoffload_<option>`` that is not at its
default overrides the same key of ``superoffload_config``. The planner's expert switches
(:class:`~hf_superoffload.config.PlannerOverrides`) have no argument: they go under ``"overrides"`` in
``superoffload_config``; their old argument names are refused with that spelling.

The optimizer hyper-parameters are the usual ``TrainingArguments`` ones: ``learning_rate``, ``adam_beta1``,
``adam_beta2``, ``adam_epsilon``, ``weight_decay`` (HF's decay/no-decay groups) and ``max_grad_norm`` (clipping
happens inside the optimizer, exactly ``clip_grad_norm_``; 0 turns it off).

Combinations that cannot work are refused at construction with the fix: DeepSpeed or FSDP (they own the
optimizer and the gradient flow), fp16 (needs loss scaling; use bf16 or nothing, the weights are bf16
anyway), and an ``optim`` other than AdamW (``adamw_torch``/``adamw_torch_fused`` are accepted and both mean
SuperOffload's AdamW).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field, make_dataclass
from typing import Any, Literal, Optional

from transformers import TrainingArguments

from ..config import (
    USER_OPTIONS,
    InvalidConfigValue,
    PlannerOverrides,
    SuperOffloadConfig,
    field_alternatives,
    load_config_mapping,
    value_from_text,
)

__all__ = ["SuperOffloadArguments", "superoffload_config_from_args"]

logger = logging.getLogger("hf_superoffload")

_D = SuperOffloadConfig()
_ADAMW = ("adamw_torch", "adamw_torch_fused")
PREFIX = "superoffload_"
_EXPERT = tuple(f.name for f in dataclasses.fields(PlannerOverrides))

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


def _flag_type(name: str) -> tuple[Any, Any]:
    """The ``HfArgumentParser`` type and default of ``--superoffload_<name>``, from ``SuperOffloadConfig.<name>``:
    a plain ``bool``/``int``/``float`` or a ``Literal`` of choices keeps its type (and ``--no_`` complement for a
    true default); a field mixing kinds (``int | Literal["auto"]``) is text, parsed by the config's own parser."""
    alts = field_alternatives(SuperOffloadConfig, name)
    default = getattr(_D, name)
    if alts in ((bool,), (int,), (float,)):
        return alts[0], default
    if all(isinstance(a, str) for a in alts):
        return Literal[alts], default  # choices in --help
    if alts == (int, type(None)):
        return Optional[int], default  # noqa: UP045 -- HfArgumentParser reads typing.Optional
    return str, str(default).lower()


def _flag(name: str) -> tuple[str, Any, Any]:
    kind, default = _flag_type(name)
    meta = next(f.metadata for f in dataclasses.fields(SuperOffloadConfig) if f.name == name)
    return PREFIX + name, kind, field(default=default, metadata=_help(f"SuperOffload: {meta['help']}"))


def _removed_flag(name: str) -> tuple[str, Any, Any]:
    """A planner override's old argument: hidden from ``--help``, refused with its new spelling when set."""
    return PREFIX + name, Optional[str], field(default=None, metadata={"help": argparse.SUPPRESS})  # noqa: UP045


# The superoffload_<option> arguments, generated from SuperOffloadConfig (one per user option), plus the removed
# planner-override names so that passing one gives its new spelling instead of "argument not used".
_SuperOffloadOptionArguments = make_dataclass(
    "_SuperOffloadOptionArguments", [_flag(n) for n in USER_OPTIONS] + [_removed_flag(n) for n in _EXPERT],
    bases=(TrainingArguments,), namespace={"__module__": __name__})


@dataclass
class SuperOffloadArguments(_SuperOffloadOptionArguments):
    """``TrainingArguments`` for :class:`~hf_superoffload.integrations.transformers.SuperOffloadTrainer`.

    The offload options come from ``superoffload_config`` (dict, JSON string or JSON/YAML file) and the generated
    ``superoffload_<option>`` arguments, one per user option of :class:`~hf_superoffload.config.SuperOffloadConfig`
    (its field docstrings give the full semantics, ``--help`` the one-line form); an argument not at its default
    overrides ``superoffload_config``. :meth:`to_superoffload_config` converts them.

    Attributes:
        superoffload_config: The offload options as a dict, a JSON string or the path of a JSON/YAML file (under an
            optional top-level ``superoffload:`` key); expert planner switches go under ``"overrides"``.
        superoffload_<option>: One per ``SuperOffloadConfig`` user option (``superoffload_bucket_size_mb``,
            ``superoffload_gpu_resident_buckets``...), generated from the config's fields.
        superoffload_max_seq_len: The longest training sequence in tokens; when given, the GPU-resident share of
            the optimizer state is sized from the memory model for this batch shape (a planner ``Workload``).
        sequence_parallel_size: Ulysses sequence parallelism: ranks per sequence (1 = off).
        tiled_mlp_tokens: Run each decoder layer's MLP this many tokens at a time, forward and backward (0 = off;
            ``sequence_parallel.enable_tiled_mlp``, docs/long_context.md).
        keep_attention_checkpointing: With gradient checkpointing, keep each layer's attention output instead of
            recomputing attention in backward (``sequence_parallel.enable_checkpointing_keep_attention``): at long
            sequences attention is most of the FLOPs; costs the outputs' memory, which the planner counts.
    """

    superoffload_config: dict | str | None = field(
        default=None,
        metadata=_help("SuperOffload: the offload options as a dict, a JSON string, or the path of a JSON/YAML file "
                       "(like --deepspeed), e.g. '{\"gpu_resident_buckets\": 0}'. A --superoffload_<option> "
                       "flag that is not at its default overrides the same key."))
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
        for name in _EXPERT:
            if getattr(self, PREFIX + name) is not None:
                raise ValueError(
                    f"SuperOffloadArguments.{PREFIX}{name} was removed: it is a planner override for experts; write "
                    f"superoffload_config={{\"overrides\": {{\"{name}\": {getattr(self, PREFIX + name)!r}}}}} "
                    f"(Python: SuperOffloadConfig(overrides=PlannerOverrides({name}=...)))")
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
        """The ``superoffload_<option>`` arguments by option name, as given (text or value)."""
        return {name: getattr(self, PREFIX + name) for name in USER_OPTIONS}

    def to_dict(self) -> dict[str, Any]:
        """``TrainingArguments.to_dict`` without the removed planner-override names (always ``None``)."""
        d = super().to_dict()
        for name in _EXPERT:
            d.pop(PREFIX + name, None)
        return d


def superoffload_config_from_args(args: SuperOffloadArguments) -> SuperOffloadConfig:
    """Convert ``superoffload_config`` and the ``superoffload_<option>`` arguments of ``args`` into a validated
    :class:`SuperOffloadConfig`; an argument not at its default overrides the same key of ``superoffload_config``.

    Raises ``ValueError`` naming the argument and the fix, e.g.
    ``SuperOffloadArguments.superoffload_bucket_size_mb=-1 is invalid: use 'auto' or a positive size such as 32``.
    """
    where = f"SuperOffloadArguments.{PREFIX}config"
    values = load_config_mapping(args.superoffload_config, what=where)
    labels = {k: f"{where}[{k!r}]" for k in values}
    for name, raw in args.superoffload_fields().items():
        label = f"SuperOffloadArguments.{PREFIX}{name}"
        try:
            value = value_from_text(SuperOffloadConfig, name, raw) if isinstance(raw, str) else raw
        except InvalidConfigValue as e:
            raise ValueError(e.labelled(label)) from None
        default = getattr(_D, name)
        if value != default or isinstance(value, bool) != isinstance(default, bool):  # True == 1, yet set
            values[name], labels[name] = value, label
    try:
        return SuperOffloadConfig.from_dict(values)
    except InvalidConfigValue as e:
        label = labels.get(e.name) if e.owner == "SuperOffloadConfig" else None
        raise ValueError(e.labelled(label) if label else f"{where}: {e}") from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None


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
