"""The GPU-resident tail: its buckets step AdamW on the compute stream right after validation.

The tail's fp32 master and moments live on the device (``BucketLayout.dev_*``); its gradient stayed there at
the flush. With data parallelism each rank steps its shard and every rank's shard is all-gathered back.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..triton_kernels import adamw_flat_, scatter_flat_
from .bucket import DeviceBucket
from .sharding import Sharding
from .validation import StepVerdict, Verdict

__all__ = ["step_device_tail"]


def step_device_tail(buckets: Sequence[DeviceBucket], verdict: Verdict, sharding: Sharding | None) -> None:
    """Apply ``verdict`` to the tail buckets (nothing on SKIP) and release their flat gradients."""
    with torch.profiler.record_function("superoffload::device_adam"):
        for b in buckets:
            if verdict.kind is not StepVerdict.SKIP:
                assert b.grad is not None
                for r in b.runs:
                    sl = slice(r.start, r.end)
                    adamw_flat_(
                        b.master[sl], b.grad[sl], b.exp_avg[sl], b.exp_avg_sq[sl], step=r.step,
                        hyper=verdict.hypers[r.group], grad_scale=verdict.grad_scale,
                    )
                if sharding is not None:
                    sharding.gather_device(b)  # every rank, even one whose shard had nothing to step
                elif b.runs:
                    scatter_flat_(b.master, b.params)
            b.grad = None
