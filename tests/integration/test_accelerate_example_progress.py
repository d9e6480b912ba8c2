"""examples/train_with_accelerate.py: a progress bar with loss, tokens/s and GPU wait on a terminal, none otherwise;
the per-step lines stay on stdout."""

from __future__ import annotations

import io
import sys
from pathlib import Path
from typing import Any

import pytest


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("terminal", [True, False])
def test_progress_bar(terminal: bool, hf: Any, tmp_path: Path, fresh_accelerate_state: None, capsys: Any,
                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    err = _Terminal() if terminal else io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    hf.example("train_with_accelerate").main(["--output-dir", str(tmp_path), "--max-steps", "3", "--save-every", "0", "--examples", "64",
                     "--batch-size", "2", "--seq-len", "32", "--grad-accum", "1"])
    out, bar = capsys.readouterr().out, err.getvalue()
    assert "step    3  loss" in out and "tokens/s" in out and "done at step 3" in out
    if terminal:
        assert "3/3" in bar and "loss " in bar and "tok/s " in bar and "gpu_wait " in bar
    else:
        assert "train:" not in bar
