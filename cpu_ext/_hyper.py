"""``AdamWHyper``: the one signature of every AdamW function in the package.

[Note: one AdamW signature]
The same update runs in five places: the compiled CPU op (``hf_superoffload.ops``), its torch fallback, its eager
twin (``cpu_ext/reference.py``), the Triton kernel of the GPU tail and that kernel's twin. The runtime calls them
from four more (the host pass, its undo, the moment commit, the device tail). Passing lr, beta1, beta2, eps and
weight_decay as five loose scalars, or as a positional 5-tuple unpacked at each call, wrote that signature out at
every site, and a swap of two floats there (eps for weight_decay, one group's betas for another's) type-checks and
runs. As ``torch.optim.adamw.adamw`` has one keyword signature for its foreach and fused implementations, every
AdamW function here takes one frozen ``hyper=AdamWHyper(...)``: the fields are named once, validated once at
construction (a bad value is refused before any state changes, with the fix in the message), compared whole
(the verdict's "did the hyper-parameters change since the speculative step" is ``==``), and hashable.

What is not in it, on purpose:
* ``step``: the hyper-parameters belong to a param group, the step count to a slice of parameters (one group's
  parameters may have stepped different numbers of times: a parameter without a gradient does not step), so it
  travels beside ``hyper``. The bias corrections derive from both: :meth:`AdamWHyper.bias_correction1`/``2``.
* ``grad_scale``: a per-step value of the verdict (the clip coefficient, the data-parallel divisor), a float or a
  device tensor.
* the torch ops' own schemas keep scalars (torch ops take scalars); ``ops.py`` converts at its one wrapper.

Importable from both halves of the package without a cycle: it depends on nothing but the standard library.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["AdamWHyper", "require_hyper"]

_FIELDS = ("lr", "beta1", "beta2", "eps", "weight_decay")


@dataclass(frozen=True, kw_only=True, slots=True)
class AdamWHyper:
    """The hyper-parameters of one ``torch.optim.AdamW`` update (decoupled weight decay, bias correction).

    Values are stored as Python floats (anything ``float()`` reads is accepted); the ranges are those the
    optimizer accepts for a param group.

    Attributes:
        lr: learning rate, finite, >= 0.
        beta1: decay of the first moment (``exp_avg``), in [0, 1).
        beta2: decay of the second moment (``exp_avg_sq``), in [0, 1).
        eps: added to the bias-corrected ``sqrt(exp_avg_sq)``, finite, > 0.
        weight_decay: decoupled: the parameter is multiplied by ``1 - lr * weight_decay`` first; finite, >= 0.
    """

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float

    def __post_init__(self) -> None:
        raw = {name: getattr(self, name) for name in _FIELDS}
        for name, value in raw.items():
            try:
                number = float(value)
            except (TypeError, ValueError):
                raise ValueError(f"{name}={value!r} is not a number: pass a float") from None
            object.__setattr__(self, name, number)  # frozen: __post_init__ is the one place that sets fields
        inf = math.inf
        if not 0 <= self.lr < inf:
            raise ValueError(f"lr={raw['lr']!r} is invalid: use a finite learning rate >= 0")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError(f"betas={(raw['beta1'], raw['beta2'])!r} are invalid: both must lie in [0, 1)")
        if not 0 < self.eps < inf:
            raise ValueError(f"eps={raw['eps']!r} is invalid: use a small positive number such as 1e-8")
        if not 0 <= self.weight_decay < inf:
            raise ValueError(f"weight_decay={raw['weight_decay']!r} is invalid: use a finite value >= 0")

    @property
    def betas(self) -> tuple[float, float]:
        """``(beta1, beta2)``, as ``torch.optim.AdamW`` spells them."""
        return self.beta1, self.beta2

    def bias_correction1(self, step: int) -> float:
        """``1 - beta1**step`` (the host scalar, in double, as torch computes it); ``step`` counts this update."""
        return 1.0 - self.beta1**step

    def bias_correction2(self, step: int) -> float:
        """``1 - beta2**step``; its square root divides ``sqrt(exp_avg_sq)``."""
        return 1.0 - self.beta2**step


def require_hyper(hyper: Any) -> AdamWHyper:
    """``hyper`` itself when it is an :class:`AdamWHyper`; a ``ValueError`` naming the fix otherwise (a tuple or
    loose floats from before the one signature)."""
    if not isinstance(hyper, AdamWHyper):
        raise ValueError(f"hyper must be an AdamWHyper, got {type(hyper).__name__}: pass "
                         "hyper=AdamWHyper(lr=..., beta1=..., beta2=..., eps=..., weight_decay=...)")
    return hyper
