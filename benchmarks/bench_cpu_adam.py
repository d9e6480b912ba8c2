"""Throughput of the CPU AdamW step: hf_superoffload's fused kernel against torch and DeepSpeed.

Implementations (one fp32 tensor of N params each; p/m/v are fp32):

* ``ours_bf16``        bf16 grad in, bf16 weights out, one fused pass (what the engine runs);
* ``ours_bf16_oop``    the same, out of place: reads p/m/v from one state buffer and writes the next step's
                       state to a second one (double buffering: the two swap every call); large calls stream
                       the destination, so it should move the same 28 B/param as in place;
* ``ours_bf16_only``   the bf16-only pass (``store_moments=False, store_master=False``): reads p/m/v and the bf16
                       grad, writes only the bf16 weights (16 B/param; p/m/v stay as they are, so the state does
                       not advance: the engine commits with a later full step);
* ``ours_fp32``        fp32 grad in, no bf16 copy;
* ``torch_pipeline``   torch's equivalent of ours_bf16: bf16->fp32 grad upcast, ``torch._fused_adamw_``,
                       fp32->bf16 weight cast (three passes);
* ``torch_fused_fp32`` ``torch._fused_adamw_`` alone on an fp32 grad;
* ``deepspeed_fp32`` / ``deepspeed_pipeline``  DeepSpeed CPUAdam alone / with the two casts (if importable);
* ``inplace3``         STREAM-like read+write of three fp32 arrays (the p/m/v pattern): the host roofline.

Effective GB/s counts 28 B/param for every Adam variant (12 B read + 12 B written for p/m/v, plus 2 B bf16
grad in and 2 B bf16 weights out; the fp32 variants move 4 B of grad and no copy, also 28 B), 16 B/param for
``ours_bf16_only`` (what it moves) and 24 B/element for ``inplace3``. ``roofline`` is an implementation's effective GB/s over ``inplace3``'s at the same thread
count; ``vs in-place`` is the in-place twin's time over the out-of-place row's (``ours_bf16`` for
``ours_bf16_oop``; below 1.00x the out-of-place step is slower).

    python benchmarks/bench_cpu_adam.py --quick --out /tmp/bench.json
    python benchmarks/bench_cpu_adam.py --numel 268435456 --threads 8 15 16 --out $OUT/cpu_adam.json

Straggling ([Note: CPU Adam threads] in docs/design.md): ``--schedules static dynamic`` runs every row under each
``HF_SUPEROFFLOAD_CPU_ADAM_SCHEDULE``; ``--contend K`` keeps K busy-spinning processes on the host meanwhile (as the
training, upload and loader threads are in a run); ``--bucket-numel B`` makes the ``ours_*`` rows one call per
B-param slice, as the engine calls the op once per bucket:

    python benchmarks/bench_cpu_adam.py --numel 67108864 --bucket-numel 4194304 --impls ours_bf16 ours_bf16_only \
        --schedules static dynamic --contend 1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from hf_superoffload import cpu_ext, ops

BYTES_PER_PARAM = 28
BYTES_INPLACE3 = 24
BYTES_OTHER = {"inplace3": BYTES_INPLACE3, "ours_bf16_only": 16}
HYPER = ops.AdamWHyper(lr=1e-6, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
IN_PLACE_TWIN = {"ours_bf16_oop": "ours_bf16"}


@dataclass(frozen=True, slots=True)
class Result:
    """One (implementation, thread count) measurement."""

    impl: str
    threads: int
    numel: int
    seconds: float | None
    """Median over the timed repeats; None when the implementation is absent or failed."""
    best_seconds: float | None
    """Fastest repeat (what STREAM reports; less sensitive to other load on the host)."""
    mparam_s: float | None
    """From the median."""
    gb_s: float | None
    """Effective GB/s from the median."""
    note: str = ""
    schedule: str = "dynamic"
    """``HF_SUPEROFFLOAD_CPU_ADAM_SCHEDULE`` during the measurement (the ``ours_*`` and ``inplace3`` rows use it)."""



@dataclass(slots=True)
class Buffers:
    p: torch.Tensor
    m: torch.Tensor
    v: torch.Tensor
    g16: torch.Tensor
    g32: torch.Tensor
    out: torch.Tensor
    alt: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    """The second state buffer of the out-of-place row (separately allocated, so 64-byte aligned)."""
    step: int = 0


def _alloc(numel: int) -> Buffers:
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(numel, generator=gen)
    g32 = torch.randn(numel, generator=gen) * 1e-2
    alt = (p.clone(), torch.zeros(numel), torch.zeros(numel))
    return Buffers(p, torch.zeros(numel), torch.zeros(numel), g32.to(torch.bfloat16), g32,
                   torch.empty(numel, dtype=torch.bfloat16), alt)


def _time(fn: Callable[[], None], repeats: int, warmup: int) -> tuple[float, float]:
    """(median, best) seconds per call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times)


