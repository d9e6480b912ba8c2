"""Where a profiled step's time goes: a per-step breakdown of a ``torch.profiler`` Chrome trace.

    python benchmarks/trace_summary.py TRACE.json[.gz] [--json OUT.json] [--min-gap-us 20] [--bins 50]

The suite's ``--profile`` writes such traces (one ``ProfilerStep#N`` range per step, every thread recorded) and
stores this summary in its record. Per step it reports:

- ``main``: the training thread's time inside each ``superoffload::*`` range (``wait_cpu`` is the forward
  blocked on a host bucket; ``validate`` includes the one device-to-host sync of the step);
- ``worker``: the CPU threads' time per range (``cpu_adam``, ``moment_commit``, ``upload``, ``undo``), their
  union (``busy_ms``) and ``pass_ms``, from the end of ``validate`` to the end of the last ``upload`` (the part
  of the host pass on the critical path when the verdict is known only then), and ``pass_busy_ms``, the part of
  that window some worker thread spent inside a range (the rest is queueing, the GIL, waits on events);
- ``gpu`` (CUDA traces): busy time per stream (kernels and copies), copy bytes and bandwidth per direction, and
  the compute stream's idle time split by what the training thread was doing when the stream went idle
  (the innermost ``superoffload::*`` range open at that moment, ``optimizer_step`` for the rest of
  ``Optimizer.step``, or ``python`` when none was open), and ``pageable_copies``: copies CUPTI saw to or from
  pageable host memory (each one is synchronous for the thread that issued it; the engine should have none).

``--bins MS`` also prints the last step as a timeline: per bin, the percentage of it during which the compute
stream ran a kernel, each copy direction ran, and each ``superoffload::*`` range was open (training-thread ranges
prefixed ``main.``, summed over threads: nested ranges or parallel threads can exceed 100).

The compute stream is the stream with the most kernel time. Only the standard library is used.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

__all__ = ["load_events", "main", "summarize", "timeline"]

PREFIX = "superoffload::"
_GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def load_events(path: str | Path) -> list[dict[str, Any]]:
    """The complete-duration (``ph == "X"``) events of a Chrome trace (plain or gzipped JSON)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def _union_ms(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(spans):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total / 1e3


def _clip(spans: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(s, lo), min(e, hi)) for s, e in spans if e > lo and s < hi]


def _direction(e: dict[str, Any]) -> str:
    name = e.get("name", "")
    for key in ("HtoD", "DtoH", "DtoD"):
        if key in name:
            return key
    return "other"


