"""Checkpoint integrity beyond a flipped bit: reordered bytes, non-finite values, names in errors, old formats.

- two blocks of an arena swapped inside ``optimizer.pt`` (a plain sum of the words cannot see it) are detected,
  naming the file, the arena and the parameters in the damaged range;
- a NaN/inf master or moment, saved consistently by a run that had diverged, is refused at load, naming the
  parameter (it would otherwise make every later step non-finite, skipped forever);
- shape and size mismatches name the parameter by its model name, not by its index in arrival order;
- checkpoints written before the order-sensitive checksum still load, and their plain sum is still verified.

Every refusal leaves the live optimizer as it was.
"""

from __future__ import annotations

import copy
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from hf_superoffload import state as st
from hf_superoffload.testing import tiny_llama


def test_two_swapped_blocks_in_the_file_are_detected_naming_file_arena_and_parameters(
        rel: Any, checkpoint: Path, fresh: Any, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoint, ckpt)
    f = ckpt / "optimizer.pt"
    raw = f.read_bytes()
    arena = torch.load(f, map_location="cpu", weights_only=True)["superoffload"]["host"]["exp_avg"]
    data = arena.numpy().tobytes()
    at = raw.find(data)  # the whole arena: a prefix may also occur elsewhere
    assert at > 0
    block = 4 * 64  # two 64-element blocks swap places
    a, b = raw[at : at + block], raw[at + block : at + 2 * block]
    assert a != b
    f.write_bytes(raw[:at] + b + a + raw[at + 2 * block :])
    swapped = torch.load(f, map_location="cpu", weights_only=True)["superoffload"]["host"]["exp_avg"]
    assert st._digest(swapped) == st._digest(arena), "a plain sum of the words cannot see the swap"

    before = rel.snapshot(fresh.model, fresh.superoffload_optimizer)
    with pytest.raises(ValueError, match=r"host/exp_avg fails its checksum in elements 0\.\.\d+ \(parameter "
                                         r"\S+.*\): its bytes were changed or reordered") as info:
        fresh._load_optimizer_and_scheduler(str(ckpt))
    assert str(f) in str(info.value)
    rel.assert_same_state(before, rel.snapshot(fresh.model, fresh.superoffload_optimizer))


def test_checksum_is_order_sensitive_and_localises_the_damage(monkeypatch: Any) -> None:
    monkeypatch.setattr(st, "_CRC_BYTES", 4 * 1000)
    t = torch.randn(10_000)
    base = st._checksum(t)
    assert base == st._checksum(t.clone()) and len(base["crcs"]) == 10
    swapped = t.clone()
    swapped[2000:2010], swapped[7000:7010] = t[7000:7010].clone(), t[2000:2010].clone()
    crcs = st._checksum(swapped)["crcs"]
    assert [k for k, (x, y) in enumerate(zip(base["crcs"], crcs)) if x != y] == [2, 7]
    within = t.clone()
    within[3], within[4] = t[4].clone(), t[3].clone()
    assert st._checksum(within)["crcs"][0] != base["crcs"][0]


def _trained(rel: Any) -> tuple[nn.Module, Any]:
    model = tiny_llama()
    opt = rel.optimizer(model)
    rel.train(model, opt, rel.batches(2))
    return model, opt


def _locate(opt: Any, name: str) -> tuple[str, int, int]:
    eng = opt.engine
    p = dict(eng.hooks.roots[0].named_parameters())[name]
    i = next(k for k, q in enumerate(eng.params) if q is p)
    pl, off = eng.param_location(i)
    return ("host" if pl.value == "host" else "device"), off, p.numel()


