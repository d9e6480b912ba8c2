"""Child process for tests/reliability/test_kill.py (run as a script; never collected by pytest).

Modes (each prints marker lines on stdout and then blocks, so the parent can kill it at a known point):

- ``trainer OUT [--block backward|save] [--at STEP] [--block-s S]``: a SuperOffloadTrainer run (tiny Llama,
  checkpoints every 3 steps up to 12). ``backward``: while computing step ``STEP + 1`` it blocks (S seconds) inside
  backward, in the gradient hook of a late-arriving parameter (other buckets already offloaded and speculated)
  and prints ``BLOCKED backward``. ``save``: while writing checkpoint-``STEP``'s ``optimizer.pt`` (through the integration's
  atomic save) it writes half of the bytes, prints ``BLOCKED save``, and blocks.
- ``atomic OUT``: a larger optimizer state (~1M parameters) is saved with ``atomic_torch_save`` to
  ``OUT/optimizer.pt`` (prints ``SAVED <sha256>``); after two more steps a second save to the same name writes
  half of its bytes, prints ``BLOCKED save`` and blocks.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import sys
import time
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

BLOCK_S = 300
TRAINER_KW: dict[str, Any] = dict(
    use_cpu=True, report_to="none", disable_tqdm=True, logging_steps=100, save_strategy="steps", save_steps=3,
    max_steps=12, per_device_train_batch_size=2, learning_rate=1e-3, weight_decay=0.1, lr_scheduler_type="linear",
    max_grad_norm=1.0, seed=0, dataloader_num_workers=0, dataloader_pin_memory=False,
    superoffload_bucket_size_mb=0.004, superoffload_gpu_resident_buckets="2",
)


def say(line: str) -> None:
    print(line, flush=True)



def make_trainer(out: str, model: Any = None, **overrides: Any) -> Any:
    """The SuperOffloadTrainer of these tests (also used in-process by the parent tests)."""
    from hf_superoffload.integrations.transformers import SuperOffloadArguments, SuperOffloadTrainer
    from hf_superoffload.testing import TokenDataset, tiny_llama

    args = SuperOffloadArguments(output_dir=out, **{**TRAINER_KW, **overrides})
    return SuperOffloadTrainer(model=model if model is not None else tiny_llama(seed=0), args=args,
                               train_dataset=TokenDataset())


def half_then_block(obj: Any, f: Any) -> None:
    """``torch.save`` that serialises fully, writes half of the bytes to the real file, and blocks."""
    buf = io.BytesIO()
    _real_save(obj, buf)
    data = buf.getvalue()
    f.write(data[: len(data) // 2])
    f.flush()
    say(f"BLOCKED save {len(data)}")
    time.sleep(BLOCK_S)
    raise SystemExit("not killed")


_real_save = torch.save


def run_trainer(out: str, block: str, at: int, block_s: float = BLOCK_S) -> None:
    trainer = make_trainer(out)
    if block == "backward":
        param = trainer.model.model.layers[0].self_attn.q_proj.weight

        def hook(grad: torch.Tensor) -> torch.Tensor:
            if trainer.state.global_step == at:
                say("BLOCKED backward")
                time.sleep(block_s)
            return grad

        param.register_hook(hook)
    else:

        def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
            if trainer.state.global_step == at and isinstance(obj, dict) and "superoffload" in obj:
                half_then_block(obj, f)
            _real_save(obj, f, *args, **kwargs)

        torch.save = save
    trainer.train()
    say("FINISHED")


def run_atomic(out: str) -> None:
    from hf_superoffload import SuperOffloadConfig, SuperOffloadOptimizer
    from hf_superoffload.integrations._common import atomic_torch_save
    from hf_superoffload.testing import tiny_llama

    model = tiny_llama(seed=0, **ATOMIC_MODEL)
    opt = SuperOffloadOptimizer(model, lr=1e-3, max_grad_norm=1.0, log_plan=False,
                                config=SuperOffloadConfig(bucket_size_mb=0.5, gpu_resident_buckets=1))
    g = torch.Generator().manual_seed(0)

    def steps(n: int) -> None:
        for _ in range(n):
            ids = torch.randint(0, ATOMIC_MODEL["vocab_size"], (2, 16), generator=g)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()

    steps(2)
    path = os.path.join(out, "optimizer.pt")
    atomic_torch_save(opt.state_dict(), path)
    atomic_torch_save(model.state_dict(), os.path.join(out, "model.pt"))
    with open(path, "rb") as f:
        say(f"SAVED {hashlib.sha256(f.read()).hexdigest()}")
    steps(2)
    torch.save = lambda obj, f, *a, **k: half_then_block(obj, f)
    atomic_torch_save(opt.state_dict(), path)


ATOMIC_MODEL: dict[str, Any] = dict(vocab_size=512, hidden_size=128, intermediate_size=512, num_hidden_layers=4)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["trainer", "atomic"])
    p.add_argument("out")
    p.add_argument("--block", choices=["backward", "save"], default="backward")
    p.add_argument("--at", type=int, default=7)
    p.add_argument("--block-s", type=float, default=BLOCK_S, help="how long the block lasts")
    a = p.parse_args(argv)
    say(f"PID {os.getpid()}")
    if a.mode == "trainer":
        run_trainer(a.out, a.block, a.at, a.block_s)
    else:
        run_atomic(a.out)


if __name__ == "__main__":
    main(sys.argv[1:])