def _impls(b: Buffers, threads: int, bucket: int | None = None) -> dict[str, Callable[[], None] | str]:
    """Callables per implementation, or a string saying why it is absent. ``bucket``: the ``ours_*`` rows make one
    op call per slice of that many params (the engine's per-bucket calls) instead of one call."""

    def next_step() -> int:
        b.step += 1
        return b.step

    def sliced(call: Callable[[slice], None]) -> None:
        n = b.p.numel()
        for start in range(0, n, bucket or n):
            call(slice(start, min(n, start + (bucket or n))))

    def ours_bf16() -> None:
        step = next_step()
        sliced(lambda s: ops.cpu_adamw_step_(b.p[s], b.g16[s], b.m[s], b.v[s], step=step, param_bf16_out=b.out[s],
                                             num_threads=threads, hyper=HYPER))

    def ours_bf16_oop() -> None:
        # Reads (p, m, v), writes alt, then swaps, so the state stays current for the other rows.
        src = (b.p, b.m, b.v)
        ops.cpu_adamw_step_(b.alt[0], b.g16, b.alt[1], b.alt[2], step=next_step(), param_bf16_out=b.out,
                            source=src, num_threads=threads, hyper=HYPER)
        (b.p, b.m, b.v), b.alt = b.alt, src

    def ours_bf16_only() -> None:
        step = next_step()
        sliced(lambda s: ops.cpu_adamw_step_(b.p[s], b.g16[s], b.m[s], b.v[s], step=step, param_bf16_out=b.out[s],
                                             num_threads=threads, store_moments=False, store_master=False, hyper=HYPER))

    def ours_fp32() -> None:
        step = next_step()
        sliced(lambda s: ops.cpu_adamw_step_(b.p[s], b.g32[s], b.m[s], b.v[s], step=step, num_threads=threads,
                                             hyper=HYPER))

    state_step = torch.tensor(1.0)

    def torch_fused(grad: torch.Tensor) -> None:
        state_step.fill_(next_step())
        torch._fused_adamw_(
            [b.p], [grad], [b.m], [b.v], [], [state_step], lr=HYPER.lr, beta1=HYPER.beta1,
            beta2=HYPER.beta2, weight_decay=HYPER.weight_decay, eps=HYPER.eps, amsgrad=False,
            maximize=False,
        )

    def torch_pipeline() -> None:
        b.g32.copy_(b.g16)  # the separate upcast pass
        torch_fused(b.g32)
        b.out.copy_(b.p)  # the separate cast pass

    impls: dict[str, Callable[[], None] | str] = {
        "ours_bf16": ours_bf16,
        "ours_bf16_oop": ours_bf16_oop,
        "ours_bf16_only": ours_bf16_only,
        "ours_fp32": ours_fp32,
        "torch_pipeline": torch_pipeline,
        "torch_fused_fp32": lambda: torch_fused(b.g32),
    }
    impls.update(_deepspeed_impls(b, threads))
    # Own arrays: the STREAM update grows the values without bound, which must not reach p/m/v.
    abc = [torch.ones(b.p.numel()) for _ in range(3)]
    impls["inplace3"] = lambda: torch.ops.hf_superoffload._cpu_bench_inplace3(*abc, threads)
    return impls


