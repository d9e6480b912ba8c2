"""Probe: how close can a bf16 copy + gradient statistics get to a plain copy? (issue #4, session 11)

The row kernels (``triton_kernels/_kernels.py``) carry a work table, per-row alignment flags and a persistent
grid. This probe strips all of that away to bound what Triton reaches on the best case, one contiguous
16-byte-aligned bf16 tensor: if the stripped kernels cannot reach the issue's 85% of the copy ceiling, no
row-table variant will; if one does, its shape is the one to carry into the row kernel.

Every kernel moves bf16 pairs as int32 words and computes the statistics on the packed bits (the same
arithmetic as ``_word_sums``). Variants:

* ``copy/bB/wW``: plain copy, one program per ``B``-word tile (torch's elementwise shape).
* ``st/bB/wW/F``: copy + statistics, one program per tile, one partial each; ``F`` is the finish: ``1p`` the
  last-ticket reduction inside the launch (what the row kernels did), ``2p`` a second launch, ``0p`` none (the
  partials stay for the reader: [Note: spread statistics] in docs/design.md).
* ``gs/bB/wW/pP/F``: persistent grid-stride loop (program p takes tiles p, p + G, ...; memory swept as a front),
  ``[B]`` register accumulators, one partial per program.
* ``gs2/...``: the grid-stride loop with the next tile's load issued before the current tile's store.

Session 11 (results/2026-12-01_run17_session11/call1_probe_gc, call2_probe_finish_8b): the finish, not the
arithmetic, is what the statistics cost (16 MB: 58-69% of the ceiling with ``1p``, 76-84% with ``0p``, 88-89% for
the plain copy).

Timing is bench_triton's: 8 calls captured in a CUDA graph, sources rotated past L2, median of replays; the
ceiling is its 2 GB ``copy_``, the size-matched row its graph-timed contiguous ``copy_``. Every statistics
variant is checked against a float64 reference (and for determinism) before it is timed.

    python3 benchmarks/probe_stats_kernels.py --out $OUT/probe_stats.json     # on the GPU box, ~1 min
    TRITON_INTERPRET=1 python3 benchmarks/probe_stats_kernels.py --cpu-check   # correctness only, CPU
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_triton as bt

MB = 1 << 20


@triton.jit
def _wsums(w):
    lo = (w << 16).to(tl.float32, bitcast=True)
    hi = (w & -65536).to(tl.float32, bitcast=True)
    sq = lo * lo + hi * hi
    t = ((w & 0x7F807F80) + 0x00800080) >> 15
    pair = t & 0x00010001
    return sq, (pair & 0xFFFF) + (pair >> 16)


@triton.jit
def _copy_k(src, dst, nw, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if EVEN:
        tl.store(dst + offs, tl.load(src + offs))
    else:
        m = offs < nw
        tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)


@triton.jit
def _finish(part_sq, part_bad, stats, nparts, WIDTH: tl.constexpr):
    """Adds ``nparts`` partials in order into ``stats`` (fp32 sum of squares, fp32 count)."""
    acc_s = tl.zeros([WIDTH], tl.float32)
    acc_c = tl.zeros([WIDTH], tl.int32)
    for i in range(0, nparts, WIDTH):
        o = i + tl.arange(0, WIDTH)
        m = o < nparts
        acc_s += tl.load(part_sq + o, mask=m, other=0.0)
        acc_c += tl.load(part_bad + o, mask=m, other=0)
    tl.store(stats, tl.load(stats) + tl.sum(acc_s, 0))
    tl.store(stats + 1, tl.load(stats + 1) + tl.sum(acc_c, 0).to(tl.float32))


@triton.jit
def _stats_k(src, dst, part_sq, part_bad, ticket, stats, nw, BLOCK: tl.constexpr, EVEN: tl.constexpr,
             FINISH: tl.constexpr, WIDTH: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if EVEN:
        w = tl.load(src + offs)
        tl.store(dst + offs, w)
    else:
        m = offs < nw
        w = tl.load(src + offs, mask=m, other=0)
        tl.store(dst + offs, w, mask=m)
    sq, bad = _wsums(w)
    tl.store(part_sq + pid, tl.sum(sq, 0))
    tl.store(part_bad + pid, tl.sum(bad, 0))
    if FINISH == 1:
        n = tl.num_programs(0)
        t = tl.atomic_add(ticket, 1, sem="acq_rel")
        if t == n - 1:
            _finish(part_sq, part_bad, stats, n, WIDTH)
            tl.atomic_xchg(ticket, 0)


@triton.jit
def _finish_k(part_sq, part_bad, stats, nparts, WIDTH: tl.constexpr):
    _finish(part_sq, part_bad, stats, nparts, WIDTH)


@triton.jit
def _gs_k(src, dst, part_sq, part_bad, ticket, stats, nw, BLOCK: tl.constexpr, AHEAD: tl.constexpr,
          FINISH: tl.constexpr, WIDTH: tl.constexpr):  # fmt: skip
    """Grid-stride over whole tiles (``nw`` a multiple of BLOCK here), register accumulators."""
    pid = tl.program_id(0)
    g = tl.num_programs(0)
    ntiles = nw // BLOCK
    acc_s = tl.zeros([BLOCK], tl.float32)
    acc_c = tl.zeros([BLOCK], tl.int32)
    r = tl.arange(0, BLOCK)
    t = pid
    if AHEAD:
        o = t.to(tl.int64) * BLOCK + r
        w = tl.load(src + o, mask=o < nw, other=0)
        while t < ntiles:
            nxt = t + g
            o2 = nxt.to(tl.int64) * BLOCK + r
            w2 = tl.load(src + o2, mask=o2 < nw, other=0)
            tl.store(dst + t.to(tl.int64) * BLOCK + r, w)
            s, c = _wsums(w)
            acc_s += s
            acc_c += c
            w = w2
            t = nxt
    else:
        while t < ntiles:
            o = t.to(tl.int64) * BLOCK + r
            w = tl.load(src + o)
            tl.store(dst + o, w)
            s, c = _wsums(w)
            acc_s += s
            acc_c += c
            t += g
    tl.store(part_sq + pid, tl.sum(acc_s, 0))
    tl.store(part_bad + pid, tl.sum(acc_c, 0))
    if FINISH == 1:
        tk = tl.atomic_add(ticket, 1, sem="acq_rel")
        if tk == g - 1:
            _finish(part_sq, part_bad, stats, g, WIDTH)
            tl.atomic_xchg(ticket, 0)


def variants(n_sm: int) -> list[dict[str, Any]]:
    """``finish``: ``1p`` last-ticket finish in the launch, ``2p`` a second launch, ``0p`` partials only
    (the reduction left to whoever reads them)."""
    out: list[dict[str, Any]] = []
    for b, w in ((1024, 8), (2048, 4), (4096, 8)):
        out.append({"kind": "copy", "block": b, "warps": w})
    for b in (2048, 4096, 8192):
        for w in (4, 8):
            for fin in ("1p", "0p"):
                out.append({"kind": "st", "block": b, "warps": w, "finish": fin})
    out += [{"kind": "st", "block": 4096, "warps": 4, "finish": "2p"},
            {"kind": "st", "block": 8192, "warps": 8, "finish": "2p"}]  # fmt: skip
    for b, w in ((512, 4), (1024, 4), (1024, 8)):
        for ahead in (False, True):
            for fin in ("1p", "0p"):
                out.append({"kind": "gs", "block": b, "warps": w, "per_sm": 8, "ahead": ahead, "finish": fin})
    for p in (4, 12, 16):
        out.append({"kind": "gs", "block": 1024, "warps": 4, "per_sm": p, "ahead": True, "finish": "0p"})
    return out


def tag(v: dict[str, Any]) -> str:
    if v["kind"] == "copy":
        return f"copy/b{v['block']}/w{v['warps']}"
    if v["kind"] == "st":
        return f"st/b{v['block']}/w{v['warps']}/{v['finish']}"
    return f"{'gs2' if v['ahead'] else 'gs'}/b{v['block']}/w{v['warps']}/p{v['per_sm']}/{v['finish']}"


class Runner:
    """Scratch for one word count: partials, ticket, stats."""

    def __init__(self, nw: int, device: torch.device, n_sm: int) -> None:
        self.nw = nw
        self.n_sm = n_sm
        self.parts = max(1, nw // 512) + 16 * n_sm
        self.part_sq = torch.zeros(self.parts, dtype=torch.float32, device=device)
        self.part_bad = torch.zeros(self.parts, dtype=torch.int32, device=device)
        self.ticket = torch.zeros(1, dtype=torch.int32, device=device)
        self.stats = torch.zeros(2, dtype=torch.float32, device=device)
        self.grid = 0

    def fn(self, v: dict[str, Any], src: torch.Tensor, dst: torch.Tensor) -> Callable[[], None] | None:
        nw, b = self.nw, v["block"]
        if v["kind"] == "copy":
            grid = (triton.cdiv(nw, b),)
            return lambda: _copy_k[grid](src, dst, nw, BLOCK=b, EVEN=nw % b == 0, num_warps=v["warps"])
        fin = 1 if v["finish"] == "1p" else 0
        if v["kind"] == "st":
            g = triton.cdiv(nw, b)
        elif nw % b:
            return None
        else:
            g = min(self.n_sm * v["per_sm"], nw // b)
        if g > self.parts:
            return None
        self.grid = g

        def run() -> None:
            if v["kind"] == "st":
                _stats_k[(g,)](src, dst, self.part_sq, self.part_bad, self.ticket, self.stats, nw, BLOCK=b,
                               EVEN=nw % b == 0, FINISH=fin, WIDTH=1024, num_warps=v["warps"])  # fmt: skip
            else:
                _gs_k[(g,)](src, dst, self.part_sq, self.part_bad, self.ticket, self.stats, nw, BLOCK=b,
                            AHEAD=v["ahead"], FINISH=fin, WIDTH=1024, num_warps=v["warps"])  # fmt: skip
            if v["finish"] == "2p":
                _finish_k[(1,)](self.part_sq, self.part_bad, self.stats, g, WIDTH=1024, num_warps=4)

        return run


def check(r: Runner, v: dict[str, Any], src: torch.Tensor, dst: torch.Tensor) -> str | None:
    f = r.fn(v, src, dst)
    if f is None:
        return "n/a"
    outs = []
    for _ in range(2):
        dst.zero_()
        r.stats.zero_()
        f()
        if v["kind"] != "copy" and v["finish"] == "0p":  # the reader's reduction, here on the host
            ps, pb = r.part_sq[: r.grid].double().sum(), r.part_bad[: r.grid].double().sum()
            outs.append(torch.stack([ps, pb]).float().cpu())
        else:
            outs.append(r.stats.clone().cpu())
    if not torch.equal(dst, src):
        return "copy differs"
    if v["kind"] == "copy":
        return None
    if not torch.equal(outs[0].view(torch.int32), outs[1].view(torch.int32)):
        return f"not deterministic {outs}"
    x = src.view(torch.bfloat16).double()
    fin = torch.isfinite(x)
    want_bad = float((~fin).sum())
    want_sq = float((x[fin] ** 2).sum())
    sq, bad = outs[0].tolist()
    if bad != want_bad:
        return f"nonfinite {bad} vs {want_bad}"
    if want_bad == 0 and abs(sq - want_sq) > 1e-4 * max(want_sq, 1e-30):
        return f"sumsq {sq} vs {want_sq}"
    return None


def probe_args(doc: str, sizes_mb: list[int], argv: list[str] | None) -> argparse.Namespace | None:
    """The probes' shared command line; ``None`` (after saying why) for ``--cpu-check`` outside the interpreter."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--sizes-mb", type=int, nargs="+", default=sizes_mb)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--cpu-check", action="store_true", help="interpreter correctness check on small sizes")
    a = ap.parse_args(argv)
    if a.cpu_check and os.environ.get("TRITON_INTERPRET") != "1":
        print("--cpu-check needs TRITON_INTERPRET=1", file=sys.stderr)
        return None
    return a


