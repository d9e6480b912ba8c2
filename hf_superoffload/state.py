"""Checkpoint format of the offloaded optimizer state.

The state is saved as flat arenas (one per kind and placement: a host arena as one tensor, a device arena as its
pieces, below) plus the layout that maps each parameter to its slice, so ``torch.save`` writes each arena once and
``load`` copies *into* the existing
(possibly page-locked) buffers, never adopting the incoming tensors. A different plan (say, another
GPU-resident tail) is converted parameter by parameter; a different model is refused.

Data parallel: each rank saves its own shard of every bucket, with the bucket layout (``sharding``). A shard
loads into the same rank of the same layout. :func:`consolidate_state_dicts` merges every rank's shard into
one single-process state, which loads into any world size (each rank takes its slices).

Device arenas are saved in pieces of at most 64 MiB (``_PIECE_ELEMS``), each on a storage of exactly its bytes
that aliases the live GPU arena: ``torch.save`` copies one storage to the host at a time while it writes, so a
checkpoint needs one piece of host RAM beside the host state, not the whole device state (80 GiB at 14B on an
H200, which the host RAM the plan fills cannot give). Host arenas are saved whole, aliased too (``exact_storage``).
Readers take an arena as one tensor (format v1, and what ``consolidate_state_dicts`` returns) or as its pieces.

Integrity: each arena carries order-sensitive checksums (:func:`_checksum`, CRC32 per 16 MiB: a flipped bit or two
swapped blocks are detected, naming the arena and the parameters in the damaged range) and is refused on load if it
holds a NaN/inf (naming the parameter). Checkpoints
written before the checksum existed are verified with the older plain sum (``digest``), and new ones still carry
that sum, so older versions of this package read them.
"""

from __future__ import annotations

import os
import sys
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from .planning.plan import Placement
from .runtime.engine import OffloadEngine
from .runtime.host_memory import CHECKPOINT_PIECE_BYTES, exact_storage

__all__ = ["FORMAT", "consolidate_state_dicts", "engine_state_dict", "is_own_shard", "load_engine_state", "names_in",
           "validate_engine_state", "validate_whole_state", "weights_from_masters"]

FORMAT = "hf_superoffload.optimizer.v2"
_READABLE = (FORMAT, "hf_superoffload.optimizer.v1")  # v1: every arena one tensor, the device ones host copies
_PIECE_ELEMS = CHECKPOINT_PIECE_BYTES // 4  # fp32 elements per saved piece of a device arena
_KINDS = ("master", "exp_avg", "exp_avg_sq")
_CRC_BYTES = 16 << 20  # one CRC32 per 16 MiB of an arena: the damaged range is located to that resolution
_crc = zlib.crc32  # (data, running value): the order-sensitive checksum of every window
_CHUNK = 1 << 22  # elements per pass of the finiteness check: bounds its temporary to 4 MiB


def engine_state_dict(engine: OffloadEngine, **counters: int) -> dict[str, Any]:
    refuse_stock_accelerate_wrapper("__init__")
    if engine.step_in_progress:
        raise RuntimeError("optimizer.state_dict() was called between backward() and step(): the optimizer state is "
                           "mid-update. Call it after step().")
    if not engine.consistent:
        raise RuntimeError("the optimizer state is inconsistent: a validated step was only partly applied (the CPU "
                           "worker failed, or step() was interrupted). Resume from the last checkpoint.")
    flat = engine.flat_state()
    arenas: dict[str, dict[str, Saved]] = {
        "host": {k: exact_storage(v) for k, v in flat["host"].items()},
        "device": {k: [exact_storage(v[at : at + _PIECE_ELEMS]) for at in range(0, v.numel(), _PIECE_ELEMS)]
                   for k, v in flat["device"].items()},
    }
    sharded = engine.comm is not None
    return {
        "format": FORMAT,
        "names": param_names(engine),
        "numels": [p.numel() for p in engine.params],
        "shapes": [list(p.shape) for p in engine.params],
        "locations": None if sharded else [(pl.value, off) for pl, off in
                                           (engine.param_location(i) for i in range(len(engine.params)))],
        "sharding": _layout(engine) if sharded else None,
        "param_steps": torch.tensor(engine.param_steps, dtype=torch.int64),
        **arenas,
        "manifest": _manifest(arenas),
        "counters": dict(counters),
        "governor": engine.governor.state_dict(),
    }


