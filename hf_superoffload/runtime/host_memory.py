"""Host buffers of exact size, page-locked only where DMA touches them.

[Note: pinned memory budget]: torch's caching host allocator rounds every pinned request up to a power of
two (a 43 GB arena would lock 64 GiB). We allocate ordinary memory and register exactly its pages with
``cudaHostRegister``; the registration is undone when the buffer is freed.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

__all__ = ["HostBuffer"]


def _unregister(ptr: int) -> None:
    with contextlib.suppress(Exception):  # interpreter shutdown
        torch.cuda.cudart().cudaHostUnregister(ptr)


class HostBuffer:
    """A flat host tensor of exactly ``numel`` elements, optionally page-locked.

    Attributes:
        tensor: the flat 1-D CPU tensor; views of it are handed to buckets.
        pinned: whether its pages are registered with CUDA (DMA without a bounce buffer).
    """

    tensor: torch.Tensor
    pinned: bool

    def __init__(self, numel: int, dtype: torch.dtype, *, pin: bool, name: str) -> None:
        self.tensor = torch.empty(max(numel, 0), dtype=dtype)
        self.pinned = False
        self.name = name
        if pin and numel > 0:
            nbytes = self.tensor.numel() * self.tensor.element_size()
            ptr = self.tensor.data_ptr()
            err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
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
