"""Preemption of a two-process SuperOffloadTrainer run: a SIGTERM that reaches one rank only stops every rank at
the same step ([Note: preemption agreement] in hf_superoffload/integrations/_preemption.py).

Rank 1 alone is signalled while it is inside the backward of step 3 (rank 0 is waiting for its gradients). Both
ranks must finish step 3, save checkpoint-3 together (each rank its optimizer shard) and exit 0; that checkpoint
must hold the same bits as an uninterrupted run's checkpoint-3, and resuming from it must end bit-identical to the
uninterrupted run. Without the agreement rank 1 stops alone and the ranks block each other (the deadline ends it).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

WORKER = Path(__file__).with_name("_preemption_worker.py")
MAX_STEPS, STOP_STEP = 6, 3
COMPLETE = {"optimizer_rank0.pt", "optimizer_rank1.pt", "scheduler.pt", "model.safetensors", "trainer_state.json",
            "rng_state_0.pth", "rng_state_1.pth"}


def _log(fin: Any) -> str:
    return "\n".join(f"--- rank {r} (rc {rc}) ---\n{out[-4000:]}"
                     for r, (rc, out) in enumerate(zip(fin.returncodes, fin.outputs)))


def _stopped_at(output: str) -> int | None:
    lines = [ln for ln in output.splitlines() if ln.startswith("STOPPED ")]
    return int(lines[-1].split()[1]) if lines else None


def _assert_same(a: Any, b: Any, where: str) -> None:
    """Nested state dicts hold the same structure, the same values and the same tensor bits."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: keys differ"
        for k in a:
            _assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _load(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=True)


@pytest.fixture(scope="module")
def uninterrupted(launcher: Any, tmp_path_factory: Any) -> Path:
    """The same run without a signal: checkpoint-3 (the preempted run's stop step) and checkpoint-6."""
    out = tmp_path_factory.mktemp("uninterrupted")
    fin = launcher(WORKER, 2, [str(out), str(MAX_STEPS), str(STOP_STEP)])
    assert fin.returncodes == [0, 0], _log(fin)
    return out


@pytest.fixture(scope="module")
def preempted(launcher: Any, tmp_path_factory: Any) -> tuple[Path, Any]:
    """No scheduled checkpoint (save_steps > max_steps): whatever is saved, the preemption saved."""
    out = tmp_path_factory.mktemp("preempted")
    fin = launcher(WORKER, 2, [str(out), str(MAX_STEPS), "100", "--block-at", str(STOP_STEP - 1), "--block-rank", "1"],
                   deadline=150, signal_when=(1, "BLOCKED backward", signal.SIGTERM))
    return out, fin


def test_sigterm_to_one_rank_stops_both_ranks_at_the_same_step_with_a_complete_checkpoint_of_it(
    preempted: tuple[Path, Any]
) -> None:
    out, fin = preempted
    assert "BLOCKED backward" in fin.outputs[1], _log(fin)
    assert fin.returncodes == [0, 0], _log(fin)
    assert [_stopped_at(o) for o in fin.outputs] == [STOP_STEP, STOP_STEP], _log(fin)
    ckpts = sorted(d.name for d in out.iterdir() if d.name.startswith("checkpoint-"))
    assert ckpts == [f"checkpoint-{STOP_STEP}"]
    ckpt = out / ckpts[0]
    files = set(os.listdir(ckpt))
    assert files >= COMPLETE, f"incomplete checkpoint: {sorted(files)}"
    assert not [f for f in files if f.endswith(".tmp")], sorted(files)
    assert json.loads((ckpt / "trainer_state.json").read_text())["global_step"] == STOP_STEP


def test_the_preempted_checkpoint_holds_the_bits_of_an_uninterrupted_run_at_that_step(
    preempted: tuple[Path, Any], uninterrupted: Path
) -> None:
    from safetensors.torch import load_file

    out, fin = preempted
    assert fin.returncodes == [0, 0], _log(fin)
    ckpt, reference = out / f"checkpoint-{STOP_STEP}", uninterrupted / f"checkpoint-{STOP_STEP}"
    # every rank's shard: masters, Adam moments, step counts; the scheduler; the model's weights
    for name in ("optimizer_rank0.pt", "optimizer_rank1.pt", "scheduler.pt"):
        _assert_same(_load(reference / name), _load(ckpt / name), name)
    _assert_same(load_file(reference / "model.safetensors"), load_file(ckpt / "model.safetensors"), "model")


def test_resuming_the_preempted_checkpoint_ends_bit_identical_to_an_uninterrupted_run(
    launcher: Any, preempted: tuple[Path, Any], uninterrupted: Path, tmp_path: Path
) -> None:
    src, fin = preempted
    assert fin.returncodes == [0, 0], _log(fin)
    resumed = tmp_path / "resumed"
    shutil.copytree(src, resumed)
    fin = launcher(WORKER, 2, [str(resumed), str(MAX_STEPS), "100", "--resume"])
    assert fin.returncodes == [0, 0], _log(fin)
    assert [_stopped_at(o) for o in fin.outputs] == [MAX_STEPS, MAX_STEPS], _log(fin)
    for rank in (0, 1):
        name = f"final_rank{rank}.pt"
        _assert_same(_load(uninterrupted / name), _load(resumed / name), name)
