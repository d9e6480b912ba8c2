#!/usr/bin/env python
"""Compile row-kernel variants for a CUDA target without a GPU and report what the hardware would run.

For each launch config (``_configs.sweep_candidates`` of a family, or ``--tags``) and dtype pair it compiles
the row kernel exactly as the launcher would (same constexprs, ``num_warps``, 16-byte pointer
specialisation) for ``--arch`` (90: H100 / H200) with the installed Triton's own ptxas, and prints the
registers per thread, the programs per SM that fit (CUDA occupancy rules), spills, and per loop of the
SASS: instructions, 16-byte loads / stores, 2-byte loads / stores and barriers (a ``BAR.SYNC`` inside a
copy loop is a shared-memory layout exchange per tile).

Register counts depend on the Triton version: use the GPU box's (the H200 runs of 2026-11 had 3.6.0), e.g.
``pip install --target /tmp/t36 --no-deps triton==3.6.0`` and ``PYTHONPATH=/tmp/t36``. Needs no driver.

Example: ``python -P benchmarks/triton_offline_sass.py --family flatten --pairs bf16:bf16 fp32:bf16 --stats``
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

_KINDS = {"fp32": 0, "bf16": 1, "fp16": 2}
_PTR = {0: "*fp32", 1: "*i16", 2: "*fp16"}


def compile_variant(cfg: object, src_kind: int, dst_kind: int, stats: bool, stochastic: bool, arch: int) -> object:
    """The compiled row kernel for one config and dtype pair (``triton.compile``, no launch)."""
    import triton
    from hf_superoffload.triton_kernels import _kernels
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    meta = _kernels._meta(cfg, src_kind, dst_kind, stats, stochastic)  # type: ignore[arg-type]
    fn = _kernels._rows_fn(cfg)  # type: ignore[arg-type]
    second = ("heads_ptr", "*i64") if cfg.kernel == 2 else ("starts_ptr", "*i32")  # type: ignore[attr-defined]
    sig = {"table_ptr": "*i64", second[0]: second[1], "src_base_ptr": _PTR[src_kind],
           "dst_base_ptr": _PTR[dst_kind], "part_sq_ptr": "*fp32", "part_bad_ptr": "*i32", "part_base": "i32",
           "counter_ptr": "*i32", "stats_ptr": "*fp32", "k0": "i32", "k1": "i32", "rng_offset": "i64"}  # fmt: skip
    sig.update({k: "constexpr" for k in meta})
    names = list(sig)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n].startswith("*")}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in meta.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": cfg.warps})  # type: ignore[attr-defined]


def sass_report(compiled: object) -> tuple[dict[str, int], list[dict[str, int]]]:
    """``(totals, loops)`` from the cubin: registers, spills; per backward branch (a loop) its counts."""
    import triton

    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])  # type: ignore[attr-defined]
        res = subprocess.run([f"{tools}/cuobjdump", "-res-usage", path], capture_output=True, text=True).stdout
        sass = subprocess.run([f"{tools}/cuobjdump", "-sass", path], capture_output=True, text=True).stdout
    regs = int(m.group(1)) if (m := re.search(r"REG:(\d+)", res)) else -1
    ins = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    at = {a: i for i, (a, _) in enumerate(ins)}
    pats = {"ldg16B": r"LDG\.E\.128", "stg16B": r"STG\.E\.128", "ldg2B": r"LDG\.E\.(U|S)16",
            "stg2B": r"STG\.E\.U16", "bar": r"BAR\.SYNC"}  # fmt: skip
    loops = []
    for i, (a, text) in enumerate(ins):
        m = re.search(r"BRA (0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < a and int(m.group(1), 16) in at:
            body = [t for _, t in ins[at[int(m.group(1), 16)] : i + 1]]
            loops.append({"instr": len(body), **{k: sum(bool(re.search(p, t)) for t in body) for k, p in pats.items()}})
    spills = len(re.findall(r"\b(STL|LDL)\b", sass))
    return {"regs": regs, "spill_ops": spills}, loops


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit status."""
    os.environ.pop("TRITON_INTERPRET", None)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="flatten", choices=["flatten", "scatter", "scatter_sr"])
    ap.add_argument("--tags", nargs="*", help="only these config tags (default: the family's sweep candidates)")
    ap.add_argument("--extra", nargs="*", default=[], help="RowsConfig(...) expressions to compile as well")
    ap.add_argument("--pairs", nargs="+", default=["bf16:bf16"], help="SRC:DST dtype pairs, e.g. fp32:bf16")
    ap.add_argument("--stats", action="store_true", help="with statistics (flatten)")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--loops", action="store_true", help="print every loop, not only the totals")
    ap.add_argument("--json", help="also write the records (config, pair, totals, loops) to this file")
    args = ap.parse_args(argv)
    from hf_superoffload.triton_kernels import _configs

    cfgs = _configs.sweep_candidates(args.family)
    if args.tags is not None:
        cfgs = [c for c in cfgs if c.tag in set(args.tags)]
    cfgs += [eval(x, {"RowsConfig": _configs.RowsConfig}) for x in args.extra]
    import triton

    print(f"triton {triton.__version__}, sm_{args.arch}")
    records = []
    for cfg in cfgs:
        for pair in args.pairs:
            s, d = (_KINDS[k] for k in pair.split(":"))
            try:
                tot, loops = sass_report(compile_variant(cfg, s, d, args.stats, args.family == "scatter_sr", args.arch))
            except Exception as e:  # a variant that does not compile: say so, go on
                print(f"{cfg.tag:24s} {pair:10s} FAILED {type(e).__name__}: {str(e)[:200]}")
                continue
            fit = _configs.max_resident_programs(warps=cfg.warps, regs_per_thread=tot["regs"], shared_bytes=0)
            records.append({"config": cfg.tag, "pair": pair, **tot, "fit_per_sm": fit, "loops": loops})
            barred = sum(1 for lp in loops if lp["bar"])
            print(f"{cfg.tag:24s} {pair:10s} regs {tot['regs']:3d}  fit/SM {fit:2d}  spill ops {tot['spill_ops']}  "
                  f"loops {len(loops)} ({barred} with barriers)")  # fmt: skip
            for lp in loops if args.loops else []:
                print("    " + "  ".join(f"{k} {v}" for k, v in lp.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"triton": triton.__version__, "arch": args.arch, "records": records}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
