"""Launch multi-process gloo runs of a worker script; every run has a deadline so a hang fails the test."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Finished:
    returncodes: list[int]
    outputs: list[str]
    seconds: float


def launch(script: Path, world: int, args: list[str], *, deadline: float = 240.0, env: dict | None = None) -> Finished:
    """Run ``world`` ranks of ``script`` (one process each); kill them all at ``deadline`` seconds."""
    port = free_port()
    procs = []
    t0 = time.monotonic()
    for rank in range(world):
        e = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
             "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
             "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **(env or {})}
        procs.append(subprocess.Popen([sys.executable, str(script), *args], env=e, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = []
    for p in procs:
        left = max(1.0, deadline - (time.monotonic() - t0))
        try:
            out, _ = p.communicate(timeout=left)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, _ = p.communicate()
            out = (out or "") + f"\n[killed at the {deadline:.0f}s deadline]"
        outputs.append(out or "")
    return Finished([p.returncode for p in procs], outputs, time.monotonic() - t0)


@pytest.fixture
def launcher():
    return launch
