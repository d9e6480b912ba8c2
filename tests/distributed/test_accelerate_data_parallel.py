"""prepare_superoffload in a two-process Accelerate loop (gloo): no DDP wrapper, the optimizer shards its state,
``save_state`` writes every rank's shard and ``load_state`` resumes bit-exactly."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

WORKER = Path(__file__).with_name("_accelerate_worker.py")


def test_accelerate_two_processes_save_and_resume_bit_exactly(launcher, tmp_path):
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    fin = launcher(WORKER, 2, [str(full), "8", "-", "3"], env={"ACCELERATE_USE_CPU": "true"})
    assert fin.returncodes == [0, 0], "\n".join(o[-3000:] for o in fin.outputs)
    files = set(os.listdir(full / "ckpt"))
    assert {"optimizer_rank0.pt", "optimizer_rank1.pt"} <= files, files
    fin = launcher(WORKER, 2, [str(resumed), "4", str(full / "ckpt")], env={"ACCELERATE_USE_CPU": "true"})
    assert fin.returncodes == [0, 0], "\n".join(o[-3000:] for o in fin.outputs)
    a = json.loads((full / "losses.json").read_text())
    b = json.loads((resumed / "losses.json").read_text())
    assert a[4:] == b, (a, b)
    wa, wb = torch.load(full / "weights.pt"), torch.load(resumed / "weights.pt")
    for n in wa:
        assert torch.equal(wa[n], wb[n]), n
