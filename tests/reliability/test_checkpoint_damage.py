"""Damaged checkpoints and resuming into something else.

- a truncated, empty or bit-flipped ``optimizer.pt`` on resume through ``SuperOffloadTrainer``;
- a malformed optimizer state (wrong sizes, dtypes, missing entries) given to ``load_state_dict``;
- a checkpoint of another model, other param groups (refused) or another plan (converted exactly).

Promise: either the state loads exactly, or a clear error names the file (or entry) and what is wrong, and the
live optimizer is left as it was.
"""

from __future__ import annotations

import copy
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from hf_superoffload import SuperOffloadOptimizer
from hf_superoffload.testing import tiny_llama


def _damaged(checkpoint: Path, dst: Path, damage: str) -> Path:
    shutil.copytree(checkpoint, dst)
    f = dst / "optimizer.pt"
    raw = f.read_bytes()
    if damage == "truncated":
        f.write_bytes(raw[: len(raw) // 2])
    elif damage == "empty":
        f.write_bytes(b"")
    elif damage == "garbage":
        f.write_bytes(b"not a checkpoint\n" * 64)
    elif damage == "bit_flip":
        # flip the exponent bits of one exp_avg element: the zip container has no checksum torch verifies
        arena = torch.load(f, map_location="cpu", weights_only=True)["superoffload"]["host"]["exp_avg"]
        at = raw.find(arena.numpy().tobytes())  # the whole arena: a prefix may also occur elsewhere
        assert at > 0
        b = bytearray(raw)
        b[at + 4 * 100 + 3] ^= 0x40
        f.write_bytes(bytes(b))
    else:
        raise AssertionError(damage)
    return dst


def _snap(rel: Any, trainer: Any) -> dict[str, Any]:
    return rel.snapshot(trainer.model, trainer.superoffload_optimizer)


@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage"])
def test_damaged_optimizer_file_is_refused_and_the_optimizer_is_untouched(rel: Any, checkpoint: Path, fresh: Any,
                                                                          tmp_path: Path, damage: str) -> None:
    ckpt = _damaged(checkpoint, tmp_path / "ckpt", damage)
    before = _snap(rel, fresh)
    with pytest.raises(Exception):  # noqa: B017 - today torch's own RuntimeError / EOFError / UnpicklingError
        fresh._load_optimizer_and_scheduler(str(ckpt))
    rel.assert_same_state(before, _snap(rel, fresh))


@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage"])
def test_damaged_optimizer_file_error_names_the_file_and_the_damage(checkpoint: Path, fresh: Any, tmp_path: Path,
                                                                    damage: str) -> None:
    ckpt = _damaged(checkpoint, tmp_path / "ckpt", damage)
    with pytest.raises(ValueError) as info:
        fresh._load_optimizer_and_scheduler(str(ckpt))
    msg = str(info.value)
    assert str(ckpt / "optimizer.pt") in msg
    assert any(w in msg for w in ("truncated", "damaged", "corrupt"))


def test_bit_flip_in_optimizer_file_is_detected(rel: Any, checkpoint: Path, fresh: Any, tmp_path: Path) -> None:
    ckpt = _damaged(checkpoint, tmp_path / "ckpt", "bit_flip")
    before = _snap(rel, fresh)
    with pytest.raises(ValueError, match="checksum") as info:
        fresh._load_optimizer_and_scheduler(str(ckpt))
    assert str(ckpt / "optimizer.pt") in str(info.value)
    rel.assert_same_state(before, _snap(rel, fresh))


def test_missing_optimizer_file_is_reported_and_adam_restarts(checkpoint: Path, fresh: Any, tmp_path: Path,
                                                              caplog: Any) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoint, ckpt)
    (ckpt / "optimizer.pt").unlink()  # e.g. saved with save_only_model=True
    with caplog.at_level(logging.WARNING, logger="hf_superoffload"):
        fresh._load_optimizer_and_scheduler(str(ckpt))
    msg = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert str(ckpt) in msg and "fresh Adam state" in msg
    assert fresh.superoffload_optimizer.engine.param_steps == [0] * len(fresh.superoffload_optimizer.engine.params)


def test_checkpoint_of_another_model_is_refused_through_the_trainer(checkpoint: Path, tmp_path: Path,
                                                                    kill_child: Any) -> None:
    trainer = kill_child.make_trainer(str(tmp_path / "run"), model=tiny_llama(hidden_size=48, intermediate_size=96))
    trainer.create_optimizer()
    try:
        with pytest.raises(ValueError, match=r"different set of trainable parameters \(\d+ saved, \d+ now; first "
                                             r"difference at lm_head\.weight\)"):
            trainer._load_optimizer_and_scheduler(str(checkpoint))
    finally:
        trainer.superoffload_optimizer.close()


# ---------------------------------------------------------------------------------------------------------
# malformed state dicts given to load_state_dict
def _trained(rel: Any, **kw: Any) -> tuple[nn.Module, SuperOffloadOptimizer]:
    model = tiny_llama(**kw)
    opt = rel.optimizer(model)
    rel.train(model, opt, rel.batches(2))
    return model, opt


def _mutate(case: str, sd: dict[str, Any]) -> None:
    so = sd["superoffload"]
    master = so["host"]["master"]
    if case == "short_arena":
        so["host"]["master"] = master[: master.numel() // 2].clone()
    elif case == "missing_arena":
        del so["device"]["exp_avg_sq"]
    elif case == "wrong_format":
        so["format"] = "hf_superoffload.optimizer.v0"
    elif case == "long_arena":
        so["host"]["master"] = torch.cat([master, torch.zeros(10)])
    elif case == "arena_dtype":
        so["host"]["exp_avg"] = so["host"]["exp_avg"].to(torch.bfloat16)
    elif case == "param_steps":
        so["param_steps"] = so["param_steps"][:3].clone()
    elif case == "missing_numels":
        del so["numels"]
    elif case == "missing_side":
        del so["device"]
    else:
        raise AssertionError(case)




@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("short_arena", r"host/master is truncated \(\d+ elements, parameter (model|lm_head)\.\S+ needs \d+\)"),
        ("missing_arena", r"missing device/exp_avg_sq; the file is damaged"),
        ("wrong_format", r"unknown optimizer state format 'hf_superoffload.optimizer.v0'"),
        pytest.param("long_arena", r"host/master"),
        pytest.param("arena_dtype", r"host/exp_avg.*(dtype|bfloat16)"),
        pytest.param("param_steps", r"param_steps"),
        pytest.param("missing_numels", r"numels"),
        pytest.param("missing_side", r"device"),
    ],
)
def test_malformed_optimizer_state_is_refused_naming_the_entry(rel: Any, case: str, match: str) -> None:
    model, opt = _trained(rel)
    sd = copy.deepcopy(opt.state_dict())
    _mutate(case, sd)
    other = tiny_llama(seed=3)
    new = rel.optimizer(other)
    with pytest.raises(ValueError, match=match):
        new.load_state_dict(sd)


