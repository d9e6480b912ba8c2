"""Adaptive master deferral in the engine ([Note: adaptive master deferral] in docs/design.md).

Which buckets leave their fp32 master to the commit changes nothing in the numbers (the commit re-runs the step bit
for bit), so a run whose share moves every step must equal the run without deferred stores BITWISE; and the share
must follow what the engine measures: all buckets when the commits always finish early, none when they are always
still pending at the verdict.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

import hf_superoffload.runtime.commit as commit_module
from hf_superoffload import SuperOffloadConfig, SuperOffloadOptimizer
from hf_superoffload import state as st
from hf_superoffload.config import PlannerOverrides
from hf_superoffload.planning.plan import MasterDeferral
from hf_superoffload.runtime.host_pass import HostPass
from hf_superoffload.runtime.master_deferral import MOMENTS_KEPT, DeferralObservation, DeferralSplit
from hf_superoffload.testing import tiny_llama

LR = 1e-3


def build(**kw: Any) -> tuple[torch.nn.Module, SuperOffloadOptimizer]:
    config = SuperOffloadConfig(bucket_size_mb=0.004, gpu_resident_buckets=1, worker_timeout_s=60, speculation=False,
                                cast_side="cpu", **kw)
    model = tiny_llama(seed=0)
    return model, SuperOffloadOptimizer(model, lr=LR, weight_decay=0.1, max_grad_norm=1e-3, config=config,
                                        log_plan=False)


def step(model: torch.nn.Module, opt: SuperOffloadOptimizer, ids: torch.Tensor) -> None:
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


def batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 128, (2, 16), generator=g) for _ in range(n)]


def state(model: torch.nn.Module, opt: SuperOffloadOptimizer) -> dict[str, torch.Tensor]:
    sd = opt.state_dict()["superoffload"]
    out = {f"{side}/{k}": st._whole(t).clone() for side in ("host", "device") for k, t in sd[side].items()}
    out.update({f"model/{n}": p.detach().clone() for n, p in model.named_parameters()})
    return out


def test_a_split_moving_every_step_is_bitwise_the_run_without_deferred_stores(monkeypatch: pytest.MonkeyPatch):
    """Masters and moments alike ([Note: adaptive moment deferral]): a bucket that stores its moments in the pass
    one step and leaves them to the commit the next gives the same bits."""
    model, opt = build()
    assert opt.plan.defer_master is MasterDeferral.ADAPTIVE
    n = len(opt.engine.host_buckets)
    assert n >= 4
    splits = [(n, 0), (n, 1), (n, n // 2), (n, n), (1, 0), (n, 2), (0, 0), (n - 1, 0), (n // 2, 0), (n, n - 1)]
    cycle = itertools.cycle(splits)
    monkeypatch.setattr(commit_module, "next_split", lambda numels, split, obs: DeferralSplit(*next(cycle)))
    eager_model, eager = build(overrides=PlannerOverrides(defer_moments=False))
    seen = []
    for ids in batches(2 * len(splits)):
        step(model, opt, ids)
        step(eager_model, eager, ids)
        st = opt.last_step_stats
        seen.append((st.moment_deferred_buckets, st.master_deferred_buckets))
    assert seen == splits * 2  # the split in force at each step, as the rule set it
    a, b = state(model, opt), state(eager_model, eager)
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs"


def test_work_pending_at_the_verdicts_gives_back_the_moments_and_slack_brings_them_back(
        monkeypatch: pytest.MonkeyPatch):
    """[Note: adaptive moment deferral]: below a master share of none, pending commit work gives back the last
    buckets' moments: their passes store them and owe nothing (here all but the first bucket's, kept so that its
    commits keep the slack measured: far more is pending than they hold). Then commits that finish early bring the
    moments back, and the masters after them."""
    pending = DeferralObservation
    forced = {"verdicts": 3}

    def observed(pending_bytes: float, slack_s: float, rate: float) -> DeferralObservation:
        if forced["verdicts"]:
            forced["verdicts"] -= 1
            return pending(1e12, 0.0, rate)
        return pending(pending_bytes, slack_s, rate)

    monkeypatch.setattr(commit_module, "DeferralObservation", observed)
    owed: list[int] = []  # the share rank of every bucket whose pass left a store to the commit
    owe = HostPass._owe

    def record(self: HostPass, b: Any, *args: Any, **kwargs: Any) -> None:
        owed.append(self.layout.host_rank[b.index])
        owe(self, b, *args, **kwargs)

    monkeypatch.setattr(HostPass, "_owe", record)
    model, opt = build()
    n = len(opt.engine.host_buckets)
    seen = []
    for ids in batches(3):
        step(model, opt, ids)
        st = opt.last_step_stats
        seen.append((st.moment_deferred_buckets, st.master_deferred_buckets))
    opt.synchronize()
    assert n > MOMENTS_KEPT and seen == [(MOMENTS_KEPT, 0)] * 3
    assert owed and set(owed) == set(range(MOMENTS_KEPT)), owed  # only the kept buckets' passes owe commits
    for ids in batches(24)[3:]:
        step(model, opt, ids)
        opt.synchronize()  # the commits finish long before the next verdict: slack
        st = opt.last_step_stats
        seen.append((st.moment_deferred_buckets, st.master_deferred_buckets))
        if seen[-1] == (n, n):
            break
    assert seen[-1] == (n, n), seen
    assert seen == sorted(seen), f"slack only grows the split: {seen}"


def test_commits_that_finish_early_grow_the_share_to_every_bucket():
    model, opt = build()
    n = len(opt.engine.host_buckets)
    data = batches(16)
    shares = []
    for ids in data[:-1]:
        step(model, opt, ids)
        opt.synchronize()  # the commits finish long before the next verdict: slack
        shares.append(opt.engine.commits.master_count)
        if shares[-1] == n:
            break
    assert shares[-1] == n, f"the share never reached every bucket: {shares}"
    assert shares == sorted(shares), f"slack only grows the share: {shares}"
    assert opt.last_step_stats.as_log()["superoffload/master_deferred_buckets"] == n


def test_commits_never_done_early_keep_the_share_at_none():
    model, opt = build()
    # every commit waits for the bucket's next task (its first in the next backward): no idle chain ever ends, so no
    # slack is measured and no master is deferred (work still pending at a verdict may give moments back)
    opt.engine.commit_when_idle = False
    for ids in batches(6):
        step(model, opt, ids)
    assert opt.engine.commits.master_count == 0
    assert opt.last_step_stats.master_deferred_buckets == 0
