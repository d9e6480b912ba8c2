"""Soak on the GPU box: many optimizer steps of a preset model; host RSS, pinned bytes, device memory and threads
must stay flat. One JSON object to ``--out`` (and stdout); exit status 1 when a bound is broken.

Usage (GPU box, issue #9: 500 steps of the 3.6B anchor config)::

    python benchmarks/soak.py --model 3.6b --steps 500 --batch 2 --seq-len 2048 --out $OUT/soak.json

CPU rehearsal (seconds)::

    python benchmarks/soak.py --model tiny --device cpu --steps 60 --batch 2 --seq-len 64 --out /tmp/soak.json

Method: the model is built directly in bf16 on the device (gradient checkpointing, SDPA) and trained with the
``SuperOffloadOptimizer`` (``max_grad_norm=1.0``) whose GPU tail may fill ``--device-memory-fraction`` of the
free GPU memory (default 0.25: on one H200 about 1.3B of the 3.6B parameters' optimizer state is on the host), on a pool of 16 random token batches, one per
step in turn (a fresh batch every step, no generation cost in the loop). After ``--settle`` steps (allocator and
malloc arenas warm) it samples, every step: host RSS (``/proc/self/statm``), the engine's pinned bytes,
``torch.cuda.memory_allocated`` at the step boundary (every 25th step after draining the pipeline with
``opt.synchronize()``: between those, an upload buffer of one bucket may still be in flight; its maximum is
reported, not bounded), and the live thread count. Bounds (the same kind as the
CPU soak test, ``tests/reliability/test_soak.py``): RSS growth from the settle point to the end below
``--rss-bound-mib``; pinned bytes and thread count constant; device memory at step boundaries constant to within
``--device-bound-mib`` at the drained samples; no skipped step; the loss finite. The per-step samples are in the JSON for plots.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

MiB = 2**20


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="3.6b", help="a preset of hf_superoffload.demo.presets")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--settle", type=int, default=20, help="steps before the memory baseline is taken")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--device-memory-fraction", type=float, default=0.25,
                    help="share of free GPU memory the optimizer-state tail may fill (the rest is offloaded)")
    ap.add_argument("--rss-bound-mib", type=float, default=256.0)
    ap.add_argument("--device-bound-mib", type=float, default=64.0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    import gc

    import torch

    from hf_superoffload import SuperOffloadConfig, SuperOffloadOptimizer
    from hf_superoffload.config import PlannerOverrides
    from hf_superoffload.demo.presets import PRESETS, build_on, llama_config

    if args.device == "cuda" and not torch.cuda.is_available():
        print("soak: no CUDA device; use --device cpu", file=sys.stderr)
        return 2
    dev = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    cfg = llama_config(args.model, max_position_embeddings=max(args.seq_len, 2048),
                       vocab_size=None if PRESETS[args.model].get("vocab_size") else 4096)
    t0 = time.perf_counter()
    model = build_on(cfg, device=dev, dtype=torch.bfloat16, seed=0)
    model.gradient_checkpointing_enable()
    model.config.use_cache = False
    model.train()
    # no workload: a workload would let the planner keep everything on the GPU; the soak is about the offload path
    config = SuperOffloadConfig(overrides=PlannerOverrides(device_memory_fraction=args.device_memory_fraction))
    opt = SuperOffloadOptimizer(model, lr=1e-5, weight_decay=0.01, max_grad_norm=1.0, log_plan=False, config=config)
    init_s = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(0)
    pool = [torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len), generator=gen).to(dev) for _ in range(16)]

    def allocated() -> int:
        return torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0

    samples: list[dict[str, float]] = []
    base: dict[str, int] | None = None
    losses: list[float] = []
    t_loop = time.perf_counter()
    for step in range(args.steps):
        ids = pool[step % len(pool)]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
        if step + 1 == args.settle:
            opt.synchronize()
            gc.collect()
            base = {"rss": rss_bytes(), "pinned": opt.engine.pinned_bytes, "threads": threading.active_count(),
                    "device": allocated()}
        if base is not None:
            settled = (step + 1) % 25 == 0
            if settled:  # drained: no bucket in flight (an in-flight upload buffer is one bucket, not a leak)
                opt.synchronize()
            samples.append({"step": step, "rss_mib": round((rss_bytes() - base["rss"]) / MiB, 2),
                            "device_mib": round((allocated() - base["device"]) / MiB, 2), "settled": settled,
                            "pinned": opt.engine.pinned_bytes, "threads": threading.active_count()})
        if (step + 1) % 50 == 0:
            print(f"step {step + 1}/{args.steps} loss {losses[-1]:.4f} "
                  f"rss +{samples[-1]['rss_mib'] if samples else 0:.1f} MiB", flush=True)
    opt.synchronize()
    gc.collect()
    loop_s = time.perf_counter() - t_loop
    assert base is not None, "--steps must exceed --settle"
    end_rss = (rss_bytes() - base["rss"]) / MiB
    device_drift = max(abs(s["device_mib"]) for s in samples if s["settled"] or s is samples[0])
    in_flight_max = max(s["device_mib"] for s in samples)
    checks = {
        "rss_growth_mib": round(end_rss, 2), "rss_bound_mib": args.rss_bound_mib,
        "rss_ok": end_rss < args.rss_bound_mib,
        "pinned_ok": all(s["pinned"] == base["pinned"] for s in samples),
        "threads_ok": all(s["threads"] == base["threads"] for s in samples),
        "device_drift_mib": round(device_drift, 2), "device_ok": device_drift <= args.device_bound_mib,
        "device_in_flight_max_mib": round(in_flight_max, 2),
        "no_skipped_steps": opt.skipped_steps == 0,
        "loss_finite": all(x == x and abs(x) != float("inf") for x in losses),
    }
    ok = all(v for k, v in checks.items() if k.endswith("_ok") or k in ("no_skipped_steps", "loss_finite"))
    result = {
        "soak": True, "ok": ok, "model": args.model, "params_B": round(sum(p.numel() for p in model.parameters()) / 1e9, 3),
        "device": str(dev), "steps": args.steps, "settle": args.settle, "batch": args.batch, "seq_len": args.seq_len,
        "init_s": round(init_s, 1), "loop_s": round(loop_s, 1), "step_s_mean": round(loop_s / args.steps, 4),
        "plan": {"host_numel": opt.plan.host_numel, "device_numel": opt.plan.device_numel,
                 "rollback": opt.plan.rollback.value},
        "pinned_bytes": base["pinned"], "threads": base["threads"], "checks": checks,
        "loss_first": losses[0], "loss_last": losses[-1], "samples": samples[:: max(1, len(samples) // 100)],
        "torch": torch.__version__, "command": " ".join(sys.argv),
    }
    opt.close()
    text = json.dumps(result)
    with open(args.out, "w") as f:
        f.write(text + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
