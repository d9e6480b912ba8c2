"""SuperOffloadArguments validation, the refused plain-Trainer path, and skipped steps under Trainer."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch
from transformers import HfArgumentParser, Trainer, TrainingArguments

from hf_superoffload import SuperOffloadConfig
from hf_superoffload.config import PlannerOverrides
from hf_superoffload.integrations.transformers import SuperOffloadArguments, SuperOffloadTrainer
from hf_superoffload.testing import tiny_llama


def _args(tmp_path: Any, **kw: Any) -> SuperOffloadArguments:
    return SuperOffloadArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", **kw)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"deepspeed": {"zero_optimization": {"stage": 2}}}, "deepspeed is set"),
        ({"fsdp": "full_shard"}, "fsdp='full_shard' is set"),
        ({"fp16": True}, "fp16 is not supported"),
        ({"optim": "adafactor"}, "optim='adafactor' cannot be used"),
        ({"optim": "adamw_torch", "optim_args": "foo=1"}, "optim_args"),
        ({"superoffload_bucket_size_mb": -1.0}, "superoffload_bucket_size_mb=-1.0 is invalid"),
        ({"superoffload_gpu_resident_buckets": "many"}, "superoffload_gpu_resident_buckets='many'"),
        ({"superoffload_d2h_lead_buckets": "4"}, r"superoffload_d2h_lead_buckets was removed.*\{\"overrides\": "
                                                 r"\{\"d2h_lead_buckets\": '4'\}\}"),
        ({"superoffload_max_redo_rate": 2.0}, "superoffload_max_redo_rate was removed"),
        ({"superoffload_defer_master": "0.5"}, r"superoffload_defer_master was removed.*\{\"overrides\": "
                                               r"\{\"defer_master\": '0.5'\}\}"),
        ({"superoffload_config": {"overrides": {"defer_master": "half"}}},
         r"superoffload_config: PlannerOverrides.defer_master='half' is invalid: use 'auto', true"),
        ({"superoffload_config": {"overrides": {"defer_master": 1.5}}},
         "defer_master=1.5 is invalid: use 'auto', true, false"),
    ],
)
def test_incompatible_or_invalid_arguments_are_refused(tmp_path: Any, kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _args(tmp_path, **kw)


def test_fp16_from_the_accelerate_environment_is_refused(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    with pytest.raises(ValueError, match="ACCELERATE_MIXED_PRECISION=fp16"):
        _args(tmp_path)


def test_adamw_names_are_accepted(tmp_path: Any) -> None:
    for optim in ("adamw_torch", "adamw_torch_fused"):
        assert _args(tmp_path, optim=optim).to_superoffload_config() == SuperOffloadConfig()


def test_every_config_field_has_an_argument_and_the_parser_reads_them(tmp_path: Any) -> None:
    config_fields = {f.name for f in dataclasses.fields(SuperOffloadConfig)} - {"overrides"}
    removed = {f.name for f in dataclasses.fields(PlannerOverrides)}  # hidden, refused with the new spelling
    arg_fields = {f.name[len("superoffload_"):] for f in dataclasses.fields(SuperOffloadArguments)
                  if f.name.startswith("superoffload_")}
    # plus the one run-shape argument (the planner's workload) and the config source
    assert arg_fields == config_fields | removed | {"max_seq_len", "config"}
    (args,) = HfArgumentParser(SuperOffloadArguments).parse_args_into_dataclasses(args=[
        "--output_dir", str(tmp_path), "--use_cpu", "--superoffload_gpu_resident_buckets", "0",
        "--no_superoffload_speculation", "--superoffload_rollback", "inverse", "--superoffload_cpu_threads", "1",
        "--superoffload_bucket_size_mb", "8",
    ])
    assert args.to_superoffload_config() == SuperOffloadConfig(gpu_resident_buckets=0, speculation=False,
                                                               rollback="inverse", cpu_threads=1, bucket_size_mb=8)


def test_plain_trainer_with_superoffload_arguments_is_refused(tmp_path: Any) -> None:
    with pytest.raises(TypeError, match="not a SuperOffloadTrainer"):
        Trainer(model=tiny_llama(), args=_args(tmp_path))


def test_superoffload_trainer_needs_its_arguments_and_its_optimizer(tmp_path: Any) -> None:
    model = tiny_llama()
    with pytest.raises(TypeError, match="needs SuperOffloadArguments"):
        SuperOffloadTrainer(model=model, args=TrainingArguments(output_dir=str(tmp_path), use_cpu=True))
    with pytest.raises(ValueError, match="drop optimizers"):
        SuperOffloadTrainer(model=model, args=_args(tmp_path),
                            optimizers=(torch.optim.SGD(model.parameters(), lr=0.1), None))
    with pytest.raises(ValueError, match="optimizer_cls_and_kwargs"):
        SuperOffloadTrainer(model=model, args=_args(tmp_path),
                            optimizer_cls_and_kwargs=(torch.optim.SGD, {"lr": 0.1}))


class _NanAtStep2(SuperOffloadTrainer):
    def compute_loss(self, model: Any, inputs: Any, *a: Any, **kw: Any) -> Any:
        loss = super().compute_loss(model, inputs, *a, **kw)
        return loss * float("nan") if self.state.global_step == 2 else loss


def test_non_finite_step_is_skipped_and_the_lr_schedule_does_not_advance(hf: Any, tmp_path: Any) -> None:
    args = SuperOffloadArguments(**hf.train_kwargs(tmp_path, max_steps=5), **hf.SMALL_BUCKETS)
    model = tiny_llama(seed=0)
    trainer = _NanAtStep2(model=model, args=args, train_dataset=hf.TokenDataset(16))
    trainer.train()
    opt = trainer.superoffload_optimizer
    assert opt is not None and opt.skipped_steps == 1
    assert trainer.lr_scheduler.last_epoch == 4, "the LR scheduler stepped on the skipped step"
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [math.isfinite(h["grad_norm"]) for h in logs] == [True, True, False, True, True]
    assert logs[-1]["superoffload/skipped_steps"] == 1.0
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_the_trainer_arguments_mirror_every_config_field() -> None:
    import dataclasses

    from hf_superoffload.config import USER_OPTIONS
    from hf_superoffload.integrations.arguments import SuperOffloadArguments

    ours = {f.name for f in dataclasses.fields(SuperOffloadArguments)}
    missing = [name for name in USER_OPTIONS if f"superoffload_{name}" not in ours]
    assert not missing, f"SuperOffloadArguments lacks superoffload_ fields for {missing}"


def test_max_seq_len_gives_the_planner_the_batch_shape(hf: Any, tmp_path: Any) -> None:
    """superoffload_max_seq_len becomes the planner's Workload (batch, length, checkpointing); it is not a config
    field; without it there is no workload (the GPU tail then takes a fixed share of free memory)."""
    from hf_superoffload.planning.planner import Workload

    args = SuperOffloadArguments(**hf.train_kwargs(tmp_path, max_steps=1, per_device_train_batch_size=2,
                                                   gradient_checkpointing=True),
                                 **hf.SMALL_BUCKETS, superoffload_max_seq_len=16)
    assert "max_seq_len" not in args.superoffload_fields()
    model = tiny_llama(seed=0)
    trainer = SuperOffloadTrainer(model=model, args=args, train_dataset=hf.TokenDataset(4))
    trainer.create_optimizer()
    w = trainer.superoffload_optimizer.workload
    assert w == Workload(model.config, 2, 16, True, sequence_parallel=1, loss_chunk_tokens=None,
                         chunked_loss=True)  # tiny_llama uses HF's default loss: the chunked one replaces it
    plain = SuperOffloadTrainer(model=tiny_llama(seed=0), args=_args(tmp_path / "plain"), train_dataset=hf.TokenDataset(4))
    plain.create_optimizer()
    assert plain.superoffload_optimizer.workload is None


@pytest.mark.parametrize("bad", [0, -3, True, 1.5])
def test_max_seq_len_is_validated(tmp_path: Any, bad: Any) -> None:
    with pytest.raises(ValueError, match=r"superoffload_max_seq_len=.* is invalid: use the longest training sequence"):
        _args(tmp_path, superoffload_max_seq_len=bad)


def test_keep_attention_checkpointing_needs_checkpointing(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match="set gradient_checkpointing=True too"):
        _args(tmp_path, keep_attention_checkpointing=True)
    with pytest.raises(ValueError, match="drop use_reentrant=True"):
        _args(tmp_path, keep_attention_checkpointing=True, gradient_checkpointing=True,
              gradient_checkpointing_kwargs={"use_reentrant": True})


def test_keep_attention_checkpointing_skips_the_attention_recompute(hf: Any, tmp_path: Any) -> None:
    """keep_attention_checkpointing: the Trainer's checkpointing keeps attention's outputs (the fused attention
    kernel runs once forward and once backward per layer, not twice forward), the losses equal plain
    checkpointing's, and the planner's workload counts the kept outputs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountAttention(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if "scaled_dot_product" in str(func):
                CountAttention.calls += 1
            return func(*args, **(kwargs or {}))

    runs = {}
    for keep in (False, True):
        CountAttention.calls = 0
        args = SuperOffloadArguments(**hf.train_kwargs(tmp_path / str(keep), max_steps=2, gradient_checkpointing=True,
                                                       logging_steps=1),
                                     **hf.SMALL_BUCKETS, keep_attention_checkpointing=keep, superoffload_max_seq_len=16)
        model = tiny_llama(seed=0, attn_implementation="sdpa")
        trainer = SuperOffloadTrainer(model=model, args=args, train_dataset=hf.TokenDataset(8))
        with CountAttention():
            trainer.train()
        assert trainer.superoffload_optimizer.workload.keep_attention is keep
        runs[keep] = (CountAttention.calls, [h["loss"] for h in trainer.state.log_history if "loss" in h])
    layers, steps = 2, 2
    assert runs[False][0] == 3 * layers * steps and runs[True][0] == 2 * layers * steps, runs
    assert runs[True][1] == pytest.approx(runs[False][1], rel=1e-6)
