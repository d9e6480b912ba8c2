"""TRL: ``SuperOffloadSFTTrainer`` and ``SuperOffloadSFTConfig``, TRL's ``SFTTrainer`` through
:class:`~hf_superoffload.SuperOffloadOptimizer`.

Usage::

    from hf_superoffload.integrations.trl import SuperOffloadSFTConfig, SuperOffloadSFTTrainer

    args = SuperOffloadSFTConfig(output_dir="out", learning_rate=2e-5, max_grad_norm=1.0, max_length=1024)
    trainer = SuperOffloadSFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok)
    trainer.train()

Both classes are compositions, nothing more:

- ``SuperOffloadSFTConfig`` is ``SFTConfig`` plus the ``superoffload_*`` fields of
  :class:`~.arguments.SuperOffloadArguments` (with their checks), so one config object holds the SFT settings
  (``max_length``, ``packing``, ``completion_only_loss``, ...) and the offload settings, and ``HfArgumentParser``
  and TRL's CLI parse both. SFTConfig's defaults stay TRL's (``gradient_checkpointing=True``, ``bf16`` on when
  ``fp16`` is off, ``learning_rate=2e-5``).
- ``SuperOffloadSFTTrainer`` is ``SuperOffloadTrainer`` placed in front of ``SFTTrainer`` in the MRO: SFTTrainer
  prepares the dataset, the collator, the PEFT adapter and the loss; SuperOffloadTrainer builds the optimizer,
  never clips in Trainer, forwards skipped steps to the scheduler, checkpoints the host optimizer state and logs
  the offload telemetry and the plan (everything its module docstring lists). It takes exactly SFTTrainer's
  arguments; ``optimizers`` / ``optimizer_cls_and_kwargs`` are refused as in ``SuperOffloadTrainer``.
  One addition: SFTTrainer's loss projects hidden states through ``lm_head.weight`` in tiles without calling
  ``lm_head`` (its fused LM head), so ``compute_loss`` runs inside ``module_weights(lm_head)``, which waits for
  that weight's update as the module's forward would ([Note: unhooked reads]).

Why a config class of its own: SFTTrainer converts any ``TrainingArguments`` that is not an ``SFTConfig``
(``SuperOffloadArguments`` included) into a fresh ``SFTConfig``, dropping the offload fields. So
``SuperOffloadSFTTrainer`` refuses anything but ``SuperOffloadSFTConfig``, and a plain ``SFTTrainer`` given
``SuperOffloadSFTConfig`` is refused like a plain ``Trainer`` given ``SuperOffloadArguments`` (it would build
torch AdamW).

Importing this module imports ``trl`` (``pip install hf_superoffload[trl]``).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

from trl import SFTConfig, SFTTrainer

from ..runtime.engine import module_weights
from .arguments import SuperOffloadArguments
from .transformers import SuperOffloadTrainer

__all__ = ["SuperOffloadSFTConfig", "SuperOffloadSFTTrainer"]


# SFTConfig first: a dataclass takes each field's default from the last base (in reverse MRO) that declares it, and
# SuperOffloadArguments re-declares every TrainingArguments field with Trainer's defaults, which would silently
# replace TRL's (learning_rate, logging_steps, gradient_checkpointing, bf16).
@dataclass
class SuperOffloadSFTConfig(SFTConfig, SuperOffloadArguments):
    """``SFTConfig`` with the ``superoffload_*`` fields of :class:`SuperOffloadArguments` (see the module
    docstring). ``__post_init__`` runs the checks of all three (TRL's ``bf16`` default is resolved before the
    offload checks see it)."""


class SuperOffloadSFTTrainer(SuperOffloadTrainer, SFTTrainer):
    """TRL's ``SFTTrainer`` whose optimizer is :class:`~hf_superoffload.SuperOffloadOptimizer`.

    ``args`` must be :class:`SuperOffloadSFTConfig` (``None`` gives its defaults with ``output_dir`` derived from
    the model name, as SFTTrainer does).
    """

    def __init__(self, model: Any, args: SuperOffloadSFTConfig | None = None, *rest: Any, **kwargs: Any) -> None:
        if args is None:
            name = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", "")
            args = SuperOffloadSFTConfig(output_dir=f"{(name or 'model').rstrip('/').split('/')[-1]}-SFT")
        if not isinstance(args, SuperOffloadSFTConfig):
            raise TypeError(
                f"SuperOffloadSFTTrainer needs SuperOffloadSFTConfig, got {type(args).__name__} (SFTTrainer would "
                "replace it with a plain SFTConfig and lose the offload settings). Build it with the same keywords: "
                "SuperOffloadSFTConfig(output_dir=..., max_length=..., ...)."
            )
        super().__init__(model, args, *rest, **kwargs)

    def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        head = self.accelerator.unwrap_model(model).get_output_embeddings()
        with module_weights(head) if head is not None else nullcontext():
            return super().compute_loss(model, inputs, *args, **kwargs)
