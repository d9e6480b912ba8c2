"""Misuse of SuperOffloadOptimizer with Trainer and Accelerate is refused before training, naming the fix.

- our optimizer inside a plain ``transformers.Trainer(optimizers=(opt, sched))``: ``TypeError`` naming
  ``SuperOffloadTrainer`` when Trainer prepares it, before the first step (with and without accumulation);
- a plain ``accelerator.prepare(model, opt)``: ``TypeError`` naming ``prepare_superoffload`` at prepare, or at the
  first step when accelerate was told not to place the optimizer (``device_placement=False``);
- an optimizer built for another model, given to ``SuperOffloadTrainer`` or ``prepare_superoffload``: ``ValueError``.

``Trainer(args=SuperOffloadArguments(...))`` is refused too (tests/integration/test_trainer_errors.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from accelerate import Accelerator
from transformers import Trainer, TrainingArguments

from hf_superoffload import SuperOffloadConfig, SuperOffloadOptimizer
from hf_superoffload.integrations.accelerate import prepare_superoffload
from hf_superoffload.integrations.transformers import SuperOffloadArguments, SuperOffloadTrainer
from hf_superoffload.testing import tiny_llama

CFG = SuperOffloadConfig(bucket_size_mb=0.004, gpu_resident_buckets=2, worker_timeout_s=30)


@pytest.fixture
def built() -> Iterator[list[SuperOffloadOptimizer]]:
    opts: list[SuperOffloadOptimizer] = []
    yield opts
    for opt in opts:
        opt.close()


def _opt(built: list[SuperOffloadOptimizer], model: torch.nn.Module) -> SuperOffloadOptimizer:
    opt = SuperOffloadOptimizer(model, lr=1e-3, config=CFG, log_plan=False)
    built.append(opt)
    return opt


def _untouched(model: torch.nn.Module, opt: SuperOffloadOptimizer, weights: dict[str, torch.Tensor]) -> None:
    assert opt.engine.param_steps == [0] * len(opt.engine.params), "a step was taken"
    for n, p in model.named_parameters():
        assert torch.equal(p, weights[n]), f"{n} changed"


@pytest.mark.parametrize("accumulation", [1, 2])
def test_our_optimizer_in_a_plain_trainer_is_refused_naming_superoffload_trainer(
        hf: Any, tmp_path: Any, built: list[SuperOffloadOptimizer], fresh_accelerate_state: None,
        accumulation: int) -> None:
    model = tiny_llama(seed=0)
    opt = _opt(built, model)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = TrainingArguments(**hf.train_kwargs(tmp_path, max_steps=2, gradient_accumulation_steps=accumulation))
    trainer = Trainer(model=model, args=args, train_dataset=hf.TokenDataset(8), optimizers=(opt, None))
    with pytest.raises(TypeError, match=r"plain transformers\.Trainer .*use hf_superoffload\.SuperOffloadTrainer "
                                        r"with SuperOffloadArguments"):
        trainer.train()
    _untouched(model, opt, weights)


def test_plain_accelerate_prepare_is_refused_naming_prepare_superoffload(
        built: list[SuperOffloadOptimizer], fresh_accelerate_state: None) -> None:
    model = tiny_llama(seed=0)
    opt = _opt(built, model)
    accelerator = Accelerator(cpu=True)
    with pytest.raises(TypeError, match=r"accelerator\.prepare\(\.\.\.\) cannot wrap a SuperOffloadOptimizer.*"
                                        r"hf_superoffload\.prepare_superoffload\(accelerator, model, optimizer\)"):
        accelerator.prepare(model, opt)


def test_plain_accelerate_prepare_without_device_placement_is_refused_at_the_first_step(
        built: list[SuperOffloadOptimizer], fresh_accelerate_state: None) -> None:
    model = tiny_llama(seed=0)
    opt = _opt(built, model)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    accelerator = Accelerator(cpu=True, device_placement=False)
    model, wrapped = accelerator.prepare(model, opt)  # accelerate does not read the optimizer here
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    accelerator.backward(model(input_ids=ids, labels=ids).loss)
    with pytest.raises(TypeError, match=r"use model, optimizer = hf_superoffload\.prepare_superoffload"):
        wrapped.step()
    wrapped.zero_grad()
    _untouched(model, opt, weights)


def test_prepare_superoffload_with_a_built_optimizer_still_works(built: list[SuperOffloadOptimizer],
                                                                 fresh_accelerate_state: None) -> None:
    model = tiny_llama(seed=0)
    opt = _opt(built, model)
    accelerator = Accelerator(cpu=True)
    model, wrapped = prepare_superoffload(accelerator, model, opt)
    model, wrapped = accelerator.prepare(model, wrapped)  # an already prepared wrapper passes through untouched
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    accelerator.backward(model(input_ids=ids, labels=ids).loss)
    wrapped.step()
    wrapped.zero_grad()
    assert opt.engine.param_steps == [1] * len(opt.engine.params)
    assert "state" in accelerator._optimizers[0].state_dict()


def test_an_optimizer_of_another_model_is_refused_by_prepare_superoffload(built: list[SuperOffloadOptimizer],
                                                                           fresh_accelerate_state: None) -> None:
    other = _opt(built, tiny_llama(seed=1))
    with pytest.raises(ValueError, match=r"prepare_superoffload: the SuperOffloadOptimizer was built for another model "
                                         r"\(\d+ of its \d+ parameters are not parameters of the model given here\)"):
        prepare_superoffload(Accelerator(cpu=True), tiny_llama(seed=0), other)


def test_an_optimizer_of_another_model_is_refused_by_superoffload_trainer(tmp_path: Any,
                                                                          built: list[SuperOffloadOptimizer]) -> None:
    other = _opt(built, tiny_llama(seed=1))
    args = SuperOffloadArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    with pytest.raises(ValueError, match=r"SuperOffloadTrainer\(optimizers=\(\.\.\.\)\): the SuperOffloadOptimizer was "
                                         r"built for another model"):
        SuperOffloadTrainer(model=tiny_llama(seed=0), args=args, optimizers=(other, None))


def test_accumulating_without_no_sync_names_the_adapters_that_handle_it() -> None:
    """A second backward before ``step()`` outside ``no_sync()`` (what a plain Trainer or ``accelerator.prepare``
    does with accumulation) is refused in one line that names the adapters doing it right."""
    model = tiny_llama()
    opt = SuperOffloadOptimizer(model, lr=1e-3, config=SuperOffloadConfig(gpu_resident_buckets=0), log_plan=False)
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    with pytest.raises(RuntimeError, match=r"no_sync.*SuperOffloadTrainer and prepare_superoffload"):
        model(input_ids=ids, labels=ids).loss.backward()
    opt.close()
