"""Op-level behaviour of the CPU Adam library: schemas (opcheck), contracts, threads, sumsq, ISA choice."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tempfile

import pytest
import torch

from hf_superoffload import cpu_ext, ops
from hf_superoffload.ops import AdamWHyper

HYPER = AdamWHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def _tensors(n: int, grad_dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(n)
    return [
        torch.randn(n, generator=gen), torch.randn(n, generator=gen).to(grad_dtype),
        torch.randn(n, generator=gen), torch.rand(n, generator=gen),
    ]


@pytest.mark.parametrize("with_optionals", [False, True])
def test_opcheck_step(compiled: None, with_optionals: bool) -> None:
    n = 37
    p, g, m, v = _tensors(n)
    out = torch.empty(n, dtype=torch.bfloat16) if with_optionals else None
    # With the optionals the step is out of place: p/m/v become pure outputs of the source.
    src = [torch.randn(n), torch.randn(n), torch.rand(n)] if with_optionals else [None, None, None]
    args = (p, g, m, v, 2, 1e-3, 0.9, 0.999, 1e-8, 0.01, 0.5, out, *src, 1)
    torch.library.opcheck(torch.ops.hf_superoffload.cpu_adamw_step.default, args)


def test_opcheck_undo_and_sumsq(compiled: None) -> None:
    p, g, m, v = _tensors(41, torch.float32)
    out = torch.empty(41, dtype=torch.bfloat16)
    torch.library.opcheck(
        torch.ops.hf_superoffload.cpu_adamw_undo.default, (p, g, m, v, 2, 1e-3, 0.9, 0.999, 1e-8, 0.01, 1.0, out, 1)
    )
    torch.library.opcheck(torch.ops.hf_superoffload.grad_sumsq_nonfinite.default, (g.bfloat16(), 1))


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda t: t.__setitem__(0, t[0].half()), "float32"),
        (lambda t: t.__setitem__(1, t[1].int()), "float32 or bfloat16"),
        (lambda t: t.__setitem__(2, torch.empty(2 * t[2].numel())[::2]), "contiguous"),
        (lambda t: t.__setitem__(3, torch.rand(t[3].numel() + 1)), "elements"),
        (lambda t: t.__setitem__(3, t[2]), "share memory"),
    ],
)
def test_contract_violations_raise(compiled: None, mutate, match: str) -> None:  # type: ignore[no-untyped-def]
    ts = _tensors(16)
    mutate(ts)
    with pytest.raises(RuntimeError, match=match):
        ops.cpu_adamw_step_(*ts, step=1, hyper=HYPER)


_N = 2**16 + 3  # large enough for several threads and the SIMD body, so a check behind the kernel would show


def _violations() -> list[tuple[str, dict, str]]:
    """(op, what to change in its arguments, the whole first line of the error): every numeric message."""
    n = _N
    return [
        ("step", {"grad": torch.randn(n + 1).bfloat16()}, f"grad has {n + 1} elements, expected {n} (as param)"),
        ("step", {"param_bf16_out": torch.zeros(n - 1, dtype=torch.bfloat16)},
         f"param_bf16_out has {n - 1} elements, expected {n} (as param)"),
        ("step", {"source": (torch.randn(n), torch.randn(n), torch.rand(n + 1))},
         f"src_exp_avg_sq has {n + 1} elements, expected {n} (as param)"),
        ("step", {"step": 0}, "step must be >= 1 (the count after this update), got 0"),
        # beta = 0 is a valid AdamWHyper (torch's range), but the op refuses it: its undo divides by beta
        ("step", {"hyper": dataclasses.replace(HYPER, beta2=0.0)}, "betas must lie in (0, 1), got 0.9, 0"),
        ("undo", {"exp_avg": torch.randn(n + 1)}, f"exp_avg has {n + 1} elements, expected {n} (as param)"),
        ("moments", {"exp_avg_sq": torch.rand(n + 1)}, f"exp_avg_sq has {n + 1} elements, expected {n} (as param)"),
        ("moments", {"hyper": dataclasses.replace(HYPER, beta1=0.0)}, "betas must lie in (0, 1), got 0, 0.999"),
    ]


@pytest.mark.parametrize(("op", "change", "message"), _violations(),
                         ids=[f"{op}-{next(iter(change))}" for op, change, _ in _violations()])
def test_rejected_call_writes_nothing_and_names_the_numbers(isa: str, op: str, change: dict, message: str) -> None:
    """Every contract check runs before any kernel work, on every SIMD path; the message keeps its numbers (the
    H200 box crashed formatting them: [Note: one libstdc++ per process] in cpu_ext/_build.py)."""
    p, g, m, v = _tensors(_N)
    args = {"param": p, "grad": g, "exp_avg": m, "exp_avg_sq": v, "param_bf16_out": torch.zeros(_N, dtype=torch.bfloat16),
            "step": 2, "hyper": HYPER, "num_threads": 2, **change}
    outputs = [args["param"], args["exp_avg"], args["exp_avg_sq"], args["param_bf16_out"]]
    before = [t.clone() for t in outputs]
    with pytest.raises(RuntimeError) as info:
        if op == "step":
            ops.cpu_adamw_step_(args.pop("param"), args.pop("grad"), args.pop("exp_avg"), args.pop("exp_avg_sq"), **args)
        elif op == "undo":
            ops.cpu_adamw_undo_(args.pop("param"), args.pop("grad"), args.pop("exp_avg"), args.pop("exp_avg_sq"), **args)
        else:
            ops.cpu_adamw_moments_(args["grad"], args["exp_avg"], args["exp_avg_sq"], hyper=args["hyper"],
                                   num_threads=2)
    assert str(info.value).splitlines()[0] == message
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(outputs, before)), (
        "a rejected call wrote an output"
    )


def test_step_zero_raises(compiled: None) -> None:
    with pytest.raises(RuntimeError, match="step must be >= 1"):
        ops.cpu_adamw_step_(*_tensors(16), step=0, hyper=HYPER)


def test_bad_source_raises(compiled: None) -> None:
    p, g, m, v = _tensors(16)
    with pytest.raises(ValueError, match="three tensors"):
        ops.cpu_adamw_step_(p, g, m, v, step=1, source=(torch.empty(16),), hyper=HYPER)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="all three source tensors or none"):
        torch.ops.hf_superoffload.cpu_adamw_step(
            p, g, m, v, 1, 1e-3, 0.9, 0.999, 1e-8, 0.0, 1.0, None, torch.empty(16), None, None, 1
        )
    with pytest.raises(RuntimeError, match="src_exp_avg must be float32"):
        ops.cpu_adamw_step_(p, g, m, v, step=1, source=(torch.empty(16), g, torch.empty(16)), hyper=HYPER)
    with pytest.raises(RuntimeError, match="src_exp_avg_sq has 17 elements"):
        ops.cpu_adamw_step_(p, g, m, v, step=1, source=(torch.empty(16), m, torch.empty(17)), hyper=HYPER)


def test_overlapping_source_raises(compiled: None) -> None:
    p, g, m, v = _tensors(16)
    before = [t.clone() for t in (p, m, v)]
    # Overlapping its own destination by part: neither in place nor out of place.
    buf = torch.randn(40)
    with pytest.raises(ValueError, match="src_param partially overlaps param"):
        ops.cpu_adamw_step_(buf[:16], g, m, v, step=1, source=(buf[8:24], torch.empty(16), torch.empty(16)), hyper=HYPER)
    with pytest.raises(ValueError, match="src_exp_avg_sq partially overlaps exp_avg_sq"):
        ops.cpu_adamw_step_(p, g, m, buf[:16], step=1, source=(torch.empty(16), m, buf[1:17]), hyper=HYPER)
    # Sharing memory with another destination, another source, grad or the bf16 copy.
    raw = torch.empty(16)
    shared_grad = raw[:8].view(torch.bfloat16)  # 16 bf16 over the first half of raw
    for args, source, match in (
        ((p, g, m, v), (m, torch.empty(16), torch.empty(16)), "exp_avg and src_param"),
        ((p, g, m, v), (torch.empty(16), raw, raw), "src_exp_avg and src_exp_avg_sq"),
        ((p, shared_grad, m, v), (raw, torch.empty(16), torch.empty(16)), "grad and src_param"),
    ):
        with pytest.raises(RuntimeError, match=match):
            ops.cpu_adamw_step_(*args, step=1, source=source, hyper=HYPER)  # type: ignore[arg-type]
    out = raw[8:].view(torch.bfloat16)
    with pytest.raises(RuntimeError, match="param_bf16_out and src_param"):
        ops.cpu_adamw_step_(p, g, m, v, step=1, param_bf16_out=out, source=(raw, torch.empty(16), torch.empty(16)),
                            hyper=HYPER)
    # Rejected before any write.
    assert all(torch.equal(a, b) for a, b in zip((p, m, v), before))


def test_source_identical_to_destination_is_in_place(compiled: None) -> None:
    base = _tensors(1000)
    p, g, m, v = (t.clone() for t in base)
    ops.cpu_adamw_step_(p, g, m, v, step=2, source=(p, m, v), hyper=HYPER)
    q, _, mm, vv = (t.clone() for t in base)
    ops.cpu_adamw_step_(q, g, mm, vv, step=2, hyper=HYPER)
    assert torch.equal(torch.cat([p, m, v]), torch.cat([q, mm, vv]))


def test_forced_isa_unknown_or_unsupported_raises(compiled: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_ext.ISA_ENV, "avx1024")
    with pytest.raises(RuntimeError, match="unknown ISA"):
        ops.cpu_adamw_step_(*_tensors(8), step=1, hyper=HYPER)
    foreign = "neon" if "avx2" in torch.ops.hf_superoffload.cpu_adam_supported_isas() else "avx2"
    monkeypatch.setenv(cpu_ext.ISA_ENV, foreign)
    with pytest.raises(RuntimeError, match="not supported"):
        ops.backend()


def test_backend_reports_the_forced_and_the_best_path(isa: str, monkeypatch: pytest.MonkeyPatch) -> None:
    assert ops.backend() == isa
    monkeypatch.delenv(cpu_ext.ISA_ENV)
    best = torch.ops.hf_superoffload.cpu_adam_supported_isas()[-1]
    assert ops.backend() == best


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [0, 1, 7, 1023, 2**20 + 3])
@pytest.mark.parametrize("n_bad", [0, 3])
def test_grad_sumsq_nonfinite_matches_torch(isa: str, dtype: torch.dtype, n: int, n_bad: int) -> None:
    g = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 5).to(dtype)
    bad = [float("nan"), float("inf"), float("-inf")][:n_bad] if n else []
    for k, value in enumerate(bad):
        g[(k * 7919) % n] = value
    sumsq, nonfinite = ops.grad_sumsq_nonfinite(g, num_threads=2)
    assert nonfinite == int((~torch.isfinite(g)).sum())
    want = float(g.double().square().sum())
    if nonfinite:
        assert sumsq != sumsq or sumsq == float("inf")
    else:
        assert sumsq == pytest.approx(want, rel=1e-12, abs=0.0)


def test_threads_partition_gives_identical_results(compiled: None) -> None:
    n = 2**20 + 3
    base = _tensors(n)
    results = []
    for threads in (1, 2, 3):
        p, g, m, v = (t.clone() for t in base)
        out = torch.empty(n, dtype=torch.bfloat16)
        ops.cpu_adamw_step_(p, g, m, v, step=2, param_bf16_out=out, num_threads=threads, hyper=HYPER)
        results.append(torch.cat([p, m, v, out.float()]))
    assert torch.equal(results[0], results[1])
    assert torch.equal(results[0], results[2])


def test_default_threads_ignore_omp_num_threads(compiled: None) -> None:
    """accelerate sets OMP_NUM_THREADS=1; the op's team size must not follow it."""
    code = (
        "import torch; from hf_superoffload import ops; ops.backend();"
        "print(torch.ops.hf_superoffload._cpu_adam_team_size(3),"
        " torch.ops.hf_superoffload._cpu_adam_default_threads(), ops.default_num_threads())"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # cwd: a checkout's root would shadow the installed (or staged) package, which alone holds cpu_ext
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                         cwd=tempfile.gettempdir())
    team, cpp_default, py_default = map(int, res.stdout.split())
    assert team == 3
    assert cpp_default == py_default == max(1, len(os.sched_getaffinity(0)) - 1)


