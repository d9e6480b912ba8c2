"""The speculation governor's pauses and resumptions are logged once each (INFO, logger ``hf_superoffload``): why a
run's CPU pass is exposed is a question users ask ([Note: speculation and rollback])."""

from __future__ import annotations

import logging

import pytest
import torch

from hf_superoffload import SuperOffloadConfig, SuperOffloadOptimizer
from hf_superoffload.config import PlannerOverrides
from hf_superoffload.testing import tiny_llama


@pytest.mark.parametrize("speculation", [True, False])
def test_pauses_and_resumptions_are_logged_once_each(caplog, speculation: bool) -> None:
    model = tiny_llama(seed=0)
    cfg = SuperOffloadConfig(bucket_size_mb=0.004, gpu_resident_buckets=0, speculation=speculation,
                             overrides=PlannerOverrides(max_redo_rate=0.5, redo_window=2))
    opt = SuperOffloadOptimizer(model, lr=1e-3, max_grad_norm=1e-3, config=cfg, log_plan=False)
    g = torch.Generator().manual_seed(0)
    with caplog.at_level(logging.INFO, logger="hf_superoffload"):
        for k in range(10):
            opt.max_grad_norm = 1e-3 if k < 4 else None  # clipping on every step, then never
            ids = torch.randint(0, 128, (2, 16), generator=g)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
    opt.close()
    messages = [r.getMessage() for r in caplog.records]
    paused = [m for m in messages if "speculation paused" in m]
    resumed = [m for m in messages if "speculation resumed" in m]
    if not speculation:  # nothing to pause: nothing said
        assert not paused and not resumed
        return
    assert len(paused) == 1 and "1 of the last 1 steps" in paused[0] and "max_redo_rate=0.5" in paused[0]
    assert len(resumed) == 1 and not opt.engine.governor.paused
    assert messages.index(paused[0]) < messages.index(resumed[0])
