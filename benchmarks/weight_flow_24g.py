"""Weight flow under a 24 GiB GPU cap: full-parameter training of a Llama-3-8B-style model; one JSON to --out.

Usage (GPU box)::

    python benchmarks/weight_flow_24g.py --out $OUT/weight_flow_24g.json

Rehearsal (CPU, tiny model, seconds)::

    python benchmarks/weight_flow_24g.py --model tiny --device cpu --out /tmp/wf.json

The parent process tries the batch sizes of ``--batch-sizes`` from the largest down, each in a fresh child
process (a CUDA out-of-memory leaves the allocator fragmented; a fresh process measures cleanly), and reports
the first that trains. Each child caps the GPU with ``torch.cuda.set_per_process_memory_fraction(cap / total)``
*before* building the model, builds it directly in bf16 on the device (never 32 GB of fp32 anywhere), enables
gradient checkpointing (SDPA), trains with ``SuperOffloadOptimizer(weight_placement="flow")`` and measures
``--steps`` optimizer steps of ``--grad-accum`` micro-batches each after ``--warmup``. The gradient
accumulation matters: the CPU Adam of 8B parameters takes ~2.5 s on a 16-core host, which a single micro-batch
of the size that fits under the cap cannot hide (weights still stream twice per micro-batch). The micro-batches
are summed on the host (``--accumulate-on-host``, default on: [Note: host accumulation] in docs/weight_flow.md);
device-side accumulation would keep 16 GB of bf16 gradients on the GPU. On a 128 GiB host the planner's
``auto`` dtype sums in the bf16 landing buffer (an fp32 sum needs 4 B/param more, 30 GB at 8B, which does not fit).

Host RAM, not the GPU, bounds 8B on a 128 GiB host: 16 B/param of host state is 120 GiB. ``--gpu-resident-buckets``
(default 1: the input embedding's bucket, 0.53B parameters, 8.4 GB of fp32 state plus its resident bf16 weights)
keeps part of the optimizer state on the GPU so the host fits; rollback is ``inverse`` (no second host copy).

MFU convention (docs/benchmarks.md, "Conventions"): model FLOPs per token = 6N + 6*L*d*s
(all parameters, causal attention, recompute not counted), against 989 TFLOP/s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GiB = 1024**3
SHAPES = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256),
    "tiny": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),
}


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON result file")
    p.add_argument("--model", choices=sorted(SHAPES), default="8b")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--cap-gib", type=float, default=24.0, help="GPU memory cap (set_per_process_memory_fraction)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-sizes", default="4,3,2,1", help="tried from the first (largest) on")
    p.add_argument("--grad-accum", type=int, default=8,
                   help="micro-batches per optimizer step (the CPU Adam then hides behind K forward/backward passes)")
    p.add_argument("--accumulate-on-host", choices=["true", "false", "auto"], default="true",
                   help="sum micro-batches on the host (SuperOffloadConfig.accumulate_on_host)")
    p.add_argument("--host-accumulation-dtype", choices=["auto", "fp32", "landing"], default="auto")
    p.add_argument("--loss-chunk", type=int, default=4096,
                   help="tokens per chunk of the LM-head + cross-entropy (0: the model's own loss, full logits)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--gpu-resident-buckets", default="1", help="'auto' or an int (see the module docstring)")
    p.add_argument("--rollback", default="inverse")
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--timeout-s", type=float, default=420.0, help="per child process")
    p.add_argument("--profile-dir", default=None,
                   help="after the timed steps, profile one more step (every thread) into this directory: a gzipped "
                        "Chrome trace, top ops, and the trace_summary breakdown in the result's 'profile'")
    p.add_argument("--child-batch", type=int, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _host_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def child(a: argparse.Namespace) -> dict:
    import dataclasses

    import torch
    from transformers import LlamaConfig

    from hf_superoffload import SuperOffloadConfig, SuperOffloadOptimizer
    from hf_superoffload.demo.presets import build_on
    from hf_superoffload.planning.hardware import HardwareProfile
    from hf_superoffload.sequence_parallel import causal_lm_loss, shard_batch

    dev = torch.device("cuda", 0) if a.device == "cuda" else torch.device(a.device)  # torch 2.11 wants an index
    bs, seq = a.child_batch, a.seq_len
    shape = SHAPES[a.model]
    cap = None
    if dev.type == "cuda":
        total = torch.cuda.get_device_properties(dev).total_memory
        cap = int(a.cap_gib * GiB)
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), dev)
    cfg = LlamaConfig(**shape, max_position_embeddings=max(seq, 128), tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    t0 = time.perf_counter()
    model = build_on(cfg, device=dev, dtype=torch.bfloat16, seed=0)  # created and initialised in bf16 on the device
    model.gradient_checkpointing_enable()
    model.config.use_cache = False
    model.train()
    n = sum(p.numel() for p in model.parameters())
    profile = HardwareProfile.read(dev)
    if cap is not None:  # the planner must see the cap, not the whole device
        profile = dataclasses.replace(profile, device_free_bytes=cap - torch.cuda.memory_allocated(dev))
    tail = a.gpu_resident_buckets if a.gpu_resident_buckets == "auto" else int(a.gpu_resident_buckets)
    accumulate = a.accumulate_on_host if a.accumulate_on_host == "auto" else a.accumulate_on_host == "true"
    config = SuperOffloadConfig(weight_placement="flow", gpu_resident_buckets=tail, rollback=a.rollback,
                                accumulate_on_host=accumulate, host_accumulation_dtype=a.host_accumulation_dtype)
    opt = SuperOffloadOptimizer(model, lr=1e-5, weight_decay=0.0, max_grad_norm=a.max_grad_norm, config=config,
                                profile=profile)
    init_s = time.perf_counter() - t0
    flow = opt.engine._flow
    ids = torch.randint(0, shape["vocab_size"], (bs, seq), device=dev)
    shard = shard_batch({"input_ids": ids, "labels": ids}, None)  # chunked loss: no [tokens, vocab] logits

    def micro_loss() -> torch.Tensor:
        if a.loss_chunk:
            return causal_lm_loss(model, shard, None, chunk_size=a.loss_chunk).loss
        return model(input_ids=ids, labels=ids).loss

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def step() -> float:
        total = torch.zeros((), device=dev)
        for k in range(a.grad_accum):
            with opt.no_sync() if k < a.grad_accum - 1 else contextlib.nullcontext():
                loss = micro_loss() / a.grad_accum
                loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad()
        return float(total)

    for _ in range(a.warmup):
        step()
    sync()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    flow.stats.reset_peak()
    times, stats, losses = [], [], []
    for _ in range(a.steps):
        t = time.perf_counter()
        losses.append(step())  # .item() of the loss: one host sync per step, as a training loop logs
        sync()
        times.append(time.perf_counter() - t)
        st = opt.last_step_stats
        stats.append({"cpu_s": round(st.cpu_s, 3), "wait_s": round(st.wait_s, 3), "verdict": st.verdict,
                      "norm": round(st.grad_norm, 3), "h2d_GB": round(st.h2d_bytes / 1e9, 2),
                      "d2h_GB": round(st.d2h_bytes / 1e9, 2), "overlap": round(st.overlap, 3)})
    profile = None
    if a.profile_dir:
        sys.path.insert(0, str(Path(__file__).parent))
        import suite  # the suite's profiler step (its module body imports only the standard library)

        profile = suite._profile("weight_flow", step, sync, dev, 1, Path(a.profile_dir), f"weight_flow_b{bs}")
    opt.synchronize()
    sync()
    dt = sorted(times)[len(times) // 2]
    tok = bs * seq * a.grad_accum / dt
    layers, h = shape["num_hidden_layers"], shape["hidden_size"]
    flops = (6 * n + 6 * layers * h * seq) * tok
    out = {
        "model": a.model, "params_B": round(n / 1e9, 3), "batch_size": bs, "seq_len": seq,
        "grad_accum": a.grad_accum, "loss_chunk": a.loss_chunk, "tokens_per_step": bs * seq * a.grad_accum,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "cap_gib": a.cap_gib if cap else None, "step_s_median": round(dt, 3), "step_s_all": [round(x, 3) for x in times],
        "tokens_per_s": round(tok, 1), "model_TFLOPs": round(flops / 1e12, 2), "MFU_vs_989": round(flops / 989e12, 4),
        "losses": [round(x, 4) for x in losses],
        "peak_gpu_GiB": round(torch.cuda.max_memory_allocated(dev) / GiB, 2) if cap else None,
        "peak_gpu_reserved_GiB": round(torch.cuda.max_memory_reserved(dev) / GiB, 2) if cap else None,
        "peak_host_rss_GB": round(_host_rss_gb(), 1), "init_s": round(init_s, 1),
        "plan": opt.plan.summary(), "host_accumulation": opt.plan.host_accumulation.value,
        "flow": {"units": len(flow.units), "peak_units": flow.stats.peak_units,
                 "peak_weights_GiB": round(flow.stats.peak_bytes / GiB, 3),
                 "h2d_GB_per_step": round(flow.stats.h2d_bytes / 1e9 / max(1, a.warmup + a.steps), 2)},
        "offload_stats": stats, "torch": torch.__version__, "profile": profile,
    }
    return out


def parent(a: argparse.Namespace) -> int:
    attempts = []
    result = None
    for bs in [int(x) for x in a.batch_sizes.split(",")]:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            tmp = f.name
        cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--child-batch", str(bs), "--out", tmp]
        t = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout_s)
            rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-3000:]
        except subprocess.TimeoutExpired as e:
            rc, tail = "timeout", str(e)[-3000:]
        entry = {"batch_size": bs, "rc": rc, "wall_s": round(time.perf_counter() - t, 1)}
        if rc == 0:
            result = json.loads(Path(tmp).read_text())
            attempts.append(entry)
            os.unlink(tmp)
            break
        entry["oom"] = "out of memory" in tail.lower() or "outofmemory" in tail.lower()
        entry["log_tail"] = tail
        attempts.append(entry)
        os.unlink(tmp)
        print(f"batch {bs}: failed (rc {rc}{', OOM' if entry['oom'] else ''}); trying smaller", file=sys.stderr)
    out = {"result": result, "attempts": attempts, "argv": sys.argv[1:]}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(result if result is not None else out, indent=2))
    return 0 if result is not None else 1


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    if a.child_batch is None:
        return parent(a)
    out = child(a)
    Path(a.out).write_text(json.dumps(out) + "\n")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no teardown: close() would bring every weight back to the capped device just to exit


if __name__ == "__main__":
    sys.exit(main())
