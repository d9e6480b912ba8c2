#!/usr/bin/env python
"""Benchmark the Triton bucket kernels against the device copy ceiling and the per-tensor torch path.

For buckets of 16, 64 and 256 MB (bf16 bytes; the fp32 side is twice that) filled with a realistic mix of
parameter shapes, it times (CUDA events, median of ``--reps`` after warm-up, inputs rotated so that the
working set exceeds L2):

* ``scatter_f32_bf16``: fp32 flat -> bf16 params (RNE)       vs per param ``p.copy_(slice.to(bf16))``
* ``scatter_f32_bf16_sr``: same with stochastic rounding     vs the same torch path (which is RNE)
* ``scatter_bf16``: bf16 flat -> bf16 params (plain copy)    vs per param ``p.copy_(slice)``
* ``flatten_stats_bf16``: bf16 grads -> bf16 bucket + [sum sq, non-finite count]
  vs per grad ``copy_`` + ``torch._foreach_norm`` (which gives no non-finite count: a lower bar)
* ``flatten_stats_f32_bf16``: fp32 grads -> bf16 bucket + stats, same baseline (with a cast in ``copy_``)
* ``upcast``: flat bf16 -> fp32                              vs ``dst.copy_(src)``
* ``adamw``: fused AdamW, bf16 grad, bf16 param copy out     vs ``torch._fused_adamw_`` + a bf16 ``copy_``

Achieved GB/s counts bytes read plus bytes written once each; the ceiling is a large (2 GB) device-to-device
``copy_`` measured in the same run: issue #4's target is a fraction of it. Beside it, per bucket size, the
*size-matched copy*: a contiguous bf16 -> bf16 ``copy_`` of the bucket's size (inputs rotated like the
kernels', graph-timed like them), i.e. what a plain copy of that many bytes reaches; the table's ``%szcp``
column is an op's graph GB/s over it. The ``graph`` column is device time (calls captured in a CUDA graph and
replayed), the eager ``triton`` column includes Python launch overhead; ``legacy`` is the graph time of the
flatten / scatter kernels under their pre-table launch config (``_configs.LEGACY``).

``--sweep`` first times every candidate launch config of the flatten / scatter kernels
(``_configs.sweep_candidates``: tile, warps, row length, persistent grid, one- or two-launch statistics;
LEGACY is the old kernel shape) on every size and layout, graph time only, each checked for correct
output first; prints the best per op and size and a filled-in ``HEURISTIC`` table for ``_configs.py``;
then (unless ``--no-table``) produces the normal table with that suggested table applied in-process. The
sweep stops early, keeping what it has, when ``--budget-s`` is spent; ``--families`` limits it to some op
families (e.g. ``flatten``), ``--one-per-path`` to one candidate of each code path (for the CPU
rehearsal: it checks each path's bookkeeping, not their speed). Writes everything as JSON to ``--out``.

Needs a CUDA GPU: without one it exits with status 2 and says so. ``--cpu-rehearsal`` runs every code
path on the CPU instead (Triton's interpreter, ``--sizes-mb`` read as KiB, wall-clock timing, no graphs):
a check of the script, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

MB = 1 << 20  # the unit of --sizes-mb (KiB under --cpu-rehearsal)
_CPU = False  # --cpu-rehearsal: wall-clock timing, no CUDA graphs

# op -> launch-config family of the flatten / scatter kernels (ops not listed have fixed launches)
FAMILY = {
    "scatter_f32_bf16": "scatter",
    "scatter_f32_bf16_sr": "scatter_sr",
    "scatter_bf16": "scatter",
    "flatten_stats_bf16": "flatten",
    "flatten_stats_f32_bf16": "flatten",
    "flatten_stats_bf16_spread": "flatten_spread",
    "flatten_stats_f32_bf16_spread": "flatten_spread",
}


@dataclass
class Row:
    """One measured op at one bucket size."""

    op: str
    bucket_mb: int
    n_tensors: int
    bytes_moved: int
    layout: str
    triton_ms: float
    triton_gbps: float
    frac_of_copy: float
    graph_ms: float | None
    graph_gbps: float | None
    torch_ms: float
    torch_gbps: float
    speedup: float
    config: str | None = None
    legacy_graph_gbps: float | None = None
    size_copy_gbps: float | None = None  # the size-matched bf16 copy (module docstring)


def time_ms(fn: Callable[[int], None], n_sets: int, reps: int, warmup: int = 3) -> float:
    """Median milliseconds of ``fn(i % n_sets)`` over ``reps`` runs, timed with CUDA events."""
    if _CPU:
        for i in range(warmup):
            fn(i % n_sets)
        cpu_times = []
        for i in range(reps):
            t = time.perf_counter()
            fn(i % n_sets)
            cpu_times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(cpu_times)
    for i in range(warmup):
        fn(i % n_sets)
    torch.cuda.synchronize()
    times = []
    for i in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(i % n_sets)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_graph_ms(fn: Callable[[int], None], n_sets: int, reps: int, per_graph: int = 8) -> float | None:
    """Device-only milliseconds per call: ``per_graph`` calls captured in a CUDA graph, replayed ``reps``
    times (median). Removes the Python/launch overhead that :func:`time_ms` includes. ``None`` if the
    capture fails."""
    if _CPU:  # rehearsal: the eager time stands in
        return time_ms(fn, n_sets, reps, warmup=1)
    stream = torch.cuda.Stream()
    try:
        with torch.cuda.stream(stream):  # warm on the capture stream: work tables are cached per stream
            for i in range(per_graph):
                fn(i % n_sets)
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for i in range(per_graph):
                fn(i % n_sets)
    except Exception as e:  # capture is a bonus measurement
        print(f"    (graph capture failed: {type(e).__name__}: {e})", file=sys.stderr)
        torch.cuda.synchronize()
        return None
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / per_graph)
    del graph
    return statistics.median(times)


def _empty_cache() -> None:
    if not _CPU:
        torch.cuda.empty_cache()


def copy_ceiling_gbps(device: torch.device, nbytes: int = 2 << 30, reps: int = 20) -> float:
    """Device-to-device copy bandwidth (bytes read + written) on a buffer far larger than L2."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    a.random_()
    ms = time_ms(lambda _i: b.copy_(a), 1, reps)
    return 2 * nbytes / ms / 1e6


