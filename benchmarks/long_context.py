"""Long-context training with Ulysses sequence parallelism over all ranks; one JSON line per step.

One process per GPU, the sequence sharded over every rank (sp = world size, dp = 1)::

    torchrun --standalone --nproc_per_node 2 benchmarks/long_context.py --model 8b --seq-len 256k \\
        --optimizer superoffload --steps 3 --warmup 1 --out $OUT/long_context.jsonl

Longest sequence that runs (each length in a fresh ``torchrun``, stops at the first failure)::

    python benchmarks/long_context.py --search 64k,128k,256k,512k,1m --nproc-per-node 2 --model 8b \\
        --optimizer superoffload --out $OUT/long_context_search.jsonl

CPU rehearsal (gloo, tiny model)::

    torchrun --standalone --nproc_per_node 2 benchmarks/long_context.py --model tiny --device cpu \\
        --seq-len 256 --optimizer sgd --steps 2 --out /tmp/lc.jsonl

Training recipe: a Llama-style config built locally (no download), bf16 weights, gradient checkpointing, SDPA
(flash kernel) inside Ulysses attention, the chunked LM-head loss normalised by the group's token count,
``--offload-activations`` moves the checkpointed layer inputs to pinned host memory
(``torch.autograd.graph.save_on_cpu``), ``--tiled-mlp TOKENS`` runs each layer's MLP in tiles of tokens
(``sequence_parallel.enable_tiled_mlp``, docs/long_context.md): 512k tokens on 2 GPUs::

    torchrun --standalone --nproc_per_node 2 benchmarks/long_context.py --model 8b --seq-len 512k \\
        --tiled-mlp 8192 --optimizer superoffload --steps 1 --warmup 0 --out $OUT/long_context.jsonl

MFU convention (docs/benchmarks.md, "Conventions"): model FLOPs per token
= 6N + 6*L*d*s (N all parameters incl. embeddings and LM head, d = heads x head_dim, s = sequence length,
causal attention halved, recompute not counted), against 989 TFLOP/s bf16 dense per H200. Tokens per step
= batch x seq-len x dp.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from typing import Any

from hf_superoffload.demo.presets import PRESETS, build_on

PEAK_TFLOPS = {"cuda": 989.0}  # H200 SXM dense bf16; CPU: no MFU
MODELS: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256),
    **{name: PRESETS[name] for name in ("8b", "13b", "14b")},
}
OOM_EXIT = 3


def parse_len(text: str) -> int:
    """``65536``, ``64k``, ``1m`` -> tokens (k = 1024, m = 1024**2)."""
    m = re.fullmatch(r"(\d+)([kKmM]?)", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"bad length {text!r}: use e.g. 65536, 64k or 1m")
    return int(m.group(1)) * {"": 1, "k": 1024, "m": 1024 ** 2}[m.group(2).lower()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="8b")
    ap.add_argument("--seq-len", type=parse_len, default=parse_len("64k"), help="global tokens per sequence")
    ap.add_argument("--batch", type=int, default=1, help="sequences per sequence-parallel group per step")
    ap.add_argument("--sp", type=int, default=0,
                    help="ranks per sequence (default: all); --sp 1 is plain data parallelism (scaling runs)")
    ap.add_argument("--layers", type=int, default=None, help="override the model's decoder layer count (size search)")
    ap.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping; 0 turns it off")
    ap.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    ap.add_argument("--accumulate-on-host", action="store_true",
                    help="sum the offloaded buckets' micro-batch gradients on the host (SuperOffloadConfig)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--optimizer", choices=["superoffload", "sgd", "none"], default="superoffload",
                    help="superoffload: SuperOffloadOptimizer (multi-rank needs its data-parallel version); sgd: "
                         "all-reduce + clip + SGD on the GPU (rehearsal); none: forward/backward only")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--attn", choices=["sdpa", "superoffload_sdpa_cudnn", "flash_attention_2", "flash_attention_3"],
                    default="sdpa",
                    help="local attention inside Ulysses")
    ap.add_argument("--chunk-size", type=int, default=4096, help="LM-head/CE tokens per chunk")
    ap.add_argument("--no-checkpointing", action="store_true")
    ap.add_argument("--keep-attention", action="store_true",
                    help="checkpoint every layer but attention: its outputs are kept, not recomputed "
                         "(sequence_parallel.enable_checkpointing_keep_attention)")
    ap.add_argument("--offload-activations", action="store_true",
                    help="keep the checkpointed layer inputs in pinned host memory")
    ap.add_argument("--tiled-mlp", type=int, default=0, metavar="TOKENS",
                    help="run every decoder layer's MLP this many tokens at a time, forward and backward "
                         "(sequence_parallel.enable_tiled_mlp; 0: off)")
    ap.add_argument("--out", default=None, help="append JSON lines here (rank 0)")
    ap.add_argument("--tag", default="", help="free text copied into every line")
    ap.add_argument("--search", type=lambda s: [parse_len(x) for x in s.split(",")], default=None,
                    help="comma-separated lengths to try in order, each in a fresh torchrun (run this script "
                         "with plain python, not under torchrun)")
    ap.add_argument("--nproc-per-node", type=int, default=1, help="with --search: processes per trial")
    ap.add_argument("--trial-timeout", type=float, default=1800, help="with --search: seconds per trial")
    return ap.parse_args(argv)


# ---- measurement ----------------------------------------------------------------------------------
def model_flops_per_token(n_params: int, cfg: dict[str, int], seq: int) -> float:
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    return 6.0 * n_params + 6.0 * cfg["num_hidden_layers"] * cfg["num_attention_heads"] * head_dim * seq


def host_rss_gb() -> tuple[float, float]:
    """(current RSS, peak RSS) of this process in GB (the CPU Adam worker is a thread of it)."""
    cur = 0.0
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    cur = int(line.split()[1]) * 1024 / 1e9
    except OSError:
        pass
    return cur, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


# ---- one run (under torchrun) ---------------------------------------------------------------------
def model_dims(name: str, layers: int | None = None) -> dict[str, int]:
    """``MODELS[name]`` with ``layers`` (if given) as the decoder depth (the size search of the largest-model runs)."""
    return dict(MODELS[name], **({"num_hidden_layers": layers} if layers else {}))


def build_config(name: str, seq_len: int, layers: int | None = None) -> Any:
    """The Llama-style config of ``--model`` (no download), rope theta 500k as Llama 3 (see :func:`model_dims`)."""
    from transformers import LlamaConfig

    return LlamaConfig(**model_dims(name, layers), max_position_embeddings=max(seq_len, 2048), tie_word_embeddings=False,
                       use_cache=False, rope_theta=500000.0)


def make_tokens(vocab: int, batch: int, seq_len: int, dp_rank: int) -> Any:
    """Random tokens, the same on every rank of one sequence-parallel group."""
    import torch

    g = torch.Generator().manual_seed(1000 + dp_rank)
    return torch.randint(0, vocab, (batch, seq_len), generator=g)


def build_optimizer(name: str, model: Any, lr: float, groups: Any, workload: Any = None,
                    max_grad_norm: float | None = 1.0, accumulate_on_host: bool = False) -> Any:
    """The optimizer under test. SuperOffloadOptimizer reduces gradients over all ranks itself once it is
    data-parallel (SUM, then / dp): the SP ranks' partial gradients sum to the full-sequence gradient."""
    if name == "superoffload":
        from hf_superoffload import SuperOffloadConfig, SuperOffloadOptimizer

        opt = SuperOffloadOptimizer(model, lr=lr, max_grad_norm=max_grad_norm, weight_decay=0.0, log_plan=False,
                                    gradient_divisor=groups.dp_size, workload=workload,
                                    config=SuperOffloadConfig(accumulate_on_host=True if accumulate_on_host else "auto"))
        if opt.plan.rank == 0:
            print(opt.plan.summary(), flush=True)
        return opt
    return None


