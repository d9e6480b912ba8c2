"""Checkpoint format of the offloaded optimizer state.

The state is saved as whole flat arenas (one tensor per kind and placement) plus the layout that maps each
parameter to its slice, so ``torch.save`` writes each arena once and ``load`` copies *into* the existing
(possibly page-locked) buffers, never adopting the incoming tensors. A different plan (say, another
GPU-resident tail) is converted parameter by parameter; a different model is refused.

Data parallel: each rank saves its own shard of every bucket, with the bucket layout (``sharding``). A shard
loads into the same rank of the same layout. :func:`consolidate_state_dicts` merges every rank's shard into
one single-process state, which loads into any world size (each rank takes its slices).
"""

from __future__ import annotations

from typing import Any

import torch

from .planning.plan import Placement
from .runtime.engine import OffloadEngine

__all__ = ["FORMAT", "consolidate_state_dicts", "engine_state_dict", "load_engine_state", "validate_engine_state"]

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
    sharded = engine.comm is not None
    return {
        "format": FORMAT,
        "numels": [p.numel() for p in engine.params],
        "shapes": [list(p.shape) for p in engine.params],
        "locations": None if sharded else [(pl.value, off) for pl, off in
                                           (engine.param_location(i) for i in range(len(engine.params)))],
        "sharding": _layout(engine) if sharded else None,
        "param_steps": torch.tensor(engine.param_steps, dtype=torch.int64),
        **arenas,
        "manifest": {f"{side}/{k}": {"numel": t.numel(), "dtype": str(t.dtype), "digest": _digest(t)}
                     for side, d in arenas.items() for k, t in d.items()},
        "counters": dict(counters),
        "governor": engine.governor.state_dict(),
    }


def _layout(engine: OffloadEngine) -> dict[str, Any]:
    plan = engine.plan
    return {"world_size": plan.world_size, "rank": plan.rank,
            "buckets": [{"params": list(b.param_indices), "numel": b.numel, "shard": b.shard,
                         "placement": b.placement.value, "offset": b.offset} for b in plan.buckets]}


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
    if sd.get("sharding"):
        _validate_shard(engine, sd)
        return
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


def _validate_shard(engine: OffloadEngine, sd: dict[str, Any]) -> None:
    saved = sd["sharding"]
    w, r = saved.get("world_size"), saved.get("rank")
    if engine.comm is None or saved != _layout(engine):
        now = f"rank {engine.plan.rank} of {engine.plan.world_size}" if engine.comm else "a single process"
        same_world = engine.comm is not None and w == engine.plan.world_size and r == engine.plan.rank
        why = ("the bucket layout differs (another bucket size or GPU-resident tail)" if same_world
               else f"this run is {now}")
        raise ValueError(
            f"this optimizer checkpoint is the shard of rank {r} of {w} data-parallel ranks, and {why}. Resume "
            f"with the same {w} processes and offload settings, or merge the {w} shards with "
            "hf_superoffload.state.consolidate_state_dicts([...]) and load the merged state (it loads into any "
            "number of processes)."
        )
    if len(sd["param_steps"]) != len(engine.params):
        raise ValueError(f"optimizer checkpoint param_steps has {len(sd['param_steps'])} entries for "
                         f"{len(engine.params)} parameters; the file is damaged")
    need = {"host": engine.plan.host_numel, "device": engine.plan.device_numel}
    manifest = sd.get("manifest") or {}
    for side in ("host", "device"):
        for kind in _KINDS:
            t = sd[side].get(kind)
            if t is None or t.dtype != torch.float32 or t.dim() != 1 or t.numel() != need[side]:
                got = "missing" if t is None else f"{t.dtype} of shape {list(t.shape)}"
                raise ValueError(f"optimizer checkpoint {side}/{kind} is {got}, expected {need[side]} float32 "
                                 "elements; the file is damaged")
            entry = manifest.get(f"{side}/{kind}")
            if entry is not None and entry.get("digest") != _digest(t):
                raise ValueError(f"optimizer checkpoint {side}/{kind} fails its checksum (saved {entry.get('digest')}, "
                                 f"read {_digest(t)}); the file is damaged")


