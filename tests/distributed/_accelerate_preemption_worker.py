"""One rank of examples/train_with_accelerate.py, preempted (launched by test_accelerate_preemption.py).

argv: block_at block_rank grad_accum, then the example's own arguments (``--grad-accum`` is added from
grad_accum). ``block_at`` >= 0: rank ``block_rank``, in the backward of the last micro-batch of optimizer step
``block_at + 1`` (in the gradient hook of the first layer's q_proj, so the later layers' buckets are already
offloaded and stepped), prints ``BLOCKED backward`` and sleeps: that is when the parent sends it a SIGTERM.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path
from typing import Any

import torch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_with_accelerate.py"
BLOCK_S = 2.0


def main(argv: list[str]) -> None:
    block_at, block_rank, grad_accum, rest = int(argv[0]), int(argv[1]), int(argv[2]), argv[3:]
    torch.set_num_threads(1)
    spec = importlib.util.spec_from_file_location("train_with_accelerate", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    prepare = example.prepare_superoffload

    def prepare_and_block(accelerator: Any, model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        model, optimizer = prepare(accelerator, model, *args, **kwargs)
        if block_at >= 0 and accelerator.process_index == block_rank:
            calls = [0]

            def hook(grad: torch.Tensor) -> torch.Tensor:
                if calls[0] == block_at * grad_accum + grad_accum - 1:
                    print("BLOCKED backward", flush=True)
                    time.sleep(BLOCK_S)
                calls[0] += 1
                return grad

            accelerator.unwrap_model(model).model.layers[0].self_attn.q_proj.weight.register_hook(hook)
        return model, optimizer

    example.prepare_superoffload = prepare_and_block
    example.main([*rest, "--grad-accum", str(grad_accum)])
    print("EXITED", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