def _deepspeed_impls(b: Buffers, threads: int) -> dict[str, Callable[[], None] | str]:
    """DeepSpeed CPUAdam on the same tensors (JIT-builds its op on first use)."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # type: ignore[import-not-found]

        param = torch.nn.Parameter(b.p)  # shares storage with b.p
        opt = DeepSpeedCPUAdam(
            [param], lr=HYPER.lr, betas=HYPER.betas, eps=HYPER.eps,
            weight_decay=HYPER.weight_decay, adamw_mode=True,
        )
    except Exception as exc:  # ImportError, or a failed JIT build
        reason = f"absent ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        return {"deepspeed_fp32": reason, "deepspeed_pipeline": reason}

    def ds_step() -> None:
        param.grad = b.g32
        opt.step()

    def ds_pipeline() -> None:
        b.g32.copy_(b.g16)
        ds_step()
        b.out.copy_(b.p)

    return {"deepspeed_fp32": ds_step, "deepspeed_pipeline": ds_pipeline}


def run(numel: int, thread_counts: list[int], repeats: int, warmup: int, *, schedules: tuple[str, ...] = ("dynamic",),
        impls: tuple[str, ...] | None = None, bucket: int | None = None) -> list[Result]:
    """Measures every implementation (or those named in ``impls``) at every thread count under every schedule, on
    one set of buffers."""
    b = _alloc(numel)
    results: list[Result] = []
    before = os.environ.get(cpu_ext.SCHEDULE_ENV)
    try:
        for schedule in schedules:
            os.environ[cpu_ext.SCHEDULE_ENV] = schedule  # read by our ops on every call
            for threads in thread_counts:
                torch.set_num_threads(threads)  # torch's and DeepSpeed's OpenMP threads; ours take num_threads
                for name, fn in _impls(b, threads, bucket).items():
                    if impls is not None and name not in impls:
                        continue
                    if isinstance(fn, str):
                        results.append(Result(name, threads, numel, None, None, None, None, fn, schedule))
                        continue
                    try:
                        sec, best = _time(fn, repeats, warmup)
                    except Exception as exc:
                        results.append(Result(name, threads, numel, None, None, None, None,
                                              f"failed: {exc!r}"[:200], schedule))
                        continue
                    per = BYTES_OTHER.get(name, BYTES_PER_PARAM)
                    results.append(Result(name, threads, numel, sec, best, numel / sec / 1e6, numel * per / sec / 1e9,
                                          "", schedule))
    finally:
        if before is None:
            os.environ.pop(cpu_ext.SCHEDULE_ENV, None)
        else:
            os.environ[cpu_ext.SCHEDULE_ENV] = before
    return results


def _contenders(k: int) -> list[subprocess.Popen[bytes]]:
    """``k`` processes that spin on a core each until killed (other runnable threads on the Adam's cores)."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(k)]


def _table(results: list[Result]) -> str:
    by_key = {(r.impl, r.threads, r.schedule): r for r in results}
    head = (f"{'impl':<20}{'schedule':>9}{'threads':>8}{'ms':>8}{'best ms':>9}{'Mparam/s':>10}{'GB/s':>7}"
            f"{'vs torch_pipe':>14}{'roofline':>10}{'vs in-place':>12}")
    lines = [head, "-" * len(head)]
    for r in results:
        if r.seconds is None:
            lines.append(f"{r.impl:<20}{r.schedule:>9}{r.threads:>8}  {r.note}")
            continue
        ref = by_key.get(("torch_pipeline", r.threads, r.schedule))
        roof = by_key.get(("inplace3", r.threads, r.schedule))
        vs = f"{ref.seconds / r.seconds:.2f}x" if ref and ref.seconds and r.impl != "inplace3" else ""
        frac = f"{r.gb_s / roof.gb_s:.0%}" if roof and roof.gb_s and r.gb_s and r.impl != "inplace3" else ""
        twin = by_key.get((IN_PLACE_TWIN.get(r.impl, ""), r.threads, r.schedule))
        vs_in = f"{twin.seconds / r.seconds:.2f}x" if twin and twin.seconds else ""
        lines.append(
            f"{r.impl:<20}{r.schedule:>9}{r.threads:>8}{r.seconds * 1e3:>8.1f}{(r.best_seconds or 0) * 1e3:>9.1f}"
            f"{r.mparam_s:>10.0f}{r.gb_s:>7.1f}{vs:>14}{frac:>10}{vs_in:>12}"
        )
    return "\n".join(lines)


def _machine() -> dict[str, object]:
    model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": model,
        "affinity_cores": len(os.sched_getaffinity(0)),
        "torch": torch.__version__,
        "backend": ops.backend(),
        "default_threads": ops.default_num_threads(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=None, help="params per tensor (default 256Mi; 16Mi with --quick)")
    parser.add_argument("--threads", type=int, nargs="+", default=None,
                        help="thread counts (default: the library default and all cores)")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats (median reported)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="small size and few repeats")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--impls", nargs="+", default=None, help="only these rows (e.g. ours_bf16 inplace3)")
    parser.add_argument("--schedules", nargs="+", choices=("dynamic", "static"), default=["dynamic"],
                        help="run every row under each HF_SUPEROFFLOAD_CPU_ADAM_SCHEDULE (default: dynamic)")
    parser.add_argument("--contend", type=int, default=0, help="busy-spinning processes on the host meanwhile")
    parser.add_argument("--bucket-numel", type=int, default=None,
                        help="ours_* rows: one op call per slice of this many params (the engine's buckets)")
    args = parser.parse_args()
    if args.contend < 0 or (args.bucket_numel is not None and args.bucket_numel < 1):
        parser.error("--contend must be >= 0 and --bucket-numel >= 1")

    numel = args.numel or (2**24 if args.quick else 2**28)
    repeats = args.repeats or (5 if args.quick else 10)
    threads = args.threads or sorted({ops.default_num_threads(), len(os.sched_getaffinity(0))})
    machine = _machine()
    print(f"{machine}\nnumel={numel} ({numel / 2**20:.0f} Mi) repeats={repeats} warmup={args.warmup} "
          f"bucket={args.bucket_numel} contenders={args.contend}")
    spinners = _contenders(args.contend)
    try:
        results = run(numel, threads, repeats, args.warmup, schedules=tuple(args.schedules),
                      impls=tuple(args.impls) if args.impls else None, bucket=args.bucket_numel)
    finally:
        for proc in spinners:
            proc.kill()
            proc.wait()
    print(_table(results))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        payload = {"machine": machine, "numel": numel, "repeats": repeats, "bucket_numel": args.bucket_numel,
                   "contenders": args.contend, "results": [asdict(r) for r in results]}
        args.out.write_text(json.dumps(payload, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
