"""``hf-superoffload train`` shows its plan once and a progress bar (loss, tokens/s, GPU wait) on a terminal."""

from __future__ import annotations

import io
import sys
from typing import Any

import pytest

from hf_superoffload.cli import main

ARGS = ["train", "--device", "cpu", "--steps", "4", "--examples", "200", "--seq-len", "32", "--batch-size", "2",
        "--log-every", "2"]


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # train writes its outputs under ./superoffload-train-out


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_on_a_terminal(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    assert main(ARGS) == 0
    bar = term.getvalue()
    assert "train: 100%" in bar and "4/4" in bar
    assert "loss " in bar and "tok/s " in bar and "gpu_wait " in bar  # the postfix
    out = capsys.readouterr().out
    assert out.count("hf_superoffload plan:") == 1 and "CPU Adam backend:" in out
    assert "step     4  loss" in out


def test_no_bar_when_not_a_terminal(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    pipe = io.StringIO()
    monkeypatch.setattr(sys, "stderr", pipe)
    assert main(ARGS) == 0
    assert "train:" not in pipe.getvalue() and "\r" not in pipe.getvalue()
    out = capsys.readouterr().out
    assert out.count("hf_superoffload plan:") == 1 and "step     4  loss" in out
