"""The adapters on a GPU: optimizer state stays on the host, bf16 autocast, resume, `accelerate launch`."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from hf_superoffload.integrations.accelerate import SuperOffloadPlugin, prepare_superoffload
from hf_superoffload.integrations.transformers import SuperOffloadArguments, SuperOffloadTrainer
from hf_superoffload.testing import tiny_llama

pytestmark = pytest.mark.cuda
REPO = Path(__file__).resolve().parents[2]


def _trainer(hf: Any, out: Path) -> SuperOffloadTrainer:
    kw = hf.train_kwargs(out, use_cpu=False, bf16=True, max_steps=6, gradient_accumulation_steps=2,
                         save_strategy="steps", save_steps=3, eval_strategy="steps", eval_steps=3)
    args = SuperOffloadArguments(**kw, **hf.SMALL_BUCKETS)
    return SuperOffloadTrainer(model=tiny_llama(seed=0), args=args, train_dataset=hf.TokenDataset(24),
                               eval_dataset=hf.TokenDataset(8, seed=2))


def test_trainer_on_cuda_host_state_and_resume(hf: Any, tmp_path: Path) -> None:
    full = _trainer(hf, tmp_path / "full")
    full.train()
    opt = full.superoffload_optimizer
    assert opt is not None and opt.engine.device.type == "cuda"
    assert all(p.device.type == "cuda" and p.dtype == torch.bfloat16 for p in full.model.parameters())
    assert all(t.device.type == "cpu" for t in opt.engine.flat_state()["host"].values())
    assert opt.engine.pinned_bytes > 0
    logs = [h for h in full.state.log_history if "loss" in h]
    assert all(math.isfinite(h["grad_norm"]) and h["grad_norm"] > 0 for h in logs)
    assert any(h["superoffload/link_gb"] > 0 for h in logs)
    assert [h for h in full.state.log_history if "eval_loss" in h]

    resumed = _trainer(hf, tmp_path / "resumed")
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-3"))
    a = dict(full.model.named_parameters())
    for n, p in resumed.model.named_parameters():
        assert torch.equal(p.detach(), a[n].detach()), f"{n} differs after resume on CUDA"


def test_prepare_keeps_optimizer_state_off_the_device(fresh_accelerate_state: None) -> None:
    from accelerate import Accelerator

    accelerator = Accelerator(mixed_precision="bf16")
    model = tiny_llama(seed=0, hidden_size=256, intermediate_size=512, num_hidden_layers=4, device="cuda")
    n = sum(p.numel() for p in model.parameters())
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model, optimizer = prepare_superoffload(accelerator, model, dict(lr=1e-3, max_grad_norm=1.0),
                                            plugin=SuperOffloadPlugin(bucket_size_mb=0.5, gpu_resident_buckets=0))
    # a state round trip through the device (stock AcceleratedOptimizer) would peak at >= 12 B/param
    assert torch.cuda.max_memory_allocated() - base < 4 * n, "optimizer state went through the GPU"
    opt = optimizer.superoffload
    assert next(model.parameters()).device.type == "cuda"
    assert all(t.device.type == "cpu" for t in opt.engine.flat_state()["host"].values())
    assert opt.engine.flat_state()["device"]["master"].numel() == 0
    ids = torch.randint(0, 128, (2, 16), device=accelerator.device)
    for _ in range(3):
        accelerator.backward(model(input_ids=ids, labels=ids).loss)
        norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        assert norm.item() == pytest.approx(opt.last_grad_norm, rel=1e-6)


def test_accelerate_launch_single_gpu_config(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "configs" / "single_gpu.yaml"),
           str(REPO / "examples" / "train_with_accelerate.py"), "--max-steps", "5", "--output-dir", str(tmp_path)]
    res = subprocess.run(cmd, cwd=tmp_path, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-5000:]
    assert "done at step 5" in res.stdout + res.stderr


def test_device_state_is_saved_in_gpu_pieces_and_resumes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The state dict's device arenas are pieces aliasing the GPU arenas (``torch.save`` copies one to the host at
    a time), not host copies; the saved file resumes into another optimizer bit for bit."""
    from hf_superoffload import SuperOffloadConfig, SuperOffloadOptimizer
    from hf_superoffload import state as st
    from hf_superoffload.integrations._common import _load_state_file

    monkeypatch.setattr(st, "_PIECE_ELEMS", 1 << 15)
    cfg = SuperOffloadConfig(bucket_size_mb=0.5, gpu_resident_buckets=4)
    model = tiny_llama(seed=0, hidden_size=256, intermediate_size=512, num_hidden_layers=4, device="cuda")
    opt = SuperOffloadOptimizer(model, lr=1e-3, max_grad_norm=1.0, config=cfg)
    ids = torch.randint(0, 128, (2, 16), device="cuda")
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    live = opt.engine.flat_state()["device"]
    sd = opt.state_dict()
    for k, pieces in sd["superoffload"]["device"].items():
        assert len(pieces) > 1 and all(t.device.type == "cuda" for t in pieces)
        for j, t in enumerate(pieces):
            assert t.untyped_storage().nbytes() == t.numel() * 4 and t.data_ptr() == live[k][j << 15 :].data_ptr()
    torch.save(sd, tmp_path / "optimizer.pt")
    state = _load_state_file(str(tmp_path / "optimizer.pt"))
    assert all(t.device.type == "cpu" for x in state["superoffload"]["device"].values() for t in x)
    other = tiny_llama(seed=5, hidden_size=256, intermediate_size=512, num_hidden_layers=4, device="cuda")
    other.load_state_dict(model.state_dict())
    resumed = SuperOffloadOptimizer(other, lr=1e-3, max_grad_norm=1.0, config=cfg)
    resumed.load_state_dict(state)
    for side, d in resumed.engine.flat_state().items():
        for k, t in d.items():
            assert torch.equal(t.cpu(), torch.cat([p.cpu() for p in st._pieces(sd["superoffload"][side][k])])), k
    opt.close()
    resumed.close()
