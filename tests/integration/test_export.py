"""``hf-superoffload export`` / ``hf_superoffload.export_checkpoint``: a checkpoint's fp32 masters as a model.

A tiny Llama is trained a few steps through SuperOffloadTrainer with checkpoints; the exported folder loads with
``AutoModelForCausalLM.from_pretrained`` and its weights equal the optimizer's masters bit for bit (fp32), or
the masters rounded to bf16 (bf16). Tied embeddings are written once and tied again; a frozen parameter comes
from the checkpoint's model files. Bad input ends the CLI in one line with exit status 2.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_superoffload import SuperOffloadArguments, SuperOffloadTrainer, export_checkpoint
from hf_superoffload import state as st
from hf_superoffload.cli import main
from hf_superoffload.testing import tiny_llama


def _train(hf: Any, out: Path, **model_kw: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """Train 4 steps with a checkpoint every 2; returns the trainer and each trained parameter's final master."""
    args = SuperOffloadArguments(**hf.train_kwargs(out, max_steps=4, save_strategy="steps", save_steps=2),
                                 **hf.SMALL_BUCKETS)
    model = tiny_llama(seed=0, **model_kw)
    model.model.norm.weight.requires_grad_(False)  # a frozen parameter: not in the optimizer state
    trainer = SuperOffloadTrainer(model=model, args=args, train_dataset=hf.TokenDataset(16))
    trainer.train()
    opt = trainer.superoffload_optimizer
    masters = {n: hf.master_of(opt, p).clone() for n, p in model.named_parameters() if p.requires_grad}
    return trainer, masters


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_exported_fp32_weights_equal_the_masters_bit_for_bit(hf: Any, tmp_path: Path, tied: bool) -> None:
    trainer, masters = _train(hf, tmp_path / "run", tie_word_embeddings=tied)
    ckpt = tmp_path / "run" / "checkpoint-4"
    out = export_checkpoint(ckpt, tmp_path / "fp32")
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    params = dict(loaded.named_parameters())
    for name, m in masters.items():
        assert params[name].dtype == torch.float32
        assert torch.equal(params[name].detach(), m), f"{name} differs from its master"
    # the masters are not their bf16 weights: the export is not the model file upcast
    assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in masters.values())
    frozen = trainer.model.model.norm.weight.detach().float()
    assert torch.equal(params["model.norm.weight"].detach(), frozen)
    if tied:
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    else:
        assert torch.equal(params["lm_head.weight"].detach(), masters["lm_head.weight"])
    assert "lm_head.weight" not in masters or not tied

    bf16 = AutoModelForCausalLM.from_pretrained(export_checkpoint(ckpt, tmp_path / "bf16", dtype="bf16"),
                                                dtype=torch.bfloat16)
    for name, p in bf16.named_parameters():
        if name in masters:
            assert torch.equal(p.detach(), masters[name].to(torch.bfloat16)), name


