"""Checkpoint and resume through SuperOffloadTrainer: bit-identical to an uninterrupted run."""

from __future__ import annotations

import json
import os
import pickle
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import HfArgumentParser

from hf_superoffload.integrations.transformers import SuperOffloadArguments, SuperOffloadTrainer
from hf_superoffload.testing import tiny_llama


def _trainer(hf: Any, out: Any, **offload: Any) -> SuperOffloadTrainer:
    # 32 samples / (2 x 2) = 8 steps per epoch: the resumed half crosses an epoch boundary (reshuffle).
    # rollback "auto" picks the bit-exact undo on this tiny model (asserted below), so a redo is bit-exact
    # whatever the speculation governor decides after the restart.
    kw = hf.train_kwargs(out, max_steps=10, gradient_accumulation_steps=2, save_strategy="steps", save_steps=5,
                         logging_steps=5)
    args = SuperOffloadArguments(**kw, **(hf.SMALL_BUCKETS | offload))
    return SuperOffloadTrainer(model=tiny_llama(seed=0), args=args, train_dataset=hf.TokenDataset(32))


def _state(trainer: SuperOffloadTrainer) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    opt = trainer.superoffload_optimizer
    assert opt is not None
    opt.synchronize()
    # the state dict, not the parameters: under weight flow a released parameter's entry is its host staging
    weights = {n: p.detach().clone() for n, p in trainer.model.state_dict().items()}
    flat = opt.engine.flat_state()
    arenas = {f"{side}/{k}": v.detach().cpu().clone() for side in flat for k, v in flat[side].items()}
    return weights, arenas


# weight flow resumes bit-identically as well (the model file loads before the optimizer streams anything)
FLOW = dict(superoffload_weight_placement="flow", superoffload_gpu_resident_buckets="0")


@pytest.mark.parametrize("offload", [{}, FLOW], ids=["stationary", "flow"])
def test_resume_from_checkpoint_is_bit_identical(hf: Any, tmp_path: Any, offload: dict[str, str]) -> None:
    full = _trainer(hf, tmp_path / "full", **offload)
    full.train()
    assert full.superoffload_optimizer.plan.weight_mode.value == ("flow" if offload else "stationary")
    assert full.superoffload_optimizer.plan.rollback.value != "inverse"
    w_full, s_full = _state(full)
    ckpt = tmp_path / "full" / "checkpoint-5"
    files = set(os.listdir(ckpt))
    assert {"optimizer.pt", "scheduler.pt", "model.safetensors", "trainer_state.json", "rng_state.pth"} <= files
    assert not [f for f in files if f.endswith(".tmp")], "atomic save left a temporary file"

    # optimizer.pt is our host state dict, loadable with weights_only=True
    state = torch.load(ckpt / "optimizer.pt", map_location="cpu", weights_only=True)
    assert state["superoffload"]["format"] == "hf_superoffload.optimizer.v2"
    # the saved bf16 weights are bf16(master) of that step
    saved = load_file(ckpt / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in saved.values())

    resumed = _trainer(hf, tmp_path / "resumed", **offload)
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert resumed.state.global_step == 10
    w_res, s_res = _state(resumed)
    for name, t in w_full.items():
        assert torch.equal(t, w_res[name]), f"weight {name} differs after resume"
    for name, t in s_full.items():
        assert torch.equal(t, s_res[name]), f"optimizer arena {name} differs after resume"
    lr_full = [h["learning_rate"] for h in full.state.log_history if "loss" in h]
    lr_res = [h["learning_rate"] for h in resumed.state.log_history if "loss" in h]
    assert lr_res[-1] == lr_full[-1]


