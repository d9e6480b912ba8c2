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
    assert [o.count("hf_superoffload plan:") for o in fin.outputs] == [1, 0]  # the main process shows it, once
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


def test_accelerate_sequence_parallel_matches_one_process(launcher, tmp_path):
    """prepare_superoffload(..., sequence_parallel_size=2): both ranks train the same 4 sequences, half of each."""
    one, two = tmp_path / "one", tmp_path / "two"
    env = {"ACCELERATE_USE_CPU": "true"}
    fin = launcher(WORKER, 1, [str(one), "6"], env=env)
    assert fin.returncodes == [0], fin.outputs[0][-3000:]
    fin = launcher(WORKER, 2, [str(two), "6", "-", "-1", "2"], env=env)
    assert fin.returncodes == [0, 0], "\n".join(o[-3000:] for o in fin.outputs)
    a = json.loads((one / "losses.json").read_text())
    b = json.loads((two / "losses.json").read_text())
    for k, (x, y) in enumerate(zip(a, b, strict=True)):
        assert abs(x - y) <= 5e-3 * max(1.0, abs(x)), f"step {k}: {x} (1 process) vs {y} (sp=2)"
