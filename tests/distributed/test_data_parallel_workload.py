"""[Note: workload from the first batch] under data parallel, over gloo on CPU.

A bare optimizer on two ranks plans at the first training forward. The ranks' first batches differ in sequence
length, and a plan made from each rank's own batch would differ (the tail shrinks as the sequence grows), which
would misalign the bucket shards; the ranks must agree on the largest shape and make one plan. Training then
matches the plain reference (fp32 masters + clip_grad_norm_ + torch AdamW) on the same global data with the
tolerances of tests/distributed/test_data_parallel.py.
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
from hf_superoffload.state import consolidate_state_dicts
from hf_superoffload.testing import ReferenceAdamW, tiny_llama

from .test_data_parallel import masters_by_name

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


def _reference(w: ModuleType) -> tuple[torch.nn.Module, ReferenceAdamW, list[float]]:
    """One process on the global data: each step's loss is the mean of the ranks' losses (the data-parallel mean
    of their gradients), with clipping and AdamW on fp32 masters."""
    model = tiny_llama(seed=0)
    ropt = ReferenceAdamW(model, max_grad_norm=1.0, lr=w.LR, weight_decay=0.1)
    per_rank = [w.batches(r, STEPS) for r in range(len(w.SEQ))]
    losses = []
    for step in range(STEPS):
        loss = sum(model(input_ids=b[step], labels=b[step]).loss.float() for b in per_rank) / len(per_rank)
        loss.backward()
        ropt.step()
        ropt.zero_grad()
        losses.append(loss.item())
    return model, ropt, losses


def test_ranks_with_different_first_batches_agree_on_one_plan(launcher, tmp_path: Path) -> None:
    w = _worker()
    model = tiny_llama(seed=0)
    budget = _budget(model, w.SEQ)
    alone = [_tail(model, budget, seq, rank) for rank, seq in enumerate(w.SEQ)]
    assert alone[0] > alone[1] > 0, f"the ranks' own batches should plan different tails here, got {alone}"

    fin = launcher(WORKER, 2, [str(tmp_path), str(budget), str(STEPS)], deadline=240.0)
    assert fin.returncodes == [0, 0], "\n".join(fin.outputs)
    res = [torch.load(tmp_path / f"result_rank{r}.pt", weights_only=False) for r in range(2)]
    assert not any(r["planned_at_construction"] for r in res), "the bare optimizer should wait for the first batch"
    assert [r["workload"] for r in res] == [(w.BATCH, max(w.SEQ))] * 2
    assert res[0]["device_buckets"] == res[1]["device_buckets"] == alone[1], (res[0]["device_buckets"], alone)

    ref_model, ropt, ref_losses = _reference(w)
    for k, (a, b) in enumerate(zip(res[0]["losses"], ref_losses, strict=True)):
        tol = 2e-5 if k < 3 else 5e-3
        assert math.isclose(a, b, rel_tol=tol, abs_tol=tol), f"step {k}: loss {a} vs reference {b}"
    assert math.isclose(res[0]["grad_norm"], ropt.last_grad_norm, rel_tol=5e-2)
    ours = masters_by_name(ref_model, consolidate_state_dicts([r["state"] for r in res]))
    names = {id(p): n for n, p in ref_model.named_parameters()}
    worst = max((ours[names[id(p)]] - m.detach()).abs().max().item() for p, m in ropt.pairs)
    assert worst < 8 * w.LR, f"final masters differ from the reference by {worst}"
    for n, t in res[0]["params"].items():  # every replica holds the same weights, bit for bit
        assert torch.equal(t, res[1]["params"][n]), n
