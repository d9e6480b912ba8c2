"""[Note: workload from the first batch] under data parallel, over gloo on CPU.

A bare optimizer on two ranks plans at the first training forward. The ranks' first batches differ in sequence
length, and a plan made from each rank's own batch would differ (the tail shrinks as the sequence grows), which
would misalign the bucket shards; the ranks must agree on the largest shape and make one plan. Training then equals,
bit for bit, the same two ranks given that workload at construction (whose parity with the plain reference is
tests/distributed/test_data_parallel.py's, held to the fp32 rounding floor).
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from types import ModuleType

import torch

from hf_superoffload import SuperOffloadConfig
from hf_superoffload.planning.hardware import HardwareProfile
from hf_superoffload.planning.planner import Workload, make_plan
from hf_superoffload.testing import tiny_llama

WORKER = Path(__file__).with_name("_dp_workload_worker.py")
STEPS = 10
GiB = 1024**3


def _worker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_dp_workload_worker", WORKER)
    assert spec is not None and spec.loader is not None
    w = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(w)
    return w


def _tail(model: torch.nn.Module, budget: int, seq: int, rank: int = 0) -> int:
    """The GPU-resident buckets rank ``rank`` of two would plan for its own batch alone."""
    profile = HardwareProfile(device_type="cpu", device_free_bytes=budget, host_available_bytes=64 * GiB,
                              cpu_threads=1)
    numels = [p.numel() for p in model.parameters() if p.requires_grad][::-1]
    plan = make_plan(numels, element_size=2, config=SuperOffloadConfig(bucket_size_mb=0.004, cpu_threads=1),
                     profile=profile, world_size=2, rank=rank, local_world_size=2, local_rank=rank,
                     workload=Workload(model.config, 2, seq, grad_ckpt=False))
    return len(plan.device_buckets)


def _budget(model: torch.nn.Module, seqs: tuple[int, ...]) -> int:
    """A device budget on which the longest sequence still gets a GPU-resident tail and the shortest a larger one:
    a little above the smallest budget that gives the longest sequence any tail (the tiny model's activations differ
    by kilobytes, so the window is narrow: found by bisection)."""

    def threshold(seq: int) -> int:
        lo, hi = 0, 64 * GiB
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if _tail(model, mid, seq) > 0 else (mid, hi)
        return hi

    short, long = threshold(min(seqs)), threshold(max(seqs))
    return long + (long - short) // 2


def test_ranks_with_different_first_batches_agree_on_one_plan(launcher, tmp_path: Path) -> None:
    w = _worker()
    model = tiny_llama(seed=0)
    budget = _budget(model, w.SEQ)
    alone = [_tail(model, budget, seq, rank) for rank, seq in enumerate(w.SEQ)]
    assert alone[0] > alone[1] > 0, f"the ranks' own batches should plan different tails here, got {alone}"

    runs = {}
    for mode in ("bare", "given"):
        out = tmp_path / mode
        out.mkdir()
        fin = launcher(WORKER, 2, [str(out), str(budget), str(STEPS), *([mode] if mode == "given" else [])],
                       deadline=240.0)
        assert fin.returncodes == [0, 0], "\n".join(fin.outputs)
        runs[mode] = [torch.load(out / f"result_rank{r}.pt", weights_only=False) for r in range(2)]
    res, given = runs["bare"], runs["given"]
    assert not any(r["planned_at_construction"] for r in res), "the bare optimizer should wait for the first batch"
    assert all(r["planned_at_construction"] for r in given)
    assert [r["workload"] for r in res] == [(w.BATCH, max(w.SEQ))] * 2
    assert res[0]["device_buckets"] == res[1]["device_buckets"] == alone[1], (res[0]["device_buckets"], alone)
    for mine, theirs in zip(res, given, strict=True):  # each rank: the same losses, norm, weights and state bits
        assert mine["losses"] == theirs["losses"] and mine["grad_norm"] == theirs["grad_norm"]
        assert mine["params"].keys() == theirs["params"].keys()
        assert all(torch.equal(t, theirs["params"][n]) for n, t in mine["params"].items())
        assert _same_tensors(mine["state"], theirs["state"])
    assert all(math.isfinite(x) for x in res[0]["losses"])
    for n, t in res[0]["params"].items():  # every replica holds the same weights, bit for bit
        assert torch.equal(t, res[1]["params"][n]), n


def _same_tensors(a: object, b: object) -> bool:
    """``a`` and ``b`` (nested dicts, lists and tensors) hold the same structure and bits."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_tensors(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return isinstance(b, list | tuple) and len(a) == len(b) and all(map(_same_tensors, a, b))
    return a == b


def test_a_resume_before_the_first_batch_plans_with_it_and_equals_the_uninterrupted_run(launcher,
                                                                                     tmp_path: Path) -> None:
    """[Note: a state loaded before the first batch] under data parallel: the ranks' shards are loaded before the
    first batch (the plan has no bucket layout yet, so they are merged: views of the mapped files), the plan waits
    for that batch, and the resumed ranks end bit for bit where the uninterrupted run ends."""
    w = _worker()
    model = tiny_llama(seed=0)
    budget = _budget(model, w.SEQ)
    half = STEPS // 2
    runs = {}
    for mode in ("save", "resume"):
        out = tmp_path / mode
        out.mkdir()
        fin = launcher(WORKER, 2, [str(out), str(budget), str(STEPS), mode, str(half)], deadline=240.0)
        assert fin.returncodes == [0, 0], "\n".join(fin.outputs)
        runs[mode] = [torch.load(out / f"result_rank{r}.pt", weights_only=False) for r in range(2)]
    full, resumed = runs["save"], runs["resume"]
    assert full[0]["device_buckets"] > 0, "the budget should leave a GPU-resident tail"
    for mine, theirs in zip(resumed, full, strict=True):
        assert mine["workload"] == theirs["workload"] and mine["device_buckets"] == theirs["device_buckets"]
        assert mine["losses"] == theirs["losses"][half:] and mine["grad_norm"] == theirs["grad_norm"]
        assert all(torch.equal(t, theirs["params"][n]) for n, t in mine["params"].items())
        assert _same_tensors(mine["state"], theirs["state"])