Saved = torch.Tensor | list[torch.Tensor]
"""An arena as a state dict holds it: one flat tensor, or its flat pieces in order."""


def _pieces(x: Saved) -> list[torch.Tensor]:
    return list(x) if isinstance(x, list | tuple) else [x]


def _numel(x: Saved) -> int:
    return sum(t.numel() for t in _pieces(x))


def _views(x: Saved, start: int, end: int) -> list[torch.Tensor]:
    """Elements ``[start, end)`` of arena ``x`` as views of its pieces, in order (no copy)."""
    parts, at = [], 0
    for t in _pieces(x):
        lo, hi = max(start - at, 0), min(end - at, t.numel())
        if lo < hi:
            parts.append(t[lo:hi])
        at += t.numel()
    return parts


def _read(x: Saved, start: int, end: int) -> torch.Tensor:
    """Elements ``[start, end)`` of arena ``x``: a view where one piece holds them, else a copy of the span."""
    parts = _views(x, start, end)
    if len(parts) == 1:
        return parts[0]
    return torch.cat([p.cpu() for p in parts]) if parts else torch.zeros(0)


def _whole(x: Saved) -> torch.Tensor:
    """Arena ``x`` as one tensor (itself, or a copy of its pieces)."""
    return _read(x, 0, _numel(x))


def _copy_into(dst: torch.Tensor, x: Saved, start: int) -> None:
    """``dst`` := elements ``[start, start + dst.numel())`` of arena ``x``, piece by piece (no copy of the span)."""
    at = 0
    for t in _pieces(x):
        lo, hi = max(start - at, 0), min(start + dst.numel() - at, t.numel())
        if lo < hi:
            dst[at + lo - start : at + hi - start].copy_(t[lo:hi])
        at += t.numel()


def refuse_stock_accelerate_wrapper(method: str, depth: int = 8) -> None:
    """Raise if one of the ``depth`` callers is accelerate's stock ``AcceleratedOptimizer.<method>`` driving a
    SuperOffloadOptimizer. That wrapper is what ``accelerator.prepare(model, optimizer)`` and a plain
    ``transformers.Trainer(optimizers=(optimizer, ...))`` put around it; its constructor reads the state dict to
    move the host state to the GPU (so ``engine_state_dict`` checks ``__init__``: refused at prepare, before
    training) and its ``step`` forwards to ours (the optimizer checks ``step`` when a step reads its
    hyper-parameters: the case ``device_placement=False``). Under it, Trainer clips already-offloaded gradients,
    the LR advances on skipped steps and accumulation fails mid-step. Our own wrapper (a subclass defined in this
    package) is allowed."""
    stock = sys.modules.get("accelerate.optimizer")
    cls = getattr(stock, "AcceleratedOptimizer", None)
    code = getattr(getattr(cls, method, None), "__code__", None)
    if code is None:  # accelerate not imported: nothing can wrap us
        return
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return
        if frame.f_code is code:
            wrapper = frame.f_locals.get("self")
            if wrapper is None or type(wrapper).__module__.startswith("hf_superoffload."):
                return
            break
        frame = frame.f_back
    else:
        return
    while frame is not None and frame.f_globals.get("__name__") != "transformers.trainer":
        frame = frame.f_back
    if frame is not None:
        raise TypeError("SuperOffloadOptimizer cannot be used by a plain transformers.Trainer (optimizers=(...)): use "
                        "hf_superoffload.SuperOffloadTrainer with SuperOffloadArguments instead, which builds the "
                        "optimizer from the args (learning_rate, weight_decay, max_grad_norm, superoffload_*)")
    raise TypeError("accelerator.prepare(...) cannot wrap a SuperOffloadOptimizer (it would move the host state to the "
                    "GPU and advance the LR on skipped steps): use model, optimizer = "
                    "hf_superoffload.prepare_superoffload(accelerator, model, optimizer) instead")


