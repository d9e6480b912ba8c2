"""Probe: what does the work-table lookup cost a 16 MB bucket, and what do the statistics? (issue #4, session 12)

Session 11 left the row kernels at 80-83% of the copy ceiling on 16 MB buckets, where a plain Triton copy reaches
88-89% and the stripped copy + spread statistics of ``probe_stats_kernels.py`` 83.5%. A 16 MB bucket of the
benchmark's layouts holds three tensors. This probe runs one-tile-per-program kernels over exactly those three
entries and asks, one change at a time:

* ``args``: each program finds its entry from scalar kernel arguments (cumulative tile counts compared with the
  program id): no memory access before its first data load;
* ``table``: the same record (source offset, destination offset, length, tile index) read from a per-program
  table in device memory first: the row kernels' dependent load;
* ``stats``: the copy with the sum of squares and the non-finite count added into one spread row per program
  (read-modify-write, as the row kernels do); ``flag``: the non-finite count replaced by a flag derived from
  the program's sum of squares (one compare instead of the count arithmetic per word);
* ``cast``: fp32 -> bf16 (RNE on the bits) from the flat bucket into the three entries: the scatter's shape.

Timing as bench_triton's (8 calls per CUDA graph, sources rotated past L2), ceiling its 2 GB ``copy_``. Every
variant is checked (copy exact, statistics against a float64 reference) before it is timed.

    python3 benchmarks/probe_entry_args.py --out $OUT/probe_entries.json        # GPU box, ~1 min
    TRITON_INTERPRET=1 python3 benchmarks/probe_entry_args.py --cpu-check        # correctness only, CPU
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_triton as bt
from probe_stats_kernels import _wsums, probe_args  # the session 11 probe: statistics, command line

MB = 1 << 20
K = 3  # entries passed as arguments


@triton.jit
def _rne_bits(x):
    b = x.to(tl.uint32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    nan = (b & 0x7FFFFFFF) > 0x7F800000
    return tl.where(nan, (b >> 16) | 0x40, r).to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def _add2(a, b, c, d):
    return a + c, b + d


@triton.jit
def _add_or(a, b, c, d):
    return a + c, b | d


@triton.jit
def _tile(src, dst, offs, mask, MODE: tl.constexpr, MASKED: tl.constexpr, EVICT: tl.constexpr, FLAG: tl.constexpr):
    """One tile; returns (sum of squares, count) of what it stored (zeros for MODE 2: no statistics)."""
    if MODE == 2:
        if MASKED:
            x = tl.load(src + offs, mask=mask, other=0.0)
        else:
            x = tl.load(src + offs)
        y = _rne_bits(x)
        if MASKED:
            tl.store(dst + offs, y, mask=mask)
        else:
            tl.store(dst + offs, y)
        return 0.0, 0
    else:
        if MASKED:
            w = tl.load(src + offs, mask=mask, other=0, eviction_policy="evict_first" if EVICT else "")
            tl.store(dst + offs, w, mask=mask)
        else:
            w = tl.load(src + offs, eviction_policy="evict_first" if EVICT else "")
            tl.store(dst + offs, w)
        if MODE == 0:
            if FLAG == 2:  # exact "any non-finite half" per tile: an OR of the carry bits, no count
                lo = (w << 16).to(tl.float32, bitcast=True)
                hi = (w & -65536).to(tl.float32, bitcast=True)
                t = (((w & 0x7F807F80) + 0x00800080) & -2147450880).to(tl.uint32, bitcast=True)  # 0x80008000
                return tl.sum(lo * lo + hi * hi, 0), (tl.max(t, 0) > 0).to(tl.int32)
            sq, bad = _wsums(w)
            if FLAG == 3:  # the exact count, both sums in one reduction (one shared-memory exchange)
                return tl.reduce((sq, bad), 0, _add2)
            if FLAG == 4:  # exact "any non-finite half", joint reduction
                lo = (w << 16).to(tl.float32, bitcast=True)
                hi = (w & -65536).to(tl.float32, bitcast=True)
                t = ((w & 0x7F807F80) + 0x00800080) & -2147450880  # 0x80008000
                return tl.reduce((lo * lo + hi * hi, t), 0, _add_or)
            return tl.sum(sq, 0), tl.sum(bad, 0)
        else:
            return 0.0, 0


@triton.jit(do_not_specialize=["so0", "so1", "so2", "do0", "do1", "do2", "n0", "n1", "n2", "t1", "t2"])
def _ent_k(src, dst, rows, heads, so0, so1, so2, do0, do1, do2, n0, n1, n2, t1, t2,
           BLOCK: tl.constexpr, VS: tl.constexpr, VD: tl.constexpr, MODE: tl.constexpr, TABLE: tl.constexpr,
           FLAG: tl.constexpr, EVICT: tl.constexpr):  # fmt: skip
    """MODE 0: int32 words + statistics into row ``pid`` of ``rows`` ([grid, 2] fp32, added to); 1: words,
    copy only; 2: fp32 -> bf16 (int16). Offsets in elements of ``src`` / ``dst``, multiples of VS / VD (16 bytes)."""
    pid = tl.program_id(0)
    if MODE == 0:
        old_sq = tl.load(rows + 2 * pid)
        old_bad = tl.load(rows + 2 * pid + 1)
    if TABLE:
        h = heads + pid.to(tl.int64) * 4
        so = tl.load(h)
        do = tl.load(h + 1)
        n = tl.load(h + 2)
        i = tl.load(h + 3)
    else:
        a1 = pid >= t1
        a2 = pid >= t2
        so = tl.where(a2, so2, tl.where(a1, so1, so0))
        do = tl.where(a2, do2, tl.where(a1, do1, do0))
        n = tl.where(a2, n2, tl.where(a1, n1, n0))
        i = (pid - tl.where(a2, t2, tl.where(a1, t1, 0))).to(tl.int64)
    so = (so // VS) * VS
    do = (do // VD) * VD
    start = i * BLOCK
    lane = tl.arange(0, BLOCK)
    if start + BLOCK <= n:
        s, c = _tile(src + so + start, dst + do + start, lane, None, MODE, False, EVICT, FLAG)
    else:
        s, c = _tile(src + so + start, dst + do + start, lane, lane < (n - start).to(tl.int32), MODE, True, EVICT, FLAG)
    if MODE == 0:
        if FLAG == 4:
            c = (c != 0).to(tl.int32)
        if FLAG == 1:  # from the tile's sum: a non-finite element, or squares past fp32's range
            c = (s != s) | (s == float("inf"))
        tl.store(rows + 2 * pid, old_sq + s)
        tl.store(rows + 2 * pid + 1, old_bad + c.to(tl.float32))


def variants() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for b, w in ((1024, 4), (2048, 4), (2048, 8), (4096, 8)):
        for table in (False, True):
            out.append({"mode": "copy", "block": b, "warps": w, "table": table})
            out.append({"mode": "stats", "block": b, "warps": w, "table": table})
        out.append({"mode": "stats", "block": b, "warps": w, "table": False, "flag": 1})
        for f in (2, 3, 4):
            out.append({"mode": "stats", "block": b, "warps": w, "table": False, "flag": f})
    out.append({"mode": "stats", "block": 2048, "warps": 4, "table": True, "evict": True})
    for b, w in ((1024, 4), (2048, 4), (2048, 8), (4096, 8)):  # in bf16 elements: 4-8 KB of output per program
        for table in (False, True):
            out.append({"mode": "cast", "block": b, "warps": w, "table": table})
    return out


def tag(v: dict[str, Any]) -> str:
    t = f"{v['mode']}/b{v['block']}/w{v['warps']}/{'table' if v['table'] else 'args'}"
    return t + {0: "", 1: "/flag", 2: "/any", 3: "/joint", 4: "/anyjoint"}[v.get("flag", 0)] + ("/ef" if v.get("evict") else "")


_MODE = {"stats": 0, "copy": 1, "cast": 2}


class Layout:
    """The three entries of one bucket (bf16 element sizes), laid out as the row kernels would address them:
    flatten (copy / stats) reads three separate tensors into one contiguous bucket, the cast reads one
    contiguous fp32 bucket into three separate bf16 tensors. Offsets relative to a base tensor."""

    def __init__(self, sizes: list[int], device: torch.device, n_sets: int) -> None:
        assert len(sizes) == K and all(s % 8 == 0 for s in sizes)
        self.sizes = sizes
        self.n = sum(sizes)
        self.device = device
        # flatten: words (bf16 pairs); sources are separate tensors, one set per rotation
        self.wsizes = [s // 2 for s in sizes]
        self.srcs = [[torch.randn(s, device=device).to(torch.bfloat16).view(torch.int32) for s in sizes]
                     for _ in range(n_sets)]  # fmt: skip
        self.bucket = torch.empty(self.n // 2, dtype=torch.int32, device=device)
        # cast: fp32 buckets (rotated) into three bf16 (int16) tensors
        self.flat32 = [torch.randn(self.n, device=device) for _ in range(n_sets)]
        self.outs = [torch.empty(s, dtype=torch.int16, device=device) for s in sizes]

    @staticmethod
    def _offsets(tensors: list[torch.Tensor], base: torch.Tensor) -> list[int]:
        es = base.element_size()
        offs = [(t.data_ptr() - base.data_ptr()) for t in tensors]
        assert all(o % 16 == 0 for o in offs)
        return [o // es for o in offs]

    def launch(self, v: dict[str, Any], s: int, rows: torch.Tensor) -> Callable[[], None]:
        mode = _MODE[v["mode"]]
        b = v["block"]
        if mode == 2:
            src, dst = self.flat32[s], self.outs[0]
            so = [sum(self.sizes[:k]) for k in range(K)]
            do = self._offsets(self.outs, dst)
            ns, vd = self.sizes, 8
        else:
            src, dst = self.srcs[s][0], self.bucket
            so = self._offsets(self.srcs[s], src)
            do = [sum(self.wsizes[:k]) for k in range(K)]
            ns, vd = self.wsizes, 4
        tiles = [triton.cdiv(x, b) for x in ns]
        t = [sum(tiles[:k]) for k in range(K)]
        grid = sum(tiles)
        heads = torch.tensor(
            [[so[k], do[k], ns[k], i] for k in range(K) for i in range(tiles[k])], dtype=torch.int64
        ).to(self.device)
        assert rows.shape[0] >= grid

        def run() -> None:
            _ent_k[(grid,)](src, dst, rows, heads, *so, *do, *ns, t[1], t[2], BLOCK=b, VS=4, VD=vd, MODE=mode,
                            TABLE=v["table"], FLAG=v.get("flag", 0), EVICT=v.get("evict", False),
                            num_warps=v["warps"])  # fmt: skip

        return run

    def check(self, v: dict[str, Any], rows: torch.Tensor) -> str | None:
        mode = _MODE[v["mode"]]
        outs = []
        for _ in range(2):
            rows.zero_()
            self.bucket.zero_()
            for o in self.outs:
                o.zero_()
            self.launch(v, 0, rows)()
            outs.append(rows.double().sum(0).float().cpu())
        if mode == 2:
            want = self.flat32[0].to(torch.bfloat16).view(torch.int16)
            got = torch.cat(self.outs)
            return None if torch.equal(got, want) else "cast differs"
        if not torch.equal(self.bucket, torch.cat(self.srcs[0])):
            return "copy differs"
        if mode == 1:
            return None
        if not torch.equal(outs[0], outs[1]):
            return "not deterministic"
        x = torch.cat(self.srcs[0]).view(torch.bfloat16).double()
        fin = torch.isfinite(x)
        sq, bad = outs[0].tolist()
        want_bad = float((~fin).sum())
        if v.get("flag"):
            if (bad > 0) != (want_bad > 0):
                return f"flag {bad} vs {want_bad}"
        elif bad != want_bad:
            return f"nonfinite {bad} vs {want_bad}"
        want_sq = float((x[fin] ** 2).sum())
        if want_bad == 0 and abs(sq - want_sq) > 1e-4 * max(want_sq, 1e-30):
            return f"sumsq {sq} vs {want_sq}"
        return None


def main(argv: list[str] | None = None) -> int:
    a = probe_args(__doc__, [16], argv)
    if a is None:
        return 2
    if a.cpu_check:
        dev = torch.device("cpu")
        lay = Layout([4096 + 8, 16, 8192 + 24], dev, 1)
        lay.srcs[0][2].view(torch.bfloat16)[5] = float("inf")
        rows = torch.zeros(64, 2)
        bad = 0
        for v in variants():
            v = {**v, "block": min(v["block"], 1024)}
            err = lay.check(v, rows)
            bad += err is not None
            print(f"{tag(v):30s} {err or 'ok'}")
        return 1 if bad else 0

    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    l2 = getattr(props, "L2_cache_size", 50 * MB)
    ceiling = bt.copy_ceiling_gbps(dev)
    print(f"{props.name}: copy ceiling {ceiling:.0f} GB/s, {props.multi_processor_count} SMs")
    recs: list[dict[str, Any]] = []
    for mb in a.sizes_mb:
        n = mb * MB // 2
        sizes = bt.param_sizes(n, "aligned")
        if len(sizes) != K:
            print(f"{mb} MB: {len(sizes)} entries, the probe takes {K}; skipped")
            continue
        n_sets = min(8, max(1, math.ceil(3 * l2 / (6 * n))))
        lay = Layout(sizes, dev, n_sets)
        rows = torch.zeros(n // 1024 + 16, 2, device=dev)
        szc = bt.size_matched_copy_gbps(mb, dev, l2, a.reps)
        recs.append({"mb": mb, "variant": "torch copy_ (size-matched)", "gbps": szc, "frac": szc / ceiling})
        print(f"{mb:4d} MB  {sizes}  torch copy_ (size-matched) {szc:6.0f} GB/s {szc / ceiling:6.1%}")
        for v in variants():
            nbytes = 6 * n if v["mode"] == "cast" else 4 * n
            try:
                err = lay.check(v, rows)
                ms = None
                if err is None:
                    fns = [lay.launch(v, s, rows) for s in range(n_sets)]
                    ms = bt.time_graph_ms(lambda i: fns[i](), n_sets, a.reps)  # noqa: B023
            except Exception as e:  # a variant that fails to compile is recorded, not fatal
                err, ms = f"{type(e).__name__}: {e}"[:300], None
            gb = nbytes / ms / 1e6 if ms else None
            recs.append({"mb": mb, "variant": tag(v), **v, "error": err, "ms": ms, "gbps": gb,
                         "frac": gb / ceiling if gb else None})  # fmt: skip
            txt = f"{gb:6.0f} GB/s {gb / ceiling:6.1%}" if gb else f"error: {err}"
            print(f"{mb:4d} MB  {tag(v):30s} {txt}", flush=True)
        del lay, rows
        torch.cuda.empty_cache()
    if a.out:
        a.out.write_text(json.dumps({"device": props.name, "ceiling_gbps": ceiling, "records": recs}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