def test_plain_torch_optimizer_state_is_refused(rel: Any) -> None:
    model = tiny_llama()
    opt = rel.optimizer(model)
    with pytest.raises(ValueError, match="not saved by SuperOffloadOptimizer"):
        opt.load_state_dict(torch.optim.AdamW(tiny_llama().parameters()).state_dict())


def _two_groups(model: nn.Module) -> list[dict[str, Any]]:
    return [{"params": [p for p in model.parameters() if p.ndim >= 2]},
            {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0}]


@pytest.mark.parametrize("case", ["short_arena", "param_group_count"])
def test_a_refused_load_leaves_the_live_optimizer_unchanged(rel: Any, case: str) -> None:
    model, opt = _trained(rel)
    sd = copy.deepcopy(opt.state_dict())
    other = tiny_llama(seed=3)
    if case == "short_arena":
        _mutate(case, sd)
        new = rel.optimizer(other)
    else:
        new = rel.optimizer(other, _two_groups(other))  # the checkpoint has one group
    before = rel.snapshot(other, new)
    with pytest.raises(ValueError):
        new.load_state_dict(sd)
    rel.assert_same_state(before, rel.snapshot(other, new))


# ---------------------------------------------------------------------------------------------------------
# resuming into another model, other param groups, another plan
def test_checkpoint_of_another_model_is_refused(rel: Any) -> None:
    """See also tests/runtime/test_skip_and_state.py::test_load_refuses_other_model."""
    model, opt = _trained(rel)
    other = tiny_llama(num_hidden_layers=3)
    with pytest.raises(ValueError, match=r"different set of trainable parameters.*same model"):
        rel.optimizer(other).load_state_dict(opt.state_dict())


def _pair(a: int, b: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(a, b, bias=False), nn.Linear(b, a, bias=False)).to(torch.bfloat16)


def test_checkpoint_of_a_model_with_the_same_sizes_but_other_shapes_is_refused(rel: Any) -> None:
    a, b = _pair(4, 8), _pair(2, 16)  # weights [8, 4], [4, 8] vs [16, 2], [2, 16]: 32 elements each
    assert [p.numel() for p in a.parameters()] == [p.numel() for p in b.parameters()]
    sd = rel.optimizer(a).state_dict()
    with pytest.raises(ValueError, match="shape"):
        rel.optimizer(b).load_state_dict(sd)


def test_other_param_groups_are_refused(rel: Any) -> None:
    model, opt = _trained(rel)
    other = tiny_llama(seed=3)
    with pytest.raises(ValueError, match="different number of parameter groups"):
        rel.optimizer(other, _two_groups(other)).load_state_dict(opt.state_dict())


@pytest.mark.parametrize(
    "changes",
    [
        {"gpu_resident_buckets": 0},
        {"gpu_resident_buckets": 4, "bucket_size_mb": 0.002},
        {"rollback": "inverse", "speculation": False},
        {"bucket_size_mb": 1.0, "gpu_resident_buckets": 0, "cpu_threads": 1},
    ],
    ids=["no_device_tail", "smaller_buckets_longer_tail", "inverse_rollback", "one_big_plan"],
)
def test_another_plan_is_converted_parameter_by_parameter_exactly(rel: Any, changes: dict[str, Any]) -> None:
    model, opt = _trained(rel)
    sd = opt.state_dict()
    other = tiny_llama(seed=3)
    new = rel.optimizer(other, config=rel.CFG.replace(**changes))
    assert new.plan != opt.plan
    new.load_state_dict(sd)
    assert new.engine.param_steps == opt.engine.param_steps
    for p, q in zip(model.parameters(), other.parameters()):
        assert torch.equal(p, q), "weights are bf16 of the loaded masters"
        a, b = rel.state_of(opt, p), rel.state_of(new, q)
        for k in a:
            assert torch.equal(a[k], b[k]), f"{k} not converted exactly"
    rel.train(other, new, rel.batches(1, seed=4))  # and it steps
    assert new.engine.param_steps == [s + 1 for s in opt.engine.param_steps]
