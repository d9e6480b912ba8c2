"""N consecutive skipped (non-finite) steps raise instead of training nothing while looking alive.

Promises (docs/reliability.md): after ``SuperOffloadConfig.max_consecutive_skips`` skipped steps in a row,
``step()`` raises a ``RuntimeError`` naming the count, the last gradient norms and what to check; the skipped steps
have left the optimizer state exactly as it was; a finite step in between restarts the count; 0 never raises; the
Trainer and Accelerate settings carry the field.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from hf_superoffload import SuperOffloadConfig
from hf_superoffload.testing import tiny_llama


def _bad_step(model: torch.nn.Module, opt: Any, ids: torch.Tensor) -> None:
    (model(input_ids=ids, labels=ids).loss * float("nan")).backward()
    opt.step()
    opt.zero_grad()


def test_consecutive_skips_raise_naming_count_norms_and_fix_and_leave_the_state(rel: Any) -> None:
    model = tiny_llama()
    opt = rel.optimizer(model, max_grad_norm=1.0, config=rel.CFG.replace(max_consecutive_skips=3))
    rel.train(model, opt, rel.batches(2))
    good_norm = opt.last_grad_norm
    before = rel.snapshot(model, opt)
    ids = rel.batches(1, seed=7)[0]
    for _ in range(2):
        _bad_step(model, opt, ids)
    with pytest.raises(RuntimeError) as err:
        _bad_step(model, opt, ids)
    msg = str(err.value)
    assert "\n" not in msg
    assert "3 consecutive optimizer steps were skipped" in msg
    assert "nan, nan, nan" in msg and f"{good_norm:.4g}" in msg
    for fix in ("learning rate", "data", "precision", "max_consecutive_skips"):
        assert fix in msg
    assert opt.skipped_steps == 3
    rel.assert_same_state(before, rel.snapshot(model, opt))  # the skips left everything as it was
    # the caller may fix the cause and go on: the next finite step trains
    rel.train(model, opt, rel.batches(1, seed=8))
    assert not opt.step_was_skipped and math.isfinite(opt.last_grad_norm)


def test_a_finite_step_restarts_the_count_and_zero_never_raises(rel: Any) -> None:
    model = tiny_llama()
    opt = rel.optimizer(model, config=rel.CFG.replace(max_consecutive_skips=2))
    ids = rel.batches(1, seed=7)[0]
    for _ in range(3):  # skip, good, skip, good...: never two in a row
        _bad_step(model, opt, ids)
        rel.train(model, opt, rel.batches(1, seed=8))
    assert opt.skipped_steps == 3

    model = tiny_llama()
    opt = rel.optimizer(model, config=rel.CFG.replace(max_consecutive_skips=0))
    for _ in range(12):
        _bad_step(model, opt, ids)
    assert opt.skipped_steps == 12


@pytest.mark.parametrize("bad", [-1, 1.5, True, "8"])
def test_invalid_max_consecutive_skips_names_the_fix(bad: Any) -> None:
    with pytest.raises(ValueError, match=r"max_consecutive_skips=.*integer >= 0"):
        SuperOffloadConfig(max_consecutive_skips=bad)


def test_the_trainer_and_accelerate_settings_carry_it(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from hf_superoffload.integrations.accelerate import SuperOffloadPlugin
    from hf_superoffload.integrations.arguments import SuperOffloadArguments

    assert SuperOffloadConfig().max_consecutive_skips == 8
    args = SuperOffloadArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                                 superoffload_max_consecutive_skips=3)
    assert args.to_superoffload_config().max_consecutive_skips == 3
    with pytest.raises(ValueError, match="superoffload_max_consecutive_skips"):
        SuperOffloadArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                              superoffload_max_consecutive_skips=-1)
    monkeypatch.setenv("HF_SUPEROFFLOAD_MAX_CONSECUTIVE_SKIPS", "0")
    assert SuperOffloadPlugin().to_config().max_consecutive_skips == 0
