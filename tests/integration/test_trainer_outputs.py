"""[Note: no fp32 copy of the logits] in ``integrations/transformers.py``: with ``bf16=True`` the Trainer's
training forward returns the model's bf16 logits (no 4 B/logit copy beside them) where the loss is the model's own;
evaluation, and a Trainer that reads the logits, keep accelerate's fp32 outputs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hf_superoffload.integrations.transformers import SuperOffloadArguments, SuperOffloadTrainer
from hf_superoffload.testing import tiny_llama


def _logit_dtypes(hf: Any, tmp_path: Path, **args: Any) -> dict[str, set[torch.dtype]]:
    model = tiny_llama(seed=0)
    seen: dict[str, set[torch.dtype]] = {"train": set(), "eval": set()}
    model.register_forward_hook(
        lambda m, _a, out: seen["train" if m.training and torch.is_grad_enabled() else "eval"].add(out.logits.dtype))
    kw = hf.train_kwargs(tmp_path, max_steps=2, bf16=True, eval_strategy="no", **hf.SMALL_BUCKETS)
    kw.update(args)
    trainer = SuperOffloadTrainer(model=model, args=SuperOffloadArguments(**kw),
                                  train_dataset=hf.TokenDataset(8, seq=16), eval_dataset=hf.TokenDataset(4, seq=16))
    trainer.train()
    assert trainer.accelerator.native_amp, "the test needs accelerate's bf16 autocast (and its fp32 outputs) on"
    trainer.evaluate()
    return seen


def test_the_training_forward_keeps_the_bf16_logits(hf: Any, tmp_path: Path) -> None:
    seen = _logit_dtypes(hf, tmp_path)
    assert seen == {"train": {torch.bfloat16}, "eval": {torch.float32}}


@pytest.mark.parametrize("args", [{"label_smoothing_factor": 0.1}], ids=["label_smoother"])
def test_a_trainer_that_reads_the_logits_gets_them_in_fp32(hf: Any, tmp_path: Path, args: dict[str, Any]) -> None:
    seen = _logit_dtypes(hf, tmp_path, **args)
    assert seen == {"train": {torch.float32}, "eval": {torch.float32}}


def test_a_custom_loop_given_labels_gets_bf16_logits_in_training_only(fresh_accelerate_state: None) -> None:
    """``prepare_superoffload``: a training forward given labels computes its loss inside (fp32) and returns the bf16
    logits; one without labels (the loop computes its own loss from them) and evaluation keep accelerate's fp32."""
    from accelerate import Accelerator

    from hf_superoffload import prepare_superoffload

    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    model, optimizer = prepare_superoffload(accelerator, tiny_llama(seed=0), dict(lr=1e-3, max_grad_norm=1.0))
    assert accelerator.native_amp, "the test needs accelerate's bf16 autocast (and its fp32 outputs) on"
    ids = torch.randint(0, 128, (2, 16))
    out = model(input_ids=ids, labels=ids)
    assert out.logits.dtype == torch.bfloat16 and out.loss.dtype == torch.float32
    accelerator.backward(out.loss)
    optimizer.step()
    optimizer.zero_grad()
    assert model(input_ids=ids).logits.dtype == torch.float32
    model.eval()
    with torch.no_grad():
        assert model(input_ids=ids, labels=ids).logits.dtype == torch.float32
    accelerator.unwrap_model(model, keep_fp32_wrapper=False)  # accelerate still finds its original forward
    optimizer.optimizer.close()