@pytest.mark.parametrize(("kind", "value", "where"), [
    ("master", math.nan, "host"), ("exp_avg", math.inf, "host"), ("exp_avg_sq", -math.inf, "host"),
    ("master", math.nan, "device"),
])
def test_non_finite_values_in_a_saved_state_are_refused_naming_the_parameter(rel: Any, kind: str, value: float,
                                                                             where: str) -> None:
    model, opt = _trained(rel)
    sd = copy.deepcopy(opt.state_dict())
    so = sd["superoffload"]
    names = so["names"]
    name = next(n for n in names if _locate(opt, n)[0] == where and _locate(opt, n)[2] > 3)
    side, off, _ = _locate(opt, name)
    st._read(so[side][kind], off + 3, off + 4).fill_(value)  # one element: a view of its piece
    so["manifest"] = st._manifest({s: so[s] for s in ("host", "device")})  # saved as it was: checksums agree
    other = tiny_llama(seed=3)
    new = rel.optimizer(other)
    before = rel.snapshot(other, new)
    with pytest.raises(ValueError, match=rf"{side}/{kind} holds a non-finite value \({value}\) at element {off + 3} "
                                         rf"\(parameter {name.replace('.', '[.]')}\).*resume from an earlier checkpoint"):
        new.load_state_dict(sd)
    rel.assert_same_state(before, rel.snapshot(other, new))


def _pair(a: int, b: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(a, b, bias=False), nn.Linear(b, a, bias=False)).to(torch.bfloat16)


def test_shape_mismatch_names_the_parameter(rel: Any) -> None:
    sd = rel.optimizer(_pair(4, 8)).state_dict()  # weights [8, 4], [4, 8]; arrival order: 1.weight first
    with pytest.raises(ValueError, match=r"parameter 1\.weight has shape \[4, 8\] in the checkpoint and \[2, 16\] now"):
        rel.optimizer(_pair(2, 16)).load_state_dict(sd)


def test_size_mismatch_names_the_first_differing_parameter(rel: Any) -> None:
    model, opt = _trained(rel)
    other = tiny_llama(intermediate_size=96)
    with pytest.raises(ValueError, match=r"first difference at model\.layers\.1\.mlp\.down_proj\.weight\)"):
        rel.optimizer(other).load_state_dict(opt.state_dict())


def _old_format(sd: dict[str, Any]) -> None:
    """As written before the order-sensitive checksum and the names existed (format v1: each device arena one host
    tensor, not its pieces)."""
    so = sd["superoffload"]
    so["format"] = "hf_superoffload.optimizer.v1"
    so["device"] = {k: torch.cat(st._pieces(x)).clone() for k, x in so["device"].items()}
    del so["names"]
    for entry in so["manifest"].values():
        del entry["checksum"]


def test_a_checkpoint_written_before_the_checksum_loads_and_its_plain_sum_is_still_verified(rel: Any) -> None:
    model, opt = _trained(rel)
    sd = copy.deepcopy(opt.state_dict())
    _old_format(sd)
    other = tiny_llama(seed=3)
    new = rel.optimizer(other)
    new.load_state_dict(copy.deepcopy(sd))
    for p, q in zip(model.parameters(), other.parameters()):
        assert torch.equal(p, q)

    sd["superoffload"]["host"]["exp_avg"][100] += 1.0
    with pytest.raises(ValueError, match=r"host/exp_avg fails its checksum \(saved -?\d+, read -?\d+\)"):
        rel.optimizer(tiny_llama(seed=3)).load_state_dict(sd)
    del sd["superoffload"]["manifest"]  # older still: no manifest at all
    rel.optimizer(tiny_llama(seed=3)).load_state_dict(sd)


def test_a_checksum_of_an_unknown_kind_is_refused_clearly(rel: Any) -> None:
    model, opt = _trained(rel)
    sd = copy.deepcopy(opt.state_dict())
    sd["superoffload"]["manifest"]["host/master"]["checksum"] = {"algorithm": "xxh3", "crcs": []}
    with pytest.raises(ValueError, match=r"host/master has a checksum this version cannot verify"):
        rel.optimizer(tiny_llama(seed=3)).load_state_dict(sd)
