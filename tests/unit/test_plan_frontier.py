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


def test_the_options_of_a_run_that_does_not_fit_come_from_the_search(capsys: pytest.CaptureFixture[str]) -> None:
    """A run no combination holds: the batch and sequence the options offer are the search's frontier (each fits by
    the plan search's own check, one more does not), and the switches the search weighed are not offered."""
    from hf_superoffload.config import SuperOffloadConfig
    from hf_superoffload.plan_cli import arrival_numels, load_model_config, resolve_profile
    from hf_superoffload.planning.memory_model import ModelShape
    from hf_superoffload.planning.planner import PlanError, Workload, device_holds, make_plan

    argv = ["--model", "8b", "--batch-size", "8", "--seq-len", "2048", "--grad-ckpt", "--profile", "h200",
            "--gpu-mem", "20"]
    rc = main(argv)
    out = capsys.readouterr().out
    assert rc == 1 and "DOES NOT FIT" in out
    options = out.split("Options:")[1]
    assert "weight_placement='flow' would free" not in options and "lower gpu_resident_buckets" not in options
    assert "the plan search already weighed gpu_resident_buckets, weight_placement" in options
    import re

    batch = int(re.search(r"batch size (\d+) fits", options).group(1))  # type: ignore[union-attr]
    seq = int(re.search(r"at batch size 8, sequences up to (\d+) tokens fit", options).group(1))  # type: ignore[union-attr]
    cfg = load_model_config("8b")
    numels, profile = arrival_numels(cfg), resolve_profile("h200", gpu_mem_gb=20, host_mem_gb=None)

    def fits(b: int, s: int) -> bool:
        w = Workload(ModelShape.from_config(cfg), b, s, True, layer_checkpointing=True,
                     chunked_loss=SuperOffloadConfig().chunked_loss)
        try:
            plan = make_plan(numels, element_size=2, config=SuperOffloadConfig(), profile=profile, workload=w)
        except PlanError:
            return False
        return device_holds(plan, w, profile, 1)[0]

    assert fits(batch, 2048) and not fits(batch + 1, 2048)
    assert fits(8, seq) and not fits(8, seq + 1)


def test_every_line_of_plan_agrees_with_the_verdict(capsys: pytest.CaptureFixture[str]) -> None:
    """8B batch 4 on the rtx4090 profile (24 GB GPU, 64 GiB host) fits no plan: the longest-sequence line says none
    (it once offered 1,341 tokens, checked on the GPU only), and the refusal offers neither streamed weights (the
    search weighed them) nor a chunked cross-entropy (the optimizer installs one). Where the run fits, its longest
    sequence is at least the one asked for."""
    rc = main(["--model", "8b", "--batch-size", "4", "--seq-len", "2048", "--grad-ckpt", "--profile", "rtx4090"])
    out = capsys.readouterr().out
    assert rc == 1 and "DOES NOT FIT" in out
    assert "longest sequence that fits at batch 4: none" in out
    assert "weight_placement='flow'" not in out and "chunked cross-entropy" not in out
    assert "the plan search weighed streamed weights too" in out
    rc = main(["--model", "8b", "--batch-size", "4", "--seq-len", "2048", "--grad-ckpt", "--profile", "h200",
               "--json"])
    fit = json.loads(capsys.readouterr().out)
    assert rc == 0 and fit["fits"]
    assert fit["longest_sequence"]["tokens"] >= 2048 and fit["longest_sequence"]["with_this_plan"]
