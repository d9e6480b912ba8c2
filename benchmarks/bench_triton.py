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

Achieved GB/s counts bytes read plus bytes written once each; the ceiling is a large device-to-device
``copy_`` measured in the same run. Writes everything as JSON to ``--out`` and prints a table.

Needs a CUDA GPU: without one it exits with status 2 and says so.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

MB = 1 << 20


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


def time_ms(fn: Callable[[int], None], n_sets: int, reps: int, warmup: int = 3) -> float:
    """Median milliseconds of ``fn(i % n_sets)`` over ``reps`` runs, timed with CUDA events."""
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


def copy_ceiling_gbps(device: torch.device, nbytes: int = 2 << 30, reps: int = 20) -> float:
    """Device-to-device copy bandwidth (bytes read + written) on a buffer far larger than L2."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    a.random_()
    ms = time_ms(lambda _i: b.copy_(a), 1, reps)
    return 2 * nbytes / ms / 1e6


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


def bench_bucket(
    bucket_mb: int,
    device: torch.device,
    ceiling: float,
    reps: int,
    l2_bytes: int,
    layout: str = "odd",
    ops: frozenset[str] | None = None,
) -> list[Row]:
    """Time every op (or those in ``ops``) on one bucket size and parameter layout."""
    from hf_superoffload import triton_kernels as tk

    n = bucket_mb * MB // 2  # bf16 elements
    sizes = param_sizes(n, layout)
    # Rotate input sets so that consecutive runs do not hit in L2.
    n_sets = max(1, math.ceil(3 * l2_bytes / (6 * n)))
    rows: list[Row] = []

    def add(op: str, nbytes: int, tri: Callable[[int], None], ref: Callable[[int], None]) -> None:
        if ops is not None and op not in ops:
            return
        t_ms = time_ms(tri, n_sets, reps)
        g_ms = time_graph_ms(tri, n_sets, reps)
        r_ms = time_ms(ref, n_sets, reps)
        tg, rg = nbytes / t_ms / 1e6, nbytes / r_ms / 1e6
        gg = nbytes / g_ms / 1e6 if g_ms else None
        rows.append(
            Row(
                op,
                bucket_mb,
                len(sizes),
                nbytes,
                layout,
                t_ms,
                tg,
                tg / ceiling,
                g_ms,
                gg,
                r_ms,
                rg,
                r_ms / t_ms,
            )
        )
        gtxt = f"graph {g_ms:7.3f} ms {gg:5.0f} GB/s ({gg / ceiling:4.0%})" if g_ms and gg else "graph n/a"
        print(f"  {op:22s} {bucket_mb:4d} MB {layout:7s} triton {t_ms:7.3f} ms {tg:5.0f} GB/s ({tg / ceiling:4.0%})  "
              f"{gtxt}  torch {r_ms:7.3f} ms  x{r_ms / t_ms:5.2f}", flush=True)  # fmt: skip

    def views(flat: torch.Tensor) -> list[torch.Tensor]:
        out, o = [], 0
        for s in sizes:
            out.append(flat[o : o + s])
            o += s
        return out

    # ---- scatter
    flats32 = [torch.randn(n, device=device) for _ in range(n_sets)]
    flats16 = [f.to(torch.bfloat16) for f in flats32]
    params = [torch.empty(s, dtype=torch.bfloat16, device=device) for s in sizes]
    slices32 = [views(f) for f in flats32]
    slices16 = [views(f) for f in flats16]
    tk.scatter_flat_(flats32[0], params)
    assert tk.last_backend("scatter_flat_") == "triton", "the Triton path is not taken"
    assert torch.equal(torch.cat([p.view(-1) for p in params]), flats32[0].to(torch.bfloat16))

    def torch_scatter32(i: int) -> None:
        for p, s in zip(params, slices32[i]):
            p.copy_(s.to(torch.bfloat16))

    def torch_scatter16(i: int) -> None:
        for p, s in zip(params, slices16[i]):
            p.copy_(s)

    add("scatter_f32_bf16", 6 * n, lambda i: tk.scatter_flat_(flats32[i], params), torch_scatter32)
    add("scatter_f32_bf16_sr", 6 * n,
        lambda i: tk.scatter_flat_(flats32[i], params, stochastic_rounding=True, seed=i), torch_scatter32)  # fmt: skip
    add("scatter_bf16", 4 * n, lambda i: tk.scatter_flat_(flats16[i], params), torch_scatter16)

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

    add("flatten_stats_bf16", 4 * n, lambda i: tk.flatten_grads_with_stats_(grads16[i], sizes, bucket, stats),
        lambda i: torch_flatten(grads16[i]))  # fmt: skip
    grads32 = [[torch.randn(s, device=device) for s in sizes] for _ in range(max(1, n_sets // 2))]
    m32 = len(grads32)
    add("flatten_stats_f32_bf16", 6 * n,
        lambda i: tk.flatten_grads_with_stats_(grads32[i % m32], sizes, bucket, stats),
        lambda i: torch_flatten(grads32[i % m32]))  # fmt: skip

    # ---- upcast
    dst = torch.empty(n, device=device)
    add("upcast", 6 * n, lambda i: tk.upcast_(flats16[i], dst), lambda i: dst.copy_(flats16[i]))

    # ---- AdamW (one set: 28 B/element is already far over L2 from 16 MB up)
    p, m, v = (torch.randn(n, device=device) for _ in range(3))
    v.abs_()
    g = torch.randn(n, device=device, dtype=torch.bfloat16)
    out16 = torch.empty(n, dtype=torch.bfloat16, device=device)
    step_t = torch.tensor(1.0, device=device)
    kw = dict(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)

    def torch_adamw(_i: int) -> None:
        torch._fused_adamw_([p], [g.float()], [m], [v], [], [step_t], amsgrad=False, lr=1e-4, beta1=0.9,
                            beta2=0.999, weight_decay=0.01, eps=1e-8, maximize=False)  # fmt: skip
        out16.copy_(p)

    add("adamw", 28 * n,
        lambda _i: tk.adamw_flat_(p, g, m, v, step=10, grad_scale=1.0, param_out_bf16=out16, **kw),  # type: ignore[arg-type]
        torch_adamw)  # fmt: skip
    return rows


def sweep(
    device: torch.device, ceiling: float, reps: int, l2: int, bucket_mb: int
) -> list[dict[str, object]]:
    """Device-only (graph) GB/s of flatten and scatter over BLOCK x num_warps x CHUNK, both layouts.

    The launch settings are module constants of ``hf_superoffload.triton_kernels._kernels`` (read at each
    launch); this patches them per configuration and restores them afterwards.
    """
    from hf_superoffload.triton_kernels import _kernels as K
    from hf_superoffload.triton_kernels import _tables as T

    saved = (K._FLATTEN_BLOCK, K._FLATTEN_WARPS, K._SCATTER_BLOCK, K._SCATTER_WARPS, T.CHUNK)
    out: list[dict[str, object]] = []
    try:
        for block, warps, chunk in itertools.product((1024, 2048, 4096), (4, 8), (1 << 14, 1 << 16)):
            K._FLATTEN_BLOCK = K._SCATTER_BLOCK = block
            K._FLATTEN_WARPS = K._SCATTER_WARPS = warps
            T.CHUNK = chunk
            print(f"BLOCK={block} num_warps={warps} CHUNK={chunk}", flush=True)
            for layout in ("aligned", "odd"):
                for r in bench_bucket(bucket_mb, device, ceiling, reps, l2, layout,
                                      frozenset({"scatter_f32_bf16", "flatten_stats_bf16"})):  # fmt: skip
                    out.append({"block": block, "warps": warps, "chunk": chunk, **asdict(r)})
    finally:
        K._FLATTEN_BLOCK, K._FLATTEN_WARPS, K._SCATTER_BLOCK, K._SCATTER_WARPS, T.CHUNK = saved
    return out


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit status."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/bench_triton.json"))
    ap.add_argument("--sizes-mb", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--layouts", nargs="+", default=["odd", "aligned"], choices=["odd", "aligned"])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--sweep", action="store_true", help="tune BLOCK / num_warps / CHUNK instead (256 MB)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_triton.py needs a CUDA GPU (torch.cuda.is_available() is False); nothing measured.",
              file=sys.stderr)  # fmt: skip
        return 2
    import triton

    from hf_superoffload import triton_kernels as tk

    device = torch.device("cuda")
    status = tk.triton_status()
    if tk.backend_for(torch.empty(1, device=device)) != "triton":
        print(f"the Triton path is not usable here: {status}", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(device)
    l2 = int(getattr(props, "L2_cache_size", 50 * MB))
    ceiling = copy_ceiling_gbps(device)
    print(
        f"{props.name}: device copy ceiling {ceiling:.0f} GB/s (read + write), L2 {l2 / MB:.0f} MB",
        flush=True,
    )
    result: dict[str, object] = {
        "device": props.name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "copy_ceiling_gbps": ceiling,
        "triton_status": {k: v for k, v in status.items() if k != "smoke"},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.sweep:
        result["sweep"] = sweep(device, ceiling, args.reps, l2, max(args.sizes_mb))
        args.out.write_text(json.dumps(result, indent=2))
        print(
            f"\n{'BLOCK':>6s} {'warps':>5s} {'CHUNK':>6s} {'op':22s} {'layout':8s} {'graph GB/s':>10s} {'%copy':>6s}"
        )
        for r in result["sweep"]:  # type: ignore[union-attr]
            gg = r["graph_gbps"] or 0.0
            print(f"{r['block']:6d} {r['warps']:5d} {r['chunk']:6d} {r['op']:22s} {r['layout']:8s} {gg:10.0f} "
                  f"{gg / ceiling:6.1%}")  # fmt: skip
        print(f"\nwrote {args.out}")
        return 0
    rows: list[Row] = []
    for mb in args.sizes_mb:
        for layout in args.layouts:
            rows.extend(bench_bucket(mb, device, ceiling, args.reps, l2, layout))
            torch.cuda.empty_cache()
    result["rows"] = [asdict(r) for r in rows]
    args.out.write_text(json.dumps(result, indent=2))
    print()
    print(f"{'op':22s} {'MB':>4s} {'layout':7s} {'tensors':>7s} {'triton ms':>9s} {'GB/s':>6s} {'%copy':>6s} "
          f"{'graph GB/s':>10s} {'torch ms':>9s} {'GB/s':>6s} {'speedup':>7s}")  # fmt: skip
    for r in rows:
        gg = f"{r.graph_gbps:10.0f}" if r.graph_gbps else f"{'n/a':>10s}"
        print(f"{r.op:22s} {r.bucket_mb:4d} {r.layout:7s} {r.n_tensors:7d} {r.triton_ms:9.3f} {r.triton_gbps:6.0f} "
              f"{r.frac_of_copy:6.1%} {gg} {r.torch_ms:9.3f} {r.torch_gbps:6.0f} {r.speedup:7.2f}")  # fmt: skip
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
