"""One rank of the data-parallel workload-inference test (tests/distributed/test_data_parallel_workload.py).

argv: out_dir device_budget_bytes steps [given | save K | resume K]. Environment: RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT. ``save K`` also writes each rank's optimizer shard after K steps to ``out_dir/ckpt``; ``resume K`` loads
them into a bare optimizer before its first batch (the Trainer's ``read_optimizer_state``) and trains steps K..steps-1.
The optimizer is built bare (no workload): it plans at the first training forward, and the ranks' first batches have
different sequence lengths. With ``given`` it is built with the workload the ranks should agree on (the largest
sequence), planned at construction: the run the bare one must equal. Before the first backward the ranks compare their plans and stop if they differ (the
bucket sharding would not line up). Saves what the test checks.
"""

from __future__ import annotations

import dataclasses
import datetime
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from hf_superoffload import SuperOffloadConfig, SuperOffloadOptimizer
from hf_superoffload.planning import hardware
from hf_superoffload.planning.plan import OffloadPlan
from hf_superoffload.planning.planner import Workload
from hf_superoffload.testing import tiny_llama

LR = 1e-3
BATCH = 2
SEQ = (16, 40)
"""Rank r's sequence length: the first batches differ in shape across the ranks."""
GiB = 1024**3


def batches(rank: int, steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(0, 128, (BATCH, SEQ[rank]), generator=g) for _ in range(steps)]


def pretend_device_budget(budget: int) -> None:
    """What ``HardwareProfile.read`` reports on a GPU with ``budget`` bytes free (the planner sizes the tail from
    it; on CPU it reports none and the optimizer would plan at construction)."""

    def read(cls: type, device: torch.device) -> hardware.HardwareProfile:
        return hardware.HardwareProfile(device_type="cpu", device_free_bytes=budget, host_available_bytes=64 * GiB,
                                        cpu_threads=1)

    hardware.HardwareProfile.read = classmethod(read)  # type: ignore[method-assign, assignment]


def shared_part(plan: OffloadPlan) -> OffloadPlan:
    """What every rank's plan must hold alike: all but the rank, its cores, where its shards start, its shard sizes
    and the notes."""
    buckets = tuple(dataclasses.replace(b, lo=0) for b in plan.buckets)
    return dataclasses.replace(plan, buckets=buckets, rank=0, cpu_affinity=None, host_numel=0, device_numel=0,
                               notes=())


def main() -> None:
    out, budget, steps = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    given = sys.argv[4:] == ["given"]
    mode, at = (sys.argv[4], int(sys.argv[5])) if sys.argv[4:5] in (["save"], ["resume"]) else (None, 0)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == len(SEQ), f"run {len(SEQ)} ranks"
    torch.set_num_threads(1)
    pretend_device_budget(budget)
    model = tiny_llama(seed=0)
    workload = Workload(model.config, BATCH, max(SEQ), grad_ckpt=False) if given else None
    opt = SuperOffloadOptimizer(model, lr=LR, weight_decay=0.1, max_grad_norm=1.0, log_plan=False,
                                config=SuperOffloadConfig(bucket_size_mb=0.004, cpu_threads=1), workload=workload)
    planned_at_construction = opt.planned
    ckpt = out.parent / "save" / "ckpt" if mode == "resume" else out / "ckpt"
    if mode == "resume":
        from hf_superoffload.integrations._common import read_optimizer_state

        _, state = read_optimizer_state(opt, str(ckpt), "optimizer.pt")
        assert state is not None
        opt.load_state_dict(state)
        assert not opt.planned, "the load closed the plan before the first batch"
    losses = []
    for step, ids in enumerate(batches(rank, steps)):
        if step < at and mode == "resume":
            continue
        if step == at and mode == "save":
            ckpt.mkdir(exist_ok=True)
            torch.save(opt.state_dict(), ckpt / f"optimizer_rank{rank}.pt")
        loss = model(input_ids=ids, labels=ids).loss
        if step == at:
            plans: list[str | None] = [None] * world
            dist.all_gather_object(plans, repr(shared_part(opt.plan)))
            if any(p != plans[0] for p in plans):
                tails: list[int | None] = [None] * world
                dist.all_gather_object(tails, len(opt.plan.device_buckets))
                raise SystemExit(f"the ranks planned differently (GPU-resident buckets per rank: {tails})")
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = loss.detach().float().reshape(1)
        dist.all_reduce(t)
        losses.append(float(t) / world)
    opt.synchronize()
    assert opt.workload is not None
    with opt.engine.materialized():
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.save({"losses": losses, "grad_norm": opt.last_grad_norm, "params": params,
                "state": opt.state_dict()["superoffload"], "planned_at_construction": planned_at_construction,
                "workload": (opt.workload.batch_size, opt.workload.seq_len),
                "device_buckets": len(opt.plan.device_buckets)},
               out / f"result_rank{rank}.pt")
    opt.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
