"""Double buffer, steps that speculate nothing ([Note: speculation and rollback] in docs/design.md).

With ``rollback="double_buffer"`` a speculative step reads the committed copy and writes the other one, so its
undo is free. A step that speculates nothing (speculation off, or paused by the governor because clipping keeps
firing) is never undone: with ``nonspeculative_in_place`` (the default) it updates the committed copy in place,
which moves less host memory. The numbers must not change: a run with it equals the run that writes the other copy
on every step BITWISE (the kernels' in-place and out-of-place forms are the same arithmetic), through pauses,
probes, redos, skips and deferred commits, and both match the torch reference.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hf_superoffload.config import PlannerOverrides

from .test_deferred_moments import Run, assert_bitwise, assert_matches_reference, batches, cfg


def clip_schedule(step: int) -> float | None:
    """Clipping on most early steps (the governor pauses speculation), then rarely (it probes and resumes)."""
    return 1e-3 if step < 8 or step % 5 == 0 else None


def trace(run: Run, data: list[torch.Tensor], nan_at: frozenset[int] = frozenset()) -> list[tuple[bool, str, int]]:
    """Train on ``data``; per step (speculative, verdict, the committed copy afterwards)."""
    out = []
    for k, ids in enumerate(data):
        run.train([ids], nan=k in nan_at)
        st = run.opt.last_step_stats
        run.opt.synchronize()
        out.append((bool(st.speculative), str(st.verdict), run.opt.engine.layout.cur))
    return out


@pytest.mark.parametrize("speculation", [True, False], ids=["governed", "speculation_off"])
@pytest.mark.parametrize("master", [False, "auto"], ids=["moments", "adaptive_master"])
def test_nonspeculative_steps_write_in_place_and_change_no_number(speculation: bool, master: Any) -> None:
    data = batches(20)
    nan_at = frozenset({3, 15})  # skipped steps: one while paused (or off), one later
    kw: dict[str, Any] = dict(rollback="double_buffer", speculation=speculation, cast_side="cpu")
    governor = PlannerOverrides(max_redo_rate=0.5, redo_window=2, defer_moments=True, defer_master=master)
    in_place = Run(cfg(**kw, overrides=governor), clip=clip_schedule)
    out_of_place = Run(cfg(**kw, overrides=governor.replace(nonspeculative_in_place=False)), clip=clip_schedule)
    ref = Run(None, clip=clip_schedule)
    assert in_place.opt.plan.nonspeculative_in_place and not out_of_place.opt.plan.nonspeculative_in_place

    steps_in, steps_out = trace(in_place, data, nan_at), trace(out_of_place, data, nan_at)
    ref.train([ids for k, ids in enumerate(data) if k not in nan_at])

    assert [s[:2] for s in steps_in] == [s[:2] for s in steps_out]  # the same schedule of verdicts
    speculative = [s for s, _, _ in steps_in]
    if speculation:
        assert any(speculative) and not all(speculative), f"the governor never paused and resumed: {steps_in}"
    else:
        assert not any(speculative)
    cur = 0
    for k, (spec, verdict, after) in enumerate(steps_in):
        flips = spec and verdict != "skip"
        assert after == (1 - cur if flips else cur), f"step {k}: copy {cur} -> {after} ({spec=}, {verdict=})"
        cur = after
    out_cur = 0
    for k, (spec, verdict, after) in enumerate(steps_out):  # out of place: every step that is not skipped flips
        assert after == (out_cur if verdict == "skip" else 1 - out_cur), f"step {k}"
        out_cur = after

    assert_bitwise(in_place.state(), out_of_place.state())
    in_place.losses = [loss for k, loss in enumerate(in_place.losses) if k not in nan_at]
    assert_matches_reference(in_place, ref)
    in_place.opt.close()
    out_of_place.opt.close()


def test_the_plan_keeps_it_to_the_double_buffer() -> None:
    """The inverse rollback has one copy (always in place): the plan says the flag only where it means something."""
    run = Run(cfg(rollback="inverse"), clip=lambda step: 1.0)
    assert not run.opt.plan.nonspeculative_in_place
    run.opt.close()
    with pytest.raises(ValueError, match="nonspeculative_in_place"):
        PlannerOverrides(nonspeculative_in_place="yes")  # type: ignore[arg-type]
