"""``hf-superoffload train`` / ``plan`` with bad numbers or paths: one line naming the flag, exit 2, no traceback,
never a hang (``train --batch-size -1`` used to spin forever in the batch packer; ``--steps 0`` and ``--lr -1``
ended in tracebacks; ``plan --seq-len 1e11`` printed a 7.8e16 GiB estimate)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hf_superoffload.cli import main as cli_main
from hf_superoffload.plan_cli import main as plan_main

PLAN = ["plan", "--model", "tiny", "--batch-size", "1", "--seq-len", "16", "--profile", "h200"]


def _refused(capsys: Any, argv: list[str], entry: Any = cli_main) -> str:
    with pytest.raises(SystemExit) as info:
        entry(argv)
    out, err = capsys.readouterr()
    assert info.value.code == 2 and not out
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize(("argv", "flag", "why"), [
    (["--batch-size", "-1"], "--batch-size", "-1 is out of range: use 1..65,536"),
    (["--batch-size", "0"], "--batch-size", "out of range"),
    (["--steps", "0"], "--steps", "0 is out of range: use 1.."),
    (["--steps", "ten"], "--steps", "'ten' is not a whole number"),
    (["--lr", "-1"], "--lr", "-1 is out of range: use a number in (0, 1], e.g. 1e-4"),
    (["--lr", "nan"], "--lr", "out of range"),
    (["--lr", "0"], "--lr", "out of range"),
    (["--seq-len", "1e11"], "--seq-len", "1e11 is out of range"),
    (["--seq-len", "1"], "--seq-len", "out of range"),
    (["--warmup", "-5"], "--warmup", "out of range"),
    (["--examples", "0"], "--examples", "out of range"),
    (["--log-every", "0"], "--log-every", "out of range"),
    (["--seed", "-1"], "--seed", "out of range"),
    (["--model", "./no/such/model"], "--model", "'./no/such/model' does not exist: give a preset"),
    (["--model", "/no/such/folder"], "--model", "does not exist"),
    (["--offload-config", "{bad"], "--offload-config", "not valid JSON"),
    (["--offload-config", "[1]"], "--offload-config", "expected a JSON object"),
    (["--offload-config", '{"bucket_size_mb": -1}'], "--offload-config", "SuperOffloadConfig.bucket_size_mb=-1"),
    (["--device", "tpu"], "--device", "'tpu' is not"),
])
def test_train_refuses_bad_arguments_in_one_line(capsys: Any, argv: list[str], flag: str, why: str) -> None:
    line = _refused(capsys, ["train", *argv])
    assert line.startswith(f"hf-superoffload train: error: argument {flag}: ") and why in line, line


def test_train_refuses_an_output_dir_that_is_a_file(capsys: Any, tmp_path: Path) -> None:
    f = tmp_path / "out"
    f.write_text("")
    assert "argument --output-dir: " in _refused(capsys, ["train", "--output-dir", str(f)])


@pytest.mark.parametrize(("argv", "flag", "why"), [
    (["--seq-len", "100000000000"], "--seq-len", "100000000000 is out of range: use 1..16,777,216"),
    (["--seq-len", "1e11"], "--seq-len", "out of range"),
    (["--seq-len", "0"], "--seq-len", "out of range"),
    (["--batch-size", "0"], "--batch-size", "out of range"),
    (["--batch-size", "-3"], "--batch-size", "out of range"),
    (["--gpu-mem", "-5"], "--gpu-mem", "-5 is out of range: use a number in (0, 1e+06] GiB"),
    (["--host-mem", "nan"], "--host-mem", "out of range"),
    (["--host-mem", "1e300"], "--host-mem", "out of range"),
    (["--sequence-parallel", "0"], "--sequence-parallel", "out of range"),
    (["--loss-chunk", "0"], "--loss-chunk", "out of range"),
    (["--tiled-mlp", "-1"], "--tiled-mlp", "out of range"),
    (["--model", "/no/such/config.json"], "--model", "does not exist"),
    (["--model", "missing.json"], "--model", "does not exist"),
    (["--offload-config", "{"], "--offload-config", "not valid JSON"),
])
def test_plan_refuses_bad_arguments_in_one_line(capsys: Any, argv: list[str], flag: str, why: str) -> None:
    line = _refused(capsys, [*PLAN, *argv])  # the later value of a repeated flag wins
    assert line.startswith(f"hf-superoffload plan: error: argument {flag}: ") and why in line, line
    line = _refused(capsys, PLAN[1:] + argv, plan_main)  # python -m hf_superoffload.plan_cli
    assert f"argument {flag}: " in line and why in line


def _run(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, "-m", "hf_superoffload.cli", *argv], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_negative_batch_size_exits_2_instead_of_hanging() -> None:
    res = _run("train", "--batch-size", "-1", "--steps", "1", timeout=60)  # a hang fails by TimeoutExpired
    assert res.returncode == 2 and not res.stdout
    assert res.stderr.strip() == ("hf-superoffload train: error: argument --batch-size: -1 is out of range: use "
                                  "1..65,536 (see --help)")


def test_an_uncached_hub_model_and_a_corpus_shorter_than_one_sequence_end_in_one_line() -> None:
    res = _run("train", "--model", "no-such-org/no-such-model", "--device", "cpu", "--steps", "1")
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith(
        "hf-superoffload train: error: argument --model: cannot load 'no-such-org/no-such-model': ")
    res = _run("train", "--device", "cpu", "--examples", "1", "--seq-len", "100000", "--steps", "1")
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("hf-superoffload train: error: argument --seq-len: the corpus has ") and "--examples" in last


def test_the_random_init_preset_keeps_fp32_rope_frequencies_as_from_pretrained_does() -> None:
    """The main job's random-init model is bf16 as from_pretrained loads one, its RoPE frequencies fp32: a model
    cast after building (``.to(bfloat16)``) rounds them too, and then a trained model and its reload (fp32
    frequencies again) generate differently from the same weights."""
    import argparse

    import torch

    from hf_superoffload.cli import _preset

    args = argparse.Namespace(dataset="auto", examples=None, seed=0, seq_len=None)
    model = _preset(args, "tiny", torch.device("cpu"))[0]
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    freqs = [b for name, b in model.named_buffers() if name.endswith("inv_freq")]
    assert freqs and all(b.dtype == torch.float32 for b in freqs), [b.dtype for b in freqs]
