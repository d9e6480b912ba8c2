"""Host-side work tables for the multi-tensor kernels (pure torch + numpy, no Triton).

The multi-tensor kernels (flatten, scatter) take one small int64 *work table* per launch: one row per
program, each naming a raw address, an offset in the flat bucket and an element count. Building it is a
vectorised numpy computation over the tensor list; the device copy is cached by the exact contents that
determine it (addresses, sizes, dtypes), so a step that sees the same gradient / parameter storage again
(the usual case with PyTorch's caching allocator) launches without any host-to-device copy.

Rows are *chunks* of at most :data:`CHUNK` elements so that one huge tensor is spread over many programs
and many tiny tensors each get their own program: the grouped-launch scheme of torch's
``multi_tensor_apply`` / Liger, flattened into a single 1-D grid.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable

import numpy as np
import torch

__all__ = ["CHUNK", "TableCache", "chunk_rows", "common_alignment"]

# NOTE: 16 Ki elements per program. A 16 MB bf16 bucket is then 512 programs (about 4 per SM on a
# 132-SM H200) and a 256 MB one 8192, while the table stays at 32 B per 16 Ki elements (256 KiB for
# 256 MB). Larger chunks under-fill the GPU on the smallest bucket the engine uses; smaller ones add
# table bytes and per-program prologue work for no bandwidth gain (each program still loops over
# BLOCK-sized tiles). Under the CPU interpreter this also bounds one program's Python work.
CHUNK = 1 << 14


def chunk_rows(
    addr: np.ndarray,
    flat_off: np.ndarray,
    numel: np.ndarray,
    elem_size: np.ndarray,
    has_src: np.ndarray | None = None,
    chunk: int = CHUNK,
) -> np.ndarray:
    """Split entries into chunk rows ``[addr_of_chunk, flat_offset_of_chunk, n_valid, n]`` (int64).

    Args:
        addr: byte address of each entry's first element (int64; anything for entries without a source).
        flat_off: element offset of each entry in the flat bucket.
        numel: element count of each entry.
        elem_size: bytes per element of each entry's *addressed* tensor (for ``addr`` arithmetic).
        has_src: per-entry flag; entries without a source get ``n_valid = 0`` (the kernel writes zeros).
        chunk: elements per row.

    Returns:
        ``[R, 4]`` int64 array, one row per program. Entries with ``numel == 0`` produce no row.
    """
    numel = numel.astype(np.int64)
    k = -(-numel // chunk)  # ceil, 0 for empty entries
    rows = int(k.sum())
    out = np.empty((rows, 4), dtype=np.int64)
    if rows == 0:
        return out
    ent = np.repeat(np.arange(len(numel)), k)
    first_row = np.cumsum(k) - k
    j = np.arange(rows, dtype=np.int64) - first_row[ent]
    start = j * chunk
    n = np.minimum(chunk, numel[ent] - start)
    out[:, 0] = addr.astype(np.int64)[ent] + start * elem_size.astype(np.int64)[ent]
    out[:, 1] = flat_off.astype(np.int64)[ent] + start
    out[:, 2] = n if has_src is None else np.where(has_src[ent], n, 0)
    out[:, 3] = n
    return out


def common_alignment(byte_values: np.ndarray, cap: int = 16) -> int:
    """Largest power of two ``<= cap`` that divides every value (``cap`` for an empty array)."""
    a = cap
    vals = np.asarray(byte_values, dtype=np.int64)
    while a > 1 and vals.size and bool(np.any(vals % a)):
        a //= 2
    return a


class TableCache:
    """A small thread-safe LRU of device work tables keyed by everything that determines their contents.

    A hit is always correct (same key, same bytes); stale entries are merely unused device memory. Callers
    put the current CUDA stream in the key: the table's upload is ordered on the stream that built it, so
    a launch on another stream builds (and waits on) its own copy.
    """

    def __init__(self, capacity: int = 64) -> None:
        self.capacity = capacity
        self._d: OrderedDict[Hashable, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get_or_build(
        self, key: Hashable, build: Callable[[], np.ndarray], device: torch.device
    ) -> torch.Tensor:
        """Return the cached device table for ``key``, building ``build() -> np.ndarray`` on a miss."""
        with self._lock:
            t = self._d.get(key)
            if t is not None:
                self._d.move_to_end(key)
                self.hits += 1
                return t
        host = torch.from_numpy(np.ascontiguousarray(build()))
        if device.type == "cuda":
            # Pinned + non_blocking: the copy is ordered on the current stream, no host sync; the
            # caching host allocator keeps the pinned block alive until the copy has run.
            t = host.pin_memory().to(device, non_blocking=True)
        else:
            t = host.to(device)
        with self._lock:
            self.misses += 1
            self._d[key] = t
            self._d.move_to_end(key)
            while len(self._d) > self.capacity:
                self._d.popitem(last=False)
        return t

    def clear(self) -> None:
        """Drop every cached table."""
        with self._lock:
            self._d.clear()
