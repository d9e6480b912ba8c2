"""The plan summary reaches a Trainer user who configured no logging, once, and stays in the log history."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from hf_superoffload.integrations.transformers import SuperOffloadArguments, SuperOffloadTrainer
from hf_superoffload.testing import tiny_llama


def _train(hf: Any, tmp: Any, **kw: Any) -> SuperOffloadTrainer:
    args = SuperOffloadArguments(**hf.train_kwargs(tmp, max_steps=2, **hf.SMALL_BUCKETS, **kw))
    trainer = SuperOffloadTrainer(model=tiny_llama(seed=0), args=args, train_dataset=hf.TokenDataset(8))
    trainer.train()
    return trainer


def test_plan_printed_once_and_kept_in_log_history(hf: Any, tmp_path: Any, capsys: Any) -> None:
    assert not logging.getLogger("hf_superoffload").isEnabledFor(logging.INFO)  # as in a fresh script
    trainer = _train(hf, tmp_path)
    out = capsys.readouterr().out
    assert out.count("hf_superoffload plan:") == 1 and "CPU Adam backend:" in out
    plans = [h for h in trainer.state.log_history if "superoffload/plan" in h]
    assert len(plans) == 1 and plans[0]["superoffload/plan"].startswith("hf_superoffload plan:")


def test_plan_goes_through_configured_logging(hf: Any, tmp_path: Any, capsys: Any,
                                              caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="hf_superoffload"):
        _train(hf, tmp_path)
    assert "hf_superoffload plan:" not in capsys.readouterr().out  # not twice
    assert sum("hf_superoffload plan:" in r.getMessage() for r in caplog.records) == 1


def test_plan_silenced_by_explicit_log_level(hf: Any, tmp_path: Any, capsys: Any) -> None:
    root = logging.getLogger("hf_superoffload")
    try:
        _train(hf, tmp_path, log_level="warning")
    finally:
        root.setLevel(logging.NOTSET)
    assert "hf_superoffload plan:" not in capsys.readouterr().out


def test_accelerate_path_shows_the_plan_without_logging(capsys: Any) -> None:
    from accelerate import Accelerator

    from hf_superoffload.integrations.accelerate import prepare_superoffload

    assert not logging.getLogger("hf_superoffload").isEnabledFor(logging.INFO)  # as in a fresh script
    _, optimizer = prepare_superoffload(Accelerator(cpu=True), tiny_llama(seed=0), dict(lr=1e-3))
    out = capsys.readouterr().out
    assert out.count("hf_superoffload plan:") == 1 and "CPU Adam backend:" in out
    optimizer.superoffload.close()


def test_the_calibration_reaches_the_trainer_user_once(hf: Any, tmp_path: Any, capsys: Any,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """[Note: calibration from the measured peak]: what the first steps measured and changed is shown where the
    plan was, once, and kept in the log history. On CPU the device is simulated (a profile that reports free device
    memory and the H200's rates, so the plan waits for the first batch and the steps are timed against them)."""
    from hf_superoffload.planning import hardware
    from hf_superoffload.planning.planner import CALIBRATION_STEPS
    from hf_superoffload.testing import pretend_profile

    profile = pretend_profile(64 * 1024**3, rates_of="h200_pcie")
    monkeypatch.setattr(hardware.HardwareProfile, "read", classmethod(lambda cls, device: profile))
    args = SuperOffloadArguments(**hf.train_kwargs(tmp_path, max_steps=CALIBRATION_STEPS + 2, **hf.SMALL_BUCKETS))
    trainer = SuperOffloadTrainer(model=tiny_llama(seed=0), args=args, train_dataset=hf.TokenDataset(16))
    trainer.train()
    out = capsys.readouterr().out
    assert out.count(f"hf_superoffload calibration after {CALIBRATION_STEPS} steps:") == 1, out
    logged = [h for h in trainer.state.log_history if "superoffload/calibration" in h]
    assert len(logged) == 1 and "s measured" in logged[0]["superoffload/calibration"]
    assert logged[0]["step"] == CALIBRATION_STEPS
