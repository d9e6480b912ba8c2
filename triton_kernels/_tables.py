"""Host-side work tables for the multi-tensor kernels (pure torch + numpy, no Triton).

The multi-tensor kernels (flatten, scatter) take one small int64 *work table* per launch: one row per
chunk of work, each naming a source and a destination element offset (one side from the launch's base
tensor, the lowest-addressed tensor of a dtype group; the other in the flat bucket) and an element count. Building it is a
vectorised numpy computation over the tensor list; the plan (tables on the device, grouping) is cached by
the exact contents that determine it (addresses, sizes, dtypes), so a step that sees the same gradient /
parameter storage again (the usual case with PyTorch's caching allocator) launches without rebuilding
anything and without a host-to-device copy.

Rows are *chunks* of at most ``chunk`` elements (the launch config's) so that one huge tensor is spread
over many programs and many tiny tensors each get their own row: the grouped-launch scheme of torch's
``multi_tensor_apply`` / Liger, flattened into a single 1-D list that a persistent grid strides over.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

import numpy as np

__all__ = ["CHUNK", "PlanCache", "aligned16", "chunk_rows"]

# NOTE: the default row length only; the launchers take theirs from the launch config (see _configs.py,
# where the sizes were measured). Must stay a multiple of 8 (rows keep their entry's 16-byte alignment).
CHUNK = 1 << 14


def chunk_rows(
    entry_off: np.ndarray,
    flat_off: np.ndarray,
    numel: np.ndarray,
    flags: np.ndarray,
    chunk: int = CHUNK,
) -> np.ndarray:
    """Split entries into chunk rows ``[entry_offset, flat_offset, flags, n]`` (int64, offsets in elements).

    The kernels read the first column as the source and the second as the destination; scatter passes
    the flat offsets first.

    Args:
        entry_off: element offset of each entry's first element (from its group's base tensor, or flat).
        flat_off: element offset of each entry in the flat bucket (or from the group's base tensor).
        numel: element count of each entry.
        flags: per-entry bit field copied to every row of the entry (the kernels define the bits; a chunk
            of ``chunk`` elements starts at the same 16-byte alignment as its entry when ``chunk`` is a
            multiple of 8).
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
    start = (np.arange(rows, dtype=np.int64) - first_row[ent]) * chunk
    out[:, 0] = entry_off.astype(np.int64)[ent] + start
    out[:, 1] = flat_off.astype(np.int64)[ent] + start
    out[:, 2] = flags.astype(np.int64)[ent]
    out[:, 3] = np.minimum(chunk, numel[ent] - start)
    return out


def aligned16(byte_addr: np.ndarray) -> np.ndarray:
    """Per-element: is this byte address a multiple of 16?"""
    return (np.asarray(byte_addr, dtype=np.int64) % 16) == 0


class PlanCache:
    """A small thread-safe LRU of launch plans (device work tables + grouping) keyed by everything that
    determines them: device, CUDA stream, chunk size, and every tensor's address, dtype and size.

    A hit is always correct (same key, same contents); stale entries are merely unused device memory.
    The stream is in the key because a table's upload is ordered on the stream that built it, so a
    launch on another stream builds (and waits on) its own copy. Plans hold no tensor other than their
    tables: base pointers are taken from the caller's tensors at each launch.
    """

    def __init__(self, capacity: int = 4096) -> None:
        # The engine flattens every bucket once per step and scatters every host bucket once per upload: a few
        # hundred layouts for a large model, whose addresses the caching allocator hands back step after step. The
        # cache must hold them all, or each call rebuilds its table (numpy + a pinned upload) in the backward hook.
        # A plan's tables are a few bytes per parameter tensor.
        self.capacity = capacity
        self._d: OrderedDict[Hashable, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: Hashable) -> Any:
        """The cached plan for ``key`` or ``None`` (counts a hit or a miss)."""
        with self._lock:
            plan = self._d.get(key)
            if plan is None:
                self.misses += 1
            else:
                self.hits += 1
                self._d.move_to_end(key)
            return plan

    def put(self, key: Hashable, plan: Any) -> None:
        """Store ``plan``, evicting the least recently used beyond ``capacity``."""
        with self._lock:
            self._d[key] = plan
            self._d.move_to_end(key)
            while len(self._d) > self.capacity:
                self._d.popitem(last=False)

    def clear(self) -> None:
        """Drop every cached plan."""
        with self._lock:
            self._d.clear()
