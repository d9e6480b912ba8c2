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

__all__ = ["FORMAT", "engine_state_dict", "load_engine_state", "validate_engine_state"]

FORMAT = "hf_superoffload.optimizer.v1"
_KINDS = ("master", "exp_avg", "exp_avg_sq")


def engine_state_dict(engine: OffloadEngine, **counters: int) -> dict[str, Any]:
    if engine.step_in_progress:
        raise RuntimeError("optimizer.state_dict() was called between backward() and step(): the optimizer state is "
                           "mid-update. Call it after step().")
    if not engine.consistent:
        raise RuntimeError("the optimizer state is inconsistent: a validated step was only partly applied (the CPU "
                           "worker failed, or step() was interrupted). Resume from the last checkpoint.")
    flat = engine.flat_state()
    arenas = {"host": dict(flat["host"]),
              "device": {k: v.detach().to("cpu", copy=True) for k, v in flat["device"].items()}}
    return {
        "format": FORMAT,
        "numels": [p.numel() for p in engine.params],
        "shapes": [list(p.shape) for p in engine.params],
        "locations": [(pl.value, off) for pl, off in (engine.param_location(i) for i in range(len(engine.params)))],
        "param_steps": torch.tensor(engine.param_steps, dtype=torch.int64),
        **arenas,
        "manifest": {f"{side}/{k}": {"numel": t.numel(), "dtype": str(t.dtype), "digest": _digest(t)}
                     for side, d in arenas.items() for k, t in d.items()},
        "counters": dict(counters),
        "governor": engine.governor.state_dict(),
    }


def _digest(t: torch.Tensor) -> int:
    """Checksum of an arena's bytes: its 32-bit words summed in int64 (any single flipped bit changes it).
    One multi-threaded pass at memory bandwidth: seconds for a 70B-parameter host state."""
    words = t.detach().reshape(-1).view(torch.int32)
    chunk = 1 << 24  # sum(dtype=int64) casts its input first: bound that copy to 128 MiB
    return int(sum(int(words[i : i + chunk].sum(dtype=torch.int64)) for i in range(0, words.numel(), chunk)))


def validate_engine_state(engine: OffloadEngine, sd: dict[str, Any]) -> None:
    """Everything ``load_engine_state`` relies on, checked before anything is copied."""
    if not isinstance(sd, dict) or sd.get("format") != FORMAT:
        found = sd.get("format") if isinstance(sd, dict) else type(sd).__name__
        raise ValueError(f"unknown optimizer state format {found!r}; expected {FORMAT!r}")
    for key in ("numels", "shapes", "locations", "param_steps", "host", "device"):
        if key not in sd:
            raise ValueError(f"optimizer checkpoint has no {key!r} entry; the file is damaged")
    numels = [p.numel() for p in engine.params]
    if list(sd["numels"]) != numels:
        saved, ours = list(sd["numels"]), numels
        first = next((i for i, (a, b) in enumerate(zip(saved, ours)) if a != b), min(len(saved), len(ours)))
        raise ValueError(
            f"the checkpoint was saved for a different set of trainable parameters ({len(saved)} saved, {len(ours)} "
            f"now; first difference at parameter {first}). Resume with the same model, the same frozen/trainable "
            "parameters and the same param groups."
        )
    for i, (saved_shape, p) in enumerate(zip(sd["shapes"], engine.params)):
        if list(saved_shape) != list(p.shape):
            raise ValueError(f"the checkpoint was saved for a different model: parameter {i} has shape "
                             f"{list(saved_shape)} in the checkpoint and {list(p.shape)} now. Resume with the same model.")
    for key in ("locations", "param_steps"):
        if len(sd[key]) != len(numels):
            raise ValueError(f"optimizer checkpoint {key} has {len(sd[key])} entries for {len(numels)} parameters; "
                             "the file is damaged")
    need = {"host": 0, "device": 0}
    for i, (pl_value, _off) in enumerate(sd["locations"]):
        need["host" if Placement(pl_value) is Placement.HOST else "device"] += numels[i]
    manifest = sd.get("manifest")  # absent in checkpoints written before it existed
    for side in ("host", "device"):
        for kind in _KINDS:
            t = sd[side].get(kind)
            if t is None:
                raise ValueError(f"optimizer checkpoint is missing {side}/{kind}; the file is damaged")
            if t.dtype != torch.float32 or t.dim() != 1:
                raise ValueError(f"optimizer checkpoint {side}/{kind} is {t.dtype} of shape {list(t.shape)}, expected "
                                 "a flat torch.float32 tensor; the file is damaged")
            if t.numel() < need[side]:
                i, off = next((i, off) for i, (pl, off) in enumerate(sd["locations"])
                              if ("host" if Placement(pl) is Placement.HOST else "device") == side
                              and off + numels[i] > t.numel())
                raise ValueError(f"optimizer checkpoint {side}/{kind} is truncated ({t.numel()} elements, parameter "
                                 f"{i} needs {off + numels[i]})")
            if t.numel() != need[side]:
                raise ValueError(f"optimizer checkpoint {side}/{kind} has {t.numel()} elements but its layout needs "
                                 f"{need[side]}; the file is damaged")
            if manifest is not None:
                entry = manifest.get(f"{side}/{kind}", {})
                if entry.get("digest") != _digest(t):
                    raise ValueError(f"optimizer checkpoint {side}/{kind} fails its checksum (saved "
                                     f"{entry.get('digest')}, read {_digest(t)}); the file is damaged")


def load_engine_state(engine: OffloadEngine, sd: dict[str, Any], *, validate: bool = True) -> dict[str, int]:
    """Validate ``sd`` completely, then copy it into ``engine``'s buffers and refresh the model's weights from
    the loaded masters. A refused state leaves the engine untouched."""
    if validate:
        validate_engine_state(engine, sd)
    numels = [p.numel() for p in engine.params]
    ours = engine.flat_state()
    with torch.no_grad():
        for i, (pl_value, off) in enumerate(sd["locations"]):
            n = numels[i]
            src_side = "host" if Placement(pl_value) is Placement.HOST else "device"
            pl, dst_off = engine.param_location(i)
            dst_side = "host" if pl is Placement.HOST else "device"
            for kind in _KINDS:
                src = sd[src_side][kind]
                ours[dst_side][kind][dst_off : dst_off + n].copy_(src[off : off + n])
        engine.param_steps = [int(s) for s in sd["param_steps"].tolist()]
    if "governor" in sd:  # speculation decisions resume where they were (results are identical either way)
        engine.governor.load_state_dict(sd["governor"])
    engine.refresh_params_from_masters()
    return {k: int(v) for k, v in sd.get("counters", {}).items()}
