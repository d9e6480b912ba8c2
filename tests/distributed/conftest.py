"""Launch multi-process gloo runs of a worker script; every run has a deadline so a hang fails the test."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
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


def launch(script: Path, world: int, args: list[str], *, deadline: float = 240.0, env: dict | None = None,
           signal_when: tuple[int, str, int] | None = None) -> Finished:
    """Run ``world`` ranks of ``script`` (one process each); kill them all at ``deadline`` seconds.

    ``signal_when=(rank, prefix, signum)``: send ``signum`` to that rank only, the first time it prints a line
    starting with ``prefix``.
    """
    port = free_port()
    procs = []
    t0 = time.monotonic()
    for rank in range(world):
        e = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
             "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
             "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        procs.append(subprocess.Popen([sys.executable, str(script), *args], env=e, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    lines: list[list[str]] = [[] for _ in procs]

    def read(rank: int) -> None:  # one reader per rank: a full pipe would block that rank
        stdout = procs[rank].stdout
        assert stdout is not None
        pending = signal_when is not None and signal_when[0] == rank
        for line in stdout:
            lines[rank].append(line)
            if pending and signal_when is not None and line.startswith(signal_when[1]):
                procs[rank].send_signal(signal_when[2])
                pending = False

    readers = [threading.Thread(target=read, args=(r,), daemon=True) for r in range(world)]
    for t in readers:
        t.start()
    timed_out = False
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            timed_out = True
            for q in procs:
                q.kill()
            p.wait()
    for t in readers:
        t.join()
    outputs = ["".join(out) + (f"\n[killed at the {deadline:.0f}s deadline]" if timed_out else "") for out in lines]
    return Finished([p.returncode for p in procs], outputs, time.monotonic() - t0)


@pytest.fixture(scope="session")
def launcher():
    return launch
