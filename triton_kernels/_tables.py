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

__all__ = ["CHUNK", "PlanCache", "aligned16", "balanced_rows", "chunk_rows", "interleaved_rows"]

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

    def last(self) -> Any:
        """The most recently stored or fetched plan (``None`` if empty): what the last launch ran."""
        with self._lock:
            return next(reversed(self._d.values()), None)

    def clear(self) -> None:
        """Drop every cached plan."""
        with self._lock:
            self._d.clear()


def balanced_rows(
    src_off: np.ndarray,
    dst_off: np.ndarray,
    numel: np.ndarray,
    flags: np.ndarray,
    parts: int,
    align: int = 8,
) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``[src_offset, dst_offset, flags, n]`` that give each of ``parts`` programs an equal share.

    The group's entries, back to back, are cut at multiples of ``share = ceil(total / parts)`` (rounded up
    to ``align``); a cut inside an entry moves up to the next multiple of ``align`` *from the entry's
    start*, so every row keeps its entry's 16-byte alignment on both sides, and a program gets at most
    ``align - 1`` elements more or fewer than its share. Program ``p`` owns rows ``starts[p]`` to
    ``starts[p + 1]`` (exclusive), contiguous; a program can own none (tiny groups).

    Returns:
        ``(rows [R, 4] int64, starts [parts + 1] int32)``.
    """
    numel = np.asarray(numel, dtype=np.int64)
    keep = numel > 0
    src_off, dst_off, numel, flags = (
        np.asarray(a, dtype=np.int64)[keep] for a in (src_off, dst_off, numel, flags)
    )
    total = int(numel.sum())
    if total == 0:
        return np.empty((0, 4), dtype=np.int64), np.zeros(parts + 1, dtype=np.int32)
    share = -(-total // parts)
    share = -(-share // align) * align
    entry_start = np.cumsum(numel) - numel
    entry_end = entry_start + numel
    cuts = np.arange(1, -(-total // share), dtype=np.int64) * share  # cut points strictly inside the group
    # cuts falling inside each entry: (entry_start, entry_end)
    lo = np.searchsorted(cuts, entry_start, side="right")
    hi = np.searchsorted(cuts, entry_end, side="left")
    n_in = hi - lo
    ent = np.repeat(np.arange(len(numel)), n_in)
    rel = cuts[
        np.concatenate([np.arange(a, b) for a, b in zip(lo, hi)]) if len(ent) else np.empty(0, np.int64)
    ]
    rel = rel - entry_start[ent]
    rel = -(-rel // align) * align  # entry-relative cut, aligned
    ok = rel < numel[ent]
    ent, rel = ent[ok], rel[ok]
    # row starts (entry-relative): 0 for each entry, plus the cuts; deduplicated and ordered
    r_ent = np.concatenate([np.arange(len(numel)), ent])
    r_rel = np.concatenate([np.zeros(len(numel), dtype=np.int64), rel])
    order = np.lexsort((r_rel, r_ent))
    r_ent, r_rel = r_ent[order], r_rel[order]
    dup = np.zeros(len(r_ent), dtype=bool)
    dup[1:] = (r_ent[1:] == r_ent[:-1]) & (r_rel[1:] == r_rel[:-1])
    r_ent, r_rel = r_ent[~dup], r_rel[~dup]
    nxt_same = np.zeros(len(r_ent), dtype=bool)
    nxt_same[:-1] = r_ent[1:] == r_ent[:-1]
    r_end = np.where(nxt_same, np.roll(r_rel, -1), numel[r_ent])
    rows = np.empty((len(r_ent), 4), dtype=np.int64)
    rows[:, 0] = src_off[r_ent] + r_rel
    rows[:, 1] = dst_off[r_ent] + r_rel
    rows[:, 2] = flags[r_ent]
    rows[:, 3] = r_end - r_rel
    owner = (entry_start[r_ent] + r_rel) // share  # nondecreasing
    starts = np.searchsorted(owner, np.arange(parts + 1), side="left").astype(np.int32)
    return rows, starts


def interleaved_rows(
    src_off: np.ndarray,
    dst_off: np.ndarray,
    numel: np.ndarray,
    flags: np.ndarray,
    parts: int,
    pieces: int = 1,
    align: int = 8,
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`balanced_rows` for ``parts`` programs, each share cut into ``pieces`` pieces dealt round-robin.

    The group is cut into ``parts * pieces`` equal pieces (as :func:`balanced_rows` cuts it); program ``p``
    owns pieces ``p, p + parts, p + 2 * parts, ...``, whose rows are stored back to back in that order, so
    ``starts`` keeps its meaning (program ``p``: rows ``starts[p]`` to ``starts[p + 1]``). At any moment the
    programs then work in one ``parts``-piece window of the bucket rather than in ``parts`` distant places.
    ``pieces == 1`` is :func:`balanced_rows` itself.

    Returns:
        ``(rows [R, 4] int64, starts [parts + 1] int32)``.
    """
    rows, pstarts = balanced_rows(src_off, dst_off, numel, flags, parts * pieces, align)
    if pieces == 1 or len(rows) == 0:
        return rows, pstarts
    pstarts = pstarts.astype(np.int64)
    # piece q = k * parts + p goes to program p, as its k-th piece
    order = np.arange(parts * pieces, dtype=np.int64).reshape(pieces, parts).T.reshape(-1)
    counts = (pstarts[1:] - pstarts[:-1])[order]
    first = pstarts[:-1][order]
    # row indices of the pieces in the new order: first[i], first[i] + 1, ..., first[i] + counts[i] - 1
    out_start = np.cumsum(counts) - counts
    idx = np.repeat(first - out_start, counts) + np.arange(int(counts.sum()), dtype=np.int64)
    per_prog = counts.reshape(parts, pieces).sum(axis=1)
    starts = np.zeros(parts + 1, dtype=np.int32)
    starts[1:] = np.cumsum(per_prog)
    return rows[idx], starts
