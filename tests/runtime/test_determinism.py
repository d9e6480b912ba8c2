"""Run-to-run determinism ([Note: determinism] in docs/design.md): the same script on the same data gives the same
bits, whatever the CPU Adam's thread count, whether and when buckets were speculated, and the order in which the
buckets' CPU passes finish. Each test trains the same tiny model several times under different schedules (forced
by sleeps in the training thread or in the worker's CPU Adam calls) and compares a hash of the final weights and
of the whole optimizer state, and the gradient norms, bit for bit."""

from __future__ import annotations

import contextlib
import hashlib
import random
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from hf_superoffload import SuperOffloadConfig, SuperOffloadOptimizer, ops
from hf_superoffload.config import PlannerOverrides
from hf_superoffload.runtime.bucket import HostBucket
from hf_superoffload.runtime.host_pass import HostPass, StepContext
from hf_superoffload.testing import tiny_llama

LR = 1e-3
SMALL = {"bucket_size_mb": 0.004, "gpu_resident_buckets": 0}  # ~2k elements per bucket, every bucket on the host


def _digest(opt: SuperOffloadOptimizer, model: torch.nn.Module) -> str:
    """Hash of the final weights and of every tensor of the optimizer state (read after synchronizing)."""
    sd = opt.state_dict()["superoffload"]  # synchronizes: the last step's uploads are done
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().view(-1).view(torch.int16).numpy().tobytes())

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            h.update(x.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                walk(x[k])
        elif isinstance(x, list | tuple):
            for y in x:
                walk(y)

    walk({k: sd[k] for k in ("host", "device", "param_steps")})
    return h.hexdigest()


def _jitter(monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    """Random sleeps before the worker's CPU Adam calls: buckets finish in another order, and the verdict lands
    before some buckets were stepped and after others."""
    rng = random.Random(seed)
    for name in ("cpu_adamw_step_", "cpu_adamw_moments_"):
        real: Callable[..., None] = getattr(ops, name)

        def slow(*args: Any, _real: Callable[..., None] = real, **kwargs: Any) -> None:
            if rng.random() < 0.5:
                time.sleep(rng.random() * 0.006)
            _real(*args, **kwargs)

        monkeypatch.setattr(ops, name, slow)


def _worker_after_the_verdict(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker starts a bucket's first CPU task only once its step's verdict is published: a speculative step
    in which nothing is speculated (the worker arrived too late for every bucket)."""
    real = HostPass.run

    def late(self: HostPass, b: HostBucket, ctx: StepContext) -> None:
        while True:
            with self.lock:
                if ctx.verdict is not None:
                    break
            time.sleep(0.0005)
        real(self, b, ctx)

    monkeypatch.setattr(HostPass, "run", late)


def _train(*, threads: int, speculation: bool, steps: int = 8, max_grad_norm: float | None = None,
           wait_before_step: float = 0.0, accum: int = 1, model_kw: dict[str, Any] | None = None,
           poison_step: int | None = None, drain_before_poison: bool = False,
           bucket_stats: list[torch.Tensor] | None = None, **config: Any) -> tuple[str, list[float], list[Any]]:
    """Train the tiny model; returns the digest, the gradient norms and each step's StepStats.

    ``poison_step``: in that step the first layer's gradient (the last host bucket to arrive but the embedding's)
    is NaN; ``drain_before_poison`` lets the worker speculate every bucket offloaded before it first.
    ``bucket_stats`` receives a copy of each step's per-bucket statistics rows."""
    model = tiny_llama(seed=0, **(model_kw or {}))
    cfg = SuperOffloadConfig(**{**SMALL, **config}, speculation=speculation, cpu_threads=threads)
    opt = SuperOffloadOptimizer(model, lr=LR, weight_decay=0.1, max_grad_norm=max_grad_norm, config=cfg)
    gen = torch.Generator().manual_seed(1)
    norms, stats = [], []
    step = 0

    def poison(g: torch.Tensor) -> torch.Tensor:  # reads the training loop's ``step``
        if step != poison_step:
            return g
        if drain_before_poison:
            opt.engine._worker.drain(60.0)
        return torch.full_like(g, float("nan"))

    if poison_step is not None:
        model.model.layers[0].self_attn.q_proj.weight.register_hook(poison)
    try:
        for step in range(steps):
            for k in range(accum):
                ids = torch.randint(0, 128, (2, 16), generator=gen)
                with opt.no_sync() if k < accum - 1 else contextlib.nullcontext():
                    (model(input_ids=ids, labels=ids).loss / accum).backward()
            if wait_before_step:
                time.sleep(wait_before_step)  # the worker speculates every bucket before the verdict
            opt.step()
            opt.zero_grad()
            if bucket_stats is not None:
                bucket_stats.append(opt.engine.layout.grad_stats.clone())
            st = opt.engine.stats
            norms.append(st.grad_norm)
            stats.append(st)
        return _digest(opt, model), norms, stats
    finally:
        opt.close()


def test_same_bits_whatever_the_threads_speculation_and_timing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Clipping off: a speculative commit equals the verdict-known step, deferred stores and master deferral
    included, so no schedule can change a bit."""
    want, want_norms, _ = _train(threads=1, speculation=False)

    got, norms, stats = _train(threads=2, speculation=True, wait_before_step=0.05)
    assert all(s.speculative and s.verdict == "commit" for s in stats)
    assert sum(s.speculated_buckets for s in stats) > 0 and all(s.wasted_buckets == 0 for s in stats)
    assert (got, norms) == (want, want_norms), "speculated before the verdict"

    for seed, (threads, defer_master) in enumerate([(3, "auto"), (2, True), (1, False)], start=1):
        with monkeypatch.context() as m:
            _jitter(m, seed)
            got, norms, stats = _train(threads=threads, speculation=True,
                                             overrides=PlannerOverrides(defer_master=defer_master))
        assert (got, norms) == (want, want_norms), f"jittered worker, {threads} threads, defer_master={defer_master}"


@pytest.mark.parametrize("rollback", ["double_buffer", "inverse"])
def test_speculative_commit_equals_the_verdict_known_step_each_step(rollback: str) -> None:
    """Every bucket speculated (the verdict waits) against none: the host state after each step is the same. With
    the inverse rollback the speculative passes write the bf16 weights only and the commit is the whole step
    ([Note: deferred speculation])."""
    def states(speculation: bool) -> list[dict[str, torch.Tensor]]:
        model = tiny_llama(seed=0)
        opt = SuperOffloadOptimizer(model, lr=LR, weight_decay=0.1, max_grad_norm=None,
                                    config=SuperOffloadConfig(**SMALL, speculation=speculation, cpu_threads=2,
                                                              rollback=rollback))
        assert opt.plan.deferred_speculation == (rollback == "inverse" and speculation)
        gen = torch.Generator().manual_seed(1)
        out = []
        try:
            for _ in range(4):
                ids = torch.randint(0, 128, (2, 16), generator=gen)
                model(input_ids=ids, labels=ids).loss.backward()
                time.sleep(0.05)
                opt.step()
                opt.zero_grad()
                n_host = len(opt.engine.host_buckets)
                assert opt.engine.stats.speculated_buckets == (n_host if speculation else 0)
                out.append({k: v.clone() for k, v in opt.engine.flat_state()["host"].items()})
        finally:
            opt.close()
        return out

    for step, (a, b) in enumerate(zip(states(True), states(False), strict=True)):
        for k in a:
            assert torch.equal(a[k].view(torch.int32), b[k].view(torch.int32)), f"{k} after step {step}"


def test_clipped_redo_and_double_buffer_undo_are_bit_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """Clipping on: speculated buckets are undone (double buffer: exactly) and stepped again with the clip
    coefficient; the result equals a run that never speculated."""
    want, want_norms, stats = _train(threads=1, speculation=False, max_grad_norm=1.6, rollback="double_buffer")
    assert {s.verdict for s in stats} == {"redo", "commit"}
    got, norms, stats = _train(threads=2, speculation=True, max_grad_norm=1.6, rollback="double_buffer",
                               wait_before_step=0.05, overrides=PlannerOverrides(max_redo_rate=1.0))
    assert sum(s.wasted_buckets for s in stats) > 0  # speculated, then undone
    assert (got, norms) == (want, want_norms)
    with monkeypatch.context() as m:
        _jitter(m, 4)
        got, norms, _ = _train(threads=3, speculation=True, max_grad_norm=1.6, rollback="double_buffer")
    assert (got, norms) == (want, want_norms)


def test_inverse_rollback_never_undoes_without_clipping(monkeypatch: pytest.MonkeyPatch) -> None:
    """The inverse undo is exact only to fp32 rounding, so a run that undid something may differ in the last bits
    from one that did not (docs/reliability.md). Without clipping (finite gradients) nothing is undone: the bits
    are those of the double buffer."""
    want, want_norms, _ = _train(threads=1, speculation=False, rollback="double_buffer")
    with monkeypatch.context() as m:
        _jitter(m, 5)
        got, norms, stats = _train(threads=2, speculation=True, rollback="inverse")
    assert all(s.wasted_buckets == 0 for s in stats) and sum(s.speculated_buckets for s in stats) > 0
    assert (got, norms) == (want, want_norms)


def test_same_bits_whatever_torch_threads() -> None:
    """On a CPU device each bucket's statistics come from the flatten kernel's eager twin. Summed by ``torch.sum``,
    a bucket past torch's parallel grain (32 Ki elements; these hold up to ~260 Ki) was added in per-thread
    partials whose last bit followed ``torch.set_num_threads``, and with clipping the coefficient, so the weights,
    followed it too. The twin adds fixed blocks in a fixed order: 1, 2 and 3 torch threads give the same per-bucket
    statistics, norms, weights and optimizer state, bit for bit."""
    kw: dict[str, Any] = {"steps": 6, "max_grad_norm": 1.0, "threads": 2, "speculation": True,
                          "rollback": "double_buffer", "bucket_size_mb": 2.0,
                          "model_kw": {"hidden_size": 256, "intermediate_size": 1024}}
    prev = torch.get_num_threads()
    runs = {}
    try:
        for torch_threads in (1, 2, 3):
            torch.set_num_threads(torch_threads)
            rows: list[torch.Tensor] = []
            digest, norms, stats = _train(bucket_stats=rows, **kw)
            runs[torch_threads] = digest, norms, [r.view(torch.int32) for r in rows]
    finally:
        torch.set_num_threads(prev)
    assert max(p.numel() for p in tiny_llama(**kw["model_kw"]).parameters()) > 32768  # past the grain
    assert any(s.verdict == "redo" for s in stats), "clipping must fire for the norm to reach the weights"
    want_digest, want_norms, want_rows = runs[1]
    for torch_threads in (2, 3):
        digest, norms, rows = runs[torch_threads]
        for step, (a, b) in enumerate(zip(want_rows, rows, strict=True)):
            assert torch.equal(a, b), f"bucket statistics of step {step}, {torch_threads} torch threads"
        assert norms == want_norms, f"{torch_threads} torch threads"
        assert digest == want_digest, f"{torch_threads} torch threads"


def test_host_accumulation_norm_does_not_depend_on_cpu_threads() -> None:
    """With host accumulation the worker computes the accumulated gradient's sum of squares: it must be the same
    for every CPU Adam thread count (a per-thread partial sum was not), or the clip coefficient moves."""
    kw: dict[str, Any] = {"steps": 3, "accum": 2, "max_grad_norm": 1.0, "speculation": False,
                          "accumulate_on_host": True, "bucket_size_mb": 2.0,
                          "model_kw": {"hidden_size": 256, "intermediate_size": 1024}}
    want, want_norms, _ = _train(threads=1, **kw)
    for threads in (2, 3):
        got, norms, _ = _train(threads=threads, **kw)
        assert norms == want_norms, f"{threads} threads"
        assert got == want, f"{threads} threads"


# speculate on every step, redo or not; the algebraic undo (without deferred stores: no deferred speculation)
INVERSE = {"rollback": "inverse", "threads": 2, "speculation": True,
           "overrides": PlannerOverrides(max_redo_rate=1.0, defer_moments=False)}


def test_inverse_rollback_redo_does_not_depend_on_which_buckets_were_speculated(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Clipping fires on some steps with the inverse rollback ([Note: determinism], [Note: one path per bucket]
    in host_pass.py): a run whose worker speculated every bucket it could before the verdict and one whose worker
    reached every bucket after it give the same masters, moments and bf16 weights, bit for bit."""
    early, early_norms, stats = _train(max_grad_norm=1.6, wait_before_step=0.05, **INVERSE)
    redo = [i for i, s in enumerate(stats) if s.verdict == "redo"]
    assert redo and all(stats[i].speculated_buckets > 0 for i in redo)
    with monkeypatch.context() as m:
        _worker_after_the_verdict(m)
        late, late_norms, stats = _train(max_grad_norm=1.6, **INVERSE)
    assert all(s.speculative and s.speculated_buckets == 0 for s in stats)
    assert late_norms == early_norms
    assert late == early, "the redo's bits depend on which buckets were speculated before the verdict"
    with monkeypatch.context() as m:
        _jitter(m, 6)
        got, norms, _ = _train(max_grad_norm=1.6, **INVERSE)
    assert (got, norms) == (early, early_norms), "jittered worker"


def test_inverse_rollback_skip_does_not_depend_on_which_buckets_were_speculated(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A non-finite gradient in the first layer only, with the inverse rollback: every other bucket speculated
    before the skip (undone) or none (the worker came after the verdict), then more steps: the same bits."""
    early, early_norms, stats = _train(poison_step=3, drain_before_poison=True, **INVERSE)
    assert stats[3].verdict == "skip" and stats[3].speculated_buckets > 0
    with monkeypatch.context() as m:
        _worker_after_the_verdict(m)
        late, late_norms, stats = _train(poison_step=3, **INVERSE)
    assert stats[3].verdict == "skip" and all(s.speculated_buckets == 0 for s in stats)
    assert late_norms[:3] + late_norms[4:] == early_norms[:3] + early_norms[4:]  # the skipped step's norm is NaN
    assert late == early, "the skip's bits depend on which buckets were speculated before the verdict"


def test_deferred_speculation_redo_and_skip_equal_the_double_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    """[Note: deferred speculation]: with deferred stores the inverse rollback's speculative passes leave p, m, v
    alone, so a redo or a skip undoes nothing: clipping on some steps and a NaN in the first layer only give the
    bits of the double buffer without speculation, whether the worker speculated every bucket before the verdict,
    none, or at random times."""
    kw: dict[str, Any] = {"max_grad_norm": 1.6, "poison_step": 3}
    want, want_norms, _ = _train(threads=1, speculation=False, rollback="double_buffer", **kw)
    spec = {"threads": 2, "speculation": True, "rollback": "inverse",
            "overrides": PlannerOverrides(max_redo_rate=1.0)}

    def same(got: str, norms: list[float], what: str) -> None:
        assert norms[:3] + norms[4:] == want_norms[:3] + want_norms[4:], what  # the skipped step's norm is NaN
        assert got == want, what

    early, norms, stats = _train(drain_before_poison=True, wait_before_step=0.05, **spec, **kw)
    assert stats[3].verdict == "skip" and stats[3].speculated_buckets > 0
    assert any(s.verdict == "redo" and s.wasted_buckets > 0 for s in stats)
    same(early, norms, "every bucket speculated before the verdict")
    with monkeypatch.context() as m:
        _worker_after_the_verdict(m)
        late, norms, stats = _train(**spec, **kw)
    assert all(s.speculative and s.speculated_buckets == 0 for s in stats)
    same(late, norms, "the worker after every verdict")
    with monkeypatch.context() as m:
        _jitter(m, 8)
        got, norms, _ = _train(**spec, **kw)
    same(got, norms, "jittered worker")