def _profiler_steps(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``ProfilerStep#N`` ranges in time order (CUDA traces mirror annotations on the GPU timeline as
    ``gpu_user_annotation``: only the CPU-side ones count)."""
    return sorted((e for e in events if e.get("cat") == "user_annotation"
                   and str(e.get("name", "")).startswith("ProfilerStep#")), key=lambda e: e["ts"])


def _compute_stream(events: list[dict[str, Any]]) -> Any:
    """``(pid, tid)`` of the stream with the most kernel time (``None`` without kernels)."""
    kernel_time: dict[Any, float] = defaultdict(float)
    for e in events:
        if e.get("cat") == "kernel":
            kernel_time[(e.get("pid"), e.get("tid"))] += e["dur"]
    return max(kernel_time, key=kernel_time.__getitem__) if kernel_time else None


def summarize(events: list[dict[str, Any]], *, min_gap_us: float = 20.0) -> dict[str, Any]:
    """Per-step breakdown of ``events`` (see the module docstring). Steps are the ``ProfilerStep#N`` ranges;
    a trace without them is one step spanning every event."""
    steps = _profiler_steps(events)
    annotations = [e for e in events if e.get("cat") == "user_annotation" and str(e["name"]).startswith(PREFIX)]
    main_tid = steps[0]["tid"] if steps else None
    if main_tid is None:
        opt = [e for e in events if e.get("cat") == "user_annotation"
               and str(e.get("name", "")).startswith("Optimizer.step#")]
        main_tid = opt[0]["tid"] if opt else None
    gpu = [e for e in events if e.get("cat") in _GPU_CATS]
    compute = _compute_stream(gpu)
    if steps:
        windows = [(s["ts"], s["ts"] + s["dur"], s["name"]) for s in steps]
    else:
        lo = min(e["ts"] for e in events)
        windows = [(lo, max(e["ts"] + e["dur"] for e in events), "all")]

    # the training thread's open ranges, for attributing compute-stream gaps
    main_ranges = sorted(((e["ts"], e["ts"] + e["dur"], e["name"][len(PREFIX):]) for e in annotations
                          if e["tid"] == main_tid), key=lambda r: r[0])
    main_ranges += sorted(((e["ts"], e["ts"] + e["dur"], "optimizer_step") for e in events
                           if e.get("tid") == main_tid and str(e.get("name", "")).startswith("Optimizer.step#")),
                          key=lambda r: r[0])

    def cause(t: float) -> str:
        best: tuple[float, str] | None = None  # the innermost (shortest) open range
        for s, e, name in main_ranges:
            if s <= t < e and (best is None or e - s < best[0]):
                best = (e - s, name)
        return best[1] if best else "python"

    out_steps = []
    for lo, hi, name in windows:
        step: dict[str, Any] = {"step": name, "wall_ms": round((hi - lo) / 1e3, 2)}
        main: dict[str, float] = defaultdict(float)
        worker: dict[str, float] = defaultdict(float)
        worker_spans: list[tuple[float, float]] = []
        validate_end = None
        last_upload_end = None
        for e in annotations:
            s, en = e["ts"], e["ts"] + e["dur"]
            if en <= lo or s >= hi:
                continue
            key = e["name"][len(PREFIX):]
            ms = (min(en, hi) - max(s, lo)) / 1e3
            if e["tid"] == main_tid:
                main[key] += ms
                if key == "validate":
                    validate_end = en if validate_end is None else max(validate_end, en)
            else:
                worker[key] += ms
                worker_spans.append((max(s, lo), min(en, hi)))
                if key == "upload":
                    last_upload_end = en if last_upload_end is None else max(last_upload_end, en)
        step["main"] = {k: round(v, 2) for k, v in sorted(main.items())}
        step["worker"] = {k: round(v, 2) for k, v in sorted(worker.items())}
        step["worker"]["busy_ms"] = round(_union_ms(worker_spans), 2)
        if validate_end is not None and last_upload_end is not None and last_upload_end > validate_end:
            step["worker"]["pass_ms"] = round((last_upload_end - validate_end) / 1e3, 2)
            # how much of that window a worker thread was inside a range: the rest is queueing, the GIL, waits
            step["worker"]["pass_busy_ms"] = round(_union_ms(_clip(worker_spans, validate_end, last_upload_end)), 2)
        if gpu:
            step["gpu"] = _gpu_step(gpu, compute, lo, hi, min_gap_us, cause)
        out_steps.append(step)
    return {"main_thread": main_tid, "compute_stream": None if compute is None else list(compute),
            "steps": out_steps}


def _gpu_step(gpu: list[dict[str, Any]], compute: Any, lo: float, hi: float, min_gap_us: float,
              cause: Any) -> dict[str, Any]:
    per_stream: dict[Any, list[tuple[float, float]]] = defaultdict(list)
    copy_bytes: dict[str, float] = defaultdict(float)
    copy_us: dict[str, float] = defaultdict(float)
    for e in gpu:
        s, en = e["ts"], e["ts"] + e["dur"]
        if en <= lo or s >= hi:
            continue
        per_stream[(e.get("pid"), e.get("tid"))].append((s, en))
        if e["cat"] == "gpu_memcpy":
            d = _direction(e)
            copy_bytes[d] += float((e.get("args") or {}).get("bytes", 0) or 0)
            copy_us[d] += e["dur"]
    pageable = sum(1 for e in gpu if e["cat"] == "gpu_memcpy" and "Pageable" in e.get("name", "")
                   and lo <= e["ts"] < hi)
    res: dict[str, Any] = {
        "pageable_copies": pageable,
        "busy_ms_per_stream": {f"{k[0]}/{k[1]}": round(_union_ms(v), 2) for k, v in sorted(
            per_stream.items(), key=lambda kv: str(kv[0]))},
        "copies": {d: {"GB": round(copy_bytes[d] / 1e9, 3), "ms": round(copy_us[d] / 1e3, 2),
                       "GB_per_s": round(copy_bytes[d] / copy_us[d] / 1e3, 1) if copy_us[d] else None}
                   for d in sorted(copy_us)},
    }
    spans = sorted(_clip(per_stream.get(compute, []), lo, hi))
    if not spans:
        return res
    idle: dict[str, float] = defaultdict(float)
    end = spans[0][1]
    for s, e in spans[1:]:
        if s - end >= min_gap_us:
            idle[cause(end)] += (s - end) / 1e3
        end = max(end, e)
    busy = _union_ms(spans)
    res["compute_busy_ms"] = round(busy, 2)
    res["compute_idle_ms"] = {k: round(v, 2) for k, v in sorted(idle.items(), key=lambda kv: -kv[1])}
    res["compute_idle_total_ms"] = round(sum(idle.values()), 2)
    return res


def timeline(events: list[dict[str, Any]], *, bin_ms: float = 50.0) -> dict[str, Any]:
    """The last ``ProfilerStep#N`` (or the whole trace) in bins of ``bin_ms``: per column, the percentage of each
    bin covered (kernels on the compute stream, copies per direction, ``superoffload::*`` ranges per name)."""
    steps = _profiler_steps(events)
    if steps:
        last = steps[-1]
        lo, hi, main_tid = last["ts"], last["ts"] + last["dur"], last["tid"]
    else:
        lo, hi, main_tid = min(e["ts"] for e in events), max(e["ts"] + e["dur"] for e in events), None
    width = bin_ms * 1e3
    n = max(1, int((hi - lo) // width) + (1 if (hi - lo) % width else 0))
    compute = _compute_stream(events)
    cols: dict[str, list[float]] = {}

    def add(col: str, s: float, en: float) -> None:
        row = cols.setdefault(col, [0.0] * n)
        s, en = max(s, lo), min(en, hi)
        while s < en:
            i = min(int((s - lo) // width), n - 1)
            cut = min(en, lo + (i + 1) * width)
            row[i] += cut - s
            s = cut

    for e in events:
        cat, name = e.get("cat"), str(e.get("name", ""))
        s, en = e["ts"], e["ts"] + e["dur"]
        if en <= lo or s >= hi:
            continue
        if cat == "kernel" and (e.get("pid"), e.get("tid")) == compute:
            add("gpu", s, en)
        elif cat == "gpu_memcpy" and _direction(e) in ("DtoH", "HtoD"):
            add(_direction(e).lower(), s, en)
        elif cat == "user_annotation" and name.startswith(PREFIX):
            add(("main." if e.get("tid") == main_tid else "") + name[len(PREFIX):], s, en)
    order = [c for c in ("gpu", "dtoh", "htod") if c in cols] + sorted(c for c in cols if c not in ("gpu", "dtoh", "htod"))
    return {"bin_ms": bin_ms, "columns": order,
            "rows": [[round(i * bin_ms, 1)] + [round(100 * cols[c][i] / width) for c in order] for i in range(n)]}


def format_timeline(tl: dict[str, Any]) -> str:
    head = "  t_ms " + " ".join(f"{c[:12]:>12}" for c in tl["columns"])
    return "\n".join([head] + [f"{r[0]:6.0f} " + " ".join(f"{v:12d}" for v in r[1:]) for r in tl["rows"]])


def format_text(summary: dict[str, Any]) -> str:
    lines = []
    for st in summary["steps"]:
        lines.append(f"{st['step']}: wall {st['wall_ms']:.1f} ms")
        lines.append("  main   " + ", ".join(f"{k} {v:.1f}" for k, v in st["main"].items()))
        lines.append("  worker " + ", ".join(f"{k} {v:.1f}" for k, v in st["worker"].items()))
        g = st.get("gpu")
        if g:
            if "compute_busy_ms" in g:
                lines.append(f"  gpu    compute busy {g['compute_busy_ms']:.1f}, idle {g['compute_idle_total_ms']:.1f}: "
                             + ", ".join(f"{k} {v:.1f}" for k, v in g["compute_idle_ms"].items()))
            lines.append("  copies " + ", ".join(f"{d} {c['GB']} GB in {c['ms']} ms ({c['GB_per_s']} GB/s)"
                                                 for d, c in g["copies"].items())
                         + (f"; {g['pageable_copies']} to/from PAGEABLE memory" if g.get("pageable_copies") else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--json", help="also write the summary here")
    ap.add_argument("--min-gap-us", type=float, default=20.0, help="compute-stream gaps shorter than this are ignored")
    ap.add_argument("--bins", type=float, default=None, metavar="MS", help="also print the last step as a timeline")
    args = ap.parse_args(argv)
    events = load_events(args.trace)
    summary = summarize(events, min_gap_us=args.min_gap_us)
    print(format_text(summary))
    if args.bins:
        print(format_timeline(timeline(events, bin_ms=args.bins)))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
