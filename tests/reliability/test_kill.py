"""Preemption and death: SIGTERM in the middle of a Trainer run (the step finishes, is saved, the run stops and the
script exits 0), SIGKILL while a checkpoint is being written.

A child process (``_kill_child.py``) trains a tiny Llama and blocks at a known point (inside backward, or
half-way through writing ``optimizer.pt``); the test signals it there and checks what is on disk: every
checkpoint is complete, nothing partial sits under a final file name, and resuming from the last one gives the
same weights and optimizer state, bit for bit, as a run that was never interrupted.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

CHILD = Path(__file__).with_name("_kill_child.py")
COMPLETE = {"optimizer.pt", "scheduler.pt", "model.safetensors", "trainer_state.json", "rng_state.pth"}


class Child:
    """``python _kill_child.py ARGS`` with its output read line by line."""

    def __init__(self, *args: str) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        env.pop("ACCELERATE_MIXED_PRECISION", None)
        self.proc = subprocess.Popen([sys.executable, str(CHILD), *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=env)
        self.log: list[str] = []
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def wait_for(self, prefix: str, timeout: float = 300) -> str:
        while True:
            try:
                line = self._lines.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"no {prefix!r} from the child in {timeout}s:\n" + "\n".join(self.log)) from None
            if line is None:
                raise AssertionError(f"the child exited ({self.proc.wait()}) before {prefix!r}:\n" + "\n".join(self.log))
            self.log.append(line)
            if line.startswith(prefix):
                return line

    def kill(self, sig: int) -> int:
        os.kill(self.proc.pid, sig)
        return self.proc.wait(timeout=60)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=60)


def _checkpoints(out: Path) -> dict[str, set[str]]:
    return {d.name: set(os.listdir(d)) for d in sorted(out.iterdir()) if d.name.startswith("checkpoint-")}


def _final_state(trainer: Any) -> dict[str, torch.Tensor]:
    opt = trainer.superoffload_optimizer
    opt.synchronize()
    state = {f"weight/{n}": p.detach().clone() for n, p in trainer.model.named_parameters()}
    flat = opt.engine.flat_state()
    state.update({f"{side}/{k}": v.detach().cpu().clone() for side in flat for k, v in flat[side].items()})
    state["param_steps"] = torch.tensor(opt.engine.param_steps)
    return state


def _assert_equal_states(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs from the uninterrupted run"


def _resume(child_mod: Any, src: Path, dst: Path, checkpoint: str | bool) -> dict[str, torch.Tensor]:
    shutil.copytree(src, dst)
    trainer = child_mod.make_trainer(str(dst))
    resume = str(dst / checkpoint) if isinstance(checkpoint, str) else checkpoint
    trainer.train(resume_from_checkpoint=resume)
    assert trainer.state.global_step == 12
    try:
        return _final_state(trainer)
    finally:
        trainer.superoffload_optimizer.close()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: Any, kill_child: Any) -> dict[str, torch.Tensor]:
    trainer = kill_child.make_trainer(str(tmp_path_factory.mktemp("uninterrupted")))
    trainer.train()
    try:
        return _final_state(trainer)
    finally:
        trainer.superoffload_optimizer.close()


@pytest.fixture(scope="module")
def sigterm_in_backward(tmp_path_factory: Any) -> tuple[Path, int, list[str]]:
    out = tmp_path_factory.mktemp("sigterm")
    child = Child("trainer", str(out), "--block", "backward", "--at", "7", "--block-s", "3")
    try:
        child.wait_for("BLOCKED backward")  # inside backward of step 8; checkpoints 3 and 6 were written
        rc = child.kill(signal.SIGTERM)
        with contextlib.suppress(AssertionError):
            child.wait_for("FINISHED", timeout=5)
        return out, rc, child.log
    finally:
        child.close()


@pytest.fixture(scope="module")
def sigkill_in_save(tmp_path_factory: Any) -> tuple[Path, int, int]:
    out = tmp_path_factory.mktemp("sigkill")
    child = Child("trainer", str(out), "--block", "save", "--at", "6")
    try:
        line = child.wait_for("BLOCKED save")  # half of checkpoint-6/optimizer.pt is written
        return out, child.kill(signal.SIGKILL), int(line.split()[-1])
    finally:
        child.close()


def test_sigterm_mid_backward_finishes_the_step_saves_it_and_exits_0_and_that_checkpoint_resumes_bit_identically(
    sigterm_in_backward: tuple[Path, int, list[str]], uninterrupted: dict[str, torch.Tensor], tmp_path: Path,
    kill_child: Any,
) -> None:
    out, rc, log = sigterm_in_backward
    # preemption: the step in flight (8) finishes, is saved atomically, and train() returns: the script exits 0
    assert rc == 0, "\n".join(log)
    assert "FINISHED" in log
    ckpts = _checkpoints(out)
    assert list(ckpts) == ["checkpoint-3", "checkpoint-6", "checkpoint-8"]
    for name, files in ckpts.items():
        assert files >= COMPLETE, f"{name} is incomplete: {sorted(files)}"
        assert not [f for f in files if f.endswith(".tmp")], f"{name} holds a temporary file"
    state = torch.load(out / "checkpoint-8" / "optimizer.pt", map_location="cpu", weights_only=True)
    assert state["superoffload"]["format"] == "hf_superoffload.optimizer.v2"
    _assert_equal_states(uninterrupted, _resume(kill_child, out, tmp_path / "resumed", True))


def test_sigkill_while_saving_a_checkpoint_leaves_no_partial_optimizer_file_and_the_previous_one_resumes(
    sigkill_in_save: tuple[Path, int, int], uninterrupted: dict[str, torch.Tensor], tmp_path: Path, kill_child: Any
) -> None:
    out, rc, full_size = sigkill_in_save
    assert rc == -signal.SIGKILL
    ckpts = _checkpoints(out)
    assert list(ckpts) == ["checkpoint-3", "checkpoint-6"]
    assert ckpts["checkpoint-3"] >= COMPLETE
    partial = ckpts["checkpoint-6"]
    # the model was written before the optimizer; the optimizer file exists only under its temporary name
    assert "model.safetensors" in partial
    assert "optimizer.pt" not in partial and "trainer_state.json" not in partial
    tmps = [f for f in partial if f.startswith(".optimizer.pt.") and f.endswith(".tmp")]
    assert len(tmps) == 1, sorted(partial)
    assert (out / "checkpoint-6" / tmps[0]).stat().st_size == full_size // 2
    with pytest.raises(Exception):  # noqa: B017 - torch raises RuntimeError or EOFError on a cut file
        torch.load(out / "checkpoint-6" / tmps[0], map_location="cpu", weights_only=True)
    _assert_equal_states(uninterrupted, _resume(kill_child, out, tmp_path / "resumed", "checkpoint-3"))


def test_resume_latest_after_a_kill_during_save_skips_the_incomplete_checkpoint(
    sigkill_in_save: tuple[Path, int, int], uninterrupted: dict[str, torch.Tensor], tmp_path: Path, kill_child: Any
) -> None:
    out, _, _ = sigkill_in_save
    _assert_equal_states(uninterrupted, _resume(kill_child, out, tmp_path / "resumed", True))


def test_sigkill_during_atomic_save_keeps_the_previous_file_and_it_resumes(tmp_path: Path, kill_child: Any) -> None:
    from hf_superoffload import SuperOffloadConfig, SuperOffloadOptimizer
    from hf_superoffload import state as st
    from hf_superoffload.testing import tiny_llama

    child = Child("atomic", str(tmp_path))
    try:
        saved_hash = child.wait_for("SAVED").split()[1]
        full_size = int(child.wait_for("BLOCKED save").split()[-1])
        assert child.kill(signal.SIGKILL) == -signal.SIGKILL
    finally:
        child.close()
    final = tmp_path / "optimizer.pt"
    assert hashlib.sha256(final.read_bytes()).hexdigest() == saved_hash, "the previous checkpoint was touched"
    tmps = [p for p in tmp_path.iterdir() if p.name.startswith(".optimizer.pt.") and p.name.endswith(".tmp")]
    assert len(tmps) == 1 and tmps[0].stat().st_size == full_size // 2  # left behind, under a temporary name only
    with pytest.raises(Exception):  # noqa: B017
        torch.load(tmps[0], map_location="cpu", weights_only=True)

    state = torch.load(final, map_location="cpu", weights_only=True)
    assert state["superoffload"]["param_steps"].tolist() == [2] * len(state["superoffload"]["numels"])
    model = tiny_llama(seed=1, **kill_child.ATOMIC_MODEL)
    model.load_state_dict(torch.load(tmp_path / "model.pt", map_location="cpu", weights_only=True))
    opt = SuperOffloadOptimizer(model, lr=1e-3, max_grad_norm=1.0, log_plan=False,
                                config=SuperOffloadConfig(bucket_size_mb=0.5, gpu_resident_buckets=1))
    try:
        opt.load_state_dict(state)
        for side in ("host", "device"):
            for k, v in opt.engine.flat_state()[side].items():
                assert torch.equal(v, torch.cat(st._pieces(state["superoffload"][side][k]))), f"{side}/{k} not restored"
        ids = torch.randint(0, kill_child.ATOMIC_MODEL["vocab_size"], (2, 16))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.synchronize()
        assert torch.isfinite(loss) and not opt.step_was_skipped
        assert opt.engine.param_steps == [3] * len(opt.engine.params)
    finally:
        opt.close()
    with contextlib.suppress(OSError):
        tmps[0].unlink()
