"""One rank of a SuperOffloadTrainer run (launched by tests/distributed/test_trainer_data_parallel.py).

argv: out_dir max_steps per_device_batch [resume_dir] [sp_size]. Environment: RANK, WORLD_SIZE, MASTER_* (gloo).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from hf_superoffload.integrations.transformers import SuperOffloadArguments, SuperOffloadTrainer
from hf_superoffload.testing import TokenDataset, tiny_llama


def main() -> None:
    out, steps, bs = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    resume = sys.argv[4] if len(sys.argv) > 4 and sys.argv[4] != "-" else None
    sp = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    placement = sys.argv[6] if len(sys.argv) > 6 else "auto"
    torch.set_num_threads(1)
    args = SuperOffloadArguments(
        output_dir=str(out), use_cpu=True, report_to="none", disable_tqdm=True, logging_steps=1,
        save_strategy="steps", save_steps=4, per_device_train_batch_size=bs, learning_rate=1e-3, weight_decay=0.1,
        lr_scheduler_type="linear", max_grad_norm=1.0, seed=0, dataloader_num_workers=0, max_steps=steps,
        dataloader_pin_memory=False, superoffload_bucket_size_mb=0.004, superoffload_gpu_resident_buckets="2",
        superoffload_cpu_threads=1, sequence_parallel_size=sp, superoffload_weight_placement=placement,
        gradient_checkpointing=placement == "flow",
    )
    trainer = SuperOffloadTrainer(model=tiny_llama(seed=0), args=args, train_dataset=TokenDataset(64))
    trainer.train(resume_from_checkpoint=resume)
    opt = trainer.superoffload_optimizer
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert opt is not None
    if trainer.args.process_index == 0:
        (out / "losses.json").write_text(json.dumps(losses))
        with opt.engine.materialized():  # weight flow: the weights live on the host between uses
            torch.save({n: p.detach().clone() for n, p in trainer.model.named_parameters()}, out / "weights.pt")
    assert opt is not None
    opt.close()
    if torch.distributed.is_initialized():  # tear down while the interpreter is alive (see _ulysses_worker.py)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
