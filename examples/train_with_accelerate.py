"""A custom Accelerate training loop with SuperOffload, checkpointed with ``save_state`` and resumed with
``load_state``.

    accelerate launch --config_file configs/single_cpu.yaml examples/train_with_accelerate.py --max-steps 5
    accelerate launch --config_file configs/single_gpu.yaml examples/train_with_accelerate.py --model small
    accelerate launch --config_file configs/single_gpu.yaml examples/train_with_accelerate.py --resume latest

Offload settings are not accelerate config keys: pass ``--superoffload-config offload.yaml`` (a mapping of
``SuperOffloadConfig`` fields), or export ``HF_SUPEROFFLOAD_CONFIG=offload.yaml`` or ``HF_SUPEROFFLOAD_<FIELD>=...``
(e.g. ``HF_SUPEROFFLOAD_GPU_RESIDENT_BUCKETS=0``) before ``accelerate launch``. Plain ``python`` works too.

Preemption: a SIGTERM (to any process) finishes the step in flight; every process stops after that same step,
saves it to ``step-N`` and the script exits 0, so ``--resume latest`` continues from there (a second SIGTERM ends
the process at once).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
from accelerate import Accelerator
from tqdm.auto import tqdm
from transformers import get_linear_schedule_with_warmup

from hf_superoffload.demo.local_data import build_tokenizer, format_example, instruction_texts, packed_batches
from hf_superoffload.demo.presets import PRESETS, llama_config
from hf_superoffload.integrations.accelerate import (
    Preemption,
    SuperOffloadPlugin,
    last_complete_checkpoint,
    mark_checkpoint_complete,
    prepare_superoffload,
    remove_stale_temp_files,
)


class TrainProgress:
    """The loop's own position, checkpointed through ``accelerator.register_for_checkpointing``."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help=f"preset ({', '.join(PRESETS)}; random init) or a model id/path")
    p.add_argument("--max-steps", type=int, default=20, help="optimizer steps in total (a resumed run continues)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--grad-accum", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--examples", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default="out/train_with_accelerate")
    p.add_argument("--save-every", type=int, default=10, help="save_state every N optimizer steps (0: only at the end)")
    p.add_argument("--resume", default=None, help="a checkpoint folder, or 'latest' (the newest in --output-dir)")
    p.add_argument("--superoffload-config", default=None, help="YAML/JSON file of SuperOffloadConfig fields "
                   "(default: $HF_SUPEROFFLOAD_CONFIG; HF_SUPEROFFLOAD_<FIELD> variables override it)")
    return p.parse_args(argv)


def build(args: argparse.Namespace) -> tuple[torch.nn.Module, Any, list[str]]:
    texts = [format_example(r) for r in instruction_texts(args.examples, seed=args.seed)]
    if args.model in PRESETS:
        from transformers import AutoModelForCausalLM

        tokenizer = build_tokenizer(texts)
        cfg = llama_config(args.model, vocab_size=len(tokenizer), max_position_embeddings=max(args.seq_len, 128))
        torch.manual_seed(args.seed)
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16), tokenizer, texts
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16)
    return model, AutoTokenizer.from_pretrained(args.model), texts


def latest_checkpoint(output_dir: str) -> str:
    """The newest *complete* step-N folder: save_state writes its files in place, so a folder whose completion
    marker is missing (or that holds a temp file of an interrupted save) is skipped, with a warning."""
    try:
        return last_complete_checkpoint(output_dir, prefix="step")
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"--resume latest: {e}") from None


def main(argv: Sequence[str] | None = None) -> float:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    accelerator = Accelerator(gradient_accumulation_steps=args.grad_accum)
    model, tokenizer, texts = build(args)
    model, optimizer = prepare_superoffload(
        accelerator, model,
        dict(lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, max_grad_norm=args.max_grad_norm),
        plugin=SuperOffloadPlugin(config_file=args.superoffload_config),
    )
    scheduler = accelerator.prepare(get_linear_schedule_with_warmup(optimizer, args.warmup, args.max_steps))
    progress = TrainProgress()
    accelerator.register_for_checkpointing(progress)
    if args.resume:
        path = latest_checkpoint(args.output_dir) if args.resume == "latest" else args.resume
        if accelerator.is_main_process:
            remove_stale_temp_files(path)
        accelerator.load_state(path)  # model, optimizer (into the host buffers), scheduler, RNG, progress
        accelerator.print(f"resumed from {path} at step {progress.step}")

    batches = packed_batches(tokenizer, texts, batch_size=args.batch_size, seq_len=args.seq_len, seed=args.seed)
    for _ in range(progress.step * args.grad_accum):  # the data stream is deterministic: skip what was seen
        next(batches)
    model.train()
    loss_sum, last_loss, grad_norm = 0.0, float("nan"), torch.tensor(float("nan"))
    # progress on the main process, on a terminal only (tqdm's disable=None); the per-step lines stay the record
    bar = tqdm(total=args.max_steps, initial=progress.step, desc="train", unit="step", dynamic_ncols=True,
               disable=None if accelerator.is_main_process else True)
    step_tokens = args.batch_size * args.seq_len * args.grad_accum * accelerator.num_processes
    t_last = time.perf_counter()
    # SIGTERM inside this block: finish the step, save it, stop (after the Accelerator: the ranks agree through
    # torch.distributed)
    with Preemption() as preemption:
        while progress.step < args.max_steps:
            ids = next(batches).to(accelerator.device)
            with accelerator.accumulate(model):
                loss = model(input_ids=ids, labels=ids).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            loss_sum += loss.item() / args.grad_accum
            if not accelerator.sync_gradients:
                continue
            progress.step += 1
            opt = optimizer.superoffload
            now, st = time.perf_counter(), opt.last_step_stats
            rate, t_last = step_tokens / (now - t_last), now
            bar.update(1)
            bar.set_postfix_str(f"loss {loss_sum:.4f}  tok/s {rate:,.0f}  gpu_wait {st.wait_s * 1e3:.1f} ms")
            if accelerator.is_main_process:
                bar.write(f"step {progress.step:4d}  loss {loss_sum:.4f}  grad_norm {grad_norm.item():.3f}  "
                          f"lr {scheduler.get_last_lr()[0]:.2e}  tokens/s {rate:,.0f}  "
                          + json.dumps({k.split("/")[1]: v for k, v in st.as_log().items()}))
            last_loss, loss_sum = loss_sum, 0.0
            stop = preemption.should_stop()  # every rank, every optimizer step: they agree on one stop step
            if stop or (args.save_every and progress.step % args.save_every == 0) or progress.step == args.max_steps:
                folder = os.path.join(args.output_dir, f"step-{progress.step}")
                accelerator.save_state(folder)
                accelerator.wait_for_everyone()  # every rank's files are written: only now is the folder complete
                if accelerator.is_main_process:
                    mark_checkpoint_complete(folder, step=progress.step)
            if stop:
                accelerator.print(f"stopped after a SIGTERM at step {progress.step}; {folder} holds it "
                                  "(continue with --resume latest)")
                break
    bar.close()
    accelerator.wait_for_everyone()
    opt = optimizer.superoffload
    accelerator.print(f"done at step {progress.step}: skipped {opt.skipped_steps}, clipped {opt.clipped_steps}, "
                      f"redo rate {opt.engine.governor.redo_rate:.0%}")
    accelerator.end_training()
    return last_loss


if __name__ == "__main__":
    main(sys.argv[1:])
