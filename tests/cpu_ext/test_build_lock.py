"""A lock left by a killed JIT build must not hang the next import forever ([Note: CPU Adam build])."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hf_superoffload.cpu_ext import _build

fcntl = pytest.importorskip("fcntl")


@pytest.fixture
def build_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    from torch.utils.cpp_extension import _get_build_directory

    d = tmp_path / "lockprobe"
    assert _get_build_directory("lockprobe", verbose=False) == str(d)
    d.mkdir(parents=True, exist_ok=True)
    return d


def test_stale_build_lock_is_removed_fresh_one_kept(build_dir: Path) -> None:
    """The no-fcntl fallback: only a lock older than _STALE_LOCK_S is taken for stale."""
    lock = build_dir / "lock"
    lock.touch()
    _build._clear_stale_lock("lockprobe")
    assert lock.exists(), "a fresh lock belongs to a build in progress"
    old = time.time() - 2 * _build._STALE_LOCK_S
    os.utime(lock, (old, old))
    _build._clear_stale_lock("lockprobe")
    assert not lock.exists()


def test_lock_of_a_killed_build_is_removed_at_once(build_dir: Path) -> None:
    """A build killed while holding the flock leaves torch's lock file, seconds old: the next build removes it."""
    lock = build_dir / "lock"
    holder = (
        "import fcntl, sys, time\n"
        f"f = open({str(build_dir / 'build.flock')!r}, 'a'); fcntl.flock(f, fcntl.LOCK_EX)\n"
        f"open({str(lock)!r}, 'w').close(); print('held', flush=True); time.sleep(120)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "held"
        p.kill()
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    assert lock.exists() and time.time() - lock.stat().st_mtime < _build._STALE_LOCK_S
    with _build._exclusive_build("lockprobe"):
        assert not lock.exists()


def test_a_build_in_progress_is_waited_for_and_its_lock_kept(build_dir: Path) -> None:
    """While another holder builds, its lock stays and the next build waits; it enters once the holder is done."""
    lock = build_dir / "lock"
    entered = threading.Event()

    def second() -> None:
        with _build._exclusive_build("lockprobe"):
            entered.set()

    t = threading.Thread(target=second, daemon=True)
    # another open file description: flock conflicts within a process as between two
    with open(build_dir / "build.flock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        lock.touch()  # torch's baton of the build in progress
        t.start()
        assert not entered.wait(0.5), "entered while another build held the flock"
        assert lock.exists(), "the lock of a build in progress was removed"
        lock.unlink()  # the build ends: torch releases its baton, then the flock goes
    assert entered.wait(30)
    t.join(30)