def main(argv: list[str] | None = None) -> int:
    a = probe_args(__doc__, [16, 64, 256], argv)
    if a is None:
        return 2
    if a.cpu_check:
        dev = torch.device("cpu")
        bad = 0
        for nw, nonfinite in ((4096 * 3, True), (4096 * 3 + 5, True), (4096 * 3, False)):
            src = torch.randn(2 * nw).to(torch.bfloat16)
            if nonfinite:
                src[7] = float("inf")
                src[2 * nw - 1] = float("nan")
            src = src.view(torch.int32)
            r = Runner(nw, dev, 2)
            for v in variants(2):
                err = check(r, v, src, torch.empty_like(src))
                if err and err != "n/a":
                    bad += 1
                print(f"{nw:6d} {tag(v):22s} {err or 'ok'}")
        return 1 if bad else 0

    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    n_sm = props.multi_processor_count
    l2 = getattr(props, "L2_cache_size", 50 * MB)
    ceiling = bt.copy_ceiling_gbps(dev)
    print(f"{props.name}: copy ceiling {ceiling:.0f} GB/s, {n_sm} SMs")
    recs: list[dict[str, Any]] = []
    for mb in a.sizes_mb:
        n = mb * MB // 2  # bf16 elements
        nw = n // 2
        n_sets = min(8, max(1, math.ceil(3 * l2 / (4 * n))))
        srcs = [torch.randn(n, device=dev).to(torch.bfloat16).view(torch.int32) for _ in range(n_sets)]
        dst = torch.empty(nw, dtype=torch.int32, device=dev)
        szc = bt.size_matched_copy_gbps(mb, dev, l2, a.reps)
        recs.append({"mb": mb, "variant": "torch copy_ (size-matched)", "gbps": szc, "frac": szc / ceiling})
        print(f"{mb:4d} MB  torch copy_ (size-matched)  {szc:6.0f} GB/s {szc / ceiling:6.1%}")
        r = Runner(nw, dev, n_sm)
        for v in variants(n_sm):
            try:
                err = check(r, v, srcs[0], dst)
                if err == "n/a":
                    continue
                ms = None
                if err is None:
                    fns = [r.fn(v, s, dst) for s in srcs]
                    ms = bt.time_graph_ms(lambda i: fns[i](), n_sets, a.reps)  # noqa: B023
            except Exception as e:  # a variant that fails to compile is recorded, not fatal
                err, ms = f"{type(e).__name__}: {e}"[:200], None
            gb = 4 * n / ms / 1e6 if ms else None
            recs.append({"mb": mb, "variant": tag(v), **v, "error": err, "ms": ms, "gbps": gb,
                         "frac": gb / ceiling if gb else None, "of_size_copy": gb / szc if gb and szc else None})  # fmt: skip
            txt = f"{gb:6.0f} GB/s {gb / ceiling:6.1%}  ({gb / szc:6.1%} of copy_)" if gb else f"error: {err}"
            print(f"{mb:4d} MB  {tag(v):26s} {txt}", flush=True)
        del srcs, dst, r
        torch.cuda.empty_cache()
    if a.out:
        a.out.write_text(
            json.dumps({"device": props.name, "ceiling_gbps": ceiling, "records": recs}, indent=1)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
