"""The several-GPU measurements of issue #32 as users run them: one ``torchrun`` process group per row, JSON lines.

    python benchmarks/multi_gpu.py --rows dp1_8b dp2_8b ulysses2_8b_256k --out $OUT/multi_gpu.jsonl

Rows (``--rows`` takes these names or specs ``NPROC:MODEL:BATCH:SEQ:SP[:LAYERS]``; SEQ as 2048, 256k or 1m):

  dp1_8b            1 GPU, 8B, bs4 x 2048: the best 1-GPU default run, the baseline of the 2-GPU scaling target
  dp2_8b            2 GPUs, 8B, bs4 x 2048 per GPU, data parallel (target: tokens/s >= 1.9x dp1_8b)
  ulysses2_8b_256k  2 GPUs, 8B, one 256k-token sequence over both (Ulysses sp 2; target: MFU >= 40%)
  sp2_13b_64k       2 GPUs, the 13B Llama-style config (hidden 5120, 40 layers, intermediate 13824, 40 heads),
                    Ulysses sp 2 at 64k tokens: the 8-GPU rows rehearsed on 2 GPUs (a short sequence, quick steps)
  sp8_13b_1m        8 GPUs, 13B, Ulysses sp 8, 1M tokens per sequence (target: MFU >= 50%)
  dpsp8_13b_512k    8 GPUs, 13B, data parallel 2 x Ulysses sp 4, 512k tokens per sequence

What every row runs is the README's optimizer snippet and nothing else: ``SuperOffloadOptimizer(model, lr=...,
betas=..., weight_decay=..., max_grad_norm=1.0)`` (plus ``gradient_divisor`` = data-parallel replicas under
Ulysses, as ``prepare_superoffload(..., sequence_parallel_size=P)`` passes), no offload settings. Data parallel
rows plan at the first training batch ([Note: workload from the first batch]); ``--workload hint`` passes the
step's shape instead, as ``superoffload_max_seq_len`` does. The model is a random-init Llama-style config on
random tokens, bf16, activation checkpointing, clipping at 1.0 (it fires on random data).

Each row's record: median/min/max seconds per optimizer step over ``--steps`` timed steps after ``--warmup``,
tokens/s, MFU (6N + 6 L d s per token over 989 TFLOP/s per GPU), per rank: peak GPU memory
(``max_memory_allocated``) and peak host RSS, the plan (this rank's host/device elements), and the planner's
predictions for rank 0's plan (step time on the shipped H200 profile, peak GPU, expected host) beside the measured
numbers. A row whose GPUs are not there is recorded as ``skipped``; a failing or timed-out row as ``failed`` /
``timeout`` with the log's tail, and the next row runs.

CPU rehearsal (gloo, the tiny preset; tests/benchmarks/test_multi_gpu_smoke.py)::

    python benchmarks/multi_gpu.py --device cpu --rows 2:tiny:2:64:1 2:tiny:1:128:2 --warmup 1 --steps 2 --out x.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PEAK_TFLOPS = 989.0
LR, CLIP = 1e-5, 1.0
ROWS: dict[str, str] = {
    "dp1_8b": "1:8b:4:2048:1",
    "dp2_8b": "2:8b:4:2048:1",
    "ulysses2_8b_256k": "2:8b:1:256k:2",
    "sp2_13b_64k": "2:13b:1:64k:2",
    "sp8_13b_1m": "8:13b:1:1m:8",
    "dpsp8_13b_512k": "8:13b:1:512k:4",
}


def parse_len(text: str) -> int:
    """``2048``, ``256k``, ``1m`` -> tokens (k = 1024, m = 1024**2)."""
    m = re.fullmatch(r"(\d+)([kKmM]?)", text.strip())
    if not m:
        raise ValueError(f"{text!r} is not a length: use e.g. 2048, 256k or 1m")
    return int(m.group(1)) * {"": 1, "k": 1024, "m": 1024**2}[m.group(2).lower()]


def parse_row(name: str) -> dict[str, Any]:
    spec = ROWS.get(name, name)
    parts = spec.split(":")
    if not 5 <= len(parts) <= 6:
        raise SystemExit(f"--rows {name!r}: use one of {sorted(ROWS)} or NPROC:MODEL:BATCH:SEQ:SP[:LAYERS]")
    nproc, sp = int(parts[0]), int(parts[4])
    if nproc % sp:
        raise SystemExit(f"--rows {name!r}: sequence parallel {sp} does not divide {nproc} processes")
    return {"row": name, "nproc": nproc, "model": parts[1], "batch": int(parts[2]), "seq": parse_len(parts[3]),
            "sp": sp, "layers": int(parts[5]) if len(parts) > 5 else None}


# ---- one row (under torchrun) -----------------------------------------------------------------------------------
def _config(model: str, seq: int, layers: int | None) -> Any:
    from transformers import LlamaConfig

    from hf_superoffload.demo.presets import PRESETS

    dims = dict(PRESETS[model])
    dims["vocab_size"] = dims.get("vocab_size") or 256  # the tiny preset leaves it to the caller
    if layers:
        dims["num_hidden_layers"] = layers
    return LlamaConfig(**dims, max_position_embeddings=max(seq, 4096), tie_word_embeddings=False, use_cache=False,
                       rope_theta=500000.0)


def _peak_host_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def worker(row: dict[str, Any], *, device_type: str, warmup: int, steps: int, workload_hint: bool) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from hf_superoffload import SuperOffloadOptimizer
    from hf_superoffload import sequence_parallel as sp
    from hf_superoffload.demo.presets import build_on
    from hf_superoffload.planning.planner import Workload
    from hf_superoffload.sequence_parallel.loss import DEFAULT_CHUNK

    cuda = device_type == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    sp_size = row["sp"]
    groups = sp.init_sequence_parallel(sp_size, device_type=device_type) if sp_size > 1 else None
    dp_size, dp_rank = (groups.dp_size, groups.dp_rank) if groups is not None else (world, rank)
    cfg = _config(row["model"], row["seq"], row["layers"])
    if groups is not None:
        sp.check_heads(cfg, sp_size)  # fails before any memory is touched
    if groups is None:
        cfg._attn_implementation = "sdpa" if cuda else "eager"
    t0 = time.perf_counter()
    model = build_on(cfg, device=dev, dtype=torch.bfloat16, seed=0)  # the same weights on every rank
    if groups is not None:
        sp.enable_sequence_parallel(model, groups)
    # as benchmarks/defaults.py, whose 1-GPU row is the baseline
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable()
    else:
        model.gradient_checkpointing_enable()
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    batch, seq = row["batch"], row["seq"]
    workload = None
    if workload_hint:
        workload = Workload(cfg, batch, seq, True, sequence_parallel=sp_size,
                            loss_chunk_tokens=DEFAULT_CHUNK if groups is not None else None)
    # the README snippet; under Ulysses the gradient divisor prepare_superoffload passes
    opt = SuperOffloadOptimizer(model, lr=LR, betas=(0.9, 0.95), weight_decay=0.1, max_grad_norm=CLIP,
                                log_plan=False, workload=workload,
                                gradient_divisor=dp_size if groups is not None else None)
    init_s = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(1000 + dp_rank)  # the same tokens inside a sequence-parallel group
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)
    if groups is not None:
        shard = {k: v.to(dev) if isinstance(v, torch.Tensor) else v
                 for k, v in sp.shard_batch({"input_ids": ids, "labels": ids}, groups).items()}
    else:
        ids = ids.to(dev)

    def step() -> None:
        if groups is not None:
            sp.causal_lm_loss(model, shard, groups).loss.backward()
        else:
            model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    def sync() -> None:  # the GPU's queue only, as a training loop: the CPU pass overlaps the next forward
        if cuda:
            torch.cuda.synchronize(dev)

    times: list[float] = []
    for k in range(warmup + steps):
        sync()
        t = time.perf_counter()
        try:
            step()
            sync()
        except torch.OutOfMemoryError as e:  # the other ranks wait in a collective: end the whole group
            print(json.dumps({"rank": rank, "oom": str(e).splitlines()[0][:300]}), flush=True)
            os._exit(3)
        if k >= warmup:
            times.append(time.perf_counter() - t)
    opt.synchronize()
    plan = opt.plan
    mine = {"rank": rank, "peak_gpu_gb": torch.cuda.max_memory_allocated(dev) / 1e9 if cuda else None,
            "peak_host_rss_gb": _peak_host_gb(), "host_params": plan.host_numel, "device_params": plan.device_numel,
            "host_state_gb": plan.host_bytes() / 1e9, "pinned_gb": opt.engine.pinned_bytes / 1e9,
            "step_s_median": statistics.median(times)}
    per_rank: list[Any] = [None] * world
    dist.all_gather_object(per_rank, mine)
    tokens = batch * seq * dp_size
    med = statistics.median(times)
    flops = 6 * n_params + 6 * cfg.num_hidden_layers * cfg.hidden_size * seq
    rec = {**row, "status": "ok", "device": device_type, "world": world, "dp": dp_size, "params": n_params,
           "workload": "hint" if workload_hint else "none", "workload_planned": None if opt.workload is None else
           {"batch": opt.workload.batch_size, "seq": opt.workload.seq_len, "sp": opt.workload.sequence_parallel},
           "init_s": round(init_s, 1), "step_s": {"median": med, "min": min(times), "max": max(times), "n": len(times)},
           "warmup": warmup, "tokens_per_step": tokens, "tokens_per_s": tokens / med,
           "mfu": flops * tokens / med / (world * PEAK_TFLOPS * 1e12) if cuda else None,
           "per_rank": per_rank, "plan": {"summary": plan.summary(), "weight_mode": plan.weight_mode.value,
                                          "rollback": plan.rollback.value, "buckets": len(plan.buckets),
                                          "device_buckets": len(plan.device_buckets)},
           "predicted": _predicted(plan, cfg, batch, seq, sp_size, dp_size, groups is not None)}
    opt.close()
    dist.barrier()
    if groups is not None:
        sp.set_active_groups(None)  # a group left referenced at interpreter exit aborted gloo runs now and then
    dist.destroy_process_group()
    return rec


def _predicted(plan: Any, cfg: Any, batch: int, seq: int, sp_size: int, dp_size: int,
               chunked_loss: bool) -> dict[str, Any]:
    """The planner's predictions for rank 0's plan, on the shipped H200 profile (the box's)."""
    from hf_superoffload.planning.hardware import HardwareProfile
    from hf_superoffload.planning.memory_model import ModelShape, PlanLike, estimate
    from hf_superoffload.planning.step_time import predict_step_time
    from hf_superoffload.sequence_parallel.loss import DEFAULT_CHUNK

    shape = ModelShape.from_config(cfg)
    plan_like = PlanLike.from_plan(plan)
    est = estimate(shape, plan_like=plan_like, batch_size=batch, seq_len=seq, grad_ckpt=True,
                   sequence_parallel=sp_size, loss_chunk_tokens=DEFAULT_CHUNK if chunked_loss else None)
    step = predict_step_time(shape, plan_like, HardwareProfile.h200_pcie(), batch_size=batch, seq_len=seq,
                             grad_ckpt=True, sequence_parallel=sp_size, data_parallel=dp_size,
                             clipping_every_step=True)  # one rank's step; the memory model is per rank too
    return {"gpu_peak_gb": est.gpu_peak_bytes / 1e9, "host_rss_gb": est.host_expected_bytes / 1e9,
            "step_s": None if step is None else step.step_s, "gpu_s": None if step is None else step.gpu_s}


# ---- the driver (plain python): one torchrun per row --------------------------------------------------------------
def _gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:
        return 0


def run_row(row: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    if args.device == "cuda" and row["nproc"] > _gpus():
        return {**row, "status": "skipped", "error": f"needs {row['nproc']} GPUs, {_gpus()} visible"}
    out = Path(args.out).with_suffix(f".{row['row'].replace(':', '_')}.part")
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={row['nproc']}",
           os.path.abspath(__file__), "--worker", json.dumps(row), "--device", args.device, "--warmup",
           str(args.warmup), "--steps", str(args.steps), "--workload", args.workload, "--out", str(out)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        log, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        log = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return {**row, "status": "timeout", "error": f"over {args.timeout:.0f} s", "tail": log[-2000:]}
    if rc == 0 and out.is_file():
        rec = json.loads(out.read_text())
        out.unlink()
        return rec
    status = "oom" if '"oom"' in log or "OutOfMemoryError" in log else "failed"
    return {**row, "status": status, "rc": rc, "tail": log[-3000:]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--rows", nargs="+", default=["dp1_8b", "dp2_8b", "ulysses2_8b_256k"])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--steps", type=int, default=5, help="timed steps")
    ap.add_argument("--workload", choices=["none", "hint"], default="none",
                    help="none: the snippet as written; hint: the step's shape passed (superoffload_max_seq_len)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per row")
    ap.add_argument("--out", required=True, help="a .jsonl file; one record per row")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        rec = worker(json.loads(args.worker), device_type=args.device, warmup=args.warmup, steps=args.steps,
                     workload_hint=args.workload == "hint")
        if int(os.environ.get("RANK", "0")) == 0:
            Path(args.out).write_text(json.dumps(rec))
        return 0
    if args.steps < 1 or args.warmup < 0:
        raise SystemExit("--steps must be >= 1 and --warmup >= 0")
    rows = [parse_row(r) for r in args.rows]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for row in rows:
        t = time.perf_counter()
        rec = run_row(row, args)
        rec["wall_s"] = round(time.perf_counter() - t, 1)
        with open(args.out, "a") as f:
            f.write(json.dumps(rec) + "\n")
        s = rec.get("step_s") or {}
        print(f"{row['row']}: {rec['status']} in {rec['wall_s']:.0f} s"
              + (f", step {s['median']:.3f} s [{s['min']:.3f}-{s['max']:.3f}], {rec['tokens_per_s']:.0f} tok/s"
                 if s else f" {rec.get('error', '')}"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