def consolidate_state_dicts(shards: list[dict[str, Any]]) -> dict[str, Any]:
    """Merge every data-parallel rank's optimizer shard (``opt.state_dict()["superoffload"]`` of each rank,
    in any order) into one single-process state that loads into any number of processes."""
    if not shards or not all(isinstance(sd, dict) and sd.get("sharding") for sd in shards):
        raise ValueError("consolidate_state_dicts takes the sharded optimizer states of every rank")
    by_rank = {sd["sharding"]["rank"]: sd for sd in shards}
    world = shards[0]["sharding"]["world_size"]
    if sorted(by_rank) != list(range(world)) or len(shards) != world:
        raise ValueError(f"need exactly one shard of each of the {world} ranks, got ranks {sorted(by_rank)}")
    layouts = [{k: v for k, v in sd["sharding"].items() if k != "rank"} for sd in shards]
    if any(lay != layouts[0] for lay in layouts):
        raise ValueError("the shards come from different runs (their bucket layouts differ)")
    numels = list(shards[0]["numels"])
    merged: dict[str, dict[str, list[torch.Tensor]]] = {"host": {k: [] for k in _KINDS},
                                                      "device": {k: [] for k in _KINDS}}
    locations: list[tuple[str, int] | None] = [None] * len(numels)
    sizes = {"host": 0, "device": 0}
    for b in layouts[0]["buckets"]:
        side, n, shard, off = b["placement"], b["numel"], b["shard"], b["offset"]
        for kind in _KINDS:
            parts = [by_rank[r][side][kind][off : off + shard] for r in range(world)]
            merged[side][kind].append(torch.cat(parts)[:n])
        at = sizes[side]
        for i in b["params"]:
            locations[i] = (side, at)
            at += numels[i]
        sizes[side] += n
    base = shards[0]
    arenas = {side: {k: (torch.cat(v) if v else torch.zeros(0)) for k, v in d.items()} for side, d in merged.items()}
    return {
        "format": FORMAT, "numels": numels, "shapes": base["shapes"], "locations": locations, "sharding": None,
        "param_steps": base["param_steps"], **arenas,
        "manifest": {f"{side}/{k}": {"numel": t.numel(), "dtype": str(t.dtype), "digest": _digest(t)}
                     for side, d in arenas.items() for k, t in d.items()},
        "counters": base.get("counters", {}), "governor": base.get("governor"),
    }


def load_engine_state(engine: OffloadEngine, sd: dict[str, Any], *, validate: bool = True) -> dict[str, int]:
    """Validate ``sd`` completely, then copy it into ``engine``'s buffers and refresh the model's weights from
    the loaded masters. A refused state leaves the engine untouched."""
    if validate:
        validate_engine_state(engine, sd)
    engine.drop_pending_moments()  # the loaded moments replace what a deferred step still owed
    ours = engine.flat_state()
    with torch.no_grad():
        if sd.get("sharding"):  # the same rank of the same layout: arena for arena
            for side in ("host", "device"):
                for kind in _KINDS:
                    ours[side][kind].copy_(sd[side][kind])
        else:
            for i, (pl_value, off) in enumerate(sd["locations"]):
                src_side = "host" if Placement(pl_value) is Placement.HOST else "device"
                for pl, dst_off, start, end in engine.param_pieces(i):  # the whole parameter on one process
                    dst_side = "host" if pl is Placement.HOST else "device"
                    for kind in _KINDS:
                        src = sd[src_side][kind]
                        ours[dst_side][kind][dst_off : dst_off + end - start].copy_(src[off + start : off + end])
        engine.param_steps = [int(s) for s in sd["param_steps"].tolist()]
    if sd.get("governor") is not None:  # speculation decisions resume where they were (results are identical either way)
        engine.governor.load_state_dict(sd["governor"])
    engine.refresh_params_from_masters()
    return {k: int(v) for k, v in sd.get("counters", {}).items()}
