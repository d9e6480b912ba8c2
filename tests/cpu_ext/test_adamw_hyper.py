"""``AdamWHyper``, the one signature of every AdamW function ([Note: one AdamW signature] in cpu_ext/_hyper.py)."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_superoffload.cpu_ext import AdamWHyper
from hf_superoffload.triton_kernels import reference as tk_reference

from hf_superoffload import cpu_ext, ops
from hf_superoffload import triton_kernels as tk

_fallback = importlib.import_module("hf_superoffload.cpu_ext._fallback")

GOOD = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}

STEPS: list[Callable[..., None]] = [
    ops.cpu_adamw_step_, ops.cpu_adamw_undo_, cpu_ext.reference.adamw_step_, cpu_ext.reference.adamw_undo_,
    _fallback.adamw_step_, tk.adamw_flat_, tk_reference.adamw_flat_,
]
MOMENTS: list[Callable[..., None]] = [ops.cpu_adamw_moments_, cpu_ext.reference.adamw_moments_,
                                      _fallback.adamw_moments_]


def _name(f: Callable[..., Any]) -> str:
    return f"{f.__module__.rsplit('.', 1)[-1]}.{f.__name__}"


def test_fields_are_floats_frozen_and_compare_whole() -> None:
    h = AdamWHyper(lr=1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=torch.tensor(0.01))
    assert all(type(getattr(h, f)) is float for f in GOOD)
    assert h.lr == 1.0 and h.betas == (0.9, 0.999)
    with pytest.raises(dataclasses.FrozenInstanceError):
        h.lr = 2.0  # type: ignore[misc]
    assert h == AdamWHyper(**{**GOOD, "lr": 1.0, "weight_decay": float(torch.tensor(0.01))})
    assert h != dataclasses.replace(h, eps=1e-6)  # the verdict's "did the hyper-parameters change" is ==
    assert len({h, dataclasses.replace(h)}) == 1
    with pytest.raises(TypeError):
        AdamWHyper(1e-3, 0.9, 0.999, 1e-8, 0.01)  # type: ignore[misc]  # keyword-only: no positional 5-tuple


@pytest.mark.parametrize("step", [1, 2, 7, 1000])
def test_bias_corrections_are_torch_s(step: int) -> None:
    h = AdamWHyper(**GOOD)
    assert h.bias_correction1(step) == 1.0 - 0.9**step
    assert h.bias_correction2(step) == 1.0 - 0.999**step


@pytest.mark.parametrize(("change", "message"), [
    ({"lr": -1.0}, "lr=-1.0 is invalid: use a finite learning rate >= 0"),
    ({"lr": math.inf}, "lr=inf is invalid: use a finite learning rate >= 0"),
    ({"lr": math.nan}, "lr=nan is invalid: use a finite learning rate >= 0"),
    ({"beta1": 1.0}, "betas=(1.0, 0.999) are invalid: both must lie in [0, 1)"),
    ({"beta2": -0.1}, "betas=(0.9, -0.1) are invalid: both must lie in [0, 1)"),
    ({"eps": 0.0}, "eps=0.0 is invalid: use a small positive number such as 1e-8"),
    ({"weight_decay": -0.01}, "weight_decay=-0.01 is invalid: use a finite value >= 0"),
    ({"eps": "small"}, "eps='small' is not a number: pass a float"),
    ({"lr": None}, "lr=None is not a number: pass a float"),
])
def test_invalid_values_raise_one_line_naming_value_and_fix(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as info:
        AdamWHyper(**{**GOOD, **change})
    assert str(info.value) == message


def test_the_ranges_are_torch_s() -> None:
    """Edges torch.optim.AdamW accepts are accepted (beta 0, lr 0, weight decay 0)."""
    AdamWHyper(lr=0.0, beta1=0.0, beta2=0.0, eps=1e-30, weight_decay=0.0)


@pytest.mark.parametrize("fn", STEPS + MOMENTS, ids=_name)
def test_every_adamw_function_takes_one_hyper_and_the_same_tensor_names(fn: Callable[..., None]) -> None:
    params = inspect.signature(fn).parameters
    assert params["hyper"].kind is inspect.Parameter.KEYWORD_ONLY
    assert not set(params) & set(GOOD), f"{_name(fn)} still takes loose hyper-parameters"
    tensors = [n for n, p in params.items() if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    want = ["grad", "exp_avg", "exp_avg_sq"] if fn in MOMENTS else ["param", "grad", "exp_avg", "exp_avg_sq"]
    assert tensors == want
    if fn in STEPS:
        assert params["step"].kind is inspect.Parameter.KEYWORD_ONLY


def test_the_triton_launcher_takes_one_hyper() -> None:
    """The launcher's module imports triton (fixing interpreter or compiler for the process), so its signature is
    read from the source."""
    tree = ast.parse(Path(tk.__file__).with_name("_kernels.py").read_text())
    (fn,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "launch_adamw"]
    assert [a.arg for a in fn.args.args] == ["param", "grad", "exp_avg", "exp_avg_sq"]
    assert [a.arg for a in fn.args.kwonlyargs][:2] == ["step", "hyper"]


@pytest.mark.parametrize("fn", STEPS + MOMENTS, ids=_name)
def test_a_tuple_is_refused_with_the_fix(fn: Callable[..., None]) -> None:
    n = 8
    p, g, m, v = torch.randn(n), torch.randn(n), torch.zeros(n), torch.zeros(n)
    before = [t.clone() for t in (p, m, v)]
    legacy = (1e-3, 0.9, 0.999, 1e-8, 0.01)
    with pytest.raises(ValueError, match=r"hyper must be an AdamWHyper, got tuple: pass hyper=AdamWHyper\(lr="):
        if fn in MOMENTS:
            fn(g, m, v, hyper=legacy)
        else:
            fn(p, g, m, v, step=1, hyper=legacy)
    assert all(torch.equal(a, b) for a, b in zip((p, m, v), before))
