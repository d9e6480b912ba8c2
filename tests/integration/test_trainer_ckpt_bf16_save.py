"""Trainer with bf16 and gradient checkpointing; save_model writes weights synced from the fp32 masters."""

from __future__ import annotations

import math

import torch
from safetensors.torch import load_file

from hf_superoffload import SuperOffloadArguments, SuperOffloadTrainer
from hf_superoffload.testing import tiny_llama


def _train(hf, tmp_path, *, ckpt: bool):
    model = tiny_llama(seed=0)
    args = SuperOffloadArguments(**hf.train_kwargs(tmp_path / ("ckpt" if ckpt else "plain"), max_steps=6, bf16=True,
                                                   gradient_checkpointing=ckpt), **hf.SMALL_BUCKETS)
    trainer = SuperOffloadTrainer(model=model, args=args, train_dataset=hf.TokenDataset(12))
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return trainer, model, losses


def test_gradient_checkpointing_matches_plain_backward_and_save_is_synced(hf, tmp_path):
    t_ckpt, m_ckpt, l_ckpt = _train(hf, tmp_path, ckpt=True)
    t_plain, m_plain, l_plain = _train(hf, tmp_path, ckpt=False)
    assert m_ckpt.model.gradient_checkpointing
    assert len(l_ckpt) == len(l_plain) == 6
    # recomputation replays the same bf16 forward: same gradients, same training
    for a, b in zip(l_ckpt, l_plain):
        assert math.isclose(a, b, rel_tol=1e-3), (l_ckpt, l_plain)

    out = tmp_path / "saved"
    t_ckpt.save_model(str(out))
    saved = load_file(out / "model.safetensors")
    opt = t_ckpt.optimizer.optimizer if hasattr(t_ckpt.optimizer, "optimizer") else t_ckpt.optimizer
    opt = getattr(opt, "superoffload", opt)
    for name, p in m_ckpt.named_parameters():
        key = name if name in saved else name.removeprefix("model.")
        assert torch.equal(saved[key], p.detach()), f"{name}: saved weights differ from the model"
        assert torch.equal(saved[key], hf.master_of(opt, p).to(torch.bfloat16)), f"{name}: not RNE(fp32 master)"
