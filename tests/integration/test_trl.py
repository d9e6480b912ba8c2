"""TRL's SFTTrainer through SuperOffloadSFTTrainer, against the same SFTTrainer run with the plain reference.

Both sides are ``trl.SFTTrainer`` runs on the same conversational dataset (chat template, SFT's own tokenising
and collator), with identical arguments, data order and LR schedule; the reference trains bf16 weights with fp32
masters, ``clip_grad_norm_`` and ``torch.optim.AdamW`` (``hf_superoffload.testing.ReferenceAdamW``), with
Trainer's clipping off as on ours. Tolerances as in test_trainer_parity.py.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

pytest.importorskip("trl")
from datasets import Dataset
from trl import SFTConfig, SFTTrainer

from hf_superoffload.demo.local_data import build_tokenizer
from hf_superoffload.integrations.trl import SuperOffloadSFTConfig, SuperOffloadSFTTrainer
from hf_superoffload.testing import tiny_llama

from .test_trainer_parity import ReferenceOptimizerMixin

STEPS, ACCUM, LR = 8, 2, 1e-3
CHAT_TEMPLATE = ("{% for m in messages %}<|bos|>{{ m['role'] }}: {{ m['content'] }}<|eos|>{% endfor %}"
                 "{% if add_generation_prompt %}<|bos|>assistant: {% endif %}")


def _conversations(n: int) -> list[dict[str, Any]]:
    ops = [("add", lambda a, b: a + b), ("multiply", lambda a, b: a * b), ("subtract", lambda a, b: a - b)]
    rows = []
    for i in range(n):
        name, f = ops[i % len(ops)]
        a, b = 3 + i % 7, 2 + i % 5
        rows.append({"messages": [{"role": "user", "content": f"Please {name} {a} and {b}."},
                                  {"role": "assistant", "content": f"The answer is {f(a, b)}."}]})
    return rows


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    rows = _conversations(64)
    texts = [f"{m['role']}: {m['content']}" for r in rows for m in r["messages"]]
    tok = build_tokenizer(texts, vocab_size=200)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _config(cls: type, out: Any, **kw: Any) -> Any:
    return cls(output_dir=str(out), use_cpu=True, bf16=False, report_to="none", disable_tqdm=True, logging_steps=1,
               save_strategy="no", per_device_train_batch_size=4, gradient_accumulation_steps=ACCUM,
               learning_rate=LR, weight_decay=0.1, lr_scheduler_type="linear", max_grad_norm=1.0, max_steps=STEPS,
               seed=0, dataloader_num_workers=0, dataloader_pin_memory=False, max_length=64,
               gradient_checkpointing=False, **kw)


class _ReferenceSFTTrainer(ReferenceOptimizerMixin, SFTTrainer):
    pass


def _run(side: str, tok: Any, tmp: Any) -> tuple[Any, list[dict[str, float]]]:
    model = tiny_llama(seed=0, vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                       bos_token_id=tok.bos_token_id)
    data = Dataset.from_list(_conversations(STEPS * ACCUM * 4))
    if side == "ours":
        args = _config(SuperOffloadSFTConfig, tmp / side, superoffload_bucket_size_mb=0.004,
                       superoffload_gpu_resident_buckets="2")
        # peft_config: an SFTTrainer-only keyword, which SuperOffloadTrainer must pass through
        trainer: Any = SuperOffloadSFTTrainer(model=model, args=args, train_dataset=data, processing_class=tok,
                                              peft_config=None)
    else:
        trainer = _ReferenceSFTTrainer(model=model, args=_config(SFTConfig, tmp / side), train_dataset=data,
                                       processing_class=tok)
    trainer.train()
    return trainer, [h for h in trainer.state.log_history if "loss" in h]


def test_sft_trainer_matches_reference(tokenizer: Any, tmp_path: Any) -> None:
    ours, ours_logs = _run("ours", tokenizer, tmp_path)
    ref, ref_logs = _run("ref", tokenizer, tmp_path)
    opt = ours.superoffload_optimizer
    assert opt is not None and opt.skipped_steps == 0 and ours.state.global_step == STEPS
    assert len(ours_logs) == len(ref_logs) == STEPS
    for i, (a, b) in enumerate(zip(ours_logs, ref_logs)):
        tol = 1e-4 if i < 2 else 2e-2
        assert math.isfinite(a["loss"]) and a["loss"] == pytest.approx(b["loss"], rel=tol, abs=tol), (i, a, b)
        assert a["learning_rate"] == pytest.approx(b["learning_rate"], rel=1e-6), i  # same schedule, step by step
        assert a["grad_norm"] > 0 and math.isfinite(a["grad_norm"])
        assert "superoffload/cpu_adam_s" in a and "mean_token_accuracy" in a  # our telemetry and SFT's metrics
    assert ours_logs[-1]["loss"] < ours_logs[0]["loss"]
    opt.synchronize()
    init = tiny_llama(seed=0, vocab_size=len(tokenizer))
    for (name, p), q, p0 in zip(ours.model.named_parameters(), ref.model.parameters(), init.parameters()):
        assert not torch.equal(p, p0), name  # our optimizer stepped every parameter ...
        assert torch.allclose(p.float(), q.float(), atol=3e-2, rtol=3e-2), name  # ... as the reference did


def test_sft_refuses_plain_config_and_plain_trainer(tokenizer: Any, tmp_path: Any) -> None:
    data = Dataset.from_list(_conversations(8))
    model = tiny_llama(seed=0, vocab_size=len(tokenizer))
    with pytest.raises(TypeError, match="SuperOffloadSFTConfig"):
        SuperOffloadSFTTrainer(model=model, args=_config(SFTConfig, tmp_path), train_dataset=data,
                               processing_class=tokenizer)
    with pytest.raises(TypeError, match="SuperOffloadTrainer"):  # a plain SFTTrainer would build torch AdamW
        SFTTrainer(model=model, args=_config(SuperOffloadSFTConfig, tmp_path), train_dataset=data,
                   processing_class=tokenizer)


def test_trl_example_runs_offline(hf: Any, tmp_path: Any) -> None:
    metrics = hf.example("train_with_trl").main(["--output_dir", str(tmp_path), "--max_steps", "3", "--examples", "64",
                            "--assistant_only_loss", "True", "--use_cpu", "True", "--disable_tqdm", "True"])
    assert math.isfinite(metrics["train_loss"])
    assert (tmp_path / "final" / "model.safetensors").is_file()


def test_sft_config_keeps_trl_defaults(tmp_path: Any) -> None:
    import dataclasses

    ours = SuperOffloadSFTConfig(output_dir=str(tmp_path), use_cpu=True)
    trl_own = SFTConfig(output_dir=str(tmp_path), use_cpu=True)
    differ = [f.name for f in dataclasses.fields(trl_own) if getattr(ours, f.name) != getattr(trl_own, f.name)]
    assert differ == []  # e.g. learning_rate 2e-5, logging_steps 10, gradient_checkpointing on, as TRL documents
    assert ours.to_superoffload_config() is not None  # and the offload fields are there