def _layout(engine: OffloadEngine) -> dict[str, Any]:
    plan = engine.plan
    return {"world_size": plan.world_size, "rank": plan.rank,
            "buckets": [{"params": list(b.param_indices), "numel": b.numel, "shard": b.shard,
                         "placement": b.placement.value, "offset": b.offset} for b in plan.buckets]}


def weights_from_masters(params: Sequence[torch.nn.Parameter], sd: dict[str, Any]) -> None:
    """Each parameter := its master in the whole-process state ``sd``, cast to the parameter's dtype (what the
    engine writes after a load): a state kept for the first batch already shows in the weights that evaluation
    before it reads."""
    with torch.no_grad():
        for p, (pl_value, off) in zip(params, sd["locations"], strict=True):
            side = "host" if Placement(pl_value) is Placement.HOST else "device"
            p.copy_(_read(sd[side]["master"], off, off + p.numel()).view(p.shape))


def is_own_shard(engine: OffloadEngine, sd: dict[str, Any]) -> bool:
    """Whether ``sd`` is this rank's shard of a state laid out as ``engine``'s plan lays out its buckets (it loads
    arena for arena; any other state loads through the merged shards)."""
    return engine.comm is not None and bool(sd.get("sharding")) and sd["sharding"] == _layout(engine)


def param_names(engine: OffloadEngine) -> list[str]:
    """The model's name of each of the engine's parameters, in the engine's order. The engine keeps them in
    gradient-arrival order (the reverse of registration), so an index means nothing to a user: errors name them."""
    roots = engine.hooks.roots  # the model itself comes first
    return names_in(roots[0] if roots else None, engine.params)


def names_in(model: torch.nn.Module | None, params: Sequence[torch.nn.Parameter]) -> list[str]:
    """The name ``model`` gives each of ``params`` (``parameter i`` where it has none)."""
    by_id = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
    return [by_id.get(id(p), f"parameter {i}") for i, p in enumerate(params)]


def _manifest(arenas: dict[str, dict[str, Saved]]) -> dict[str, dict[str, Any]]:
    """Per arena: size, dtype, the order-sensitive ``checksum`` (verified on load) and the plain ``digest`` that
    versions before the checksum verify (kept so they can still read these checkpoints)."""
    return {f"{side}/{k}": {"numel": _numel(x), "dtype": str(torch.float32), "digest": _digest(x),
                            "checksum": _checksum(x)}
            for side, d in arenas.items() for k, x in d.items()}


def _checksum(x: Saved) -> dict[str, Any]:
    """Order-sensitive checksums of an arena's bytes: the CRC32 of each 16 MiB window, in order. A flipped bit
    changes one; two blocks that swap places change those of the windows they sit in (a plain sum of the words
    cannot see a swap). zlib's CRC32 runs at several GB/s per core and releases the GIL, so the windows are
    checksummed on a few threads. The windows run across the saved pieces (a window that straddles two continues
    its CRC into the next), so the list is the one of the whole arena; a GPU piece is read to the host one at a
    time."""
    crcs: list[int] = []
    carry: tuple[int, int] | None = None  # (CRC so far, bytes) of the window the previous piece began
    with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1))) as pool:
        for t in _pieces(x):
            data = memoryview(t.detach().reshape(-1).cpu().view(torch.uint8).numpy())
            at = 0
            if carry is not None:
                at = min(_CRC_BYTES - carry[1], len(data))
                carry = (_crc(data[:at], carry[0]), carry[1] + at)
                if carry[1] < _CRC_BYTES:
                    continue
                crcs.append(carry[0])
                carry = None
            windows = [data[i : i + _CRC_BYTES] for i in range(at, len(data), _CRC_BYTES)]
            if windows and len(windows[-1]) < _CRC_BYTES:
                last = windows.pop()
                carry = (_crc(last), len(last))
            crcs += pool.map(_crc, windows)
    if carry is not None:
        crcs.append(carry[0])
    return {"algorithm": "crc32", "piece_bytes": _CRC_BYTES, "crcs": crcs}