def test_num_threads_must_be_positive() -> None:
    with pytest.raises(ValueError, match="num_threads"):
        ops.cpu_adamw_step_(*_tensors(4), step=1, num_threads=0, hyper=HYPER)


def _all_elementwise_ops(n: int, threads: int) -> torch.Tensor:
    """Every elementwise op once (in place with a bf16 copy, out of place without the moments, the moment commit,
    undo) on the same seeded state; their outputs, concatenated."""
    p, g, m, v = _tensors(n)
    out = torch.empty(n, dtype=torch.bfloat16)
    ops.cpu_adamw_step_(p, g, m, v, step=3, param_bf16_out=out, num_threads=threads, hyper=HYPER)
    dst = [torch.empty(n), torch.empty(n), torch.empty(n)]
    ops.cpu_adamw_step_(*dst[:1], g, *dst[1:], step=4, source=(p, m, v), store_moments=False, num_threads=threads,
                        hyper=HYPER)
    ops.cpu_adamw_moments_(g, dst[1], dst[2], hyper=HYPER, source=(m, v), num_threads=threads)
    ops.cpu_adamw_undo_(p, g, m, v, step=3, num_threads=threads, hyper=HYPER)
    return torch.cat([out.float(), *dst, p, m, v])


@pytest.mark.parametrize("n", [1, 4099, 32 * 1024 * 7 + 5, 2**20 + 3])
def test_dynamic_chunks_match_static_slices_bitwise(compiled: None, monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """[dynamic chunks]: the elementwise ops give bit-identical results however the range is shared."""
    results = {}
    for schedule in ("static", "dynamic"):
        monkeypatch.setenv(cpu_ext.SCHEDULE_ENV, schedule)
        for threads in (1, 3):
            results[schedule, threads] = _all_elementwise_ops(n, threads)
    want = results["static", 1]
    for key, got in results.items():
        assert torch.equal(got, want), key


def test_unknown_schedule_raises_with_the_choices(compiled: None, monkeypatch: pytest.MonkeyPatch) -> None:
    ts = _tensors(8)
    before = [t.clone() for t in ts]
    monkeypatch.setenv(cpu_ext.SCHEDULE_ENV, "guided")
    with pytest.raises(ValueError, match=r"'dynamic' .*or 'static'"):
        ops.cpu_adamw_step_(*ts, step=1, hyper=HYPER)
    assert all(torch.equal(a, b) for a, b in zip(ts, before, strict=True))  # nothing was touched
