"""CPU rehearsal of benchmarks/long_context.py: 2 processes under torchrun (gloo), tiny model, 3 steps.

Step 0's loss (before any update) must equal a single-process HF loss on the same weights and tokens, the
rehearsal optimizer must lower the loss, and every line carries the fields the GPU run reports.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "long_context.py"


def _bench_module():
    spec = importlib.util.spec_from_file_location("long_context_bench", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


SEQ = 96


def _rehearse(out: Path, *extra: str) -> list[dict]:
    """2 ranks, tiny fp32 model, 1 warmup + 2 steps of the SGD rehearsal optimizer; the JSON lines."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-P", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(SCRIPT),
           "--model", "tiny", "--device", "cpu", "--dtype", "fp32", "--seq-len", str(SEQ), "--optimizer", "sgd",
           "--lr", "0.5", "--steps", "2", "--warmup", "1", "--chunk-size", "40", "--out", str(out), *extra]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)
    except subprocess.TimeoutExpired:
        pytest.fail("torchrun rehearsal hung")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(x) for x in out.read_text().splitlines()]


@pytest.fixture(scope="module")
def untiled_lines(tmp_path_factory) -> list[dict]:
    return _rehearse(tmp_path_factory.mktemp("lc") / "lc.jsonl")


@pytest.mark.timeout(180)
def test_long_context_rehearsal_two_ranks(untiled_lines):
    lines = untiled_lines
    seq = SEQ
    steps = [x for x in lines if "step" in x]
    summary = [x for x in lines if x.get("summary")]
    assert [x["step"] for x in steps] == [0, 1, 2] and len(summary) == 1
    for x in steps:
        assert x["world"] == 2 and x["sp"] == 2 and x["dp"] == 1 and x["tokens"] == seq
        assert x["step_s"] > 0 and x["tokens_per_s"] > 0 and x["peak_host_rss_GB_max_rank"] > 0
        assert x["mfu"] is None  # no peak for CPU
        assert x["tiled_mlp"] is None
    assert steps[2]["loss"] < steps[0]["loss"]

    bench = _bench_module()
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(bench.build_config("tiny", seq))
    ids = bench.make_tokens(bench.MODELS["tiny"]["vocab_size"], 1, seq, 0)
    with torch.no_grad():
        ref = float(model(input_ids=ids, labels=ids).loss)
    assert abs(steps[0]["loss"] - ref) < 1e-3, (steps[0]["loss"], ref)


@pytest.mark.timeout(180)
def test_long_context_rehearsal_tiled_mlp(untiled_lines, tmp_path):
    """``--tiled-mlp 7`` (48 tokens per rank: 7 tiles, the last one of 6): every step's loss equals the untiled
    run's, so the updates (from the tiled gradients) were the same."""
    lines = _rehearse(tmp_path / "lc.jsonl", "--tiled-mlp", "7")
    steps = [x for x in lines if "step" in x]
    ref = [x for x in untiled_lines if "step" in x]
    assert [x["step"] for x in steps] == [0, 1, 2]
    assert all(x["tiled_mlp"] == 7 for x in steps)
    for a, b in zip(steps, ref, strict=True):
        assert abs(a["loss"] - b["loss"]) < 2e-4, (a["loss"], b["loss"])


def test_parse_len_and_flops():
    bench = _bench_module()
    assert bench.parse_len("64k") == 65536 and bench.parse_len("1m") == 1 << 20 and bench.parse_len("300") == 300
    cfg = bench.MODELS["8b"]
    # 6N + 6*L*d*s with d = 32 x 128
    assert bench.model_flops_per_token(8_030_000_000, cfg, 262144) == pytest.approx(
        6 * 8.03e9 + 6 * 32 * 4096 * 262144)
