"""SuperOffloadTrainer with two gloo processes: the same training as one process on the same global batches,
per-rank optimizer shards in the checkpoints, and a resume into another number of processes."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

WORKER = Path(__file__).with_name("_trainer_worker.py")


def _losses(folder: Path) -> list[float]:
    return json.loads((folder / "losses.json").read_text())


def test_two_processes_train_like_one_on_the_same_global_batches(launcher, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    fin = launcher(WORKER, 1, [str(one), "8", "4"])
    assert fin.returncodes == [0], fin.outputs[0][-3000:]
    fin = launcher(WORKER, 2, [str(two), "8", "2"])
    assert fin.returncodes == [0, 0], "\n".join(o[-3000:] for o in fin.outputs)
    assert [o.count("hf_superoffload plan:") for o in fin.outputs] == [1, 0]  # the main process shows it, once
    a, b = _losses(one), _losses(two)
    assert len(a) == len(b) == 8
    for k, (x, y) in enumerate(zip(a, b)):
        assert math.isclose(x, y, rel_tol=5e-3, abs_tol=5e-3), f"step {k}: {x} (1 process) vs {y} (2 processes)"
    wa, wb = torch.load(one / "weights.pt"), torch.load(two / "weights.pt")
    worst = max((wa[n].float() - wb[n].float()).abs().max().item() for n in wa)
    assert worst < 8e-3, worst  # a few bf16 ulps / lr steps: a wrong reduction is off by far more

    ckpt = two / "checkpoint-4"
    files = set(os.listdir(ckpt))
    assert {"optimizer_rank0.pt", "optimizer_rank1.pt", "trainer_state.json"} <= files
    assert "optimizer.pt" not in files

    # resume the 2-process checkpoint in one process: the shards are merged
    resumed = tmp_path / "resumed"
    fin = launcher(WORKER, 1, [str(resumed), "8", "4", str(ckpt)])
    assert fin.returncodes == [0], fin.outputs[0][-3000:]
    assert "merging them" in fin.outputs[0]
    r = _losses(resumed)
    for k, (x, y) in enumerate(zip(b[4:], r)):
        assert math.isclose(x, y, rel_tol=5e-3, abs_tol=5e-3), f"resumed step {k}: {y} vs {x}"


def test_sequence_parallel_with_the_offloaded_optimizer(launcher, tmp_path):
    """sp=2 over 2 processes: each rank's batch is trained by both ranks (half the sequence each); the optimizer
    sums the two ranks' partial gradients (gradient_divisor = data-parallel size = 1)."""
    one, sp = tmp_path / "one", tmp_path / "sp"
    fin = launcher(WORKER, 1, [str(one), "4", "4"])
    assert fin.returncodes == [0], fin.outputs[0][-3000:]
    fin = launcher(WORKER, 2, [str(sp), "4", "2", "-", "2"])
    assert fin.returncodes == [0, 0], "\n".join(o[-3000:] for o in fin.outputs)
    a, b = _losses(one), _losses(sp)
    for k, (x, y) in enumerate(zip(a, b)):
        assert math.isclose(x, y, rel_tol=5e-3, abs_tol=5e-3), f"step {k}: {x} (1 process) vs {y} (sp=2)"


def test_sequence_parallel_with_weight_flow_and_checkpointing(launcher, tmp_path):
    """sp=2 with weight flow (every layer streamed from each rank's host copy) and gradient checkpointing."""
    one, sp = tmp_path / "one", tmp_path / "sp"
    fin = launcher(WORKER, 1, [str(one), "4", "4", "-", "1", "flow"])
    assert fin.returncodes == [0], fin.outputs[0][-3000:]
    fin = launcher(WORKER, 2, [str(sp), "4", "2", "-", "2", "flow"])
    assert fin.returncodes == [0, 0], "\n".join(o[-3000:] for o in fin.outputs)
    a, b = _losses(one), _losses(sp)
    for k, (x, y) in enumerate(zip(a, b)):
        assert math.isclose(x, y, rel_tol=5e-3, abs_tol=5e-3), f"step {k}: {x} (1 process) vs {y} (sp=2, flow)"
