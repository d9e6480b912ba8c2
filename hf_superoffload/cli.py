"""``hf-superoffload``: the command line.

``hf-superoffload train`` is the main job: a real fine-tuning run of a Llama-style model on the project's
own instruction data, through the offload engine, on the GPU when there is one and on the CPU otherwise
(the whole offload path still runs: buckets, worker, speculation, validation).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence

import torch

__all__ = ["main"]


def _train(args: argparse.Namespace) -> int:
    from . import SuperOffloadConfig, SuperOffloadOptimizer
    from .datasets_local import build_tokenizer, format_example, instruction_texts, packed_batches
    from .presets import llama_config

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(args.seed)
    texts = [format_example(r) for r in instruction_texts(args.examples, seed=args.seed)]
    preset = args.model or ("small" if device.type == "cuda" else "tiny")
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    if preset in ("tiny", "small", "1b", "3.6b", "8b", "14b"):
        tokenizer = build_tokenizer(texts)
        config = llama_config(preset, vocab_size=len(tokenizer), max_position_embeddings=max(args.seq_len, 128))
        with torch.device(device):
            model = LlamaForCausalLM(config).to(torch.bfloat16)
        source = f"preset {preset!r} (random init)"
    else:
        tokenizer = AutoTokenizer.from_pretrained(preset)
        model = AutoModelForCausalLM.from_pretrained(preset, dtype=torch.bfloat16).to(device)
        source = preset
    if args.grad_ckpt:
        model.gradient_checkpointing_enable()
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {source}, {n_params / 1e6:.1f}M parameters, on {device}")

    cfg = SuperOffloadConfig(**json.loads(args.offload_config)) if args.offload_config else SuperOffloadConfig()
    opt = SuperOffloadOptimizer(model, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, max_grad_norm=1.0, config=cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, args.warmup)))
    batches = packed_batches(tokenizer, texts, batch_size=args.batch_size, seq_len=args.seq_len, seed=args.seed)
    tokens = args.batch_size * args.seq_len
    t_start, t_last, first_loss, loss_val = time.perf_counter(), time.perf_counter(), None, float("nan")
    for step in range(1, args.steps + 1):
        ids = next(batches).to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        if step % args.log_every == 0 or step == 1 or step == args.steps:
            loss_val = loss.item()
            first_loss = loss_val if first_loss is None else first_loss
            now = time.perf_counter()
            span = args.log_every if step > 1 else 1
            st = opt.last_step_stats
            print(f"step {step:5d}  loss {loss_val:.4f}  grad_norm {opt.last_grad_norm:.3f}  "
                  f"tokens/s {span * tokens / (now - t_last):,.0f}  cpu_adam {st.cpu_s * 1e3:.1f} ms  "
                  f"gpu_wait {st.wait_s * 1e3:.1f} ms  {st.verdict}")
            t_last = now
    opt.synchronize()
    elapsed = time.perf_counter() - t_start
    gov = opt.engine.governor
    print(f"done: {args.steps} steps in {elapsed:.1f}s, {args.steps * tokens / elapsed:,.0f} tokens/s; loss "
          f"{first_loss:.3f} -> {loss_val:.3f}; skipped {opt.skipped_steps}, clipped {opt.clipped_steps}, "
          f"redo rate {gov.redo_rate:.0%}; CPU Adam backend: {__import__('hf_superoffload.ops', fromlist=['x']).backend()}")
    if args.output_dir:
        model.save_pretrained(args.output_dir)
        tokenizer.save_pretrained(args.output_dir)
        print(f"saved to {args.output_dir}")
    opt.close()
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hf-superoffload", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="fine-tune a model on the project's instruction data through the offload engine")
    t.add_argument("--model", default=None, help="preset (tiny, small, 1b, 3.6b, 8b, 14b) or a model id/path "
                   "(default: small on GPU, tiny on CPU)")
    t.add_argument("--device", default="auto", help="auto, cpu or cuda")
    t.add_argument("--steps", type=int, default=200)
    t.add_argument("--batch-size", type=int, default=8)
    t.add_argument("--seq-len", type=int, default=128)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--warmup", type=int, default=20)
    t.add_argument("--examples", type=int, default=4000, help="instruction examples to generate")
    t.add_argument("--grad-ckpt", action="store_true")
    t.add_argument("--offload-config", default=None, help='SuperOffloadConfig fields as JSON, e.g. \'{"gpu_resident_buckets": 0}\'')
    t.add_argument("--log-every", type=int, default=20)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--output-dir", default=None)
    t.set_defaults(func=_train)
    from .plan_cli import add_plan_parser

    add_plan_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
