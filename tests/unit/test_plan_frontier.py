"""The verdict and the "largest that fits" frontier come from one search: the model at the frontier fits, the
next layer does not, and a 15B-class model trains on one H200 with no settings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_superoffload.demo.presets import PRESETS
from hf_superoffload.plan_cli import main


def _plan(tmp_path: Path, layers: int, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict]:
    cfg = dict(PRESETS["14b"], num_hidden_layers=layers, model_type="llama")
    path = tmp_path / f"m{layers}.json"
    path.write_text(json.dumps(cfg))
    rc = main(["--model", str(path), "--batch-size", "4", "--seq-len", "2048", "--grad-ckpt",
               "--profile", "h200", "--json"])
    return rc, json.loads(capsys.readouterr().out)


def test_verdict_and_frontier_agree_and_15b_fits_by_default(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = _plan(tmp_path, 49, capsys)  # 15.04B
    assert rc == 0 and out["fits"], out["reason"]
    assert out["plan"]["device_buckets"] > 0 and out["plan"]["host_buckets"] > 0  # both memories are needed
    frontier = out["largest_fitting"]["num_layers"]
    assert frontier >= 49
    rc_at, at = _plan(tmp_path, frontier, capsys)
    rc_past, past = _plan(tmp_path, frontier + 1, capsys)
    assert rc_at == 0 and at["fits"]
    assert rc_past == 1 and not past["fits"]
    assert at["largest_fitting"]["num_layers"] == past["largest_fitting"]["num_layers"] == frontier
