"""Host buffers of exact size, page-locked only where DMA touches them.

[Note: pinned memory budget]: torch's caching host allocator rounds every pinned request up to a power of
two (a 43 GB arena would lock 64 GiB). We allocate ordinary memory and register exactly its pages with
``cudaHostRegister``; the registration is undone when the buffer is freed.
"""

from __future__ import annotations

import contextlib
import os
import weakref

import torch

__all__ = ["HostBuffer"]


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _unregister(ptr: int) -> None:
    with contextlib.suppress(Exception):  # interpreter shutdown
        torch.cuda.cudart().cudaHostUnregister(ptr)


class HostBuffer:
    """A flat host tensor of exactly ``numel`` elements, optionally page-locked.

    The registration lives as long as this object, not as long as ``tensor``: whoever uses the tensor keeps
    the ``HostBuffer`` too. (The gradient-statistics rows once kept only ``.tensor``: the buffer was unregistered
    at once, every 8-byte statistics copy went to pageable memory, which makes ``cudaMemcpyAsync`` synchronous,
    and each bucket flush blocked the autograd thread until its D2H had finished.)

    ``tensor.is_pinned()`` reports False even when pinned: torch asks CUDA about the storage's first byte, and the
    registered pages start after it (page alignment). Copies into ``tensor`` still run as DMA without a host
    sync: CUDA looks up the copy's own address.

    Attributes:
        tensor: the flat 1-D CPU tensor; views of it are handed to buckets.
        pinned: whether its pages are registered with CUDA (DMA without a bounce buffer).
    """

    tensor: torch.Tensor
    pinned: bool

    def __init__(self, numel: int, dtype: torch.dtype, *, pin: bool, name: str) -> None:
        numel = max(numel, 0)
        self.pinned = False
        self.name = name
        if not (pin and numel > 0):
            self.tensor = torch.empty(numel, dtype=dtype)
            return
        # Register whole pages that belong to this buffer alone: a small allocation from the heap shares its
        # pages with other objects, and two registrations of one page fail (or one's unregister unpins the other).
        nbytes = numel * dtype.itemsize
        span = -(-nbytes // _PAGE) * _PAGE
        raw = torch.empty(span + _PAGE, dtype=torch.uint8)
        off = -raw.data_ptr() % _PAGE
        self._raw = raw  # owns the pages; the finalizer below runs before it is freed
        self.tensor = raw[off:off + nbytes].view(dtype)
        ptr = raw.data_ptr() + off
        err = torch.cuda.cudart().cudaHostRegister(ptr, span, 0)
        if int(err) != 0:
            raise RuntimeError(
                f"could not page-lock {nbytes / 1024**3:.2f} GiB for {name} (cudaHostRegister error {int(err)}). "
                "The host may limit locked memory (ulimit -l) or be short of RAM; "
                "set SuperOffloadConfig(pin_memory=False) to use pageable (slower) copies."
            )
        self.pinned = True
        # The finalizer runs before the storage is freed: it holds only the pointer.
        weakref.finalize(self, _unregister, ptr)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()