def _check_integrity(side: str, kind: str, t: Saved, entry: dict[str, Any] | None, sd: dict[str, Any],
                     names: list[str]) -> None:
    """The arena's checksum (the order-sensitive one, or the plain sum of checkpoints written before it), then its
    values: a NaN/inf master or moment would make every later step non-finite, skipped forever."""
    if entry is not None:
        if "checksum" in entry:
            _verify_checksum(side, kind, t, entry["checksum"], sd, names)
        elif entry.get("digest") != _digest(t):
            raise ValueError(f"optimizer checkpoint {side}/{kind} fails its checksum (saved {entry.get('digest')}, "
                             f"read {_digest(t)}); the file is damaged")
    at = _first_non_finite(t)
    if at is not None:
        value = float(_read(t, at, at + 1))
        raise ValueError(f"optimizer checkpoint {side}/{kind} holds a non-finite value ({value}) at element {at} "
                         f"({_owner(sd, side, at, names)}): the run that saved it had already diverged (or the file "
                         "is damaged); resume from an earlier checkpoint")


def _verify_checksum(side: str, kind: str, t: Saved, saved: Any, sd: dict[str, Any], names: list[str]) -> None:
    if not isinstance(saved, dict) or saved.get("algorithm") != "crc32" or saved.get("piece_bytes") != _CRC_BYTES:
        raise ValueError(f"optimizer checkpoint {side}/{kind} has a checksum this version cannot verify ({saved!r:.80}); "
                         "load it with the hf_superoffload version that wrote it")
    read = _checksum(t)["crcs"]
    bad = [k for k, (a, b) in enumerate(zip(saved["crcs"], read)) if a != b]
    if bad or len(saved["crcs"]) != len(read):
        k = bad[0] if bad else min(len(read), len(saved["crcs"]))
        per = _CRC_BYTES // 4  # float32
        first, last = k * per, min((k + 1) * per, _numel(t)) - 1
        owners = list(dict.fromkeys(_owner(sd, side, at, names) for at in (first, last)))
        raise ValueError(f"optimizer checkpoint {side}/{kind} fails its checksum in elements {first}..{last} "
                         f"({' to '.join(owners)}; {len(bad)} of {len(read)} pieces differ): its bytes were changed "
                         "or reordered; the file is damaged")


def _first_non_finite(x: Saved) -> int | None:
    offset = 0
    for t in _pieces(x):
        for start in range(0, t.numel(), _CHUNK):
            bad = ~torch.isfinite(t[start : start + _CHUNK])
            if bool(bad.any()):
                return offset + start + int(bad.nonzero()[0, 0])
        offset += t.numel()
    return None


def _owner(sd: dict[str, Any], side: str, at: int, names: list[str]) -> str:
    """The parameter whose slice of a ``side`` arena holds element ``at``."""
    numels = list(sd["numels"])
    if sd.get("sharding"):  # this rank's shard of each bucket, in bucket order
        lay = sd["sharding"]
        for b in lay["buckets"]:
            if b["placement"] == side and b["offset"] <= at < b["offset"] + b["shard"]:
                pos = lay["rank"] * b["shard"] + at - b["offset"]  # position within the whole bucket
                for i in b["params"]:
                    if pos < numels[i]:
                        return f"parameter {names[i]}"
                    pos -= numels[i]
        return "bucket padding"
    for i, (pl_value, off) in enumerate(sd["locations"]):
        if ("host" if Placement(pl_value) is Placement.HOST else "device") == side and off <= at < off + numels[i]:
            return f"parameter {names[i]}"
    return "no parameter"


def _digest(x: Saved) -> int:
    """Checksum of an arena's bytes: its 32-bit words summed in int64 (any single flipped bit changes it).
    One multi-threaded pass at memory bandwidth: seconds for a 70B-parameter host state."""
    chunk = 1 << 24  # sum(dtype=int64) casts its input first: bound that copy to 128 MiB
    total = 0
    for t in _pieces(x):
        words = t.detach().reshape(-1).view(torch.int32)
        total += sum(int(words[i : i + chunk].sum(dtype=torch.int64)) for i in range(0, words.numel(), chunk))
    return int(total)


