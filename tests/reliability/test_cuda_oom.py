"""CUDA out of memory in forward (GPU only): caught by the training loop, the optimizer state is untouched,
and training goes on with a smaller batch.

The CPU twin of an OOM raised *during backward* (after buckets were offloaded) is
test_faults.py::test_exception_in_backward_then_abort_step_restores_the_state[OOM-...].
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from hf_superoffload import SuperOffloadConfig
from hf_superoffload.testing import tiny_llama

pytestmark = pytest.mark.cuda

VOCAB = 32000
SEQ = 64


def test_cuda_oom_in_forward_leaves_the_optimizer_intact_and_training_continues(rel: Any) -> None:
    dev = torch.device("cuda")
    model = tiny_llama(seed=0, device=dev, vocab_size=VOCAB, hidden_size=128, intermediate_size=256)
    opt = rel.optimizer(model, max_grad_norm=1.0,
                        config=SuperOffloadConfig(bucket_size_mb=1, gpu_resident_buckets=2, worker_timeout_s=60))
    g = torch.Generator(device=dev).manual_seed(0)

    def step(bs: int) -> float:
        ids = torch.randint(0, VOCAB, (bs, SEQ), device=dev, generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    for _ in range(2):
        step(4)
    before = rel.snapshot(model, opt)

    free, _ = torch.cuda.mem_get_info(dev)
    # the bf16 logits alone need twice the free device memory; every earlier activation stays < 2**31 elements
    huge = int(2 * free / (SEQ * VOCAB * 2)) + 1
    oom = False
    try:
        ids = torch.randint(0, VOCAB, (huge, SEQ), device=dev)
        model(input_ids=ids, labels=ids).loss.backward()
    except torch.OutOfMemoryError:
        oom = True  # leaving the except block drops the traceback and with it the forward's activations
    ids = None
    assert oom, f"a batch of {huge} x {SEQ} did not run out of memory"
    torch.cuda.empty_cache()

    assert not opt.engine.step_in_progress, "an OOM in forward must not start an optimizer step"
    rel.assert_same_state(before, rel.snapshot(model, opt))
    losses = [step(4) for _ in range(3)]
    assert all(math.isfinite(x) for x in losses)
    assert not opt.step_was_skipped and opt.skipped_steps == 0
    assert opt.engine.param_steps == [s + 3 for s in before["steps"]]
