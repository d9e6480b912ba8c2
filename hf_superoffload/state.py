"""Checkpoint format of the offloaded optimizer state.

The state is saved as whole flat arenas (one tensor per kind and placement) plus the layout that maps each
parameter to its slice, so ``torch.save`` writes each arena once and ``load`` copies *into* the existing
(possibly page-locked) buffers, never adopting the incoming tensors. A different plan (say, another
GPU-resident tail) is converted parameter by parameter; a different model is refused.
"""

from __future__ import annotations

from typing import Any

import torch

from .planning.plan import Placement
from .runtime.engine import OffloadEngine

__all__ = ["FORMAT", "engine_state_dict", "load_engine_state"]

FORMAT = "hf_superoffload.optimizer.v1"
_KINDS = ("master", "exp_avg", "exp_avg_sq")


def engine_state_dict(engine: OffloadEngine, **counters: int) -> dict[str, Any]:
    if engine.step_in_progress:
        raise RuntimeError("optimizer.state_dict() was called between backward() and step(): the optimizer state is "
                           "mid-update. Call it after step().")
    if not engine.consistent:
        raise RuntimeError("the optimizer state is inconsistent: the CPU worker failed while applying a validated "
                           "step. Resume from the last checkpoint.")
    flat = engine.flat_state()
    return {
        "format": FORMAT,
        "numels": [p.numel() for p in engine.params],
        "shapes": [list(p.shape) for p in engine.params],
        "locations": [(pl.value, off) for pl, off in (engine.param_location(i) for i in range(len(engine.params)))],
        "param_steps": torch.tensor(engine.param_steps, dtype=torch.int64),
        "host": dict(flat["host"]),
        "device": {k: v.detach().to("cpu", copy=True) for k, v in flat["device"].items()},
        "counters": dict(counters),
        "governor": engine.governor.state_dict(),
    }


def load_engine_state(engine: OffloadEngine, sd: dict[str, Any]) -> dict[str, int]:
    """Copy ``sd`` into ``engine``'s buffers; refresh the model's weights from the loaded masters."""
    if sd.get("format") != FORMAT:
        raise ValueError(f"unknown optimizer state format {sd.get('format')!r}; expected {FORMAT!r}")
    numels = [p.numel() for p in engine.params]
    if list(sd["numels"]) != numels:
        saved, ours = list(sd["numels"]), numels
        first = next((i for i, (a, b) in enumerate(zip(saved, ours)) if a != b), min(len(saved), len(ours)))
        raise ValueError(
            f"the checkpoint was saved for a different set of trainable parameters ({len(saved)} saved, {len(ours)} "
            f"now; first difference at parameter {first}). Resume with the same model, the same frozen/trainable "
            "parameters and the same param groups."
        )
    for kind in _KINDS:
        for side in ("host", "device"):
            if kind not in sd[side]:
                raise ValueError(f"optimizer checkpoint is missing {side}/{kind}; the file is damaged")
    ours = engine.flat_state()
    with torch.no_grad():
        for i, (pl_value, off) in enumerate(sd["locations"]):
            n = numels[i]
            src_side = "host" if Placement(pl_value) is Placement.HOST else "device"
            pl, dst_off = engine.param_location(i)
            dst_side = "host" if pl is Placement.HOST else "device"
            for kind in _KINDS:
                src = sd[src_side][kind]
                if off + n > src.numel():
                    raise ValueError(f"optimizer checkpoint {src_side}/{kind} is truncated "
                                     f"({src.numel()} elements, parameter {i} needs {off + n})")
                ours[dst_side][kind][dst_off : dst_off + n].copy_(src[off : off + n])
        engine.param_steps = [int(s) for s in sd["param_steps"].tolist()]
    if "governor" in sd:  # speculation decisions resume where they were (results are identical either way)
        engine.governor.load_state_dict(sd["governor"])
    engine.refresh_params_from_masters()
    return {k: int(v) for k, v in sd.get("counters", {}).items()}
