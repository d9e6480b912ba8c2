"""LoRA (peft) through SuperOffloadTrainer: only the adapters train, the base stays bit-identical."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from hf_superoffload import state as st
from hf_superoffload.integrations.transformers import SuperOffloadArguments, SuperOffloadTrainer
from hf_superoffload.testing import tiny_llama

peft = pytest.importorskip("peft", reason="peft is not installed (pip install peft, or the 'peft' extra)")


def test_lora_trains_only_the_adapters(hf: Any, tmp_path: Any) -> None:
    base = tiny_llama(seed=0)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                      lora_dropout=0.0))
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    adapters = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert adapters and all("lora_" in n for n in adapters)
    lora_b_before = {n: p.detach().float().clone() for n, p in adapters.items() if "lora_B" in n}

    args = SuperOffloadArguments(**hf.train_kwargs(tmp_path, max_steps=4, gradient_accumulation_steps=2,
                                                   learning_rate=1e-2), superoffload_bucket_size_mb=0.001)
    trainer = SuperOffloadTrainer(model=model, args=args, train_dataset=hf.TokenDataset(16))
    trainer.train()

    opt = trainer.superoffload_optimizer
    assert opt is not None
    assert {id(p) for p in opt.engine.params} == {id(p) for p in adapters.values()}
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p.detach(), frozen[n]), f"frozen base parameter {n} changed"
    moved = [n for n, before in lora_b_before.items() if not torch.equal(adapters[n].detach().float(), before)]
    assert moved, "no LoRA B matrix moved away from its zero init"
    assert all(p.dtype == torch.bfloat16 for p in adapters.values())

    trainer.save_model(str(tmp_path / "adapter"))
    assert os.path.isfile(tmp_path / "adapter" / "adapter_model.safetensors")


def test_lora_adapter_masters_are_the_fp32_adapters_bit_for_bit() -> None:
    """peft makes the adapters fp32 on a bf16 base (autocast_adapter_dtype): their exact fp32 values become the
    host masters, and the model keeps bf16 copies (not bf16-rounded masters)."""
    from hf_superoffload import SuperOffloadOptimizer

    base = tiny_llama(seed=0).to(torch.bfloat16)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                      lora_dropout=0.0, init_lora_weights="gaussian"))
    adapters = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert all(p.dtype == torch.float32 for p in adapters.values())
    init = {n: p.detach().clone() for n, p in adapters.items()}
    opt = SuperOffloadOptimizer(model, lr=1e-3, log_plan=False)
    sd = opt.state_dict()["superoffload"]
    for name, numel, shape, (where, off) in zip(sd["names"], sd["numels"], sd["shapes"], sd["locations"], strict=True):
        master = st._read(sd[where]["master"], off, off + numel).view(shape)
        want = init[name]
        assert master.dtype == torch.float32 and torch.equal(master, want), name
        assert torch.equal(adapters[name].detach(), want.to(torch.bfloat16)), name
    opt.close()
