"""A lock left by a killed JIT build must not hang the next import forever."""

from __future__ import annotations

import os
import time

from hf_superoffload.cpu_ext import _build


def test_stale_build_lock_is_removed_fresh_one_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    from torch.utils.cpp_extension import _get_build_directory

    lock = tmp_path / "lockprobe" / "lock"
    assert _get_build_directory("lockprobe", verbose=False) == str(lock.parent)
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.touch()
    _build._clear_stale_lock("lockprobe")
    assert lock.exists(), "a fresh lock belongs to a build in progress"
    old = time.time() - 2 * _build._STALE_LOCK_S
    os.utime(lock, (old, old))
    _build._clear_stale_lock("lockprobe")
    assert not lock.exists()