def test_cli_export_and_its_one_line_errors(hf: Any, tmp_path: Path, capsys: Any) -> None:
    _, masters = _train(hf, tmp_path / "run")
    ckpt = tmp_path / "run" / "checkpoint-4"
    assert main(["export", str(ckpt), str(tmp_path / "out")]) == 0
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    assert all(torch.equal(dict(loaded.named_parameters())[n].detach(), m) for n, m in masters.items())
    capsys.readouterr()

    with pytest.raises(SystemExit) as e:
        main(["export", str(tmp_path / "nowhere"), str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "does not exist" in err and "Traceback" not in err

    model_only = tmp_path / "model_only"
    tiny_llama().save_pretrained(model_only)  # config and weights, no optimizer state
    capsys.readouterr()
    assert main(["export", str(model_only), str(tmp_path / "y")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds no SuperOffload optimizer state" in err and "save_only_model" in err

    os.remove(ckpt / "config.json")
    assert main(["export", str(ckpt), str(tmp_path / "z")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--config" in err


def test_a_checkpoint_of_another_model_is_refused_naming_the_parameter(hf: Any, tmp_path: Path) -> None:
    from hf_superoffload.export import ExportError

    _train(hf, tmp_path / "run")
    other = tmp_path / "other"
    tiny_llama(hidden_size=64, intermediate_size=128).config.save_pretrained(other)
    with pytest.raises(ExportError, match=r"has shape .* give the config of the model that was trained"):
        export_checkpoint(tmp_path / "run" / "checkpoint-4", tmp_path / "out", config=str(other))


def _split_into_rank_shards(sd: dict[str, Any], world: int) -> list[dict[str, Any]]:
    """The single-process state ``sd`` as ``world`` data-parallel shards in the layout the sharded engine saves (one
    bucket per parameter, each rank holding 1/world of it, zero-padded), for :func:`consolidate_state_dicts`."""
    import math

    from hf_superoffload.planning.plan import Placement

    kinds = ("master", "exp_avg", "exp_avg_sq")
    buckets, parts = [], {r: {"host": {k: [] for k in kinds}, "device": {k: [] for k in kinds}} for r in range(world)}
    sizes = {"host": 0, "device": 0}
    for i, (pl, off) in enumerate(sd["locations"]):
        side = "host" if Placement(pl) is Placement.HOST else "device"
        n = sd["numels"][i]
        shard = math.ceil(n / world)
        buckets.append({"params": [i], "numel": n, "shard": shard, "placement": side, "offset": sizes[side]})
        sizes[side] += shard
        for k in kinds:
            whole = torch.cat([st._read(sd[side][k], off, off + n), torch.zeros(shard * world - n)])
            for r in range(world):
                parts[r][side][k].append(whole[r * shard : (r + 1) * shard])
    shards = []
    for r in range(world):
        arenas = {side: {k: (torch.cat(v) if v else torch.zeros(0)) for k, v in d.items()} for side, d in parts[r].items()}
        shards.append({**sd, **arenas, "locations": None, "manifest": st._manifest(arenas),
                       "sharding": {"world_size": world, "rank": r, "buckets": buckets}})
    return shards


def test_a_data_parallel_checkpoint_is_merged_from_its_rank_shards(hf: Any, tmp_path: Path) -> None:
    _, masters = _train(hf, tmp_path / "run")
    ckpt = tmp_path / "run" / "checkpoint-4"
    full = torch.load(ckpt / "optimizer.pt", map_location="cpu", weights_only=True)
    for r, shard in enumerate(_split_into_rank_shards(full["superoffload"], 2)):
        torch.save({**full, "superoffload": shard}, ckpt / f"optimizer_rank{r}.pt")
    os.remove(ckpt / "optimizer.pt")
    loaded = AutoModelForCausalLM.from_pretrained(export_checkpoint(ckpt, tmp_path / "out"), dtype=torch.float32)
    params = dict(loaded.named_parameters())
    for name, m in masters.items():
        assert torch.equal(params[name].detach(), m), name
    # merged without a copy: the arenas are views of the shards' (a mapped checkpoint stays mapped), equal to the
    # single-process state's
    shards = _split_into_rank_shards(full["superoffload"], 2)
    merged = st.consolidate_state_dicts(shards)
    homes = {t.untyped_storage().data_ptr() for sd in shards for side in ("host", "device")
             for t in st._pieces(sd[side]["master"])}
    assert st._pieces(merged["host"]["master"])
    assert all(t.untyped_storage().data_ptr() in homes for t in st._pieces(merged["host"]["master"]))
    for i, (pl, off) in enumerate(merged["locations"]):
        side = "host" if pl == "host" else "device"
        n = merged["numels"][i]
        ref_side = "host" if full["superoffload"]["locations"][i][0] == "host" else "device"
        ref_off = full["superoffload"]["locations"][i][1]
        assert torch.equal(st._read(merged[side]["exp_avg"], off, off + n),
                           st._read(full["superoffload"][ref_side]["exp_avg"], ref_off, ref_off + n))
    damaged = _split_into_rank_shards(full["superoffload"], 2)
    damaged[1]["host"]["master"][5] += 1.0  # changed after its checksum was taken: merged, it would get a fresh one
    with pytest.raises(ValueError, match=r"the shard of rank 1: optimizer checkpoint host/master fails its checksum"):
        st.consolidate_state_dicts(damaged)
    os.remove(ckpt / "optimizer_rank1.pt")  # a rank's shard is missing
    from hf_superoffload.export import ExportError

    with pytest.raises(ExportError, match="cannot merge the 1 optimizer shards"):
        export_checkpoint(ckpt, tmp_path / "out2")


def test_cli_train_with_save_state_exports_its_masters(tmp_path: Path, capsys: Any) -> None:
    """``hf-superoffload train --save-state`` leaves a folder that ``export`` turns into the fp32 masters: the
    exported weights equal the state file's masters (read from the arenas by name), whose bf16 rounding is the
    model the run saved. Without ``--save-state`` no state is written."""
    small = ["--model", "tiny", "--device", "cpu", "--steps", "3", "--seq-len", "32", "--batch-size", "2",
             "--examples", "200", "--new-tokens", "2", "--log-every", "1"]
    assert main(["train", *small, "--output-dir", str(tmp_path / "plain")]) == 0
    assert not (tmp_path / "plain" / "superoffload_optimizer.pt").exists()
    run = tmp_path / "run"
    assert main(["train", *small, "--save-state", "--output-dir", str(run)]) == 0
    assert f"hf-superoffload export {run} {run}-fp32" in capsys.readouterr().out
    assert main(["export", str(run), str(tmp_path / "fp32")]) == 0

    sd = torch.load(run / "superoffload_optimizer.pt", map_location="cpu", weights_only=True)["superoffload"]
    exported = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "fp32", dtype=torch.float32).named_parameters())
    trained = dict(AutoModelForCausalLM.from_pretrained(run, dtype=torch.bfloat16).named_parameters())
    assert len(sd["names"]) == len(trained)
    for name, numel, shape, (side, off) in zip(sd["names"], sd["numels"], sd["shapes"], sd["locations"]):
        master = st._read(sd[side]["master"], off, off + numel).view(shape)
        assert torch.equal(exported[name].detach(), master), name
        assert torch.equal(trained[name].detach(), master.to(torch.bfloat16)), name


def test_a_save_state_folder_exports_with_its_frozen_weights(fresh_accelerate_state: None, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """``prepare_superoffload``'s ``save_state`` writes the model as ``superoffload_model*`` shards ([Note: bounded
    model shards]); export reads a parameter the optimizer did not train from them."""
    from accelerate import Accelerator

    from hf_superoffload.integrations import accelerate as integration
    from hf_superoffload.integrations.accelerate import SuperOffloadPlugin, prepare_superoffload

    monkeypatch.setattr(integration, "MODEL_SHARD_SIZE", "40KB")
    accelerator = Accelerator(cpu=True)
    base = tiny_llama(seed=0)
    base.model.norm.weight.requires_grad_(False)
    with torch.no_grad():
        base.model.norm.weight.mul_(3.0)
    model, optimizer = prepare_superoffload(accelerator, base, dict(lr=1e-3),
                                            plugin=SuperOffloadPlugin(bucket_size_mb=0.004))
    ids = torch.randint(0, 128, (2, 16))
    accelerator.backward(model(input_ids=ids, labels=ids).loss)
    optimizer.step()
    accelerator.save_state(str(tmp_path / "ckpt"))
    base.config.save_pretrained(tmp_path / "config")
    assert len(list((tmp_path / "ckpt").glob("superoffload_model-*.safetensors"))) > 1
    out = export_checkpoint(tmp_path / "ckpt", tmp_path / "out", config=str(tmp_path / "config"))
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert torch.equal(loaded.model.norm.weight.detach(), base.model.norm.weight.detach().float())
    optimizer.superoffload.close()
