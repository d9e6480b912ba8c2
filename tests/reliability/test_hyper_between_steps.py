"""Invalid hyper-parameters written into ``param_groups`` between steps (by user code or a scheduler).

Promise: the next step refuses them with a ``ValueError`` naming the group, the value and the fix, before any
optimizer state or weight changes; once the value is fixed, the optimizer steps exactly as if the bad value had
never been set.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from hf_superoffload.testing import tiny_llama

CASES = [
    ("betas", (0.9, 1.5), r"param_groups\[0\] betas=\(0.9, 1.5\) are invalid: both must lie in \[0, 1\)"),
    ("betas", (-0.1, 0.999), r"betas=.* are invalid"),
    ("lr", -1.0, r"param_groups\[0\] lr=-1.0 is invalid: use a finite learning rate >= 0"),
    ("lr", math.nan, r"lr=nan is invalid"),
    ("lr", math.inf, r"lr=inf is invalid"),
    ("eps", 0.0, r"param_groups\[0\] eps=0.0 is invalid: use a small positive number"),
    ("weight_decay", -0.01, r"param_groups\[0\] weight_decay=-0.01 is invalid"),
    ("betas", "fast", r"param_groups\[0\] holds an unreadable hyper-parameter"),
    ("lr", None, r"param_groups\[0\] holds an unreadable hyper-parameter"),
]


def _step(model: torch.nn.Module, opt: Any, ids: torch.Tensor) -> None:
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize(("key", "value", "match"), CASES, ids=[f"{k}={v!r}" for k, v, _ in CASES])
def test_invalid_hyper_parameter_is_refused_before_any_state_changes_and_fixing_it_recovers(
        rel: Any, key: str, value: Any, match: str) -> None:
    data = rel.batches(3)
    ref_model = tiny_llama()
    ref = rel.optimizer(ref_model)
    for ids in data:
        _step(ref_model, ref, ids)
    ref.synchronize()

    model = tiny_llama()
    opt = rel.optimizer(model)
    _step(model, opt, data[0])
    before = rel.snapshot(model, opt)
    good = opt.param_groups[0][key]
    opt.param_groups[0][key] = value
    with pytest.raises(ValueError, match=match):
        _step(model, opt, data[1])  # refused when the step starts reading them (in backward) or at step()
    opt.zero_grad()
    rel.assert_same_state(before, rel.snapshot(model, opt))

    opt.param_groups[0][key] = good
    for ids in data[1:]:
        _step(model, opt, ids)
    opt.synchronize()
    for (n, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(p, q), f"{n} differs from a run that never saw the bad value"


def test_invalid_value_set_between_backward_and_step_is_refused_at_step(rel: Any) -> None:
    model = tiny_llama()
    opt = rel.optimizer(model)
    data = rel.batches(2)
    _step(model, opt, data[0])
    before = rel.snapshot(model, opt)
    model(input_ids=data[1], labels=data[1]).loss.backward()
    opt.param_groups[0]["eps"] = -1.0
    with pytest.raises(ValueError, match=r"eps=-1.0 is invalid"):
        opt.step()
    opt.zero_grad()
    rel.assert_same_state(before, rel.snapshot(model, opt))
    opt.param_groups[0]["eps"] = 1e-8
    _step(model, opt, data[1])
    assert opt.engine.param_steps == [2] * len(opt.engine.params)
