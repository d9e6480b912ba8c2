"""The Trainer's progress bar shows the loss, tokens/s and the GPU wait beside the step count (SuperOffloadTrainer
and examples/train_with_trainer.py, whose defaults keep the bar)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from hf_superoffload.integrations.transformers import SuperOffloadArguments, SuperOffloadTrainer
from hf_superoffload.testing import tiny_llama


def _postfixes(stderr: str) -> list[tuple[float, float, float]]:
    found = re.findall(r"loss ([0-9.]+)  tok/s ([0-9,]+)  gpu_wait ([0-9.]+) ms", stderr)
    return [(float(a), float(b.replace(",", "")), float(c)) for a, b, c in found]


def test_the_trainer_bar_shows_loss_tokens_per_second_and_gpu_wait(hf: Any, tmp_path: Path, capsys: Any) -> None:
    args = SuperOffloadArguments(**hf.train_kwargs(tmp_path, max_steps=4, logging_steps=2, disable_tqdm=False,
                                                   **hf.SMALL_BUCKETS))
    trainer = SuperOffloadTrainer(model=tiny_llama(seed=0), args=args, train_dataset=hf.TokenDataset(16, seq=16))
    trainer.train()
    shown = _postfixes(capsys.readouterr().err)
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert shown and shown[-1][0] == round(logged[-1], 4)  # the latest logged loss
    assert all(rate > 0 for _, rate, _ in shown)  # 2 sequences x 16 tokens per step, counted from input_ids


def test_the_trainer_example_shows_them_too(hf: Any, tmp_path: Path, capsys: Any) -> None:
    metrics = hf.example("train_with_trainer").main(["--output_dir", str(tmp_path), "--max_steps", "4", "--logging_steps", "2",
                            "--examples", "200", "--eval_steps", "4", "--use_cpu", "True"])
    assert metrics["train_loss"] > 0 and (tmp_path / "final" / "model.safetensors").is_file()
    assert _postfixes(capsys.readouterr().err)