def validate_engine_state(engine: OffloadEngine, sd: dict[str, Any]) -> None:
    """Everything ``load_engine_state`` relies on, checked before anything is copied."""
    names = param_names(engine)
    _check_model(engine.params, names, sd)
    if sd.get("sharding"):
        _validate_shard(engine, sd, names)
        return
    _check_whole(engine.params, names, sd)


def validate_whole_state(params: Sequence[torch.nn.Parameter], names: list[str], sd: dict[str, Any]) -> None:
    """``validate_engine_state`` for the state of one whole process (not a data-parallel shard, whose layout is the
    plan's), before the engine exists: ``params`` in the engine's order, ``names`` theirs."""
    _check_model(params, names, sd)
    if sd.get("sharding"):
        raise ValueError("this is one data-parallel rank's shard of an optimizer state; load the checkpoint's "
                         "shards together (the Trainer or accelerate's load_state merges them)")
    _check_whole(params, names, sd)


def _check_model(params: Sequence[torch.nn.Parameter], names: list[str], sd: dict[str, Any]) -> None:
    """The format, the entries, and the parameters' numbers and shapes."""
    if not isinstance(sd, dict) or sd.get("format") not in _READABLE:
        found = sd.get("format") if isinstance(sd, dict) else type(sd).__name__
        raise ValueError(f"unknown optimizer state format {found!r}; this version reads {' and '.join(_READABLE)}: "
                         "load it with the hf_superoffload version that wrote it")
    for key in ("numels", "shapes", "locations", "param_steps", "host", "device"):
        if key not in sd:
            raise ValueError(f"optimizer checkpoint has no {key!r} entry; the file is damaged")
    numels = [p.numel() for p in params]
    saved_names = sd.get("names")  # absent in checkpoints written before names were saved
    if list(sd["numels"]) != numels:
        saved, ours = list(sd["numels"]), numels
        first = next((i for i, (a, b) in enumerate(zip(saved, ours)) if a != b), min(len(saved), len(ours)))
        where = (names[first] if first < len(names) else
                 f"{saved_names[first]} (saved only)" if saved_names and first < len(saved_names) else "the end")
        raise ValueError(
            f"the checkpoint was saved for a different set of trainable parameters ({len(saved)} saved, {len(ours)} "
            f"now; first difference at {where}). Resume with the same model, the same frozen/trainable "
            "parameters and the same param groups."
        )
    for i, (saved_shape, p) in enumerate(zip(sd["shapes"], params)):
        if list(saved_shape) != list(p.shape):
            was = f" (saved as {saved_names[i]})" if saved_names and saved_names[i] != names[i] else ""
            raise ValueError(f"the checkpoint was saved for a different model: parameter {names[i]}{was} has shape "
                             f"{list(saved_shape)} in the checkpoint and {list(p.shape)} now. Resume with the same model.")


def _check_whole(params: Sequence[torch.nn.Parameter], names: list[str], sd: dict[str, Any]) -> None:
    """The layout and integrity of one whole process's arenas (any plan's: ``locations`` say where each was)."""
    numels = [p.numel() for p in params]
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
            _check_flat(side, kind, t)
            n = _numel(t)
            if n < need[side]:
                i, off = next((i, off) for i, (pl, off) in enumerate(sd["locations"])
                              if ("host" if Placement(pl) is Placement.HOST else "device") == side
                              and off + numels[i] > n)
                raise ValueError(f"optimizer checkpoint {side}/{kind} is truncated ({n} elements, parameter "
                                 f"{names[i]} needs {off + numels[i]})")
            if n != need[side]:
                raise ValueError(f"optimizer checkpoint {side}/{kind} has {n} elements but its layout needs "
                                 f"{need[side]}; the file is damaged")
            _check_integrity(side, kind, t, None if manifest is None else manifest.get(f"{side}/{kind}", {}), sd, names)


def _check_flat(side: str, kind: str, x: Any) -> None:
    """An arena is a flat float32 tensor or a list of them (its pieces)."""
    for t in _pieces(x):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.dim() != 1:
            got = f"{t.dtype} of shape {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"optimizer checkpoint {side}/{kind} is {got}, expected flat torch.float32 tensors; "
                             "the file is damaged")


