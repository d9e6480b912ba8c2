"""SuperOffloadTrainer against a Trainer running the plain reference recipe, with evaluation and telemetry.

Both sides are ``transformers.Trainer`` runs with identical arguments, data order, loss scaling and LR schedule
(20 steps, gradient_accumulation_steps=2, clipping at 1.0, linear decay, evaluation every 10 steps). The
reference trains bf16 weights with fp32 masters, ``clip_grad_norm_`` on fp32 gradients and ``torch.optim.AdamW``
(``hf_superoffload.testing.ReferenceAdamW``); Trainer's own clipping is off on that side, as on ours, because
the optimizer clips. Tolerances follow tests/runtime/test_parity.py: first steps to fp32 rounding, later ones at
a level that bf16 weight flips reach and real bugs exceed by far.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from transformers import Trainer, TrainingArguments

from hf_superoffload.integrations.transformers import SuperOffloadArguments, SuperOffloadTrainer
from hf_superoffload.testing import ReferenceAdamW, tiny_llama

STEPS, ACCUM, LR = 20, 2, 1e-3
TELEMETRY = ("cpu_adam_s", "gpu_wait_s", "overlap", "link_gb", "clip_coef", "speculative", "skipped_steps",
             "clipped_steps", "redo_rate", "pass_s", "moment_commit_s", "master_deferred_buckets",
             "moment_deferred_buckets")


class RefOptimizer(torch.optim.Optimizer):
    """A torch ``Optimizer`` face for ReferenceAdamW (LR schedulers and Accelerate need one)."""

    def __init__(self, ref: ReferenceAdamW) -> None:
        self.ref = ref
        self.norms: list[float] = []
        super().__init__([torch.zeros(1, requires_grad=True)], {})

    # the inner AdamW owns the groups (Accelerate's state round-trip replaces them: always read through)
    param_groups = property(lambda self: self.ref.opt.param_groups if hasattr(self, "ref") else [],
                            lambda self, v: None)
    state = property(lambda self: self.ref.opt.state if hasattr(self, "ref") else {}, lambda self, v: None)
    defaults = property(lambda self: self.ref.opt.defaults if hasattr(self, "ref") else {}, lambda self, v: None)

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        self.ref.step()
        self.norms.append(self.ref.last_grad_norm)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.ref.zero_grad()

    def state_dict(self) -> dict[str, Any]:
        return self.ref.opt.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.ref.opt.load_state_dict(state_dict)


class ReferenceOptimizerMixin:
    """For a Trainer subclass (Trainer, TRL's SFTTrainer): torch AdamW on fp32 masters with the same decay groups,
    clipping fp32 gradients inside its step (the reference of the parity tests)."""

    def create_optimizer(self, model: Any = None) -> torch.optim.Optimizer:
        if self.optimizer is None:
            m = self.model
            decay = set(self.get_decay_parameter_names(m))
            named = [(n, p) for n, p in m.named_parameters() if p.requires_grad]
            groups = [{"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
                      {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
            a = self.args
            self.optimizer = RefOptimizer(ReferenceAdamW(m, groups, max_grad_norm=a.max_grad_norm, lr=a.learning_rate,
                                                          betas=(a.adam_beta1, a.adam_beta2), eps=a.adam_epsilon))
        return self.optimizer

    def _clip_grad_norm(self, model: Any) -> None:  # the reference clips fp32 gradients inside step()
        return None

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> None:
        return None


class _ReferenceTrainer(ReferenceOptimizerMixin, Trainer):
    pass


def _train(side: str, hf: Any, tmp: Any) -> dict[str, Any]:
    kw = hf.train_kwargs(tmp / side, max_steps=STEPS, gradient_accumulation_steps=ACCUM, learning_rate=LR,
                         eval_strategy="steps", eval_steps=10)
    model = tiny_llama(seed=0)
    data = dict(train_dataset=hf.TokenDataset(STEPS * ACCUM * 2), eval_dataset=hf.TokenDataset(8, seed=2))
    if side == "ours":
        args = SuperOffloadArguments(**kw, **hf.SMALL_BUCKETS)
        trainer: Trainer = SuperOffloadTrainer(model=model, args=args, **data)
    else:
        trainer = _ReferenceTrainer(model=model, args=TrainingArguments(**kw), **data)
    trainer.train()
    history = trainer.state.log_history
    return {
        "trainer": trainer, "model": model,
        "losses": [h["loss"] for h in history if "loss" in h],
        "grad_norms": [h["grad_norm"] for h in history if "grad_norm" in h],
        "evals": [h["eval_loss"] for h in history if "eval_loss" in h],
        "history": history,
    }


@pytest.fixture(scope="module")
def runs(hf: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("parity")
    return {side: _train(side, hf, tmp) for side in ("ours", "ref")}


def test_losses_and_final_weights_match_the_reference(runs: dict[str, dict[str, Any]], hf: Any) -> None:
    ours, ref = runs["ours"], runs["ref"]
    assert len(ours["losses"]) == len(ref["losses"]) == STEPS
    for k, (a, b) in enumerate(zip(ours["losses"], ref["losses"])):
        tol = 2e-5 if k < 3 else 5e-3
        assert math.isclose(a, b, rel_tol=tol, abs_tol=tol), f"step {k + 1}: loss {a} vs reference {b}"
    opt = ours["trainer"].superoffload_optimizer
    ref_opt = ref["trainer"].optimizer.optimizer  # AcceleratedOptimizer -> RefOptimizer
    names = {id(p): n for n, p in ref["model"].named_parameters()}
    our_params = dict(ours["model"].named_parameters())
    worst = 0.0
    for p, m in ref_opt.ref.pairs:
        q = our_params[names[id(p)]]
        worst = max(worst, (hf.master_of(opt, q) - m.detach()).abs().max().item())
        assert q.dtype == p.dtype == torch.bfloat16
    assert worst < 8 * LR, f"final master weights differ by {worst} (> {8 * LR})"
    assert opt.clipped_steps > 0, "clipping never fired: the test would not cover it"


def test_reported_grad_norm_is_the_optimizers_global_norm(runs: dict[str, dict[str, Any]]) -> None:
    ours, ref = runs["ours"], runs["ref"]
    ref_norms = ref["trainer"].optimizer.optimizer.norms
    assert len(ours["grad_norms"]) == len(ref_norms) == STEPS
    assert all(math.isfinite(g) and g > 0 for g in ours["grad_norms"])
    assert math.isclose(ours["grad_norms"][0], ref_norms[0], rel_tol=1e-4)
    for a, b in zip(ours["grad_norms"], ref_norms):
        assert math.isclose(a, b, rel_tol=5e-2), (a, b)
    assert ours["grad_norms"][-1] == pytest.approx(ours["trainer"].superoffload_optimizer.last_grad_norm)


def test_lr_schedule_and_evaluation_during_training(runs: dict[str, dict[str, Any]]) -> None:
    ours, ref = runs["ours"], runs["ref"]
    lrs = [[h["learning_rate"] for h in r["history"] if "learning_rate" in h] for r in (ours, ref)]
    assert lrs[0] == lrs[1] and lrs[0][0] == pytest.approx(LR) and lrs[0][-1] < LR / 5
    assert len(ours["evals"]) == 2 and all(math.isfinite(e) for e in ours["evals"])
    for a, b in zip(ours["evals"], ref["evals"]):
        assert math.isclose(a, b, rel_tol=5e-3), (a, b)
    metrics = ours["trainer"].evaluate()
    assert math.isfinite(metrics["eval_loss"])


def test_telemetry_reaches_the_log_history(runs: dict[str, dict[str, Any]]) -> None:
    train_logs = [h for h in runs["ours"]["history"] if "loss" in h]
    assert train_logs
    for h in train_logs:
        for key in TELEMETRY:
            assert f"superoffload/{key}" in h, f"superoffload/{key} missing from {sorted(h)}"
            assert math.isfinite(h[f"superoffload/{key}"])
    last = train_logs[-1]
    opt = runs["ours"]["trainer"].superoffload_optimizer
    assert opt.engine.host_buckets  # the window averages the host passes (it reported 0 for commits and share before)
    assert any(h["superoffload/pass_s"] > 0 for h in train_logs), [h["superoffload/pass_s"] for h in train_logs]
    assert last["superoffload/clipped_steps"] == opt.clipped_steps
    assert last["superoffload/skipped_steps"] == 0
    assert 0.0 <= last["superoffload/overlap"] <= 1.0
    assert last["superoffload/link_gb"] > 0
    assert not any(k.startswith("superoffload/") for h in runs["ours"]["history"] if "eval_loss" in h for k in h)
