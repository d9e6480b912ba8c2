"""One rank of a preempted SuperOffloadTrainer run (launched by tests/distributed/test_trainer_preemption.py).

argv: out_dir max_steps save_steps [--block-at STEP --block-rank R] [--resume]. Environment: RANK, WORLD_SIZE,
MASTER_* (gloo). ``--block-at``: rank R, while computing step STEP + 1, blocks inside backward (in the gradient hook
of a late-arriving parameter, with other buckets already reduced and speculated) and prints ``BLOCKED backward``,
which is when the parent sends it a SIGTERM. Each rank prints ``STOPPED <global_step>`` when ``train()`` returns
and writes its optimizer shard, step counts and the model's weights to ``final_rank<R>.pt``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from hf_superoffload.integrations.transformers import SuperOffloadArguments, SuperOffloadTrainer
from hf_superoffload.testing import TokenDataset, tiny_llama

BLOCK_S = 2.0


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("max_steps", type=int)
    p.add_argument("save_steps", type=int)
    p.add_argument("--block-at", type=int, default=None)
    p.add_argument("--block-rank", type=int, default=1)
    p.add_argument("--resume", action="store_true")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    args = SuperOffloadArguments(
        output_dir=str(a.out), use_cpu=True, report_to="none", disable_tqdm=True, logging_steps=100,
        save_strategy="steps", save_steps=a.save_steps, max_steps=a.max_steps, per_device_train_batch_size=2,
        learning_rate=1e-3, weight_decay=0.1, lr_scheduler_type="linear", max_grad_norm=1.0, seed=0,
        dataloader_num_workers=0, dataloader_pin_memory=False, superoffload_bucket_size_mb=0.004,
        superoffload_gpu_resident_buckets="2", superoffload_cpu_threads=1,
    )
    trainer = SuperOffloadTrainer(model=tiny_llama(seed=0), args=args, train_dataset=TokenDataset(64))
    rank = trainer.args.process_index
    if a.block_at is not None and rank == a.block_rank:

        def hook(grad: torch.Tensor) -> torch.Tensor:
            if trainer.state.global_step == a.block_at:
                print("BLOCKED backward", flush=True)
                time.sleep(BLOCK_S)
            return grad

        trainer.model.model.layers[0].self_attn.q_proj.weight.register_hook(hook)
    trainer.train(resume_from_checkpoint=True if a.resume else None)
    print(f"STOPPED {trainer.state.global_step}", flush=True)
    opt = trainer.superoffload_optimizer
    assert opt is not None
    opt.synchronize()
    flat = opt.engine.flat_state()
    final = {f"{side}/{k}": v.detach().cpu().clone() for side in flat for k, v in flat[side].items()}
    final["param_steps"] = torch.tensor(opt.engine.param_steps)
    with opt.engine.materialized():  # weight flow: the weights live on the host between uses
        final.update({f"weight/{n}": p.detach().clone() for n, p in trainer.model.named_parameters()})
    torch.save(final, a.out / f"final_rank{rank}.pt")
    opt.close()
    if torch.distributed.is_initialized():  # tear down while the interpreter is alive (see _ulysses_worker.py)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