def _validate_shard(engine: OffloadEngine, sd: dict[str, Any], names: list[str]) -> None:
    saved = sd["sharding"]
    w, r = saved.get("world_size"), saved.get("rank")
    if not is_own_shard(engine, sd):
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
            if t is None:
                raise ValueError(f"optimizer checkpoint {side}/{kind} is missing, expected {need[side]} float32 "
                                 "elements; the file is damaged")
            _check_flat(side, kind, t)
            if _numel(t) != need[side]:
                raise ValueError(f"optimizer checkpoint {side}/{kind} has {_numel(t)} elements, expected "
                                 f"{need[side]} float32 elements; the file is damaged")
            _check_integrity(side, kind, t, manifest.get(f"{side}/{kind}"), sd, names)


def consolidate_state_dicts(shards: list[dict[str, Any]], *, manifest: bool = True) -> dict[str, Any]:
    """Merge every data-parallel rank's optimizer shard (``opt.state_dict()["superoffload"]`` of each rank,
    in any order) into one single-process state that loads into any number of processes.

    The merged arenas are lists of views of the shards' arenas (a mapped checkpoint stays mapped: merging holds no
    copy of the state in RAM). Each shard's checksums are verified first; ``manifest`` computes the merged state's
    own (needed where it is saved; a state merged to be loaded at once, whose shards were just verified, can skip
    that read of every byte)."""
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
    for r, sd in sorted(by_rank.items()):  # a damaged shard must not come out with fresh, valid checksums
        names = list(sd.get("names") or [f"parameter {i}" for i in range(len(numels))])
        saved = sd.get("manifest") or {}
        for side in ("host", "device"):
            for kind in _KINDS:
                try:
                    if kind not in sd.get(side, {}):
                        raise ValueError(f"optimizer checkpoint is missing {side}/{kind}; the file is damaged")
                    _check_flat(side, kind, sd[side][kind])
                    _check_integrity(side, kind, sd[side][kind], saved.get(f"{side}/{kind}"), sd, names)
                except ValueError as e:
                    raise ValueError(f"the shard of rank {r}: {e}") from None
    merged: dict[str, dict[str, list[torch.Tensor]]] = {"host": {k: [] for k in _KINDS},
                                                      "device": {k: [] for k in _KINDS}}
    locations: list[tuple[str, int] | None] = [None] * len(numels)
    sizes = {"host": 0, "device": 0}
    for b in layouts[0]["buckets"]:
        side, n, shard, off = b["placement"], b["numel"], b["shard"], b["offset"]
        for kind in _KINDS:  # rank r holds elements [r * shard, (r + 1) * shard) of the bucket, the last padded
            for r in range(world):
                take = min(shard, n - r * shard)
                if take > 0:
                    merged[side][kind].extend(_views(by_rank[r][side][kind], off, off + take))
        at = sizes[side]
        for i in b["params"]:
            locations[i] = (side, at)
            at += numels[i]
        sizes[side] += n
    base = shards[0]
    arenas = {side: {k: (v if v else torch.zeros(0)) for k, v in d.items()} for side, d in merged.items()}
    return {
        "format": FORMAT, "names": base.get("names"), "numels": numels, "shapes": base["shapes"],
        "locations": locations, "sharding": None,
        "param_steps": base["param_steps"], **arenas,
        "manifest": _manifest(arenas) if manifest else None,
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
                    _copy_into(ours[side][kind], sd[side][kind], 0)
        else:
            for i, (pl_value, off) in enumerate(sd["locations"]):
                src_side = "host" if Placement(pl_value) is Placement.HOST else "device"
                for pl, dst_off, start, end in engine.param_pieces(i):  # the whole parameter on one process
                    dst_side = "host" if pl is Placement.HOST else "device"
                    for kind in _KINDS:
                        _copy_into(ours[dst_side][kind][dst_off : dst_off + end - start], sd[src_side][kind],
                                   off + start)
        engine.param_steps = [int(s) for s in sd["param_steps"].tolist()]
    if sd.get("governor") is not None:  # speculation decisions resume where they were (results are identical either way)
        engine.governor.load_state_dict(sd["governor"])
    engine.refresh_params_from_masters()
    return {k: int(v) for k, v in sd.get("counters", {}).items()}
