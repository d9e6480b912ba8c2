"""One rank of a data-parallel test run (launched by tests/distributed/test_data_parallel.py).

argv: scenario out_dir [key=value ...]. Environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT.
Each rank trains the same tiny Llama on its slice of the same global batches and saves what the test checks.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from hf_superoffload import SuperOffloadConfig, SuperOffloadOptimizer
from hf_superoffload.config import PlannerOverrides
from hf_superoffload.testing import tiny_llama

LR = 1e-3
GLOBAL_BS = 4


def batches(n: int, seed: int = 1, seq: int = 16, vocab: int = 128) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (GLOBAL_BS, seq), generator=g) for _ in range(n)]


def poison(grad: torch.Tensor) -> torch.Tensor:
    """A gradient hook: one element becomes NaN (the step must be skipped on every rank)."""
    grad = grad.clone()
    grad.view(-1)[0] = float("nan")
    return grad


def inject_delay(where: str) -> None:
    """Make one stage slow on the GPU (``torch.cuda._sleep``) so a missing stream wait shows up as wrong numbers."""
    from hf_superoffload.runtime import device_tail, flush, layout

    name = {"flatten": "flatten_grads_with_stats_", "scatter": "scatter_flat_"}[where]
    modules = {"flatten": (flush,), "scatter": (layout, device_tail)}[where]
    real = getattr(modules[0], name)

    def slow(*a, **k):
        torch.cuda._sleep(50_000_000)
        return real(*a, **k)

    for mod in modules:
        setattr(mod, name, slow)


def capture_grads(model: torch.nn.Module, into: dict[str, torch.Tensor]) -> None:
    """Tensor hooks: ``into[name]`` becomes the gradient this rank's backward gives the parameter, summed over the
    micro-batches of a step in bf16 as autograd sums ``.grad`` (what the reference is fed: the test says why)."""

    def keep(name: str, grad: torch.Tensor) -> None:
        g = grad.detach().to("cpu", copy=True)
        into[name] = g if name not in into else into[name] + g

    for n, p in model.named_parameters():
        if p.requires_grad:
            p.register_hook(lambda g, n=n: keep(n, g))


def build_model(kw: dict[str, str], device: str = "cpu") -> torch.nn.Module:
    """The tiny Llama of the test; ``tied=1`` ties the embeddings, ``freeze=1`` freezes the final norm."""
    model = tiny_llama(seed=0, device=device, tie_word_embeddings=kw.get("tied") == "1")
    if kw.get("freeze") == "1":
        model.model.norm.weight.requires_grad_(False)
    if kw.get("ckpt") == "1":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    kw = dict(a.split("=", 1) for a in sys.argv[3:])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = kw.get("device", "cpu")
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = f"cuda:{torch.cuda.current_device()}"
    if world > 1:
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo",
                                timeout=datetime.timedelta(seconds=float(kw.get("timeout", 60))))
    rank = dist.get_rank() if world > 1 else 0
    if "delay" in kw:
        inject_delay(kw["delay"])
    torch.set_num_threads(1)
    steps, start = int(kw.get("steps", 30)), int(kw.get("start", 0))
    max_norm = float(kw.get("max_norm", 1.0))
    cfg = SuperOffloadConfig(bucket_size_mb=0.004, gpu_resident_buckets=int(kw.get("tail", 2)),
                             rollback=kw.get("rollback", "auto"), overrides=PlannerOverrides(max_redo_rate=1.0), cpu_threads=1,
                             weight_placement="flow" if kw.get("flow") == "1" else "auto")
    model = build_model(kw, device)
    opt = SuperOffloadOptimizer(model, lr=LR, weight_decay=0.1, max_grad_norm=max_norm, config=cfg)
    if "load" in kw:
        opt.load_state_dict(torch.load(kw["load"].format(rank=rank), weights_only=False))
    if "resume_dir" in kw:  # the integrations' resume: this rank's own shard, or every rank's merged
        from hf_superoffload.integrations._common import read_optimizer_state

        print(f"planned before the load: {opt.planned}", flush=True)
        _, state = read_optimizer_state(opt, kw["resume_dir"], "optimizer.pt")
        opt.load_state_dict(state)
    per = GLOBAL_BS // world
    data = batches(start + steps)
    losses = []
    grads: list[dict[str, torch.Tensor]] = []
    stats: list[tuple[str, int, int]] = []
    step_grads: dict[str, torch.Tensor] = {}
    capture_grads(model, step_grads)
    for step in range(start, start + steps):
        ids = data[step][rank * per : (rank + 1) * per].to(device)
        hook = None
        if scenario == "nan" and step == int(kw.get("nan_step", 5)) and rank == world - 1:
            hook = next(model.parameters()).register_hook(poison)
        accum = int(kw.get("accum", 1))
        loss = torch.zeros((), device=device)
        for k, mb in enumerate(ids.chunk(accum)):  # non-final micro-batches accumulate on the device
            with opt.no_sync() if k < accum - 1 else contextlib.nullcontext():
                part = model(input_ids=mb, labels=mb).loss / accum
                part.backward()
            loss = loss + part.detach()
        if hook is not None:
            hook.remove()
        if kw.get("drain") == "1":  # every landed bucket is speculated before step(), whatever the box's load
            opt.engine._worker.drain(60.0)
        if scenario == "fail" and step == int(kw.get("fail_step", 3)) and rank == world - 1:
            raise RuntimeError("injected failure on the last rank")
        opt.step()
        opt.zero_grad()
        grads.append(dict(step_grads))
        step_grads.clear()
        st = opt.last_step_stats
        stats.append((st.verdict, st.speculated_buckets, st.wasted_buckets))
        t = loss.detach().float().reshape(1)
        if world > 1:
            dist.all_reduce(t)
        losses.append(float(t) / world)
        if "save_at" in kw and step == int(kw["save_at"]):
            torch.save(opt.state_dict(), out / f"opt_rank{rank}.pt")
    opt.synchronize()
    flow = opt.engine._flow
    peak_units = flow.stats.peak_units if flow is not None else None
    with opt.engine.materialized():
        params = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    torch.save({"losses": losses, "grads": grads, "stats": stats, "rollback": opt.plan.rollback.value,
                "host_accumulation": opt.plan.host_accumulation.value, "peak_units": peak_units, "grad_norm": opt.last_grad_norm, "skipped": opt.skipped_steps,
                "clipped": opt.clipped_steps,
                "params": params,
                "state": opt.state_dict()["superoffload"], "plan": opt.plan.summary()},
               out / f"result_rank{rank}.pt")
    opt.close()
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
