"""Preemption: a scheduler's SIGTERM becomes "finish this step, save it, stop", in ``SuperOffloadTrainer.train()``
and, through ``with Preemption() as preemption:``, in a hand-written Accelerate loop.

[Note: preemption agreement]

A SIGTERM only records a request; the step in flight finishes as usual, and at the next optimizer-step boundary
``should_stop()`` says so: the Trainer (``on_step_end``) or the user's loop then saves and stops. A second SIGTERM
ends the process at once: the handler puts Python's default back as soon as it runs.

The handler lives only while training runs (``train()``, or the ``with`` block around the user's loop), and never
over a handler the user installed: outside it, SIGTERM keeps Python's default. ``prepare_superoffload`` installs
nothing, because it cannot know where the loop ends nor whether the loop would check ``should_stop()``; a handler
nobody checks would turn SIGTERM into "ignored".

With several processes (data parallel, sequence parallel: ``torchrun`` / ``accelerate launch``) a scheduler may
signal one rank, or every rank at a different point of a different step. A rank that stopped on its own would
leave the others blocked in the next step's gradient collectives (and itself in the checkpoint's barrier), and
a checkpoint needs every rank's optimizer shard *of the same step*. So at every optimizer-step boundary every
rank contributes its request flag to one all-reduce MAX, and all ranks act on the agreed value: they stop after
the same step and save that step's checkpoint together (each rank its shard, then the barrier in
``_save_optimizer_and_scheduler``). The all-reduce runs on every rank at every step, whether or not that rank
could install the handler (a rank whose user installed their own SIGTERM handler contributes "no request"), so
the collective sequence is the same on all ranks.

The flag travels over a private gloo group of all ranks: a one-element CPU tensor, so with NCCL there is no
device synchronisation on the step path, and the collective never interleaves with the optimizer's (issued from
backward hooks and worker threads on its own group) or with the user's. Its cost is one small-message latency
per optimizer step (see docs/reliability.md for the measured figure).
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Preemption"]

logger = logging.getLogger(__name__)


class Preemption:
    """The SIGTERM handler of one training loop and the per-step agreement of its ranks ([Note: preemption
    agreement]).

    ``install()`` at train begin and ``restore()`` at train end (or when the loop raises), or ``with Preemption()``
    around the loop, which does both; ``should_stop()`` at every optimizer-step boundary, on every rank. In a
    hand-written Accelerate loop (create the ``Accelerator`` first: with several processes the agreement needs
    ``torch.distributed`` initialised)::

        with Preemption() as preemption:
            for batch in loader:
                with accelerator.accumulate(model):
                    ...
                    optimizer.step(); scheduler.step(); optimizer.zero_grad()
                if accelerator.sync_gradients and preemption.should_stop():  # every rank, every optimizer step
                    accelerator.save_state(folder)  # this step, on every rank
                    break
        # the script returns normally: exit status 0

    Attributes:
        requested: this process received a SIGTERM since ``install()``.
        stopping: the ranks agreed (any rank requested): save this step and stop.
    """

    requested: bool
    stopping: bool
    _previous: Any  # the handler ``install()`` replaced (Python's default); None when ours is not installed
    _group: Any  # private gloo group of all ranks; None in one process or before the first distributed install()

    def __init__(self) -> None:
        self.requested = False
        self.stopping = False
        self._previous = None
        self._group = None

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self.requested = True
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        logger.warning("hf_superoffload: SIGTERM: finishing this step, saving a checkpoint, then stopping "
                       "(a second SIGTERM stops at once)")

    def install(self) -> None:
        """Reset the request and handle SIGTERM, never over a handler the user installed, and only from the
        main thread (Python's rule). In a distributed run, every rank must call this (it may create the group)."""
        self.requested = False
        self.stopping = False
        if _distributed() and self._group is None:
            self._group = dist.new_group(backend="gloo")
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def restore(self) -> None:
        """Put back the handler ``install()`` replaced (unless something replaced ours meanwhile)."""
        if self._previous is not None:
            if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
                signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def __enter__(self) -> Preemption:
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()

    def should_stop(self) -> bool:
        """Whether any rank has requested a stop (one all-reduce over the ranks); sets and returns ``stopping``.
        Call it on every rank at every optimizer step, so every rank runs the same collectives."""
        if self._group is None and _distributed():
            raise RuntimeError("Preemption was installed before torch.distributed was initialised, so its ranks "
                               "cannot agree on a stop step: create the Accelerator before entering Preemption()")
        if self._group is None:
            self.stopping = self.requested
            return self.stopping
        flag = torch.tensor([int(self.requested)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        self.stopping = bool(flag.item())
        return self.stopping


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
