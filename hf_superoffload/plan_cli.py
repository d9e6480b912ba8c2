"""``hf-superoffload plan``: will this model train here, how, how much memory, how fast?

Builds the real :class:`~hf_superoffload.planning.plan.OffloadPlan` (``make_plan``) from the model's parameter
sizes in gradient-arrival order (the model is built on the meta device: nothing is allocated), predicts the
peak GPU and host memory (``planning/memory_model.py``) and the step time (``planning/step_time.py``), reports the
largest model of the same width that fits, and exits 1 with the reason and what to change when the run does
not fit (2 for bad input).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ._cli_args import OneLineParser, float_in, int_in, model_spec, offload_config
from .config import SuperOffloadConfig
from .planning.hardware import HardwareProfile, shipped_profile_names
from .planning.memory_model import (
    GiB,
    MemoryEstimate,
    ModelShape,
    PlanLike,
    bisect_largest,
    check_fits,
    estimate,
    fits,
    largest_model_that_fits,
)
from .planning.plan import OffloadPlan
from .planning.planner import PlanError, Workload, fit_frontier, make_plan
from .planning.step_time import PEER_GBPS_ASSUMED

__all__ = ["add_plan_parser", "arrival_numels", "check_ranks", "load_model_config", "main", "main_plan", "rank_share"]

EXIT_FITS, EXIT_DOES_NOT_FIT, EXIT_BAD_INPUT = 0, 1, 2
MAX_LAYERS = 2048  # the search limit of largest_model_that_fits
MAX_SEQ = 1 << 24  # the search limit of the longest sequence (16M tokens)
_PROFILE_ALIASES = {"gh200": "gh200", "h200": "h200_pcie", "h100": "h100_sxm", "rtx4090": "rtx4090_24gb"}


class InputError(ValueError):
    """The model or profile given on the command line cannot be used."""


# ---------------------------------------------------------------------------------------------- inputs
def load_model_config(spec: str) -> Any:
    """A transformers config from a preset name, a ``config.json`` file, a local folder or a hub model id."""
    from transformers import AutoConfig

    from .demo.presets import PRESETS, llama_config

    if spec in PRESETS:
        return llama_config(spec, vocab_size=None if PRESETS[spec]["vocab_size"] else 32000)
    path = Path(spec)
    try:
        if path.is_file():
            data = json.loads(path.read_text())
            if not isinstance(data, dict) or "model_type" not in data:
                raise InputError(f"{spec}: a model config.json needs a 'model_type' field")
            kw = {k: v for k, v in data.items() if k != "model_type"}
            return AutoConfig.for_model(data["model_type"], **kw)
        return AutoConfig.from_pretrained(spec)
    except InputError:
        raise
    except (OSError, ValueError, KeyError) as e:
        offline = " HF_HUB_OFFLINE is set, so only cached models load." if os.environ.get("HF_HUB_OFFLINE") else ""
        raise InputError(f"cannot load the model config {spec!r}: {e}.{offline} Pass a config.json file, a local "
                         f"model folder or a preset ({', '.join(PRESETS)}).") from e


def arrival_numels(config: Any) -> list[int]:
    """Trainable parameter sizes in the engine's order (deduplicated, reverse registration), on the meta device."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    seen: set[int] = set()
    numels = [p.numel() for p in model.parameters() if p.requires_grad and not (id(p) in seen or seen.add(id(p)))]
    return numels[::-1]


def _numels_by_layers(config: Any, numels: list[int]) -> Any:
    """``layers -> arrival numels`` of the same model with that many decoder layers, or ``None`` when the model is
    not one block of parameters repeated per layer between a fixed head and tail."""
    import copy

    layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(layers, int) or layers < 1:
        return None
    small = []
    for n in (1, 2):
        c = copy.deepcopy(config)
        c.num_hidden_layers = n
        for key in ("layer_types", "mlp_layer_types"):  # per-layer lists follow the layer count
            if isinstance(getattr(c, key, None), list):
                setattr(c, key, getattr(config, key)[:n])
        try:
            small.append(arrival_numels(c))
        except Exception:
            return None
    one, two = small
    c = len(two) - len(one)
    for p in range(len(one) - c + 1):
        head, block, rest = one[:p], one[p : p + c], one[p + c :]
        if two == head + block * 2 + rest and numels == head + block * layers + rest:
            return lambda n: head + block * n + rest
    return None


