"""``tiled_mlp_tokens`` in SuperOffloadArguments/SuperOffloadTrainer and prepare_superoffload: validated, applied
to the model's decoder MLPs, passed to the planner's workload, and training matches the untiled run."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from accelerate import Accelerator

from hf_superoffload.integrations.accelerate import SuperOffloadPlugin, prepare_superoffload
from hf_superoffload.integrations.transformers import (
    SuperOffloadArguments,
    SuperOffloadTrainer,
    _workload_from_args,
)
from hf_superoffload.sequence_parallel import find_decoder_mlps
from hf_superoffload.sequence_parallel.tiled_mlp import _TiledForward
from hf_superoffload.testing import tiny_llama


def _tiles(model: torch.nn.Module) -> list[int | None]:
    out = []
    for _, mlp in find_decoder_mlps(model):
        f = mlp.__dict__.get("forward")
        out.append(f.tile_tokens if isinstance(f, _TiledForward) else None)
    return out


def test_arguments_validate_tiled_mlp_tokens(tmp_path) -> None:
    kw = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none", save_strategy="no")
    for bad in (-1, 1.5, True, "8k"):
        with pytest.raises(ValueError, match=f"tiled_mlp_tokens={bad!r} is invalid"):
            SuperOffloadArguments(tiled_mlp_tokens=bad, **kw)
    args = SuperOffloadArguments(tiled_mlp_tokens=8, superoffload_max_seq_len=64, **kw)
    assert "tiled_mlp_tokens" not in args.superoffload_fields()  # not a SuperOffloadConfig field
    assert _workload_from_args(tiny_llama(), args).mlp_tile_tokens == 8
    assert _workload_from_args(tiny_llama(), SuperOffloadArguments(superoffload_max_seq_len=64, **kw)).mlp_tile_tokens is None


def _trainer_losses(hf: Any, tmp: Any, tile: int) -> tuple[list[float], list[int | None]]:
    kw = hf.train_kwargs(tmp / str(tile), max_steps=4, learning_rate=1e-3)
    model = tiny_llama(seed=0)
    trainer = SuperOffloadTrainer(model=model, args=SuperOffloadArguments(**kw, **hf.SMALL_BUCKETS, tiled_mlp_tokens=tile),
                                  train_dataset=hf.TokenDataset(8))
    tiles = _tiles(model)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], tiles


def test_trainer_tiles_the_mlps_and_trains_like_untiled(hf: Any, tmp_path) -> None:
    tiled, tiles = _trainer_losses(hf, tmp_path, 5)
    assert tiles == [5, 5]
    untiled, none = _trainer_losses(hf, tmp_path, 0)
    assert none == [None, None]
    assert len(tiled) == len(untiled) == 4
    assert math.isclose(tiled[0], untiled[0], rel_tol=1e-6)  # the forward is the same computation
    for a, b in zip(tiled, untiled, strict=True):  # bf16 rounding of the summed tile gradients
        assert math.isclose(a, b, rel_tol=5e-3, abs_tol=5e-3), (tiled, untiled)


def test_prepare_superoffload_tiles_the_mlps(fresh_accelerate_state: None) -> None:
    with pytest.raises(ValueError, match="tiled_mlp_tokens=-2 is invalid"):
        prepare_superoffload(Accelerator(cpu=True), tiny_llama(seed=0), tiled_mlp_tokens=-2)
    losses = []
    for tile in (3, 0):
        accelerator = Accelerator(cpu=True)
        model, optimizer = prepare_superoffload(accelerator, tiny_llama(seed=0), dict(lr=1e-3), tiled_mlp_tokens=tile,
                                                plugin=SuperOffloadPlugin(bucket_size_mb=0.004, gpu_resident_buckets=2))
        assert _tiles(accelerator.unwrap_model(model)) == ([3, 3] if tile else [None, None])
        ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(0))
        step_losses = []
        for _ in range(2):
            loss = model(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step_losses.append(loss.item())
        optimizer.superoffload.close()
        losses.append(step_losses)
    assert losses[0][0] == pytest.approx(losses[1][0], rel=1e-6)
    assert losses[0][1] == pytest.approx(losses[1][1], rel=5e-3, abs=5e-3)
