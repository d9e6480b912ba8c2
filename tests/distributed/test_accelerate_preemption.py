"""Preemption of examples/train_with_accelerate.py (``with Preemption()`` around its loop): a SIGTERM in the
backward of step 3 lets that step finish; every rank stops after it, saves it (``step-3``, marked complete) and
exits 0. One process: resuming that checkpoint continues exactly as the uninterrupted run. Two gloo processes with
rank 1 alone signalled: both ranks stop after step 3 and save it together ([Note: preemption agreement] in
hf_superoffload/integrations/_preemption.py). Without the handler the signalled process dies with the signal and
saves nothing.
"""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path
from typing import Any

WORKER = Path(__file__).with_name("_accelerate_preemption_worker.py")
MAX_STEPS, STOP_STEP, GRAD_ACCUM = 6, 3, 2
ENV = {"ACCELERATE_USE_CPU": "true", "HF_SUPEROFFLOAD_BUCKET_SIZE_MB": "0.25", "HF_SUPEROFFLOAD_CPU_THREADS": "1"}


def _log(fin: Any) -> str:
    return "\n".join(f"--- rank {r} (rc {rc}) ---\n{out[-4000:]}"
                     for r, (rc, out) in enumerate(zip(fin.returncodes, fin.outputs)))


def _run(launcher: Any, world: int, out: Path, *, block_rank: int | None = None, resume: bool = False) -> Any:
    """The example on ``world`` ranks; ``block_rank``: that rank blocks in step STOP_STEP's backward and gets the
    SIGTERM there. No scheduled checkpoint before the last step: whatever else is saved, the preemption saved."""
    block = [str(STOP_STEP - 1), str(block_rank)] if block_rank is not None else ["-1", "0"]
    args = [*block, str(GRAD_ACCUM), "--output-dir", str(out), "--max-steps", str(MAX_STEPS), "--save-every", "0",
            "--examples", "64", "--batch-size", "2", "--seq-len", "32", "--max-grad-norm", "10",
            *(["--resume", "latest"] if resume else [])]
    when = (block_rank, "BLOCKED backward", signal.SIGTERM) if block_rank is not None else None
    return launcher(WORKER, world, args, deadline=90, env=ENV, signal_when=when)


def _step_lines(output: str) -> dict[int, str]:
    """``step N  loss ...  grad_norm ...`` per optimizer step (the loss and norm, not the timings)."""
    return {int(m[1]): m[2] for m in re.finditer(r"^step +(\d+) +(loss \S+ +grad_norm \S+)", output, re.M)}


def _assert_stopped_and_saved(out: Path, fin: Any, world: int) -> None:
    assert fin.returncodes == [0] * world, _log(fin)
    assert all("EXITED" in o for o in fin.outputs), _log(fin)
    assert f"stopped after a SIGTERM at step {STOP_STEP}" in fin.outputs[0], _log(fin)
    assert max(_step_lines(fin.outputs[0])) == STOP_STEP, _log(fin)
    assert sorted(d.name for d in out.iterdir()) == [f"step-{STOP_STEP}"]
    ckpt = out / f"step-{STOP_STEP}"
    assert json.loads((ckpt / "checkpoint_complete.json").read_text())["step"] == STOP_STEP
    files = set(os.listdir(ckpt))
    want = {"model.safetensors", "optimizer.bin", "scheduler.bin", "custom_checkpoint_0.pkl"}
    want |= {f"random_states_{r}.pkl" for r in range(world)}
    if world > 1:  # every rank's optimizer shard, of the same step
        want |= {f"optimizer_rank{r}.pt" for r in range(world)}
    assert files >= want, f"incomplete checkpoint: {sorted(files)}"
    assert not [f for f in files if f.endswith(".tmp")], sorted(files)


def test_sigterm_mid_step_saves_that_step_exits_0_and_resumes_as_if_uninterrupted(launcher: Any,
                                                                                   tmp_path: Path) -> None:
    full = _run(launcher, 1, tmp_path / "full")
    assert full.returncodes == [0], _log(full)
    assert "BLOCKED" not in full.outputs[0] and "SIGTERM" not in full.outputs[0]
    out = tmp_path / "preempted"
    fin = _run(launcher, 1, out, block_rank=0)
    assert "BLOCKED backward" in fin.outputs[0], _log(fin)
    _assert_stopped_and_saved(out, fin, 1)
    reference = _step_lines(full.outputs[0])
    assert _step_lines(fin.outputs[0]) == {s: reference[s] for s in range(1, STOP_STEP + 1)}
    resumed = _run(launcher, 1, out, resume=True)
    assert resumed.returncodes == [0], _log(resumed)
    assert f"resumed from {out / f'step-{STOP_STEP}'} at step {STOP_STEP}" in resumed.outputs[0], _log(resumed)
    assert _step_lines(resumed.outputs[0]) == {s: reference[s] for s in range(STOP_STEP + 1, MAX_STEPS + 1)}


def test_sigterm_to_one_of_two_ranks_stops_both_after_the_same_step_with_its_checkpoint(launcher: Any,
                                                                                        tmp_path: Path) -> None:
    out = tmp_path / "preempted"
    fin = _run(launcher, 2, out, block_rank=1)
    assert "BLOCKED backward" in fin.outputs[1], _log(fin)
    _assert_stopped_and_saved(out, fin, 2)