def _largest_by_plan(shape: ModelShape, layered: Any, cfg: SuperOffloadConfig, profile: HardwareProfile,
                     workload: Workload, ranks: dict[str, Any]) -> tuple[int, MemoryEstimate] | None:
    """The most layers of this width for which the planner's own search finds a plan that fits: the same search,
    and the same check, as the verdict (so a model below the frontier always fits). ``ranks``: ``make_plan``'s
    rank arguments (empty for one process); the fit is checked against one rank's share of the host."""
    share = rank_share(profile, ranks.get("local_world_size", 1))

    def est_for(layers: int) -> MemoryEstimate | None:
        w = dataclasses.replace(workload, model=shape.with_layers(layers))
        try:
            plan = make_plan(layered(layers), element_size=2, config=cfg, profile=profile, workload=w, **ranks)
        except PlanError:
            return None
        est = w.estimate(PlanLike.from_plan(plan))
        return est if fits(est, share) else None

    best = bisect_largest(1, MAX_LAYERS, lambda layers: est_for(layers) is not None)
    if best is None:
        return None
    est = est_for(best)
    assert est is not None
    return best, est


def rank_share(profile: HardwareProfile, ranks_per_host: int) -> HardwareProfile:
    """One rank's view of a host that ``ranks_per_host`` ranks share: its 1/n of the available RAM (the planner
    sizes each rank's arenas from the same share); the GPU is the rank's own."""
    if ranks_per_host <= 1 or profile.host_available_bytes is None:
        return profile
    return dataclasses.replace(profile, host_available_bytes=profile.host_available_bytes // ranks_per_host)


def check_ranks(data_parallel: int, sequence_parallel: int, profile: HardwareProfile) -> int:
    """The ranks on this host (``data_parallel x sequence_parallel``, every one on this host); raises
    :class:`InputError` when the host cannot give each one a core for its CPU Adam."""
    world = data_parallel * sequence_parallel
    if profile.cpu_cores is not None and world > profile.cpu_cores:
        raise InputError(f"--data-parallel {data_parallel} x --sequence-parallel {sequence_parallel} = {world} ranks "
                         f"on one host, but the profile has {profile.cpu_cores} cores (each rank needs at least one): "
                         "use fewer ranks")
    return world


def resolve_profile(spec: str, *, gpu_mem_gb: float | None, host_mem_gb: float | None) -> HardwareProfile:
    """A shipped profile name, ``measure`` (this machine, quick, cached) or a JSON file, with overrides."""
    if spec == "measure":
        prof = HardwareProfile.measure(torch.device("cuda" if torch.cuda.is_available() else "cpu"), quick=True)
    elif spec in _PROFILE_ALIASES or spec in shipped_profile_names():
        prof = HardwareProfile.shipped(_PROFILE_ALIASES.get(spec, spec))
    elif Path(spec).is_file():
        try:
            prof = HardwareProfile.load(spec)
        except (OSError, ValueError, TypeError) as e:
            raise InputError(f"cannot read the hardware profile {spec}: {e}") from e
    else:
        raise InputError(f"--profile {spec!r}: use measure, {', '.join(_PROFILE_ALIASES)} or a profile JSON file")
    if gpu_mem_gb is not None:
        prof = dataclasses.replace(prof, device_type="cuda", device_free_bytes=int(gpu_mem_gb * GiB))
    if host_mem_gb is not None:
        prof = dataclasses.replace(prof, host_available_bytes=int(host_mem_gb * GiB))
    return prof


# ---------------------------------------------------------------------------------------------- command
def add_plan_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``plan`` on an ``argparse`` subparsers object (``hf-superoffload plan ...``)."""
    p = subparsers.add_parser("plan", help="predict the offload plan, memory and step time of a run; exit 1 if it "
                              "cannot fit", description=__doc__.splitlines()[0])
    from .demo.presets import PRESETS

    memory = float_in(0.0, 1e6, lo_open=True, hint=" GiB")
    p.add_argument("--model", required=True, type=model_spec(tuple(PRESETS)),
                   help="config.json, local model folder, hub model id or preset")
    p.add_argument("--batch-size", type=int_in(1, 1 << 16), required=True)
    p.add_argument("--seq-len", type=int_in(1, MAX_SEQ), required=True)
    p.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing")
    p.add_argument("--grad-accum", type=int_in(1, 1 << 16), default=1, metavar="M",
                   help="micro-batches per optimizer step (gradient accumulation; the step time covers all M)")
    p.add_argument("--gpu-mem", type=memory, default=None, help="free GPU memory in GiB (overrides the profile)")
    p.add_argument("--host-mem", type=memory, default=None, help="available host RAM in GiB (overrides the profile)")
    p.add_argument("--profile", default="measure", help="measure (this machine), gh200, h200, h100, rtx4090 or a JSON "
                   "file written by HardwareProfile.save")
    p.add_argument("--offload-config", default=None, type=offload_config, help="SuperOffloadConfig fields as JSON")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--sequence-parallel", type=int_in(1, 4096), default=1, metavar="P",
                   help="Ulysses ranks per sequence (one GPU each): activations per GPU are 1/P, the loss is chunked, "
                        "the optimizer state is sharded over the P ranks; also prints the longest sequence that fits")
    p.add_argument("--data-parallel", type=int_in(1, 4096), default=1, metavar="D",
                   help="data-parallel replicas, all on this host: D x P ranks (one GPU each) share its cores and RAM, "
                        "each trains --batch-size sequences, the optimizer state is sharded over the D x P ranks; "
                        "memory and step time are one rank's")
    p.add_argument("--loss-chunk", type=int_in(1, MAX_SEQ), default=None, metavar="TOKENS",
                   help="LM head + loss over chunks of this many tokens (default: 4096 with --sequence-parallel > 1, "
                        "else HF's loss over all logits)")
    p.add_argument("--tiled-mlp", type=int_in(0, MAX_SEQ), default=0, metavar="TOKENS",
                   help="each decoder layer's MLP runs this many tokens at a time (sequence_parallel.enable_tiled_mlp; "
                        "0: untiled)")
    p.add_argument("--keep-attention", action="store_true",
                   help="with --grad-ckpt: checkpointing keeps attention's outputs instead of recomputing attention "
                        "(sequence_parallel.enable_checkpointing_keep_attention)")
    p.set_defaults(func=main_plan)
    return p


def _peer_source(profile: HardwareProfile) -> str:
    if profile.peer_gbps is not None:
        return f"{profile.peer_gbps:g} GB/s between GPUs, from the profile"
    return f"{PEER_GBPS_ASSUMED:g} GB/s between GPUs assumed (NVLink 4; the profile has no peer_gbps)"


def _mem(d: dict[str, int]) -> dict[str, float]:
    return {k: round(v / GiB, 2) for k, v in d.items()}


def _items(d: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.1f}" for k, v in d.items() if v)


def main_plan(args: argparse.Namespace) -> int:
    """Run ``plan``; 0 fits, 1 does not fit (reason printed), 2 bad input."""
    try:
        if args.batch_size < 1 or args.seq_len < 1:
            raise InputError("--batch-size and --seq-len must be >= 1")
        if min(args.sequence_parallel, args.data_parallel) < 1 or (args.loss_chunk is not None and args.loss_chunk < 1):
            raise InputError("--sequence-parallel, --data-parallel and --loss-chunk must be >= 1")
        if args.tiled_mlp < 0:
            raise InputError("--tiled-mlp must be >= 0 (0: untiled)")
        if args.keep_attention and not args.grad_ckpt:
            raise InputError("--keep-attention is a form of gradient checkpointing: add --grad-ckpt")
        config = load_model_config(args.model)
        shape = ModelShape.from_config(config)
        profile = resolve_profile(args.profile, gpu_mem_gb=args.gpu_mem, host_mem_gb=args.host_mem)
        world = check_ranks(args.data_parallel, args.sequence_parallel, profile)
        cfg = SuperOffloadConfig(**json.loads(args.offload_config)) if args.offload_config else SuperOffloadConfig()
        numels = arrival_numels(config)
    except (InputError, ValueError, TypeError) as e:
        print(f"hf-superoffload plan: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    run = dict(batch_size=args.batch_size, seq_len=args.seq_len, grad_ckpt=args.grad_ckpt)
    sp, dp = args.sequence_parallel, args.data_parallel
    chunk = args.loss_chunk if args.loss_chunk is not None else (4096 if sp > 1 else None)
    # a transformers decoder trains with the chunked causal-LM loss the optimizer installs (unless configured off)
    sp_kw = dict(sequence_parallel=sp, loss_chunk_tokens=chunk, mlp_tile_tokens=args.tiled_mlp or None,
                 keep_attention=args.keep_attention, chunked_loss=cfg.chunked_loss)
    # transformers decoders checkpoint per layer: the plan may keep some ([Note: kept layers])
    workload = Workload(shape, **run, **sp_kw, layer_checkpointing=args.grad_ckpt, accumulation=args.grad_accum > 1,
                        micro_batches=args.grad_accum)
    ranks: dict[str, Any] = {}
    if world > 1:  # one rank per GPU of this host; the profile's cores are split between them
        cores = list(range(profile.cpu_cores)) if profile.cpu_cores else None
        ranks = dict(world_size=world, rank=0, local_world_size=world, local_rank=0, cores=cores)
    share = rank_share(profile, world)  # what one rank's memory is checked against
    notes: list[str] = []
    reasons: list[str] = []
    plan: OffloadPlan | None = None
    try:
        plan = make_plan(numels, element_size=2, config=cfg, profile=profile, workload=workload, **ranks)
        plan_like = PlanLike.from_plan(plan)  # the planner already sized the tail for this workload's activations
        host_est = workload.estimate(plan_like)
        over = share.host_available_bytes is not None and host_est.host_peak_bytes > share.host_available_bytes
        if over and cfg.rollback == "auto" and plan.rollback.value != "inverse":
            plan = make_plan(numels, element_size=2, config=cfg.replace(rollback="inverse"), profile=profile,
                             workload=workload, **ranks)
            plan_like = PlanLike.from_plan(plan)
            notes.append("rollback: inverse, because the second state copy does not fit with the runtime's own RSS")
    except PlanError as e:  # show the numbers of the leanest plan: every state on the host, inverse rollback
        reasons.append(f"the planner refuses: {e}")
        plan, plan_like = None, PlanLike.all_host(sum(numels))
    step = workload.step_time(plan_like, profile, world_size=world)
    clipped = workload.step_time(plan_like, profile, world_size=world, clipping_every_step=True)
    if step is not None and plan is not None and plan.rollback.value == "snapshot":
        plan_like = dataclasses.replace(plan_like, speculated_fraction=step.speculated_fraction)
    est = workload.estimate(plan_like)
    frontier: tuple[int | None, int | None] | None = None
    try:
        check_fits(est, share)
    except PlanError as e:
        why = str(e)
        if profile.device_free_bytes is not None:
            # [Note: refused with the frontier]: the options come from the plan search, as the verdict does
            frontier = fit_frontier(numels, element_size=2, config=cfg, profile=profile, workload=workload, **ranks)
            searched = frozenset(f for f in ("weight_placement", "gpu_resident_buckets") if getattr(cfg, f) == "auto")
            try:
                check_fits(est, share, frontier=frontier, searched=searched)
            except PlanError as options:
                why = str(options)
        reasons.append(why)
    reason = "\n".join(reasons) or None
    if sum(numels) and abs(sum(numels) - shape.numel) > 0.01 * shape.numel:
        notes.append(f"the model has {sum(numels) / 1e9:.3f}B parameters, the memory model counts "
                     f"{shape.numel / 1e9:.3f}B (not a plain Llama-style decoder)")
    baseline = estimate(shape, plan_like=PlanLike(optimizer="gpu_adamw"), **run)
    largest = None
    # the device memory bounds it (state that does not fit the host goes to the device tail): unknown without it
    if profile.device_free_bytes is not None:
        layered = _numels_by_layers(config, numels)
        if layered is not None and sp == 1:
            largest = _largest_by_plan(shape, layered, cfg, profile, workload, ranks)
        else:  # not a plain stack of identical layers (or Ulysses ranks): the memory model's own search
            largest = largest_model_that_fits(shape, profile=share, host_bytes_per_param=plan_like.host_bytes_per_param,
                                              max_layers=MAX_LAYERS, weight_mode=plan_like.weight_mode,
                                              bucket_bytes=plan_like.bucket_bytes, **run)
    # The longest sequence agrees with the verdict: where the run fits, how far this plan goes (both memories; a
    # longer sequence may still fit with a smaller device tail, which `plan --seq-len` at that length searches);
    # where it does not, the plan search's own frontier below the asked length (None: not even one token).
    longest = None
    if profile.device_free_bytes is not None and reason is None:
        def seq_fits(n: int) -> bool:
            return fits(estimate(shape, plan_like=plan_like, batch_size=args.batch_size, seq_len=n * sp,
                                 grad_ckpt=args.grad_ckpt, **sp_kw), share)

        per_rank = bisect_largest(1, MAX_SEQ // sp, seq_fits)
        longest = None if per_rank is None else per_rank * sp
    elif frontier is not None:
        longest = frontier[1] or 0
    if sp > 1:
        notes.append(f"sequence parallel: {sp} ranks per sequence, {-(-args.seq_len // sp)} tokens of each sequence "
                     f"per GPU; loss over chunks of {chunk} tokens; optimizer state sharded over the {sp} ranks "
                     "(the step time is one rank's; the largest-model search assumes one rank)")
    if world > 1:
        notes.append(f"{dp} data-parallel x {sp} sequence-parallel = {world} ranks on this host, one GPU each: each "
                     f"has 1/{world} of the host's cores and RAM and 1/{world} of every bucket's optimizer state; "
                     f"gradients reduce-scattered and divided by {dp}, weights all-gathered ({_peer_source(profile)}); "
                     f"memory and step time are one rank's")
    out = {
        "fits": reason is None, "reason": reason,
        "longest_sequence": None if longest is None else {"tokens": longest, "sequence_parallel": sp,
                                                          "at_search_limit": longest >= MAX_SEQ - sp,
                                                          "with_this_plan": reason is None},
        "model": {"source": args.model, "numel": sum(numels), **dataclasses.asdict(shape)},
        "run": run, "profile": profile.to_dict(),
        "plan": None if plan is None else {
            "buckets": len(plan.buckets), "host_buckets": len(plan.host_buckets),
            "device_buckets": len(plan.device_buckets), "host_numel": plan.host_numel,
            "device_numel": plan.device_numel, "weight_mode": plan.weight_mode.value,
            "cast_side": plan.cast_side.value, "rollback": plan.rollback.value, "speculation": plan.speculation,
            "deferred_speculation": plan.deferred_speculation, "cpu_threads": plan.cpu_threads, "notes": list(plan.notes)},
        "memory_gib": {
            "gpu_peak_phase": est.gpu_peak_phase, "gpu": _mem(est.gpu), "gpu_peak": round(est.gpu_peak_bytes / GiB, 2),
            "gpu_required": round(est.gpu_required_bytes / GiB, 2), "host": _mem(est.host),
            "host_peak": round(est.host_peak_bytes / GiB, 2), "host_expected": round(est.host_expected_bytes / GiB, 2)},
        "step_time_s": None if step is None else {k: round(v, 4) for k, v in dataclasses.asdict(step).items()},
        "step_time_clipping_every_step_s": None if clipped is None else round(clipped.step_s, 4),
        "deferred_commits_clipping_every_step_s": None if clipped is None else round(clipped.commit_s, 4),
        "ranks": {
            "data_parallel": dp, "sequence_parallel": sp, "world_size": world, "ranks_per_host": world,
            "gradient_divisor": dp, "tokens_per_step": dp * args.batch_size * args.seq_len,
            "host_available_per_rank_gib": (None if share.host_available_bytes is None
                                            else round(share.host_available_bytes / GiB, 2)),
            "per_rank": {"gpu_peak_gib": round(est.gpu_peak_bytes / GiB, 2),
                         "gpu_required_gib": round(est.gpu_required_bytes / GiB, 2),
                         "host_peak_gib": round(est.host_peak_bytes / GiB, 2),
                         "host_optimizer_numel": plan_like.host_numel,
                         "step_s": None if step is None else round(step.step_s, 4),
                         "collectives_s": None if step is None else round(step.collectives_s, 4),
                         "collectives_exposed_s": None if step is None else round(step.collectives_exposed_s, 4)},
            "host_peak_all_ranks_gib": round(world * est.host_peak_bytes / GiB, 2)},
        "gpu_adamw_baseline_gib": {"gpu_required": round(baseline.gpu_required_bytes / GiB, 2),
                                   "fits": fits(baseline, profile)},
        "largest_fitting": None if largest is None else {
            "num_layers": largest[0], "numel": largest[1].shape.numel, "at_search_limit": largest[0] == MAX_LAYERS},
        "notes": notes + list(est.notes),
    }
    print(json.dumps(out, indent=2) if args.json else _text(out, plan, profile))
    return EXIT_FITS if reason is None else EXIT_DOES_NOT_FIT


def _text(out: dict[str, Any], plan: OffloadPlan | None, profile: HardwareProfile) -> str:
    m, run = out["model"], out["run"]
    lines = [f"model: {m['source']}: {m['numel'] / 1e9:.2f}B parameters, {m['num_layers']} layers, hidden "
             f"{m['hidden_size']}; batch {run['batch_size']} x {run['seq_len']}, checkpointing "
             f"{'on' if run['grad_ckpt'] else 'off'}",
             f"hardware: {profile.name or profile.device_type} ({profile.source or 'unknown source'})"]
    if plan is not None:
        lines.append(plan.summary())
    mem = out["memory_gib"]
    free = "unknown" if profile.device_free_bytes is None else f"{profile.device_free_bytes / GiB:.1f} GiB"
    avail = "unknown" if profile.host_available_bytes is None else f"{profile.host_available_bytes / GiB:.1f} GiB"
    lines += [f"predicted GPU memory: {mem['gpu_required']:.1f} GiB required of {free} free ({mem['gpu_peak']:.1f} "
              f"allocated at the {mem['gpu_peak_phase']} phase: {_items(mem['gpu'])})",
              f"predicted host memory: {mem['host_peak']:.1f} GiB peak of {avail} available (expected RSS "
              f"{mem['host_expected']:.1f}: {_items(mem['host'])})"]
    st = out["step_time_s"]
    if st is None:
        lines.append("predicted step: unknown (the profile lacks measured GPU/link rates; try --profile h200)")
    else:
        accum = "" if st["micro_batches"] == 1 else (f"{st['micro_batches']} micro-batches, each before the last "
                                                      f"{st['micro_batch_s']:.3f} s; the last: ")
        lines.append(f"predicted step: {st['step_s']:.3f} s ({accum}GPU {st['gpu_s']:.3f}, CPU Adam {st['cpu_s']:.3f} "
                     f"against a {st['backward_window_s']:.3f} s backward, exposed {st['exposed_s']:.3f}, device tail "
                     f"{st['tail_s']:.3f}; {st['speculated_fraction']:.0%} of host buckets speculated); "
                     f"{out['step_time_clipping_every_step_s']:.3f} s while clipping fires every step")
        if out["deferred_commits_clipping_every_step_s"]:  # the worker's time beside the pass ([Note: deferred moments])
            lines[-1] += (f" (the deferred stores' commits: {out['deferred_commits_clipping_every_step_s']:.3f}"
                          " s of CPU worker time after the pass)")
    rk = out["ranks"]
    if rk["world_size"] > 1:
        pr = rk["per_rank"]
        coll = "" if st is None else (f"; collectives {pr['collectives_s']:.3f} s (reduce-scatter + all-gather), "
                                      f"{pr['collectives_exposed_s']:.3f} s of it exposed")
        lines.append(f"ranks: {rk['data_parallel']} data-parallel x {rk['sequence_parallel']} sequence-parallel = "
                     f"{rk['world_size']} on this host; per rank {pr['gpu_required_gib']:.1f} GiB GPU required, "
                     f"{pr['host_peak_gib']:.1f} GiB host peak (all ranks {rk['host_peak_all_ranks_gib']:.1f})"
                     f"{coll}")
    b = out["gpu_adamw_baseline_gib"]
    lines.append(f"plain GPU AdamW would need {b['gpu_required']:.1f} GiB ({'fits' if b['fits'] else 'does not fit'})")
    lg = out["largest_fitting"]
    lines.append("largest model of this width that fits: " + (
        "unknown (free GPU memory unknown: pass --gpu-mem or --profile)" if profile.device_free_bytes is None else
        "none" if lg is None else f"{'at least ' if lg['at_search_limit'] else ''}{lg['num_layers']} layers, "
        f"{lg['numel'] / 1e9:.2f}B parameters"))
    ls = out["longest_sequence"]
    if ls is not None and not ls["tokens"]:
        lines.append(f"longest sequence that fits at batch {run['batch_size']}: none (no plan fits one token)")
    elif ls is not None:
        how = "with this plan" if ls["with_this_plan"] else "shorter than asked, with the plan search's plan for it"
        lines.append(f"longest sequence that fits at batch {run['batch_size']}: "
                     f"{'at least ' if ls['at_search_limit'] else ''}{ls['tokens']:,} tokens "
                     f"({ls['sequence_parallel']} GPU(s) per sequence; {how})")
    lines += [f"note: {n}" for n in out["notes"]]
    lines.append("fits: yes" if out["fits"] else f"DOES NOT FIT: {out['reason']}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hf_superoffload.plan_cli --model ...`` (the same as ``hf-superoffload plan``)."""
    parser = OneLineParser(prog="hf-superoffload")
    add_plan_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