def sgd_step(model: Any, lr: float, groups: Any) -> None:
    """Rehearsal optimizer: SUM gradients over all ranks, / dp, clip to 1.0, plain SGD."""
    import torch
    import torch.distributed as dist

    params = [p for p in model.parameters() if p.grad is not None]
    if dist.get_world_size() > 1:
        for p in params:  # per tensor, in the gradient dtype: no fp32 copy of all gradients
            dist.all_reduce(p.grad)
            p.grad.div_(groups.dp_size)
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    with torch.no_grad():
        for p in params:
            p.add_(p.grad, alpha=-lr)
            p.grad = None


def run(args: argparse.Namespace) -> int:
    import contextlib
    import gc

    import torch
    import torch.distributed as dist

    from hf_superoffload import sequence_parallel as sp

    dev_type = args.device
    if dev_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if dev_type == "cuda" else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = sp.init_sequence_parallel(args.sp or world, device_type=dev_type, inner_attention=args.attn)
    dev = torch.device(dev_type, torch.cuda.current_device()) if dev_type == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    shape = model_dims(args.model, args.layers)
    cfg = build_config(args.model, args.seq_len, layers=args.layers)
    sp.check_heads(cfg, groups.sp_size)  # fails before any memory is touched

    t0 = time.perf_counter()
    model = build_on(cfg, device=dev, dtype=dtype, seed=0)  # identical weights on every rank
    if groups.sp_size > 1:
        sp.enable_sequence_parallel(model, groups, inner_attention=args.attn)
    else:
        model.config._attn_implementation = args.attn
    if args.keep_attention and args.no_checkpointing:
        raise SystemExit("--keep-attention is a form of checkpointing: drop --no-checkpointing or --keep-attention")
    if args.keep_attention:
        sp.enable_checkpointing_keep_attention(model)
    elif not args.no_checkpointing:
        model.gradient_checkpointing_enable()
    if args.tiled_mlp:
        sp.enable_tiled_mlp(model, tile_tokens=args.tiled_mlp)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    from hf_superoffload.planning.planner import Workload

    workload = Workload(cfg, args.batch, args.seq_len, not args.no_checkpointing, groups.sp_size, args.chunk_size,
                        mlp_tile_tokens=args.tiled_mlp or None, keep_attention=args.keep_attention)
    opt = build_optimizer(args.optimizer, model, args.lr, groups, workload, args.max_grad_norm or None,
                          args.accumulate_on_host)
    init_s = time.perf_counter() - t0

    ids = make_tokens(shape["vocab_size"], args.batch, args.seq_len, groups.dp_rank)  # same inside an SP group
    shard = {k: v.to(dev) if isinstance(v, torch.Tensor) else v
             for k, v in sp.shard_batch({"input_ids": ids, "labels": ids}, groups).items()}
    tokens = args.batch * args.seq_len * groups.dp_size * args.grad_accum
    fpt = model_flops_per_token(n_params, shape, args.seq_len)
    peak = PEAK_TFLOPS.get(dev_type)

    def sync() -> None:
        if dev_type == "cuda":
            torch.cuda.synchronize()

    def step() -> float:
        total = None
        for k in range(args.grad_accum):
            last = k == args.grad_accum - 1
            ctx = (torch.autograd.graph.save_on_cpu(pin_memory=dev_type == "cuda") if args.offload_activations
                   else contextlib.nullcontext())
            with opt.no_sync() if opt is not None and not last else contextlib.nullcontext():
                with ctx:
                    out = sp.causal_lm_loss(model, shard, groups, chunk_size=args.chunk_size)
                (out.loss / args.grad_accum).backward()
            part = out.global_loss.detach() / args.grad_accum
            total = part if total is None else total + part
        if args.optimizer == "superoffload":
            opt.step()
            opt.zero_grad()
        elif args.optimizer == "sgd":
            sgd_step(model, args.lr, groups)
        else:
            model.zero_grad(set_to_none=True)
        return float(total)

    common = dict(model=args.model, layers=cfg.num_hidden_layers, max_grad_norm=args.max_grad_norm or None,
                  grad_accum=args.grad_accum, accumulate_on_host=args.accumulate_on_host,
                  params_B=round(n_params / 1e9, 3), seq_len=args.seq_len, batch=args.batch,
                  world=world, sp=groups.sp_size, dp=groups.dp_size, device=dev_type, dtype=args.dtype,
                  optimizer=args.optimizer, attn=args.attn, checkpointing=not args.no_checkpointing,
                  offload_activations=args.offload_activations, chunk_size=args.chunk_size,
                  tiled_mlp=args.tiled_mlp or None, keep_attention=args.keep_attention, tag=args.tag,
                  torch=torch.__version__, mfu_convention="6N+6*L*d*s per token, vs 989 TFLOP/s per GPU")
    if opt is not None and hasattr(opt, "plan"):
        pl = opt.plan
        common["plan"] = {"host_numel": pl.host_numel, "device_numel": pl.device_numel, "buckets": len(pl.buckets),
                          "weight_mode": pl.weight_mode.value, "cast_side": pl.cast_side.value,
                          "rollback": pl.rollback.value}
    lines: list[dict[str, Any]] = []
    times: list[float] = []
    status = 0
    for i in range(args.warmup + args.steps):
        if dev_type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        sync()
        t = time.perf_counter()
        try:
            loss = step()
        except torch.OutOfMemoryError as e:
            line = {**common, "step": i, "oom": True, "error": str(e).splitlines()[0][:300]}
            print(json.dumps(line), flush=True)
            lines.append(line)
            status = OOM_EXIT
            break
        sync()
        dt = time.perf_counter() - t
        peak_gpu = torch.cuda.max_memory_allocated() / 1e9 if dev_type == "cuda" else 0.0
        stats = torch.tensor([peak_gpu, host_rss_gb()[1]], dtype=torch.float64, device=dev)
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
        tps = tokens / dt
        line = {**common, "step": i, "warmup": i < args.warmup, "step_s": round(dt, 3), "tokens": tokens,
                "tokens_per_s": round(tps, 1), "model_TFLOPs_per_gpu": round(fpt * tps / world / 1e12, 2),
                "mfu": round(fpt * tps / (world * peak * 1e12), 4) if peak else None,
                "peak_gpu_GB_max_rank": round(float(stats[0]), 2), "peak_host_rss_GB_max_rank": round(float(stats[1]), 2),
                "loss": round(loss, 4), "init_s": round(init_s, 1)}
        if args.optimizer == "superoffload" and getattr(opt, "last_step_stats", None) is not None:
            st = opt.last_step_stats
            line["offload"] = {k: getattr(st, k) for k in ("verdict", "cpu_s", "wait_s", "grad_norm", "speculative")
                               if hasattr(st, k)}
        if i >= args.warmup:
            times.append(dt)
        lines.append(line)
        if rank == 0:
            print(json.dumps(line, default=str), flush=True)
    if status == 0 and times:
        med = sorted(times)[len(times) // 2]
        summary = {**common, "summary": True, "step_s_median": round(med, 3), "tokens_per_s": round(tokens / med, 1),
                   "mfu": round(fpt * tokens / med / (world * peak * 1e12), 4) if peak else None,
                   "peak_gpu_GB_max_rank": max(x["peak_gpu_GB_max_rank"] for x in lines),
                   "peak_host_rss_GB_max_rank": max(x["peak_host_rss_GB_max_rank"] for x in lines)}
        lines.append(summary)
        if rank == 0:
            print(json.dumps(summary), flush=True)
    if args.out and (rank == 0 or status):
        with open(args.out, "a") as f:
            for line in lines:
                f.write(json.dumps(line, default=str) + "\n")
    if opt is not None and hasattr(opt, "close"):
        opt.close()
    if status == 0:
        # Tear down while the interpreter is fully alive: every rank done with collectives, our references to the
        # groups dropped, then the process groups destroyed. A gloo group left to interpreter finalization (still
        # referenced from the active-attention registry) aborted the process now and then in CI.
        dist.barrier()
        sp.set_active_groups(None)
        del groups, model, opt
        gc.collect()
        dist.destroy_process_group()
    return status


# ---- search (plain python; one torchrun per length) -----------------------------------------------
def search(args: argparse.Namespace, argv: list[str]) -> int:
    passthrough, skip = [], False
    for a in argv:  # drop the search-only options; --seq-len and --out are set per trial
        if skip:
            skip = False
            continue
        if a in ("--search", "--nproc-per-node", "--trial-timeout", "--seq-len", "--out"):
            skip = True
            continue
        if a.split("=")[0] in ("--search", "--nproc-per-node", "--trial-timeout", "--seq-len", "--out"):
            continue
        passthrough.append(a)
    best: dict[str, Any] | None = None
    trials = []
    for length in args.search:
        with tempfile.NamedTemporaryFile("r", suffix=".jsonl") as tmp:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc_per_node={args.nproc_per_node}", os.path.abspath(__file__), *passthrough,
                   "--seq-len", str(length), "--out", tmp.name]
            t = time.perf_counter()
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.trial_timeout)
                rc, log = proc.returncode, proc.stdout + proc.stderr
            except subprocess.TimeoutExpired as e:
                rc, log = -1, f"timeout after {args.trial_timeout}s: {e}"
            lines = [json.loads(x) for x in tmp.read().splitlines() if x.strip()]
        summary = next((x for x in lines if x.get("summary")), None)
        oom = any(x.get("oom") for x in lines) or "OutOfMemoryError" in log or "CUDA out of memory" in log
        trial = {"search_trial": True, "seq_len": length, "rc": rc, "ok": rc == 0 and summary is not None,
                 "oom": oom, "wall_s": round(time.perf_counter() - t, 1), "summary": summary,
                 "log_tail": None if rc == 0 else log[-1500:]}
        trials.append(trial)
        print(json.dumps(trial), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(trial) + "\n")
        if not trial["ok"]:
            break
        best = summary
    result = {"search_result": True, "model": args.model, "nproc": args.nproc_per_node,
              "tried": [t["seq_len"] for t in trials], "longest_ok": None if best is None else best["seq_len"],
              "longest_ok_summary": best}
    print(json.dumps(result), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(result) + "\n")
    return 0 if best is not None else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.tiled_mlp < 0:
        raise SystemExit(f"--tiled-mlp {args.tiled_mlp}: use a number of tokens per MLP tile (e.g. 8192), or 0 for off")
    if args.search:
        if "LOCAL_RANK" in os.environ:
            raise SystemExit("--search launches its own torchrun per length: run it with plain python")
        return search(args, argv)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