def test_training_args_bin_round_trips(hf: Any, tmp_path: Any) -> None:
    args = SuperOffloadArguments(**hf.train_kwargs(tmp_path), superoffload_gpu_resident_buckets=0,
                                 superoffload_speculation=False, superoffload_cpu_threads=1)
    back = pickle.loads(pickle.dumps(args))
    assert back.to_superoffload_config() == args.to_superoffload_config()
    assert back.to_superoffload_config().gpu_resident_buckets == 0
    d = json.loads(args.to_json_string())
    assert d["superoffload_gpu_resident_buckets"] == 0 and d["superoffload_speculation"] is False
    json_file = tmp_path / "args.json"  # the JSON form parses back to the same config (HfArgumentParser)
    json_file.write_text(json.dumps({k: d[k] for k in ("output_dir", "superoffload_gpu_resident_buckets",
                                                        "superoffload_speculation", "superoffload_cpu_threads")}))
    (parsed,) = HfArgumentParser(SuperOffloadArguments).parse_json_file(str(json_file))
    assert parsed.to_superoffload_config() == args.to_superoffload_config()


def test_model_saves_are_written_in_bounded_shards(hf: Any, tmp_path: Any, monkeypatch: Any) -> None:
    """[Note: bounded model shards]: safetensors copies every GPU tensor of a shard to the host before it writes,
    and ``save_pretrained``'s shards hold up to 50 GB; the Trainer's checkpoints and final save write shards of at
    most ``MODEL_SHARD_SIZE`` (made small here), which ``from_pretrained`` reads back."""
    from transformers import AutoModelForCausalLM

    from hf_superoffload.integrations import transformers as integration

    monkeypatch.setattr(integration, "MODEL_SHARD_SIZE", "40KB")
    from hf_superoffload.integrations import _streamed_save

    streamed: set[str] = set()
    real_write = _streamed_save.save_file_streamed
    monkeypatch.setattr(_streamed_save, "save_file_streamed",
                        lambda t, f, metadata=None: (streamed.add(os.path.basename(f)), real_write(t, f, metadata)))
    kw = hf.train_kwargs(tmp_path, max_steps=2, save_strategy="steps", save_steps=2)
    trainer = SuperOffloadTrainer(model=tiny_llama(seed=0), args=SuperOffloadArguments(**kw, **hf.SMALL_BUCKETS),
                                  train_dataset=hf.TokenDataset(8))
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    assert "save_pretrained" not in vars(trainer.model)  # the model's own method again
    weights = {n: p.detach() for n, p in trainer.model.named_parameters()}
    for folder in (tmp_path / "checkpoint-2", tmp_path / "final"):
        shards = sorted(folder.glob("model-*.safetensors"))
        assert len(shards) > 1 and (folder / "model.safetensors.index.json").is_file(), sorted(os.listdir(folder))
        assert max(f.stat().st_size for f in shards) <= 40_000 + 8_192  # the bound, plus each file's header
        assert {f.name for f in shards} <= streamed, "a shard was not written a piece at a time"
        loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
        for n, p in loaded.named_parameters():
            assert torch.equal(p, weights[n].to(torch.bfloat16)), n


def test_best_model_loads_into_streamed_weights(hf: Any, tmp_path: Any) -> None:
    """``load_best_model_at_end`` loads a checkpoint's model file after training, while weight flow holds the
    parameters released (a copy into their 0-byte storages crashed the process): the model ends as the best
    checkpoint's weights."""
    kw = hf.train_kwargs(tmp_path, max_steps=6, save_strategy="steps", save_steps=2, eval_strategy="steps",
                         eval_steps=2, load_best_model_at_end=True, metric_for_best_model="loss",
                         greater_is_better=True)  # the loss falls: "best" is then an early checkpoint, not the last
    args = SuperOffloadArguments(**kw, **(hf.SMALL_BUCKETS | FLOW))
    trainer = SuperOffloadTrainer(model=tiny_llama(seed=0), args=args, train_dataset=hf.TokenDataset(32),
                                  eval_dataset=hf.TokenDataset(8, seed=3))
    trainer.train()
    assert trainer.superoffload_optimizer.plan.weight_mode.value == "flow"
    best = trainer.state.best_model_checkpoint
    assert best is not None and best.endswith("checkpoint-2")
    saved = load_file(os.path.join(best, "model.safetensors"))
    final = trainer.model.state_dict()
    for name, t in saved.items():
        assert torch.equal(final[name], t), f"{name} is not the best checkpoint's"
