"""``hf-superoffload``: the command line.

``hf-superoffload train`` is the main job: a real fine-tuning run through the offload engine, on the GPU when
there is one and on the CPU otherwise (the whole offload path still runs: buckets, worker, speculation,
validation). With the Hub reachable it fine-tunes a pretrained instruct model on a small public instruction
dataset; offline it trains the bundled tiny model on the local instruction data and says so. Either way it
reports eval loss and sample generations before and after, and writes the model, a loss curve and metrics
(with ``--save-state`` also the optimizer state, which ``hf-superoffload export`` turns into the fp32 masters).
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
from .demo.train_job import HUB_MODELS as _HUB

__all__ = ["main"]


# Defaults that depend on what runs: a random-init preset learns the local templates fast at a high LR; a
# pretrained model needs a small LR, and on the CPU few short steps so the README command ends in minutes.
_DEFAULTS: dict[str, dict[str, float]] = {
    "preset": dict(steps=200, batch_size=8, seq_len=128, lr=1e-3, warmup=20, examples=4000, new_tokens=24),
    "cpu": dict(steps=20, batch_size=4, seq_len=128, lr=5e-5, warmup=3, examples=400, new_tokens=32),
    "cuda": dict(steps=300, batch_size=8, seq_len=512, lr=2e-5, warmup=30, examples=2000, new_tokens=48),
}


def _fill_defaults(args: argparse.Namespace, kind: str) -> None:
    for name, value in _DEFAULTS[kind].items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)


def _load(args: argparse.Namespace, device: torch.device) -> tuple[Any, Any, list[str], list[str], Any] | int:
    """Model, tokenizer, train and eval texts, and their sources; or the exit status of a one-line error."""

    from .demo import train_job

    spec = args.model or "auto"
    loaded = None
    if spec not in _TRAIN_PRESETS:
        try:
            loaded = train_job.resolve_model(spec, device)
        except OSError as e:  # an explicit model: not a model folder, or a hub id that is not cached / reachable
            return _error("--model", f"cannot load {spec!r}: {_first_line(e)}")
        if loaded is None:
            spec = "tiny" if device.type == "cpu" else "small"
            print(train_job.FALLBACK_LINE.replace("tiny", spec))
    try:
        if loaded is None:
            model, tokenizer, sources, texts = _preset(args, spec, device)
            train, held_out = train_job.split_eval(texts)
        else:
            model, tokenizer = loaded
            _fill_defaults(args, device.type)
            sources = train_job.Sources(spec if spec != "auto" else train_job.HUB_MODELS[device.type], "", True)
            train, held_out, sources.data = train_job.load_texts(tokenizer, args.dataset, int(args.examples),
                                                                 args.seed)
    except (OSError, ValueError) as e:
        return _error("--dataset", f"cannot load {args.dataset!r}: {_first_line(e)}")
    return model, tokenizer, train, held_out, sources


def _preset(args: argparse.Namespace, spec: str, device: torch.device) -> tuple[Any, Any, Any, list[str]]:
    """A random-init preset, a tokenizer trained on its data (local unless --dataset names one), the texts."""
    from transformers import AutoModelForCausalLM

    from .demo import train_job
    from .demo.local_data import build_tokenizer
    from .demo.presets import llama_config

    _fill_defaults(args, "preset")
    rows, data_src = train_job.load_rows("local" if args.dataset == "auto" else args.dataset, int(args.examples),
                                         args.seed)
    texts = [train_job.format_row(None, r) for r in rows]  # no chat template: the bundled tokenizer has none
    tokenizer = build_tokenizer(texts)
    config = llama_config(spec, vocab_size=len(tokenizer), max_position_embeddings=max(int(args.seq_len), 128))
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)  # RoPE frequencies stay fp32
    return model, tokenizer, train_job.Sources(f"preset {spec!r} (random init)", data_src, pretrained=False), texts


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _error(flag: str, why: str) -> int:
    print(f"hf-superoffload train: error: argument {flag}: {why}", file=sys.stderr)
    return 2


def _print_samples(when: str, samples: list[dict[str, str]]) -> None:
    for s in samples:
        print(f"sample ({when}) {s['prompt']!r} -> {s['completion'].strip()!r}")


def _train(args: argparse.Namespace) -> int:
    from . import SuperOffloadConfig, SuperOffloadOptimizer, ops
    from .demo import train_job
    from .demo.local_data import packed_batches
    from .planning.plan import OffloadPlan

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(args.seed)
    loaded = _load(args, device)
    if isinstance(loaded, int):
        return loaded
    model, tokenizer, texts, held_out, sources = loaded
    if args.grad_ckpt:
        model.gradient_checkpointing_enable()
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {sources.model}, {n_params / 1e6:.1f}M parameters, on {device}\ndata: {sources.data}, "
          f"{len(texts)} train / {len(held_out)} eval examples")

    batches = packed_batches(tokenizer, texts, batch_size=args.batch_size, seq_len=args.seq_len, seed=args.seed)
    try:  # the packer checks the corpus against --seq-len when it yields its first batch
        batches = itertools.chain([next(batches)], batches)
    except ValueError as e:
        return _error("--seq-len", f"{e}; lower --seq-len or raise --examples")
    eval_ids = train_job.eval_blocks(tokenizer, held_out, args.seq_len)
    eval_before = train_job.eval_loss(model, eval_ids, device)
    samples_before = train_job.generate_samples(model, tokenizer, device, int(args.new_tokens))
    print(f"eval loss before: {eval_before:.4f}")
    _print_samples("before", samples_before)

    cfg = SuperOffloadConfig(**json.loads(args.offload_config)) if args.offload_config else SuperOffloadConfig()
    opt = SuperOffloadOptimizer(model, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, max_grad_norm=1.0, config=cfg,
                                log_plan=False)
    from tqdm.auto import tqdm

    def show_plan(plan: OffloadPlan) -> None:  # once, above the progress bar
        tqdm.write(f"{plan.summary()}\n  CPU Adam backend: {ops.backend()}")

    if opt.planned:
        show_plan(opt.plan)
    else:  # [Note: workload from the first batch]: planned at the first training forward
        opt.plan_listeners.append(show_plan)
    opt.calibration_listeners.append(tqdm.write)  # [Note: calibration from the measured peak]: once, early
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, args.warmup)))
    tokens = args.batch_size * args.seq_len
    t_start, t_last, first_loss, loss_val = time.perf_counter(), time.perf_counter(), None, float("nan")
    step_last = 0
    step_losses: list[torch.Tensor] = []  # read once at the end: no device sync per step
    bar = _progress(args.steps)
    for step in range(1, args.steps + 1):
        ids = next(batches).to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        step_losses.append(loss.detach())
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
          f"redo rate {gov.redo_rate:.0%}; CPU Adam backend: {ops.backend()}")
    _finish(args, model, tokenizer, opt, device, sources, eval_ids,
            before=(eval_before, samples_before), losses=step_losses, elapsed=elapsed)
    opt.close()
    return 0


def _finish(args: argparse.Namespace, model: Any, tokenizer: Any, opt: Any, device: torch.device, sources: Any,
            eval_ids: torch.Tensor, *, before: tuple[float, list[dict[str, str]]], losses: list[torch.Tensor],
            elapsed: float) -> None:
    """Eval loss and samples after training, then the model, loss curve and metrics written to --output-dir."""
    from . import ops
    from .demo import train_job

    eval_before, samples_before = before
    tokens = args.batch_size * args.seq_len
    with opt.materialized():  # in weight-flow mode the weights live on the host between uses
        eval_after = train_job.eval_loss(model, eval_ids, device)
        samples_after = train_job.generate_samples(model, tokenizer, device, int(args.new_tokens))
    print(f"eval loss: {eval_before:.4f} -> {eval_after:.4f}")
    _print_samples("after", samples_after)
    metrics = {
        "model": sources.model, "pretrained": sources.pretrained, "data": sources.data, "device": str(device),
        "steps": args.steps, "batch_size": args.batch_size, "seq_len": args.seq_len, "lr": args.lr,
        "losses": [x.float().item() for x in losses],
        "eval_loss_before": eval_before, "eval_loss_after": eval_after, "eval_tokens": eval_ids.numel(),
        "tokens_per_s": args.steps * tokens / elapsed, "elapsed_s": elapsed,
        "skipped_steps": opt.skipped_steps, "clipped_steps": opt.clipped_steps,
        "plan": opt.plan.summary() if opt.planned else None, "cpu_adam_backend": ops.backend(),
        "samples_before": samples_before, "samples_after": samples_after,
    }
    for line in train_job.save_outputs(args.output_dir, model, tokenizer, opt, metrics):
        print(line)
    if args.save_state:  # the model files hold the bf16 weights; the exact fp32 values live in this state
        from .integrations._common import save_optimizer_state

        save_optimizer_state(opt, args.output_dir, STATE_FILE)
        print(f"optimizer state (fp32 masters and moments): {args.output_dir}/{STATE_FILE}; the fp32 model: "
              f"hf-superoffload export {args.output_dir} {args.output_dir}-fp32")


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


STATE_FILE = "superoffload_optimizer.pt"  # a name hf-superoffload export reads
_TRAIN_PRESETS = ("tiny", "small", "1b", "3.6b", "8b", "14b")
_MANY = 10**9  # steps, warmup and logging intervals beyond this are typos, not runs


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="hf-superoffload", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="fine-tune a pretrained instruct model on a Hub instruction dataset (offline: the "
                       "bundled tiny model on local data) through the offload engine; writes model, curve, metrics")
    t.add_argument("--model", default="auto", type=model_spec((*_TRAIN_PRESETS, "auto")),
                   help=f"auto ({_HUB['cpu']} on CPU, {_HUB['cuda']} on GPU; the bundled tiny preset when the Hub "
                   "is not reachable), a model id/path, or a random-init preset (tiny, small, 1b, 3.6b, 8b, 14b)")
    t.add_argument("--dataset", default="auto", help="auto (HuggingFaceTB/smoltalk everyday-conversations, local data "
                   "when the Hub is not reachable), local, or a hub dataset id[:subset]")
    t.add_argument("--device", default="auto", type=_device, help="auto, cpu, cuda or cuda:N")
    t.add_argument("--steps", type=int_in(1, _MANY), default=None, help="default sized for the model and device")
    t.add_argument("--batch-size", type=int_in(1, 1 << 16), default=None)
    t.add_argument("--seq-len", type=int_in(2, 1 << 20), default=None)
    t.add_argument("--lr", type=float_in(0.0, 1.0, lo_open=True, hint=", e.g. 1e-4"), default=None)
    t.add_argument("--warmup", type=int_in(0, _MANY), default=None)
    t.add_argument("--examples", type=int_in(1, 10**7), default=None, help="instruction examples to use")
    t.add_argument("--new-tokens", type=int_in(1, 4096), default=None, help="tokens per sample generation")
    t.add_argument("--grad-ckpt", action="store_true")
    t.add_argument("--offload-config", default=None, type=offload_config,
                   help='SuperOffloadConfig fields as JSON, e.g. \'{"gpu_resident_buckets": 0}\'')
    t.add_argument("--log-every", type=int_in(1, _MANY), default=20)
    t.add_argument("--seed", type=int_in(0, 2**63 - 1), default=0)
    t.add_argument("--output-dir", default="superoffload-train-out", type=_output_dir,
                   help="where the model, loss_curve.png and metrics.json go")
    t.add_argument("--save-state", action="store_true", help=f"also write the optimizer state ({STATE_FILE}: "
                   "fp32 masters and moments) to --output-dir, for hf-superoffload export")
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
