"""A resume reads the optimizer file through a mapping: the saved state is not copied into anonymous memory beside
the live host arenas (at 8B that second copy alone is ~96 GB)."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from hf_superoffload.integrations._common import _load_state_file


def _anonymous_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    pytest.skip("no RssAnon in /proc/self/status")


def test_the_optimizer_file_is_mapped_not_read_into_anonymous_memory(tmp_path: Path) -> None:
    path = tmp_path / "optimizer.pt"
    arena = torch.randn(32 << 20)  # 128 MiB
    expected = arena[:: 1 << 16].clone()
    torch.save({"superoffload": {"host": {"master": arena}}}, path)
    del arena
    gc.collect()
    before = _anonymous_bytes()
    state = _load_state_file(str(path))
    loaded = state["superoffload"]["host"]["master"]
    assert torch.isfinite(loaded.sum())  # every page read
    grown = _anonymous_bytes() - before
    assert grown < 16 << 20, f"loading a 128 MiB state grew anonymous memory by {grown / 2**20:.0f} MiB"
    assert torch.equal(loaded[:: 1 << 16], expected)
