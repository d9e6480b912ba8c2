"""Accelerate: SuperOffloadPlugin resolution, prepare_superoffload in a custom loop, and `accelerate launch`."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from hf_superoffload import SuperOffloadConfig
from hf_superoffload.integrations.accelerate import (
    SuperOffloadPlugin,
    accelerate_config_path,
    prepare_superoffload,
)
from hf_superoffload.testing import tiny_llama

REPO = Path(__file__).resolve().parents[2]


# ---- plugin ------------------------------------------------------------------------------------------
def test_plugin_precedence_explicit_env_file_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for k in list(os.environ):
        if k.startswith("HF_SUPEROFFLOAD_"):
            monkeypatch.delenv(k)
    assert SuperOffloadPlugin().to_config() == SuperOffloadConfig()
    f = tmp_path / "offload.yaml"
    f.write_text("superoffload:\n  bucket_size_mb: 8\n  speculation: false\n  cpu_threads: 3\n")
    monkeypatch.setenv("HF_SUPEROFFLOAD_CONFIG", str(f))
    monkeypatch.setenv("HF_SUPEROFFLOAD_BUCKET_SIZE_MB", "16")
    monkeypatch.setenv("HF_SUPEROFFLOAD_GPU_RESIDENT_BUCKETS", "0")
    cfg = SuperOffloadPlugin(cpu_threads="auto").to_config()
    assert cfg == SuperOffloadConfig(bucket_size_mb=16, speculation=False, gpu_resident_buckets=0, cpu_threads=None)
    assert SuperOffloadPlugin(bucket_size_mb=4).to_config().bucket_size_mb == 4
    j = tmp_path / "offload.json"
    j.write_text('{"pin_memory": false}')
    assert SuperOffloadPlugin(config_file=str(j)).to_config().pin_memory is False


def test_plugin_errors_name_their_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_SUPEROFFLOAD_SPECULATION", "maybe")
    with pytest.raises(ValueError, match=r"speculation='maybe' is invalid: use True or False.*HF_SUPEROFFLOAD_SPECULATION"):
        SuperOffloadPlugin()
    monkeypatch.delenv("HF_SUPEROFFLOAD_SPECULATION")
    monkeypatch.setenv("HF_SUPEROFFLOAD_BUCKET_SIZE_MB", "-2")
    with pytest.raises(ValueError, match=r"bucket_size_mb=-2\.0 is invalid.*set by HF_SUPEROFFLOAD_BUCKET_SIZE_MB"):
        SuperOffloadPlugin()
    monkeypatch.delenv("HF_SUPEROFFLOAD_BUCKET_SIZE_MB")
    bad = tmp_path / "bad.yaml"
    bad.write_text("bucket_size: 8\n")
    with pytest.raises(ValueError, match=r"unknown SuperOffload setting.*bucket_size"):
        SuperOffloadPlugin(config_file=str(bad))


def test_packaged_accelerate_configs_match_the_repo_ones() -> None:
    for name in ("single_gpu", "multi_gpu", "single_cpu"):
        packaged = Path(accelerate_config_path(name))
        assert packaged.read_text() == (REPO / "configs" / f"{name}.yaml").read_text()
    with pytest.raises(ValueError, match="single_gpu"):
        accelerate_config_path("zero3")


# ---- prepare_superoffload ------------------------------------------------------------------------------
def _batches(n: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (2, 16), generator=g) for _ in range(n)]


def test_custom_loop_clipping_accumulation_and_skips(fresh_accelerate_state: None) -> None:
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model, optimizer = prepare_superoffload(
        accelerator, tiny_llama(seed=0), dict(lr=1e-3, weight_decay=0.1),
        plugin=SuperOffloadPlugin(bucket_size_mb=0.004, gpu_resident_buckets=2),
    )
    opt = optimizer.superoffload
    assert optimizer in accelerator._optimizers and opt.max_grad_norm is None
    scheduler = accelerator.prepare(torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s)))
    other = torch.nn.Parameter(torch.ones(4))
    other.grad = torch.full((4,), 3.0)
    assert accelerator.clip_grad_norm_([other], 1.0).item() == pytest.approx(1.0 * 6.0)  # stock path: clipped
    assert torch.allclose(other.grad, torch.full((4,), 0.5), atol=1e-5)

    norms = []
    for k, ids in enumerate(_batches(10)):
        with accelerator.accumulate(model):
            loss = model(input_ids=ids, labels=ids).loss
            if k in (4, 5):  # the third optimizer step sees a non-finite gradient
                loss = loss * float("nan")
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norm = accelerator.clip_grad_norm_(model.parameters(), 0.5)
                assert math.isnan(norm.item())  # known only after step()
                assert all(p.grad is None for p in opt.engine.params[:3]), "gradients were not offloaded"
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            norms.append(norm.item())
            assert norm.item() == pytest.approx(opt.last_grad_norm, rel=1e-6) or opt.step_was_skipped
    assert opt.max_grad_norm == 0.5 and opt.clipped_steps == 4
    assert opt.skipped_steps == 1 and math.isnan(norms[2])
    assert scheduler.scheduler.last_epoch == 4, "the scheduler advanced on the skipped step"
    opt.synchronize()
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("placement", ["stationary", "flow"])
def test_save_state_load_state_round_trip(fresh_accelerate_state: None, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch, placement: str) -> None:
    """Also [Note: bounded model shards]: ``save_state`` and ``save_model`` write the model in shards of at most
    ``MODEL_SHARD_SIZE`` (made small here), and ``load_state`` maps the optimizer file instead of reading it. Under
    weight flow the parameters are released between uses: the model files come from the host staging and load back
    into it."""
    from hf_superoffload.integrations import accelerate as integration

    monkeypatch.setattr(integration, "MODEL_SHARD_SIZE", "40KB")
    from hf_superoffload.integrations import _streamed_save

    streamed: set[str] = set()
    real_write = _streamed_save.save_file_streamed
    monkeypatch.setattr(_streamed_save, "save_file_streamed",
                        lambda t, f, metadata=None: (streamed.add(os.path.basename(f)), real_write(t, f, metadata)))
    loads: list[tuple[str, Any]] = []
    real_load = torch.load

    def recording_load(f: Any, *args: Any, **kwargs: Any) -> Any:
        loads.append((str(f), kwargs.get("mmap")))
        return real_load(f, *args, **kwargs)

    monkeypatch.setattr(torch, "load", recording_load)
    accelerator = Accelerator(cpu=True)
    plugin = SuperOffloadPlugin(bucket_size_mb=0.004, weight_placement=placement,
                                gpu_resident_buckets=0 if placement == "flow" else None)
    model, optimizer = prepare_superoffload(accelerator, tiny_llama(seed=0), dict(lr=1e-3, max_grad_norm=1.0),
                                            plugin=plugin)
    assert optimizer.superoffload.plan.weight_mode.value == placement
    data = _batches(4)

    def step(ids: torch.Tensor) -> None:
        accelerator.backward(model(input_ids=ids, labels=ids).loss)
        optimizer.step()
        optimizer.zero_grad()

    step(data[0])
    accelerator.save_state(str(tmp_path / "ckpt"))
    assert (tmp_path / "ckpt" / "optimizer.bin").is_file()
    shards = sorted((tmp_path / "ckpt").glob("superoffload_model-*.safetensors"))
    assert len(shards) > 1 and not (tmp_path / "ckpt" / "model.safetensors").exists()
    assert max(f.stat().st_size for f in shards) <= 40_000 + 8_192  # the bound, plus each file's header
    accelerator.save_model(model, str(tmp_path / "saved"))
    saved_shards = {f.name for f in (tmp_path / "saved").glob("model-*.safetensors")}
    assert len(saved_shards) > 1 and {f.name for f in shards} | saved_shards <= streamed
    for ids in data[1:]:
        step(ids)
    optimizer.superoffload.synchronize()  # the last step's weights are final (reading .data does not wait)
    expected = {n: p.detach().clone() for n, p in model.state_dict().items()}
    accelerator.load_state(str(tmp_path / "ckpt"))
    assert [mmap for f, mmap in loads if f.endswith("optimizer.bin")] == [True]
    for ids in data[1:]:
        step(ids)
    optimizer.superoffload.synchronize()
    for n, p in model.state_dict().items():
        assert torch.equal(p.detach(), expected[n]), n


def test_load_state_restores_the_model_from_its_shards(fresh_accelerate_state: None, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A frozen parameter (no optimizer state to restore it from) comes back from ``save_state``'s model shards; a
    folder of another model is refused naming what differs."""
    from hf_superoffload.integrations import accelerate as integration

    monkeypatch.setattr(integration, "MODEL_SHARD_SIZE", "40KB")
    accelerator = Accelerator(cpu=True)
    base = tiny_llama(seed=0)
    frozen = base.model.norm.weight
    frozen.requires_grad_(False)
    model, optimizer = prepare_superoffload(accelerator, base, dict(lr=1e-3), plugin=SuperOffloadPlugin(bucket_size_mb=0.004))
    with torch.no_grad():
        frozen.mul_(3.0)
    saved = frozen.detach().clone()
    accelerator.save_state(str(tmp_path / "ckpt"))
    with torch.no_grad():
        frozen.zero_()
    accelerator.load_state(str(tmp_path / "ckpt"))
    assert torch.equal(frozen.detach(), saved)

    other = Accelerator(cpu=True)
    other_model = tiny_llama(seed=0, intermediate_size=96)
    prepare_superoffload(other, other_model, dict(lr=1e-3), plugin=SuperOffloadPlugin(bucket_size_mb=0.004))
    before = {n: p.detach().clone() for n, p in other_model.named_parameters()}
    with pytest.raises(ValueError, match=r"ckpt cannot be loaded into this model: it holds the weights of another "
                                         r"model \(model\.\S+ is \[\d+, \d+\] there and \[\d+, \d+\] here\)"):
        other.load_state(str(tmp_path / "ckpt"))
    assert all(torch.equal(p.detach(), before[n]) for n, p in other_model.named_parameters()), "refused, yet changed"
    shard = sorted((tmp_path / "ckpt").glob("superoffload_model-*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"cannot be loaded into this model: its model files cannot be read"):
        accelerator.load_state(str(tmp_path / "ckpt"))
    optimizer.superoffload.close()


def test_torch_adamw_is_taken_over(fresh_accelerate_state: None) -> None:
    model = tiny_llama(seed=0)
    adamw = torch.optim.AdamW([{"params": [model.lm_head.weight], "lr": 2e-3},
                               {"params": [p for n, p in model.named_parameters() if n != "lm_head.weight"]}],
                              lr=1e-3, betas=(0.9, 0.95), weight_decay=0.05)
    _, optimizer = prepare_superoffload(Accelerator(cpu=True), model, adamw)
    groups = optimizer.param_groups
    assert [g["lr"] for g in groups] == [2e-3, 1e-3] and groups[1]["betas"] == (0.9, 0.95)
    assert groups[0]["weight_decay"] == 0.05
    with pytest.raises(TypeError, match="SuperOffloadOptimizer itself"):
        prepare_superoffload(Accelerator(cpu=True), tiny_llama(), optimizer)


@pytest.mark.parametrize(
    ("fake", "match"),
    [
        (dict(distributed_type=DistributedType.DEEPSPEED), "distributed_type=DEEPSPEED"),
        (dict(distributed_type=DistributedType.FSDP), "distributed_type=FSDP"),
        (dict(mixed_precision="fp16"), "fp16 needs loss scaling"),
    ],
)
def test_unsupported_accelerator_setups_are_refused(fake: dict[str, Any], match: str) -> None:
    acc = SimpleNamespace(**{"distributed_type": DistributedType.NO, "num_processes": 1, "mixed_precision": "no",
                             **fake})
    with pytest.raises(ValueError, match=match):
        prepare_superoffload(acc, tiny_llama())


# ---- accelerate launch ---------------------------------------------------------------------------------
def _launch(tmp_path: Path, *script_args: str) -> str:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "configs" / "single_cpu.yaml"),
           str(REPO / "examples" / "train_with_accelerate.py"), "--output-dir", str(tmp_path / "out"), *script_args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_SUPEROFFLOAD_BUCKET_SIZE_MB": "0.5"}
    res = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"accelerate launch failed:\n{res.stdout[-3000:]}\n{res.stderr[-5000:]}"
    return res.stdout + res.stderr


def test_accelerate_launch_end_to_end_and_resume(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    log = _launch(tmp_path, "--max-steps", "5", "--save-every", "3")
    assert "step    5" in log and "done at step 5" in log
    assert "buckets:" in log  # the plan was logged
    final = load_file(tmp_path / "out" / "step-5" / "model.safetensors")
    (tmp_path / "out" / "step-5").rename(tmp_path / "uninterrupted-5")
    log = _launch(tmp_path, "--max-steps", "5", "--save-every", "3", "--resume", "latest")
    assert "resumed from" in log and "at step 3" in log and "done at step 5" in log
    resumed = load_file(tmp_path / "out" / "step-5" / "model.safetensors")
    assert final.keys() == resumed.keys()
    for k, t in final.items():
        assert torch.equal(t, resumed[k]), f"{k} differs between the resumed and the uninterrupted run"


def test_the_plugin_mirrors_every_config_field() -> None:
    import dataclasses

    from hf_superoffload import SuperOffloadConfig

    plugin = {f.name for f in dataclasses.fields(SuperOffloadPlugin)}
    missing = [f.name for f in dataclasses.fields(SuperOffloadConfig) if f.name not in plugin | {"overrides"}]
    assert not missing, f"SuperOffloadPlugin lacks {missing}"


def test_accumulate_on_host_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("HF_SUPEROFFLOAD_ACCUMULATE_ON_HOST", "false")
    assert SuperOffloadPlugin().to_config().accumulate_on_host is False
    monkeypatch.setenv("HF_SUPEROFFLOAD_ACCUMULATE_ON_HOST", "auto")
    assert SuperOffloadPlugin().to_config().accumulate_on_host == "auto"
    monkeypatch.setenv("HF_SUPEROFFLOAD_ACCUMULATE_ON_HOST", "maybe")
    with pytest.raises(ValueError, match="HF_SUPEROFFLOAD_ACCUMULATE_ON_HOST"):
        SuperOffloadPlugin()


@pytest.mark.parametrize(("text", "value"), [("auto", "auto"), ("true", True), ("off", False), ("0.4", 0.4)])
def test_defer_master_from_the_config_file_takes_a_fixed_share(text: str, value: Any) -> None:
    assert SuperOffloadPlugin(config_file={"overrides": {"defer_master": text}}).to_config().overrides.defer_master == value


def test_a_bad_fixed_share_names_its_source_and_the_old_variable_the_new_spelling(monkeypatch) -> None:
    with pytest.raises(ValueError, match=r"fraction strictly between 0 and 1.*SuperOffloadPlugin.config_file: overrides"):
        SuperOffloadPlugin(config_file={"overrides": {"defer_master": 1.5}})
    monkeypatch.setenv("HF_SUPEROFFLOAD_DEFER_MASTER", "0.5")
    with pytest.raises(ValueError, match=r"HF_SUPEROFFLOAD_DEFER_MASTER was removed.*'overrides:'"):
        SuperOffloadPlugin()
