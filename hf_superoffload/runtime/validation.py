"""Speculation-then-validation: the verdict at the end of backward, and when to speculate at all.

[Note: speculation and rollback] in docs/design.md.
"""

from __future__ import annotations

import enum
import logging
import math
from collections import deque
from dataclasses import dataclass

from ..cpu_ext import AdamWHyper

__all__ = ["GroupHypers", "SpeculationGovernor", "StepVerdict", "Verdict", "decide"]

logger = logging.getLogger("hf_superoffload")

GroupHypers = tuple[AdamWHyper, ...]
"""One :class:`AdamWHyper` per param group, in ``param_groups`` order (a run of group ``g`` steps with ``[g]``)."""


class StepVerdict(enum.Enum):
    COMMIT = "commit"
    """Finite gradients, no clipping, same hyper-parameters: speculative results stand."""
    REDO = "redo"
    """Clipping fired (or the hyper-parameters changed): undo and step again with the final values."""
    SKIP = "skip"
    """A gradient is non-finite: undo everything; the step never happened."""


@dataclass(frozen=True, slots=True)
class Verdict:
    kind: StepVerdict
    grad_scale: float
    hypers: GroupHypers
    grad_norm: float


def decide(
    *, sumsq: float, nonfinite: bool, max_grad_norm: float | None, hypers: GroupHypers, spec_hypers: GroupHypers | None,
    check_finite: bool, grad_divisor: float = 1.0,
) -> Verdict:
    """The verdict, matching ``clip_grad_norm_(max_norm)`` (coef = max_norm / (norm + 1e-6), clamped to 1).

    ``sumsq`` is of the gradients as held (data parallel: summed over ranks); the gradient the update uses is
    that divided by ``grad_divisor``, so ``grad_scale`` = clip coefficient / ``grad_divisor`` (what a
    speculative step applies when the verdict is COMMIT).
    """
    norm = math.sqrt(sumsq) / grad_divisor if sumsq >= 0 else float("nan")
    if (nonfinite or not math.isfinite(norm)) and check_finite:
        return Verdict(StepVerdict.SKIP, 1.0 / grad_divisor, hypers, float("nan") if nonfinite else norm)
    scale = 1.0
    if max_grad_norm is not None and max_grad_norm > 0:
        coef = max_grad_norm / (norm + 1e-6)
        if coef < 1.0:
            scale = coef
    if scale != 1.0 or (spec_hypers is not None and hypers != spec_hypers):
        return Verdict(StepVerdict.REDO, scale / grad_divisor, hypers, norm)
    return Verdict(StepVerdict.COMMIT, 1.0 / grad_divisor, hypers, norm)


class SpeculationGovernor:
    """Decides whether the next step speculates, from how often recent steps *needed* a redo.

    Every step's verdict is known (speculative or not), so the governor sees the true clip rate even while
    speculation is paused and resumes as soon as clipping becomes rare again, with no probing. A redo costs an
    undo plus an exposed CPU pass; a synchronous step costs only the exposed pass. [Note: speculation and
    rollback] in docs/design.md.
    """

    def __init__(self, *, enabled: bool, max_redo_rate: float, window: int) -> None:
        self.enabled = enabled
        self.max_redo_rate = max_redo_rate
        self._recent: deque[bool] = deque(maxlen=window)
        self.redo_steps = 0
        self.steps = 0
        self.speculative_steps = 0
        self.pauses = 0
        self._paused = False

    def speculate_next(self) -> bool:
        return self.enabled and not self._paused

    def record(self, *, speculated: bool, verdict: StepVerdict) -> None:
        redo = verdict is StepVerdict.REDO
        self.steps += 1
        self.redo_steps += int(redo)
        self.speculative_steps += int(speculated)
        self._recent.append(redo)
        redos, window = sum(self._recent), len(self._recent)
        paused = redos / window > self.max_redo_rate
        if self.enabled and paused != self._paused:  # why the CPU pass is (no longer) exposed: users ask
            if paused:
                logger.info("hf_superoffload: speculation paused: clipping fired (or the hyper-parameters changed) on "
                            "%d of the last %d steps, above max_redo_rate=%g; each step's CPU pass now runs after its "
                            "backward, and speculation resumes when clipping gets rarer (docs/tuning.md)",
                            redos, window, self.max_redo_rate)
            else:
                logger.info("hf_superoffload: speculation resumed: %d of the last %d steps needed a redo", redos, window)
        self.pauses += int(paused and not self._paused)
        self._paused = paused

    def state_dict(self) -> dict[str, object]:
        return {"recent": list(self._recent), "redo_steps": self.redo_steps, "steps": self.steps,
                "speculative_steps": self.speculative_steps, "pauses": self.pauses, "paused": self._paused}

    def load_state_dict(self, sd: dict[str, object]) -> None:
        self._recent.clear()
        self._recent.extend(bool(x) for x in sd["recent"])  # type: ignore[union-attr]
        self.redo_steps, self.steps = int(sd["redo_steps"]), int(sd["steps"])  # type: ignore[arg-type]
        self.speculative_steps, self.pauses = int(sd["speculative_steps"]), int(sd["pauses"])  # type: ignore[arg-type]
        self._paused = bool(sd["paused"])

    @property
    def paused(self) -> bool:
        """Speculation is paused: too many recent steps needed a redo."""
        return self._paused

    @property
    def redo_rate(self) -> float:
        """Fraction of all steps whose verdict needed a redo (clipping fired or hyper-parameters changed)."""
        return self.redo_steps / self.steps if self.steps else 0.0
