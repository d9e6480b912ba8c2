"""Temporary files of interrupted atomic saves are cleaned, and resume picks the newest *complete* checkpoint.

Promises (docs/reliability.md): the next save into a folder (and a resume from it) removes the stale temp files of
ours (by name; never another program's, never one written since this process started, which another rank may be
writing now); ``resume_from_checkpoint=True`` and the Accelerate example's ``--resume latest`` skip a folder without
its completion marker or with a temp file of ours, with a warning, through one function
(``last_complete_checkpoint``).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from hf_superoffload.integrations._common import (
    COMPLETE_MARKER,
    atomic_torch_save,
    last_complete_checkpoint,
    remove_stale_temp_files,
)

REPO = Path(__file__).resolve().parents[2]
STALE = (".optimizer.pt.k3j9x0qa.tmp", ".scheduler.pt.a1b2c3d4.superoffload.tmp", ".optimizer_rank1.pt.zz_9zz9z.tmp")
FOREIGN = (".data.bin.k3j9x0qa.tmp", "notes.tmp", ".optimizer.pt.tmp")


def _plant(folder: Path, names: tuple[str, ...], age_s: float = 3600.0) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / name).write_bytes(b"partial")
        if age_s:
            t = time.time() - age_s
            os.utime(folder / name, (t, t))


def test_a_save_removes_only_our_stale_temp_files(tmp_path: Path, caplog: Any) -> None:
    _plant(tmp_path, STALE + FOREIGN)
    in_flight = ".optimizer_rank0.pt.qqqqqqqq.superoffload.tmp"  # another rank of this run, writing now
    _plant(tmp_path, (in_flight,), age_s=0)
    with caplog.at_level(logging.WARNING, logger="hf_superoffload"):
        atomic_torch_save({"x": torch.ones(3)}, tmp_path / "optimizer.pt")
    left = {p.name for p in tmp_path.iterdir()}
    assert left == {"optimizer.pt", in_flight, *FOREIGN}
    assert torch.equal(torch.load(tmp_path / "optimizer.pt", weights_only=True)["x"], torch.ones(3))
    (msg,) = [r.getMessage() for r in caplog.records if "stale temporary" in r.getMessage()]
    assert "3 stale temporary file(s)" in msg and str(tmp_path) in msg
    assert remove_stale_temp_files(tmp_path) == [] and remove_stale_temp_files(tmp_path / "missing") == []


def test_last_complete_checkpoint_skips_unmarked_and_interrupted_folders(tmp_path: Path, caplog: Any) -> None:
    for n in (2, 4, 6):
        (tmp_path / f"step-{n}").mkdir()
    (tmp_path / "step-2" / COMPLETE_MARKER).write_text("{}")
    (tmp_path / "step-4" / COMPLETE_MARKER).write_text("{}")
    _plant(tmp_path / "step-4", STALE[:1])  # a save into a complete folder was interrupted: mixed steps
    with caplog.at_level(logging.WARNING, logger="hf_superoffload"):
        assert last_complete_checkpoint(str(tmp_path), prefix="step") == str(tmp_path / "step-2")
    msg = " ".join(r.getMessage() for r in caplog.records)
    assert f"step-6: no {COMPLETE_MARKER}" in msg and f"step-4: an interrupted save left {STALE[0]}" in msg
    (tmp_path / "step-2" / COMPLETE_MARKER).unlink()
    with pytest.raises(ValueError, match="every step-N folder is incomplete"):
        last_complete_checkpoint(str(tmp_path), prefix="step")


def test_trainer_resume_skips_an_interrupted_checkpoint_and_cleans_the_one_it_resumes(tmp_path: Path, caplog: Any) -> None:
    from hf_superoffload import SuperOffloadArguments, SuperOffloadTrainer
    from hf_superoffload.testing import TokenDataset, tiny_llama

    def trainer(max_steps: int) -> Any:
        args = SuperOffloadArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", disable_tqdm=True,
                                     save_strategy="steps", save_steps=2, max_steps=max_steps,
                                     per_device_train_batch_size=2, learning_rate=1e-3, seed=0,
                                     dataloader_num_workers=0, superoffload_bucket_size_mb=0.004,
                                     superoffload_gpu_resident_buckets="1")
        return SuperOffloadTrainer(model=tiny_llama(seed=0), args=args, train_dataset=TokenDataset(16))

    trainer(4).train()
    _plant(tmp_path / "checkpoint-4", STALE[:1])  # checkpoint-4 was being re-saved when the run died
    resumed = trainer(6)
    with caplog.at_level(logging.WARNING, logger="hf_superoffload"):
        resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 6
    (msg,) = [r.getMessage() for r in caplog.records if "skipping incomplete" in r.getMessage()]
    assert "checkpoint-4: an interrupted save left" in msg and msg.endswith(str(tmp_path / "checkpoint-2"))
    # the re-save into checkpoint-4 removed the stale file there
    assert not [f for f in os.listdir(tmp_path / "checkpoint-4") if f.endswith(".tmp")]
    # a resume from a named folder removes the stale files in it
    _plant(tmp_path / "checkpoint-2", STALE[1:])
    again = trainer(6)
    again.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert again.state.global_step == 6
    assert not [f for f in os.listdir(tmp_path / "checkpoint-2") if f.endswith(".tmp")]


@pytest.fixture
def fresh_accelerate_state() -> Any:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _example(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, REPO / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_accelerate_example_resume_latest_picks_the_newest_complete_checkpoint(
    tmp_path: Path, fresh_accelerate_state: None, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    example = _example("train_with_accelerate")
    common = ["--output-dir", str(tmp_path), "--save-every", "2", "--examples", "64", "--batch-size", "2",
              "--seq-len", "32", "--grad-accum", "1"]
    example.main([*common, "--max-steps", "4"])
    assert (tmp_path / "step-2" / COMPLETE_MARKER).is_file() and (tmp_path / "step-4" / COMPLETE_MARKER).is_file()
    (tmp_path / "step-4" / COMPLETE_MARKER).unlink()  # the run died inside save_state of step 4
    capsys.readouterr()
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    example.main([*common, "--max-steps", "6", "--resume", "latest"])
    out = capsys.readouterr().out
    assert f"resumed from {tmp_path / 'step-2'} at step 2" in out
    assert (tmp_path / "step-6" / COMPLETE_MARKER).is_file()
