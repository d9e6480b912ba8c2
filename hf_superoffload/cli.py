"""``hf-superoffload``: the command line.

``hf-superoffload train`` is the main job: a real fine-tuning run of a Llama-style model on the project's
own instruction data, through the offload engine, on the GPU when there is one and on the CPU otherwise
(the whole offload path still runs: buckets, worker, speculation, validation).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from ._cli_args import OneLineParser, float_in, int_in, model_spec, offload_config

__all__ = ["main"]


def _train(args: argparse.Namespace) -> int:
    from . import SuperOffloadConfig, SuperOffloadOptimizer
    from .datasets_local import build_tokenizer, format_example, instruction_texts, packed_batches
    from .planning.plan import OffloadPlan
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
        try:
            tokenizer = AutoTokenizer.from_pretrained(preset)
            model = AutoModelForCausalLM.from_pretrained(preset, dtype=torch.bfloat16).to(device)
        except OSError as e:  # not a model folder, or a hub id that is not cached / reachable
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            print(f"hf-superoffload train: error: argument --model: cannot load {preset!r}: {first}", file=sys.stderr)
            return 2
        source = preset
    if args.grad_ckpt:
        model.gradient_checkpointing_enable()
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {source}, {n_params / 1e6:.1f}M parameters, on {device}")

    cfg = SuperOffloadConfig(**json.loads(args.offload_config)) if args.offload_config else SuperOffloadConfig()
    opt = SuperOffloadOptimizer(model, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, max_grad_norm=1.0, config=cfg,
                                log_plan=False)
    from tqdm.auto import tqdm

    from . import ops

    def show_plan(plan: OffloadPlan) -> None:  # once, above the progress bar
        tqdm.write(f"{plan.summary()}\n  CPU Adam backend: {ops.backend()}")

    if opt.planned:
        show_plan(opt.plan)
    else:  # [Note: workload from the first batch]: planned at the first training forward
        opt.plan_listeners.append(show_plan)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, args.warmup)))
    batches = packed_batches(tokenizer, texts, batch_size=args.batch_size, seq_len=args.seq_len, seed=args.seed)
    try:  # the packer checks the corpus against --seq-len when it yields its first batch
        batches = itertools.chain([next(batches)], batches)
    except ValueError as e:
        print(f"hf-superoffload train: error: argument --seq-len: {e}; lower --seq-len or raise --examples",
              file=sys.stderr)
        opt.close()
        return 2
    tokens = args.batch_size * args.seq_len
    t_start, t_last, first_loss, loss_val = time.perf_counter(), time.perf_counter(), None, float("nan")
    step_last = 0
    bar = _progress(args.steps)
    for step in range(1, args.steps + 1):
        ids = next(batches).to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        bar.update(1)
        if step % args.log_every == 0 or step == 1 or step == args.steps:
            loss_val = loss.item()  # a device sync: only on logging steps, so the CPU stays ahead of the GPU
            first_loss = loss_val if first_loss is None else first_loss
            now = time.perf_counter()
            st = opt.last_step_stats
            rate = (step - step_last) * tokens / (now - t_last)
            bar.set_postfix_str(f"loss {loss_val:.4f}  tok/s {rate:,.0f}  gpu_wait {st.wait_s * 1e3:.1f} ms  "
                                f"cpu_adam {st.cpu_s * 1e3:.1f} ms")
            bar.write(f"step {step:5d}  loss {loss_val:.4f}  grad_norm {opt.last_grad_norm:.3f}  "
                      f"tokens/s {rate:,.0f}  cpu_adam {st.cpu_s * 1e3:.1f} ms  "
                      f"gpu_wait {st.wait_s * 1e3:.1f} ms  {st.verdict}")
            t_last, step_last = now, step
    bar.close()
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


def _progress(total: int) -> Any:
    """The training progress bar on stderr; tqdm turns it off when stderr is not a terminal (logs, CI), where the
    per-step lines (on stdout) are the record."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="train", unit="step", disable=None, dynamic_ncols=True, file=sys.stderr)


def _device(text: str) -> str:
    """auto, cpu, cuda or cuda:N; a CUDA device this machine does not have is refused at parse time."""
    if text == "auto":
        return text
    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device: use auto, cpu, cuda or cuda:N") from None
    if dev.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text!r} is not supported: use auto, cpu, cuda or cuda:N")
    if dev.type == "cuda" and (not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count()):
        raise argparse.ArgumentTypeError(f"{text!r} is not available on this machine ({torch.cuda.device_count()} CUDA "
                                         "device(s)): use auto or cpu")
    return text


def _output_dir(text: str) -> str:
    from pathlib import Path

    if Path(text).expanduser().is_file():
        raise argparse.ArgumentTypeError(f"{text!r} is a file: give a folder (created if missing)")
    return text


_TRAIN_PRESETS = ("tiny", "small", "1b", "3.6b", "8b", "14b")
_MANY = 10**9  # steps, warmup and logging intervals beyond this are typos, not runs


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="hf-superoffload", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="fine-tune a model on the project's instruction data through the offload engine")
    t.add_argument("--model", default=None, type=model_spec(_TRAIN_PRESETS), help="preset (tiny, small, 1b, 3.6b, "
                   "8b, 14b) or a model id/path (default: small on GPU, tiny on CPU)")
    t.add_argument("--device", default="auto", type=_device, help="auto, cpu, cuda or cuda:N")
    t.add_argument("--steps", type=int_in(1, _MANY), default=200)
    t.add_argument("--batch-size", type=int_in(1, 1 << 16), default=8)
    t.add_argument("--seq-len", type=int_in(2, 1 << 20), default=128)
    t.add_argument("--lr", type=float_in(0.0, 1.0, lo_open=True, hint=", e.g. 1e-4"), default=1e-3)
    t.add_argument("--warmup", type=int_in(0, _MANY), default=20)
    t.add_argument("--examples", type=int_in(1, 10**7), default=4000, help="instruction examples to generate")
    t.add_argument("--grad-ckpt", action="store_true")
    t.add_argument("--offload-config", default=None, type=offload_config,
                   help='SuperOffloadConfig fields as JSON, e.g. \'{"gpu_resident_buckets": 0}\'')
    t.add_argument("--log-every", type=int_in(1, _MANY), default=20)
    t.add_argument("--seed", type=int_in(0, 2**63 - 1), default=0)
    t.add_argument("--output-dir", default=None, type=_output_dir)
    t.set_defaults(func=_train)
    from .plan_cli import add_plan_parser

    add_plan_parser(sub)
    from .export import add_export_parser

    add_export_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
