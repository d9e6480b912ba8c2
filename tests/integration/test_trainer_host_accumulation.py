"""SuperOffloadTrainer with gradient_accumulation_steps=2: host-side accumulation
(``superoffload_accumulate_on_host=True``, every micro-batch offloaded and summed on the host) trains like
device-side accumulation (the default in stationary mode), losses and weights within rounding."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from hf_superoffload.integrations.transformers import SuperOffloadArguments, SuperOffloadTrainer
from hf_superoffload.planning.plan import HostAccumulation
from hf_superoffload.testing import tiny_llama

STEPS, ACCUM, LR = 10, 2, 1e-3


def _train(hf: Any, tmp: Any, accumulate: str) -> dict[str, Any]:
    kw = hf.train_kwargs(tmp / accumulate, max_steps=STEPS, gradient_accumulation_steps=ACCUM, learning_rate=LR)
    model = tiny_llama(seed=0)
    args = SuperOffloadArguments(**kw, **hf.SMALL_BUCKETS, superoffload_accumulate_on_host=accumulate)
    trainer = SuperOffloadTrainer(model=model, args=args, train_dataset=hf.TokenDataset(STEPS * ACCUM * 2))
    seen: list[int] = []
    opt_holder: dict[str, Any] = {}

    orig = trainer.training_step

    def training_step(*a: Any, **k: Any) -> Any:
        out = orig(*a, **k)
        opt = trainer.superoffload_optimizer
        opt_holder["opt"] = opt
        host = [p for b in opt.engine.host_buckets for p in b.params]
        seen.append(sum(p.grad is not None for p in host))  # host-bucket gradients left on the device
        return out

    trainer.training_step = training_step  # type: ignore[method-assign]
    trainer.train()
    history = trainer.state.log_history
    opt = trainer.superoffload_optimizer
    return {"losses": [h["loss"] for h in history if "loss" in h], "opt": opt, "model": model, "seen": seen,
            "grad_norms": [h["grad_norm"] for h in history if "grad_norm" in h]}


@pytest.fixture(scope="module")
def runs(hf: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("host_accum")
    return {a: _train(hf, tmp, a) for a in ("true", "false")}


def test_host_accumulation_matches_device_accumulation(runs: dict[str, dict[str, Any]], hf: Any) -> None:
    on, off = runs["true"], runs["false"]
    assert on["opt"].plan.host_accumulation is not HostAccumulation.OFF
    assert off["opt"].plan.host_accumulation is HostAccumulation.OFF
    assert len(on["losses"]) == len(off["losses"]) == STEPS
    for k, (a, b) in enumerate(zip(on["losses"], off["losses"])):
        tol = 2e-5 if k < 3 else 5e-3
        assert math.isclose(a, b, rel_tol=tol, abs_tol=tol), f"step {k + 1}: loss {a} vs {b}"
    for a, b in zip(on["grad_norms"], off["grad_norms"]):
        assert math.isclose(a, b, rel_tol=1e-2), (on["grad_norms"], off["grad_norms"])
    on_params, off_params = dict(on["model"].named_parameters()), dict(off["model"].named_parameters())
    worst = max((hf.master_of(on["opt"], on_params[n]) - hf.master_of(off["opt"], off_params[n])).abs().max().item()
                for n in on_params)
    assert worst < 8 * LR, worst


def test_host_accumulation_leaves_no_host_bucket_gradient_on_the_device(runs: dict[str, dict[str, Any]]) -> None:
    assert len(runs["true"]["seen"]) == STEPS * ACCUM
    assert all(n == 0 for n in runs["true"]["seen"]), runs["true"]["seen"]
    # device accumulation keeps the non-final micro-batch's gradients in param.grad
    assert any(n > 0 for n in runs["false"]["seen"][0::2])


def test_the_trainer_tells_the_optimizer_its_micro_batches(hf: Any, tmp_path: Any,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan made at the first batch prices ``gradient_accumulation_steps`` micro-batches per step ([Note: one
    search over the plan] in planning/planner.py): the Trainer hands the count over with its sync predicate."""
    from hf_superoffload import SuperOffloadOptimizer

    told: list[int | None] = []
    orig = SuperOffloadOptimizer.set_sync_predicate

    def record(self: Any, predicate: Any, micro_batches: int | None = None) -> None:
        told.append(micro_batches)
        orig(self, predicate, micro_batches)

    monkeypatch.setattr(SuperOffloadOptimizer, "set_sync_predicate", record)
    kw = hf.train_kwargs(tmp_path, max_steps=1, gradient_accumulation_steps=3, learning_rate=LR)
    trainer = SuperOffloadTrainer(model=tiny_llama(seed=0), args=SuperOffloadArguments(**kw, **hf.SMALL_BUCKETS),
                                  train_dataset=hf.TokenDataset(6))
    trainer.create_optimizer()
    assert told == [3]
    trainer.superoffload_optimizer.close()


class _LengthsDataset(torch.utils.data.Dataset):
    """Token blocks whose length changes along the dataset (what dynamic padding gives a Trainer)."""

    def __init__(self, lengths: list[int]) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = [torch.randint(0, 128, (n,), generator=g) for n in lengths]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def test_a_longer_batch_at_a_step_boundary_moves_the_tail(hf: Any, tmp_path: Any,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """[Note: moving the tail to the host] under host accumulation through the Trainer: on a device budget that
    holds about half of the optimizer beside the first (shorter) batches, the first longer batch arrives at an
    optimizer step's first micro-batch and the tail moves to the host instead of refusing the batch."""
    from hf_superoffload.planning import hardware
    from hf_superoffload.planning.memory_model import PlanLike, estimate
    from hf_superoffload.testing import pretend_profile

    model = tiny_llama(seed=3, num_hidden_layers=4)
    n = sum(p.numel() for p in model.parameters())
    need = [estimate(model.config, batch_size=2, seq_len=24, grad_ckpt=False, chunked_loss=True,
                     plan_like=PlanLike(device_numel=d, host_numel=n - d, bucket_bytes=2 * n // 8)).gpu_required_bytes
            for d in (0, n)]
    budget = int((need[0] + need[1]) / 2 / (1 - 0.04))
    monkeypatch.setattr(hardware.HardwareProfile, "read", classmethod(lambda cls, device: pretend_profile(budget)))
    steps = 4
    lengths = [24] * (2 * ACCUM * 2) + [32] * (2 * ACCUM * 2)  # two steps of each length, 2 sequences a batch
    kw = hf.train_kwargs(tmp_path, max_steps=steps, gradient_accumulation_steps=ACCUM, learning_rate=LR)
    trainer = SuperOffloadTrainer(model=model, args=SuperOffloadArguments(**kw), train_dataset=_LengthsDataset(lengths))
    monkeypatch.setattr(trainer, "_get_train_sampler",
                        lambda *a, **k: torch.utils.data.SequentialSampler(trainer.train_dataset))
    tails: list[int] = []
    orig = trainer.training_step

    def training_step(*a: Any, **k: Any) -> Any:
        out = orig(*a, **k)
        tails.append(len(trainer.superoffload_optimizer.plan.device_buckets))
        return out

    trainer.training_step = training_step  # type: ignore[method-assign]
    trainer.train()
    opt = trainer.superoffload_optimizer
    assert opt.plan.host_accumulation is not HostAccumulation.OFF
    assert trainer.state.global_step == steps
    assert len(tails) == steps * ACCUM
    short, long = set(tails[: 2 * ACCUM]), set(tails[2 * ACCUM :])
    assert len(short) == len(long) == 1 and 0 < min(long) < min(short), tails
    opt.close()
