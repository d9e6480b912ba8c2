"""Every stream the runtime uses is created here, once; events travel with the tensors they guard.

[Note: stream ordering] in docs/design.md explains which wait protects which tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Handoff", "StreamSet"]


@dataclass(frozen=True, slots=True)
class StreamSet:
    """The copy streams of one engine.

    Attributes:
        device: the model's device.
        d2h: gradients device -> host, overlapped with the rest of backward (``None`` on CPU).
        h2d: updated weights host -> device and their scatter into parameters, overlapped with
            the CPU Adam of other buckets and with the next forward (``None`` on CPU).
        gather: data parallel: the all-gather of every rank's updated shard and its scatter into the
            parameters, overlapped with the next forward (``None`` on CPU).
        weights: weight flow's per-unit host -> device fetches (``runtime/weight_flow.py``), overlapped with the
            compute of the previous unit (``None`` on CPU).
    """

    device: torch.device
    d2h: torch.cuda.Stream | None
    h2d: torch.cuda.Stream | None
    gather: torch.cuda.Stream | None = None
    weights: torch.cuda.Stream | None = None

    @classmethod
    def create(cls, device: torch.device) -> StreamSet:
        if device.type != "cuda":
            return cls(device, None, None, None, None)
        return cls(device, *(torch.cuda.Stream(device) for _ in range(4)))

    @property
    def is_cuda(self) -> bool:
        return self.d2h is not None

    def record(self, stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
        """An event marking all work queued so far on ``stream`` (``None`` where there are no streams)."""
        if stream is None:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event


@dataclass(frozen=True, slots=True)
class Handoff:
    """A tensor written asynchronously and the event after which it may be read.

    The producer keeps the tensor alive (it is a view into an engine-owned buffer) until every consumer
    has waited on ``event``: a host thread with :meth:`wait_host`, a stream with :meth:`wait_stream`.
    ``event is None`` means the tensor is ready (synchronous CPU path).
    """

    tensor: torch.Tensor
    event: torch.cuda.Event | None

    def wait_host(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def wait_stream(self, stream: torch.cuda.Stream | None) -> None:
        if self.event is not None and stream is not None:
            stream.wait_event(self.event)
