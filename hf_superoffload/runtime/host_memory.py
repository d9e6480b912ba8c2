"""Host buffers of exact size, page-locked only where DMA touches them, with room to grow in place where asked.

[Note: pinned memory budget]: torch's caching host allocator rounds every pinned request up to a power of
two (a 43 GB arena would lock 64 GiB). We allocate ordinary memory and register exactly its pages with
``cudaHostRegister``; the registration is undone when the buffer is freed.
"""

from __future__ import annotations

import contextlib
import os
import weakref

import torch

__all__ = ["CHECKPOINT_PIECE_BYTES", "HostBuffer", "exact_storage"]


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _pages(nbytes: int) -> int:
    """``nbytes`` rounded up to whole pages."""
    return -(-nbytes // _PAGE) * _PAGE


def _strict_overcommit() -> bool:
    """Whether Linux charges address space as it is allocated (``vm.overcommit_memory=2``): reserved room would then
    take from the commit limit what later allocations need, so none is reserved."""
    try:
        with open("/proc/sys/vm/overcommit_memory") as f:
            return f.read().strip() == "2"
    except OSError:
        return False


def _untouched_bytes(nbytes: int) -> torch.Tensor:
    """``nbytes`` of address space whose pages are first touched when written: a bare storage (``torch.empty``
    fills every byte under ``torch.use_deterministic_algorithms``, which would make reserved room resident)."""
    return torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage(nbytes))


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
        capacity: the elements :meth:`grow` can take in place (``numel`` and the reserved room).
    """

    tensor: torch.Tensor
    pinned: bool
    capacity: int

    def __init__(self, numel: int, dtype: torch.dtype, *, pin: bool, name: str, reserve: int = 0) -> None:
        """``reserve``: elements of address space kept past ``numel`` that :meth:`grow` takes in place ([Note:
        reserved room in the host arenas]); their pages stay untouched, so they cost no resident memory."""
        numel, reserve = max(numel, 0), max(reserve, 0)
        self.pinned = False
        self.name = name
        self._pin, self._unpin = pin, None
        self._raw: torch.Tensor | None = None
        if not reserve and not (pin and numel > 0):
            self.tensor = torch.empty(numel, dtype=dtype)
            self.capacity = numel
            return
        # Whole pages that belong to this buffer alone: a small allocation from the heap shares its pages with
        # other objects, and two registrations of one page fail (or one's unregister unpins the other).
        raw = None
        if reserve and not _strict_overcommit():
            with contextlib.suppress(RuntimeError):  # the host refused the address space: exact size, as without
                raw = _untouched_bytes(_pages((numel + reserve) * dtype.itemsize) + _PAGE)
        self.capacity = numel + reserve if raw is not None else numel
        if raw is None:
            raw = torch.empty(_pages(numel * dtype.itemsize) + _PAGE, dtype=torch.uint8)
        self._raw, self._dtype = raw, dtype  # owns the pages; the finalizer below runs before they are freed
        self._start = -raw.data_ptr() % _PAGE
        self.tensor = self._view(numel)
        if pin and numel > 0:
            self._register(numel)

    def grow(self, numel: int) -> bool:
        """Take ``numel`` elements in place, the contents in front kept, when the reserved room holds them (a
        pinned buffer's pages are registered again, whole: call it where no copy into or out of it is in flight);
        ``False`` when it does not (nothing changes)."""
        if numel <= self.tensor.numel():
            return True
        if self._raw is None or numel > self.capacity:
            return False
        before, was_pinned = self.tensor.numel(), self._unpin is not None
        if self._unpin is not None:
            # one registration over the whole range: a copy that crossed from the old pages into the new ones
            # would span two registrations
            self._unpin()
            self._unpin, self.pinned = None, False
        self.tensor = self._view(numel)
        if self._pin:
            try:
                self._register(numel)
            except RuntimeError:  # (ulimit -l) the buffer stays as it was, its registration too
                self.tensor = self._view(before)
                if was_pinned:
                    self._register(before)
                raise
        return True

    def _view(self, numel: int) -> torch.Tensor:
        assert self._raw is not None
        return self._raw[self._start:self._start + numel * self._dtype.itemsize].view(self._dtype)

    def _register(self, numel: int) -> None:
        ptr, nbytes = self.tensor.data_ptr(), numel * self._dtype.itemsize
        err = torch.cuda.cudart().cudaHostRegister(ptr, _pages(nbytes), 0)
        if int(err) != 0:
            raise RuntimeError(
                f"could not page-lock {nbytes / 1024**3:.2f} GiB for {self.name} (cudaHostRegister error "
                f"{int(err)}). The host may limit locked memory (ulimit -l) or be short of RAM; "
                "set SuperOffloadConfig(pin_memory=False) to use pageable (slower) copies."
            )
        self.pinned = True
        # The finalizer runs before the storage is freed: it holds only the pointer.
        self._unpin = weakref.finalize(self, _unregister, ptr)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


CHECKPOINT_PIECE_BYTES = 64 << 20
"""Host bytes a checkpoint copies from the GPU at a time: a piece of a device arena (``state``), a chunk of a model
tensor (``integrations._streamed_save``). One bound for both ([Note: bounded model shards])."""


def exact_storage(t: torch.Tensor) -> torch.Tensor:
    """``t`` (contiguous, CPU or GPU) on a storage of exactly its bytes, sharing its memory and keeping it alive.

    ``torch.save`` writes a view's whole storage. A view of a :class:`HostBuffer` would carry its page padding
    (whatever the heap left there: bytes of other objects of this process) and any room reserved past it ([Note:
    reserved room in the host arenas] in ``runtime/tail_move.py``); a slice of a GPU arena would be copied to the
    host whole. DLPack hands the same memory over with the view's extent as the storage."""
    if t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return torch.from_dlpack(t.detach().contiguous())
