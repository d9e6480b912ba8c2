"""A script that ends without ``optimizer.close()`` exits cleanly (runtime/cpu_worker.py ``_close_live_workers``).

Before the atexit hook, a daemon CPU worker still inside a torch op when the interpreter finalized aborted the
process ("terminate called without an active exception", exit status 134) in ~30-50% of such exits on the dev
box; the subprocess test repeats the exit so that a missing hook fails it with high probability, and the
in-process test checks the hook itself deterministically.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import torch

from hf_superoffload import SuperOffloadConfig, SuperOffloadOptimizer
from hf_superoffload.runtime import cpu_worker
from hf_superoffload.testing import tiny_llama

SCRIPT = textwrap.dedent("""
    import torch
    from hf_superoffload import SuperOffloadConfig, SuperOffloadOptimizer
    from hf_superoffload.testing import tiny_llama
    cfg = SuperOffloadConfig(bucket_size_mb=0.004, gpu_resident_buckets=0)
    for _ in range(2):  # two optimizers, neither closed; the script ends right after a step()
        model = tiny_llama(seed=0, num_hidden_layers=2)
        opt = SuperOffloadOptimizer(model, lr=1e-3, max_grad_norm=1.0, config=cfg, log_plan=False)
        g = torch.Generator().manual_seed(1)
        for _ in range(4):
            ids = torch.randint(0, 128, (2, 16), generator=g)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
    print("trained")
""")


def test_a_script_that_never_closes_the_optimizer_exits_cleanly() -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    for _ in range(4):
        proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode == 0 and "trained" in proc.stdout, (proc.returncode, proc.stderr[-2000:])
        assert "terminate called" not in proc.stderr


def test_the_exit_hook_finishes_the_last_step_and_stops_every_worker_thread() -> None:
    model = tiny_llama(seed=0, num_hidden_layers=2)
    before = set(threading.enumerate())
    opt = SuperOffloadOptimizer(model, lr=1e-3, config=SuperOffloadConfig(bucket_size_mb=0.004, gpu_resident_buckets=0),
                                log_plan=False)
    mine = set(threading.enumerate()) - before
    assert mine  # the worker (and its D2H gate thread)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    cpu_worker._close_live_workers()  # what the interpreter runs at exit
    assert not any(t.is_alive() for t in mine)
    assert opt.engine.param_steps == [1] * len(opt.engine.params)  # the step was finished, not dropped
    assert not any(w is opt.engine._worker for w in cpu_worker._LIVE.values())
    opt.close()  # still allowed afterwards
