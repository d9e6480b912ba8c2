"""One rank of the data-parallel thread-trial test (tests/distributed/test_data_parallel_thread_trial.py).

argv: out_dir law. Environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT.
The host reports six cores, three per rank (the plan gives the CPU Adam two of them); each CPU Adam call sleeps for
a time that scales with its thread count by the rank's ``law``: ``faster`` / ``slower`` with more threads on every
rank, or ``mixed`` (rank 0 much faster with three, rank 1 a little slower). Saves what the test checks.
"""

from __future__ import annotations

import datetime
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hf_superoffload import SuperOffloadConfig, SuperOffloadOptimizer
from hf_superoffload.planning import hardware
from hf_superoffload.planning.planner import CALIBRATION_STEPS
from hf_superoffload.planning.thread_trial import TRIAL_STEPS
from hf_superoffload.testing import pretend_profile, tiny_llama, train_steps

GiB = 1024**3
STEPS = CALIBRATION_STEPS + TRIAL_STEPS + 1  # and one more at the chosen count
PAUSE_S = 0.02
"""Per Adam call at the planned two threads, times the rank's weight: the pass outweighs the tiny model's step."""
LAWS = {"faster": ((1.0, -3), (1.0, -3)), "slower": ((1.0, 3), (1.0, 3)), "mixed": ((1.0, -3), (0.2, 3))}
"""Each rank's (weight, exponent): an Adam call at ``n`` threads sleeps ``PAUSE_S * weight * (n / 2) ** exponent``."""


def main() -> None:
    out, law = Path(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    torch.set_num_threads(1)
    from hf_superoffload.runtime import host_pass

    profile = pretend_profile(64 * GiB, rates_of="h200_pcie", cpu_threads=2)
    hardware.HardwareProfile.read = classmethod(lambda cls, device: profile)  # type: ignore[method-assign, assignment]
    # six cores, three per rank: the cores are pretended, so the worker does not pin itself to them
    os.sched_getaffinity = lambda pid: set(range(6))  # type: ignore[assignment]
    os.sched_setaffinity = lambda pid, cores: None  # type: ignore[assignment]
    weight, exponent = LAWS[law][rank]
    real = host_pass.ops.cpu_adamw_step_

    def timed_step(*args: object, num_threads: int, **kwargs: object) -> None:
        time.sleep(PAUSE_S * weight * (num_threads / 2) ** exponent)
        real(*args, num_threads=num_threads, **kwargs)

    host_pass.ops.cpu_adamw_step_ = timed_step
    model = tiny_llama(seed=3, num_hidden_layers=2)
    # no clipping: every step commits, so every steady iteration is alike
    opt = SuperOffloadOptimizer(model, lr=1e-3, max_grad_norm=None, log_plan=False,
                                config=SuperOffloadConfig(gpu_resident_buckets=0, bucket_size_mb=0.05))
    told: list[str] = []
    opt.calibration_listeners.append(told.append)
    g = torch.Generator().manual_seed(11 + rank)
    steps = train_steps(model, opt, [torch.randint(0, 128, (2, 24), generator=g) for _ in range(STEPS)])
    opt.synchronize()
    torch.save({"threads": (opt.calibration or {}).get("threads"), "planned": opt.plan.cpu_threads,
                "pass_threads": [s.stats.host_pass.threads if s.stats.host_pass else None for s in steps],
                "told": told, "settled": opt.settled}, out / f"result_rank{rank}.pt")
    opt.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