def size_matched_copy_gbps(bucket_mb: int, device: torch.device, l2_bytes: int, reps: int) -> float | None:
    """Graph-timed GB/s (read + write) of a contiguous bf16 -> bf16 ``copy_`` of one bucket's size, the
    sources rotated like :func:`build_ops`' (so that consecutive copies do not hit in L2); ``None`` if the
    capture fails."""
    n = bucket_mb * MB // 2
    n_sets = min(8, max(1, math.ceil(3 * l2_bytes / (6 * n))))
    srcs = [torch.randn(n, device=device).to(torch.bfloat16) for _ in range(n_sets)]
    dst = torch.empty(n, dtype=torch.bfloat16, device=device)
    ms = time_graph_ms(lambda i: dst.copy_(srcs[i]), n_sets, reps)
    return 4 * n / ms / 1e6 if ms else None


def param_sizes(total_elems: int, layout: str = "odd") -> list[int]:
    """A realistic mix of parameter sizes summing to ``total_elems``.

    ``odd``: includes odd sizes (a 1-element scalar, a 32003-row vocab, a ``+3``), so most entries sit at
    bucket offsets that are not 16-byte aligned. ``aligned``: every size a multiple of 8 elements.
    """
    # ~1.5 M elements on average: a 16 MB bucket holds ~3 tensors, a 256 MB one ~100.
    pattern = [2048 * 2048, 2048, 2048 * 5632 // 2 + 3, 2048, 256 * 2048, 2048, 1, 32003, 2048 * 512]
    if layout == "aligned":
        pattern = [-(-p // 8) * 8 for p in pattern]
    sizes: list[int] = []
    left = total_elems
    i = 0
    while left > 0:
        n = min(pattern[i % len(pattern)], left)
        sizes.append(n)
        left -= n
        i += 1
    return sizes


@dataclass
class Op:
    """One benchmarked op on one bucket: bytes moved, the Triton call, the torch baseline and a check of
    the Triton call's output (returns an error text, or None when correct)."""

    name: str
    nbytes: int
    tri: Callable[[int], None]
    ref: Callable[[int], None]
    check: Callable[[], str | None] | None = None


def build_ops(bucket_mb: int, device: torch.device, l2_bytes: int, layout: str) -> tuple[list[Op], int, int]:
    """The inputs of one bucket size and layout and every op over them; ``(ops, n_sets, n_tensors)``."""
    from hf_superoffload.cpu_ext import AdamWHyper
    from hf_superoffload.triton_kernels import reference as ref

    from hf_superoffload import triton_kernels as tk

    n = bucket_mb * MB // 2  # bf16 elements
    sizes = param_sizes(n, layout)
    # Rotate input sets so that consecutive runs do not hit in L2.
    n_sets = min(8, max(1, math.ceil(3 * l2_bytes / (6 * n))))

    def views(flat: torch.Tensor) -> list[torch.Tensor]:
        out, o = [], 0
        for s in sizes:
            out.append(flat[o : o + s])
            o += s
        return out

    ops: list[Op] = []
    # ---- scatter
    flats32 = [torch.randn(n, device=device) for _ in range(n_sets)]
    flats16 = [f.to(torch.bfloat16) for f in flats32]
    params = [torch.empty(s, dtype=torch.bfloat16, device=device) for s in sizes]
    slices32 = [views(f) for f in flats32]
    slices16 = [views(f) for f in flats16]
    tk.scatter_flat_(flats32[0], params)
    assert tk.last_backend("scatter_flat_") == "triton", "the Triton path is not taken"

    def params_equal(want: torch.Tensor) -> str | None:
        got = torch.cat([p.view(-1) for p in params]).view(torch.int16)
        bad = int((got != want.view(torch.int16)).sum())
        return f"{bad} wrong elements" if bad else None

    def check_scatter(flat: torch.Tensor, **kw: Any) -> str | None:
        params[0].fill_(1.0)
        params[-1].fill_(1.0)
        tk.scatter_flat_(flat, params, **kw)
        if kw.get("stochastic_rounding"):
            return params_equal(ref.stochastic_round_to_bf16(flat, seed=kw["seed"]))
        return params_equal(flat.to(torch.bfloat16))

    def torch_scatter32(i: int) -> None:
        for p, s in zip(params, slices32[i]):
            p.copy_(s.to(torch.bfloat16))

    def torch_scatter16(i: int) -> None:
        for p, s in zip(params, slices16[i]):
            p.copy_(s)

    ops.append(Op("scatter_f32_bf16", 6 * n, lambda i: tk.scatter_flat_(flats32[i], params), torch_scatter32,
                  lambda: check_scatter(flats32[0])))  # fmt: skip
    ops.append(Op("scatter_f32_bf16_sr", 6 * n,
                  lambda i: tk.scatter_flat_(flats32[i], params, stochastic_rounding=True, seed=i),
                  torch_scatter32, lambda: check_scatter(flats32[0], stochastic_rounding=True, seed=3)))  # fmt: skip
    ops.append(Op("scatter_bf16", 4 * n, lambda i: tk.scatter_flat_(flats16[i], params), torch_scatter16,
                  lambda: check_scatter(flats16[0])))  # fmt: skip

    # ---- flatten + stats
    grads16 = [[torch.randn(s, device=device, dtype=torch.bfloat16) for s in sizes] for _ in range(n_sets)]
    bucket = torch.empty(n, dtype=torch.bfloat16, device=device)
    bucket_views = views(bucket)
    stats = torch.zeros(2, device=device)

    def torch_flatten(gs: list[torch.Tensor]) -> None:
        for d, g in zip(bucket_views, gs):
            d.copy_(g)
        norms = torch._foreach_norm(gs)
        stats[0] += torch.stack(norms).float().pow(2).sum()

    grads32 = [[torch.randn(s, device=device) for s in sizes] for _ in range(max(1, n_sets // 2))]
    m32 = len(grads32)

    n_rows = tk.spread_stats_rows(device, sizes)

    def new_stats(spread: bool) -> torch.Tensor:
        """The op's statistics buffer: ``[2]`` (reduced in the launch) or one bucket's spread rows."""
        return torch.zeros(n_rows, 2, device=device) if spread else torch.zeros(2, device=device)

    def check_flatten(gs: list[torch.Tensor], spread: bool = False) -> str | None:
        want = torch.cat([g.to(torch.bfloat16) for g in gs])
        w = want.double()
        want_sq = float((w * w).sum())
        runs = []
        for _ in range(2):
            bucket.fill_(1.0)
            st = new_stats(spread)
            tk.flatten_grads_with_stats_(gs, sizes, bucket, st)
            runs.append(st.view(-1, 2).sum(dim=0).cpu())
        if not torch.equal(bucket.view(torch.int16), want.view(torch.int16)):
            return "bucket bits differ"
        if not torch.equal(runs[0], runs[1]):
            return f"statistics not deterministic: {runs[0].tolist()} vs {runs[1].tolist()}"
        sq, bad = runs[0].tolist()
        if bad != 0 or abs(sq - want_sq) > 1e-4 * want_sq:
            return f"statistics {runs[0].tolist()}, want [{want_sq}, 0]"
        return check_nonfinite(gs, spread)

    def check_nonfinite(gs: list[torch.Tensor], spread: bool = False) -> str | None:
        """+Inf at the bucket's first element, -Inf at a tile boundary inside the middle entry, NaN at the
        last element, the largest finite bf16 next to the -Inf: exactly 3 counted, the sum NaN."""
        mid = gs[len(gs) // 2].view(-1)
        at = [(gs[0].view(-1), 0, float("inf")), (gs[-1].view(-1), gs[-1].numel() - 1, float("nan")),
              (mid, min(mid.numel() - 1, 4096), float("-inf")), (mid, min(mid.numel() - 1, 4096) - 1, 3.3895e38)]  # fmt: skip
        saved = [(t, i, t[i].clone()) for t, i, _ in at]
        try:
            for t, i, v in at:
                t[i] = v
            want_bad = sum(int((~torch.isfinite(g.to(torch.bfloat16))).sum()) for g in gs)
            st = new_stats(spread)
            tk.flatten_grads_with_stats_(gs, sizes, bucket, st)
            sq, bad = st.view(-1, 2).sum(dim=0).tolist()
        finally:
            for t, i, v in reversed(saved):
                t[i] = v
        if bad != want_bad or not math.isnan(sq):
            return f"non-finite check: statistics [{sq}, {bad}], want [nan, {want_bad}]"
        return None

    ops.append(Op("flatten_stats_bf16", 4 * n,
                  lambda i: tk.flatten_grads_with_stats_(grads16[i], sizes, bucket, stats),
                  lambda i: torch_flatten(grads16[i]), lambda: check_flatten(grads16[0])))  # fmt: skip
    ops.append(Op("flatten_stats_f32_bf16", 6 * n,
                  lambda i: tk.flatten_grads_with_stats_(grads32[i % m32], sizes, bucket, stats),
                  lambda i: torch_flatten(grads32[i % m32]), lambda: check_flatten(grads32[0])))  # fmt: skip
    # What the engine runs: one row per program, no reduction in the launch ([Note: spread statistics]); the
    # rows keep adding up over the timed calls, like the engine's over a step's buckets.
    rows = new_stats(True)
    ops.append(Op("flatten_stats_bf16_spread", 4 * n,
                  lambda i: tk.flatten_grads_with_stats_(grads16[i], sizes, bucket, rows),
                  lambda i: torch_flatten(grads16[i]), lambda: check_flatten(grads16[0], True)))  # fmt: skip
    ops.append(Op("flatten_stats_f32_bf16_spread", 6 * n,
                  lambda i: tk.flatten_grads_with_stats_(grads32[i % m32], sizes, bucket, rows),
                  lambda i: torch_flatten(grads32[i % m32]), lambda: check_flatten(grads32[0], True)))  # fmt: skip

    # ---- upcast
    dst = torch.empty(n, device=device)
    ops.append(Op("upcast", 6 * n, lambda i: tk.upcast_(flats16[i], dst), lambda i: dst.copy_(flats16[i])))

    # ---- AdamW (one set: 28 B/element is already far over L2 from 16 MB up)
    p, m, v = (torch.randn(n, device=device) for _ in range(3))
    v.abs_()
    g = torch.randn(n, device=device, dtype=torch.bfloat16)
    out16 = torch.empty(n, dtype=torch.bfloat16, device=device)
    step_t = torch.tensor(1.0, device=device)
    hyper = AdamWHyper(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)

    def torch_adamw(_i: int) -> None:
        torch._fused_adamw_([p], [g.float()], [m], [v], [], [step_t], amsgrad=False, lr=1e-4, beta1=0.9,
                            beta2=0.999, weight_decay=0.01, eps=1e-8, maximize=False)  # fmt: skip
        out16.copy_(p)

    ops.append(Op("adamw", 28 * n,
                  lambda _i: tk.adamw_flat_(p, g, m, v, step=10, hyper=hyper, grad_scale=1.0, param_bf16_out=out16),
                  torch_adamw))  # fmt: skip
    return ops, n_sets, len(sizes)


def bench_bucket(
    bucket_mb: int,
    device: torch.device,
    ceiling: float,
    reps: int,
    l2_bytes: int,
    layout: str = "odd",
    ops: frozenset[str] | None = None,
    size_copy: float | None = None,
) -> list[Row]:
    """Time every op (or those in ``ops``) on one bucket size and parameter layout, launch configs from
    the size table (plus the LEGACY config's graph time for the flatten / scatter ops)."""
    from hf_superoffload.triton_kernels import _configs, _kernels

    built, n_sets, n_tensors = build_ops(bucket_mb, device, l2_bytes, layout)
    rows: list[Row] = []
    for op in built:
        if ops is not None and op.name not in ops:
            continue
        fam = FAMILY.get(op.name)
        t_ms = time_ms(op.tri, n_sets, reps)
        ran = "+".join(dict.fromkeys(_kernels.last_tags(_plan_kind(fam)))) if fam else None
        g_ms = time_graph_ms(op.tri, n_sets, reps)
        legacy = None
        if fam:
            with _configs.forced(**{fam: _configs.LEGACY}):
                l_ms = time_graph_ms(op.tri, n_sets, reps)
            legacy = op.nbytes / l_ms / 1e6 if l_ms else None
        r_ms = time_ms(op.ref, n_sets, reps)
        tg, rg = op.nbytes / t_ms / 1e6, op.nbytes / r_ms / 1e6
        gg = op.nbytes / g_ms / 1e6 if g_ms else None
        rows.append(Row(op.name, bucket_mb, n_tensors, op.nbytes, layout, t_ms, tg, tg / ceiling, g_ms, gg, r_ms,
                        rg, r_ms / t_ms, ran, legacy, size_copy if fam else None))  # fmt: skip
        gtxt = f"graph {g_ms:7.3f} ms {gg:5.0f} GB/s ({gg / ceiling:4.0%})" if g_ms and gg else "graph n/a"
        ltxt = f"  legacy {legacy / ceiling:4.0%}" if legacy else ""
        print(f"  {op.name:22s} {bucket_mb:4d} MB {layout:7s} triton {t_ms:7.3f} ms {tg:5.0f} GB/s "
              f"({tg / ceiling:4.0%})  {gtxt}{ltxt}  torch {r_ms:7.3f} ms  x{r_ms / t_ms:5.2f}", flush=True)  # fmt: skip
    return rows


def sweep(
    device: torch.device,
    ceiling: float,
    reps: int,
    l2: int,
    sizes_mb: list[int],
    layouts: list[str],
    budget_s: float,
    families: frozenset[str] | None = None,
    paths_only: bool = False,
) -> tuple[list[dict[str, Any]], bool]:
    """Graph-time every candidate config of each flatten / scatter op, on each size and layout (sizes in
    the given order, so the small buckets that matter most come first). Each config's output is checked
    before it is timed; a wrong one is recorded with its error and never chosen. Returns the records and
    whether the sweep was complete (False: ``budget_s`` ran out). ``paths_only``: LEGACY and
    ``_configs.one_per_path`` of each family's candidates."""
    from hf_superoffload.triton_kernels import _configs, _kernels

    t0 = time.perf_counter()
    out: list[dict[str, Any]] = []
    for mb in sizes_mb:
        for layout in layouts:
            built, n_sets, n_tensors = build_ops(mb, device, l2, layout)
            for op in built:
                fam = FAMILY.get(op.name)
                if fam is None or (families is not None and fam not in families):
                    continue
                cands = _configs.sweep_candidates(fam)
                if paths_only:  # LEGACY (the baseline the summary compares with) first
                    cands = [cands[0], *[c for c in _configs.one_per_path(cands) if c != cands[0]]]
                for cfg in cands:
                    if time.perf_counter() - t0 > budget_s:
                        print(f"sweep budget of {budget_s:.0f} s spent: stopping at {op.name} {mb} MB {layout}",
                              flush=True)  # fmt: skip
                        return out, False
                    rec: dict[str, Any] = {"op": op.name, "family": fam, "bucket_mb": mb, "layout": layout,
                                           "n_tensors": n_tensors, "config": cfg.tag, **asdict(cfg)}  # fmt: skip
                    with _configs.forced(**{fam: cfg}):
                        try:
                            err = op.check() if op.check else None
                            ran = _kernels.last_tags(_plan_kind(fam))
                            if not err and cfg.tag not in ran:  # kernel 3 on rows it cannot take
                                err = f"not run: the launch ran {'+'.join(ran)}"
                            g_ms = None if err else time_graph_ms(op.tri, n_sets, reps)
                        except Exception as e:  # a config that does not compile or launch
                            err, g_ms = f"{type(e).__name__}: {e}", None
                    gg = op.nbytes / g_ms / 1e6 if g_ms else None
                    rec.update(
                        error=err, graph_ms=g_ms, graph_gbps=gg, frac_of_copy=gg / ceiling if gg else None
                    )
                    out.append(rec)
                    status = f"{gg:6.0f} GB/s ({gg / ceiling:5.1%})" if gg else f"FAILED: {err}"
                    print(f"  {op.name:22s} {mb:4d} MB {layout:7s} {cfg.tag:24s} {status}", flush=True)
            del built
            _empty_cache()
    return out, True


def _plan_kind(family: str) -> str:
    """The launch-plan cache a family's launches go through: ``"flatten"`` or ``"scatter"``."""
    return "flatten" if family.startswith("flatten") else "scatter"


def summarize(records: list[dict[str, Any]], ceiling: float) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Best config per (op, size) by mean graph GB/s over the layouts (configs that failed anywhere are out),
    and a suggested size table per family: per swept size, the config with the best mean fraction of the
    copy ceiling over the family's ops and layouts; bounds halfway (geometrically) between swept sizes. A
    kernel-3 winner runs only launches of a few aligned rows (``_configs.usable``), so its size also gets the
    best other config, right after it, as the table's rows do."""
    from hf_superoffload.triton_kernels._configs import LEGACY, RowsConfig

    failed = {(r["op"], r["bucket_mb"], r["config"]) for r in records if r["error"]}
    by: dict[tuple[str, int, str], list[float]] = {}
    cfg_of: dict[str, RowsConfig] = {}
    for r in records:
        if r["graph_gbps"] and (r["op"], r["bucket_mb"], r["config"]) not in failed:
            by.setdefault((r["op"], r["bucket_mb"], r["config"]), []).append(r["graph_gbps"])
            cfg_of[r["config"]] = config_of(r)
    best: list[dict[str, Any]] = []
    for op, mb in sorted({(k[0], k[1]) for k in by}, key=lambda x: (x[0], x[1])):
        cands = {k[2]: statistics.mean(v) for k, v in by.items() if k[0] == op and k[1] == mb}
        top = max(cands, key=cands.__getitem__)
        legacy = cands.get(LEGACY.tag)
        best.append({"op": op, "bucket_mb": mb, "config": top, "graph_gbps": cands[top],
                     "frac_of_copy": cands[top] / ceiling, "legacy_gbps": legacy})  # fmt: skip
    table: dict[str, Any] = {}
    for fam in sorted({r["family"] for r in records}):
        ops = {r["op"] for r in records if r["family"] == fam}
        sizes = sorted({k[1] for k in by if k[0] in ops})
        rows = []
        for mb in sizes:
            score: dict[str, list[float]] = {}
            for (op, m, c), v in by.items():
                if op in ops and m == mb:
                    score.setdefault(c, []).append(statistics.mean(v) / ceiling)
            n_ops = max(len(s) for s in score.values())
            full = {c: statistics.mean(s) for c, s in score.items() if len(s) == n_ops}
            top = max(full, key=full.__getitem__)
            tops = [top]
            if cfg_of[top].kernel == 3:
                other = {c: f for c, f in full.items() if cfg_of[c].kernel != 3}
                if not other:
                    raise ValueError(f"{fam} at {mb} MB: only kernel-3 configs were measured; sweep a kernel 1 or 2 "
                                     "config as well (kernel 3 cannot run every launch)")  # fmt: skip
                tops.append(max(other, key=other.__getitem__))
            rows.append((mb, tops, full))
        entries = []
        for i, (mb, tops, full) in enumerate(rows):
            bound = None if i == len(rows) - 1 else int(math.sqrt(mb * rows[i + 1][0]) * MB // 2)
            for tag in tops:
                entries.append({"max_elements": bound, "config": tag, **asdict(cfg_of[tag]), "mean_frac": full[tag]})
        table[fam] = entries
    return best, table


def config_of(rec: dict[str, Any]) -> Any:
    """The ``RowsConfig`` whose fields a sweep record or table entry carries (``asdict`` of it)."""
    from dataclasses import fields

    from hf_superoffload.triton_kernels._configs import RowsConfig

    return RowsConfig(**{f.name: rec[f.name] for f in fields(RowsConfig) if f.name in rec})


# RowsConfig fields always printed in the suggested table; every other field only when not at its default
_BASE_FIELDS = ("chunk", "block", "warps", "programs_per_sm", "one_pass", "kernel", "packed")


def _extra_fields() -> dict[str, Any]:
    """The RowsConfig fields beyond ``_BASE_FIELDS`` with their defaults (derived, so a new field is never
    dropped from a suggested table)."""
    from dataclasses import fields

    from hf_superoffload.triton_kernels._configs import RowsConfig

    return {f.name: f.default for f in fields(RowsConfig) if f.name not in _BASE_FIELDS}


def heuristic_source(table: dict[str, Any]) -> str:
    """The suggested table as Python source for ``HEURISTIC`` in triton_kernels/_configs.py."""
    lines = ["HEURISTIC: dict[str, tuple[tuple[int | None, RowsConfig], ...]] = {"]
    for fam, entries in table.items():
        lines.append(f'    "{fam}": (')
        for e in entries:
            b = "None" if e["max_elements"] is None else str(e["max_elements"])
            k2 = f", kernel={e['kernel']}, packed={e['packed']}" if e.get("kernel", 1) != 1 else ""
            extra = "".join(f", {f}={e[f]!r}" for f, dflt in _extra_fields().items() if e.get(f, dflt) != dflt)
            lines.append(f"        ({b}, RowsConfig(chunk={e['chunk']}, block={e['block']}, warps={e['warps']}, "
                         f"programs_per_sm={e['programs_per_sm']}, one_pass={e['one_pass']}{k2}{extra})),"
                         f"  # {e['mean_frac']:.1%}")  # fmt: skip
        lines.append("    ),")
    lines.append("}")
    return "\n".join(lines)


def apply_table(table: dict[str, Any]) -> None:
    """Use ``table`` (from :func:`summarize`) as this process's size table."""
    from hf_superoffload.triton_kernels import _configs

    for fam, entries in table.items():
        _configs.HEURISTIC[fam] = tuple((e["max_elements"], config_of(e)) for e in entries)


def print_table(rows: list[Row]) -> None:
    print(f"\n{'op':22s} {'MB':>4s} {'layout':7s} {'tensors':>7s} {'triton ms':>9s} {'GB/s':>6s} {'%copy':>6s} "
          f"{'graph GB/s':>10s} {'%copy':>6s} {'legacy':>6s} {'%szcp':>6s} {'torch ms':>9s} {'GB/s':>6s} {'speedup':>7s}  "
          "config")  # fmt: skip
    ceiling = rows[0].triton_gbps / rows[0].frac_of_copy if rows else 1.0
    for r in rows:
        gg = (
            f"{r.graph_gbps:10.0f} {r.graph_gbps / ceiling:6.1%}" if r.graph_gbps else f"{'n/a':>10s} {'':6s}"
        )
        lg = f"{r.legacy_graph_gbps / ceiling:6.1%}" if r.legacy_graph_gbps else f"{'':6s}"
        sz = f"{r.graph_gbps / r.size_copy_gbps:6.1%}" if r.graph_gbps and r.size_copy_gbps else f"{'':6s}"
        print(f"{r.op:22s} {r.bucket_mb:4d} {r.layout:7s} {r.n_tensors:7d} {r.triton_ms:9.3f} {r.triton_gbps:6.0f} "
              f"{r.frac_of_copy:6.1%} {gg} {lg} {sz} {r.torch_ms:9.3f} {r.torch_gbps:6.0f} {r.speedup:7.2f}  "
              f"{r.config or ''}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit status."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/bench_triton.json"))
    ap.add_argument("--sizes-mb", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--layouts", nargs="+", default=["odd", "aligned"], choices=["odd", "aligned"])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--sweep", action="store_true",
                    help="time every candidate launch config first, suggest a size table, apply it to the table")  # fmt: skip
    ap.add_argument("--sweep-reps", type=int, default=15)
    ap.add_argument("--budget-s", type=float, default=110.0, help="wall-clock budget of the sweep part")
    ap.add_argument("--families", nargs="+", choices=list(dict.fromkeys(FAMILY.values())), default=None,
                    help="with --sweep: sweep only these op families (default: all)")  # fmt: skip
    ap.add_argument("--one-per-path", action="store_true",
                    help="with --sweep: LEGACY and one candidate per code path (_configs.one_per_path)")  # fmt: skip
    ap.add_argument("--no-table", action="store_true", help="with --sweep: skip the normal table")
    ap.add_argument("--cpu-rehearsal", action="store_true",
                    help="run every code path on the CPU (interpreter, sizes in KiB): a script check only")  # fmt: skip
    args = ap.parse_args(argv)
    global MB, _CPU
    if args.cpu_rehearsal:
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            print(
                "--cpu-rehearsal: triton was imported before TRITON_INTERPRET=1 could be set", file=sys.stderr
            )
            return 2
        os.environ["TRITON_INTERPRET"] = "1"
        MB, _CPU = 1 << 10, True
    elif not torch.cuda.is_available():
        print("bench_triton.py needs a CUDA GPU (torch.cuda.is_available() is False); nothing measured.",
              file=sys.stderr)  # fmt: skip
        return 2
    import triton
    from hf_superoffload.triton_kernels import _kernels

    from hf_superoffload import triton_kernels as tk

    t_start = time.perf_counter()
    device = torch.device("cpu" if _CPU else "cuda")
    status = tk.triton_status()
    if tk.backend_for(torch.empty(1, device=device)) != "triton":
        print(f"the Triton path is not usable here: {status}", file=sys.stderr)
        return 2
    if _CPU:
        name, l2, sms = "CPU rehearsal (Triton interpreter; sizes in KiB)", 64 << 10, 0
        ceiling = copy_ceiling_gbps(device, nbytes=1 << 20, reps=3)
    else:
        props = torch.cuda.get_device_properties(device)
        name, l2, sms = props.name, int(getattr(props, "L2_cache_size", 50 * MB)), props.multi_processor_count
        ceiling = copy_ceiling_gbps(device)
    print(f"{name}: device copy ceiling {ceiling:.0f} GB/s (read + write), L2 {l2 / MB:.0f} MB, {sms} SMs",
          flush=True)  # fmt: skip
    size_copy: dict[int, float | None] = {}
    for mb in args.sizes_mb:
        size_copy[mb] = size_matched_copy_gbps(mb, device, l2, args.reps)
        sc = size_copy[mb]
        txt = f"{sc:.0f} GB/s ({sc / ceiling:.1%} of the ceiling)" if sc else "n/a (graph capture failed)"
        print(f"  size-matched bf16 copy, {mb:4d} MB bucket: {txt}", flush=True)
    result: dict[str, Any] = {
        "device": name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "copy_ceiling_gbps": ceiling,
        "size_matched_copy_gbps": {str(mb): v for mb, v in size_copy.items()},
        "triton_status": {k: v for k, v in status.items() if k != "smoke"},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def write() -> None:
        result["occupancy"] = [{"key": repr(k), **v} for k, v in _kernels.occupancy.items()]
        result["elapsed_s"] = time.perf_counter() - t_start
        args.out.write_text(json.dumps(result, indent=2))

    if args.sweep:
        fams = frozenset(args.families) if args.families else None
        records, complete = sweep(
            device, ceiling, args.sweep_reps, l2, args.sizes_mb, args.layouts, args.budget_s, fams, args.one_per_path
        )
        best, table = summarize(records, ceiling)
        result.update(sweep=records, sweep_complete=complete, best=best, suggested_heuristic=table)
        write()
        print(f"\nbest config per op and size (mean graph GB/s over layouts; ceiling {ceiling:.0f} GB/s)")
        print(f"{'op':22s} {'MB':>4s} {'config':32s} {'GB/s':>6s} {'%copy':>6s} {'legacy':>7s} {'%szcp':>6s}")
        for b in best:
            lg = f"{b['legacy_gbps'] / ceiling:7.1%}" if b["legacy_gbps"] else f"{'':7s}"
            sc = size_copy.get(b["bucket_mb"])
            b["size_copy_gbps"] = sc
            sz = f"{b['graph_gbps'] / sc:6.1%}" if sc else ""
            print(f"{b['op']:22s} {b['bucket_mb']:4d} {b['config']:32s} {b['graph_gbps']:6.0f} "
                  f"{b['frac_of_copy']:6.1%} {lg} {sz}")  # fmt: skip
        print(f"(%copy: of the 2 GB copy ceiling, issue #4's target; %szcp: of the size-matched bf16 copy: "
              f"{', '.join(f'{mb} MB {v / ceiling:.1%}' for mb, v in size_copy.items() if v)} of the ceiling)")
        print("\nrow-kernel variants: registers, spills, programs per SM that fit")
        for occ in _kernels.occupancy.values():
            print("  " + " ".join(f"{k}={v}" for k, v in occ.items()))
        print("\nsuggested size table for triton_kernels/_configs.py"
              + ("" if complete else " (INCOMPLETE sweep: sizes not reached keep the last row)") + ":")  # fmt: skip
        print(heuristic_source(table), flush=True)
        if args.no_table:
            print(f"\nwrote {args.out} ({time.perf_counter() - t_start:.0f} s)")
            return 0
        apply_table(table)
        print("\n(the table below runs with the suggested size table)")
    rows: list[Row] = []
    for mb in args.sizes_mb:
        for layout in args.layouts:
            rows.extend(bench_bucket(mb, device, ceiling, args.reps, l2, layout, size_copy=size_copy.get(mb)))
            _empty_cache()
    result["rows"] = [asdict(r) for r in rows]
    write()
    print_table(rows)
    print(f"\nwrote {args.out} ({time.perf_counter() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
