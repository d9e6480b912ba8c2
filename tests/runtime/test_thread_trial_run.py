"""[Note: the thread trial] in a run: after the calibration the optimizer runs one steady iteration at the planned
CPU Adam threads and one at one more, keeps the faster, says so, and trains exactly as it would have at either
count. Each pass's Adam call is made to last a time that scales with the threads it was given, so which count is
faster is known here."""

from __future__ import annotations

import time

import pytest
import torch

from hf_superoffload import SuperOffloadConfig, SuperOffloadOptimizer, ops
from hf_superoffload.planning import hardware
from hf_superoffload.planning.planner import CALIBRATION_STEPS
from hf_superoffload.planning.thread_trial import SAMPLES, TRIAL_STEPS
from hf_superoffload.testing import pretend_profile, state_tensors, tiny_llama, train_steps

GiB = 1024**3
STEPS = CALIBRATION_STEPS + TRIAL_STEPS + 1  # and one more at the chosen count
PAUSE_S = 0.02  # per Adam call at the planned two threads: the pass outweighs the tiny model's forward and backward


def run(monkeypatch: pytest.MonkeyPatch, *, cores: int, more_is: str | None, cpu_threads: int | None = None
        ) -> tuple[SuperOffloadOptimizer, list, torch.nn.Module, list[str]]:
    from hf_superoffload.runtime import host_pass

    profile = pretend_profile(64 * GiB, rates_of="h200_pcie", cpu_threads=2)
    monkeypatch.setattr(hardware.HardwareProfile, "read", classmethod(lambda cls, device: profile))
    monkeypatch.setattr(ops, "affinity_cores", lambda: cores)
    real = host_pass.ops.cpu_adamw_step_

    def timed_step(*args: object, num_threads: int, **kwargs: object) -> None:
        if more_is is not None:
            ratio = 2 / num_threads if more_is == "faster" else num_threads / 2
            time.sleep(PAUSE_S * ratio**3)  # a gap no other noise of a loaded CI machine closes
        real(*args, num_threads=num_threads, **kwargs)

    monkeypatch.setattr(host_pass.ops, "cpu_adamw_step_", timed_step)
    model = tiny_llama(seed=3, num_hidden_layers=2)
    # no clipping: every step commits, so every steady iteration is alike
    opt = SuperOffloadOptimizer(model, lr=1e-3, max_grad_norm=None, log_plan=False,
                                config=SuperOffloadConfig(gpu_resident_buckets=0, bucket_size_mb=0.05,
                                                          cpu_threads=cpu_threads))
    told: list[str] = []
    opt.calibration_listeners.append(told.append)
    g = torch.Generator().manual_seed(11)
    steps = train_steps(model, opt, [torch.randint(0, 128, (2, 24), generator=g) for _ in range(STEPS)])
    return opt, steps, model, told


@pytest.mark.parametrize("more_is", ["faster", "slower"])
def test_the_faster_thread_count_stays(more_is: str, monkeypatch: pytest.MonkeyPatch) -> None:
    opt, steps, _, told = run(monkeypatch, cores=3, more_is=more_is)
    opt.close()
    record = opt.calibration["threads"]
    chosen = 3 if more_is == "faster" else 2
    assert (record["planned"], record["trial"], record["chosen"]) == (2, 3, chosen), record
    assert opt.plan.cpu_threads == chosen and opt.settled
    assert any(f"runs {chosen} threads" in t for t in told), told
    # the steps are counted from 1; step k's stats hold the pass of step k - 1. The baseline's iterations are the
    # second and third after the calibration's: their passes and those before run at the planned count, the
    # passes of the steps until the verdict at the trial count, those after it at the chosen one
    last_base = CALIBRATION_STEPS + 1 + SAMPLES
    threads = [s.stats.host_pass.threads for s in steps[1:]]
    assert threads == [2] * last_base + [3] * (SAMPLES + 1) + [chosen], threads
    assert len(threads) == STEPS - 1


@pytest.mark.parametrize(("cores", "cpu_threads"), [(2, None), (3, 2)], ids=["no core to spare", "set by the user"])
def test_no_trial(cores: int, cpu_threads: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    opt, steps, _, _ = run(monkeypatch, cores=cores, more_is="faster", cpu_threads=cpu_threads)
    opt.close()
    assert "threads" not in (opt.calibration or {}) and opt.settled
    assert {s.stats.host_pass.threads for s in steps[1:]} == {2}


def test_the_trial_changes_the_speed_not_the_training(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bit for bit the run at the planned count: the CPU Adam is elementwise and its sums are cut at fixed offsets."""
    tried, _, tried_model, _ = run(monkeypatch, cores=3, more_is="faster")
    assert tried.calibration["threads"]["chosen"] == 3, tried.calibration["threads"]
    fixed, _, fixed_model, _ = run(monkeypatch, cores=3, more_is=None, cpu_threads=2)
    assert "threads" not in (fixed.calibration or {})
    for a, b in zip(state_tensors(tried.state_dict()), state_tensors(fixed.state_dict()), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(tried_model.parameters(), fixed_model.parameters(), strict=True):
        assert torch.equal(a, b)
    tried.close()
    fixed.close()
