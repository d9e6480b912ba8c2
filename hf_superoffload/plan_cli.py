"""``hf-superoffload plan``: will this model train here, how, how much memory, how fast?

Builds the real :class:`~hf_superoffload.planning.plan.OffloadPlan` (``make_plan``) from the model's parameter
sizes in gradient-arrival order (the model is built on the meta device: nothing is allocated), predicts the
peak GPU and host memory (``planning/memory_model.py``) and the step time (the roofline below), reports the
largest model of the same width that fits, and exits 1 with the reason and what to change when the run does
not fit (2 for bad input).

[Note: step-time roofline]
T = batch x seq tokens, N parameters, L layers, d attention width, S sequence length.

* GPU: F = k (N T + L d S T) FLOPs, k = 8 with checkpointing (the forward runs twice), 6 without; the second
  term is causal attention. ``gpu_s = F_gemm / (matmul_tflops x 0.68) + F_attention / (matmul_tflops x 0.6)``:
  with bf16 weights (no autocast copies) the
  default plans reach 0.66 (3.6B, batch 8: 0.959 s with its device tail's 0.02 s) and 0.70 (8B, batch 4: 1.018 s)
  of the 802 TFLOP/s GEMM rate counted this way (the fp32-weight autocast anchors 0.58-0.62; 0.45 when counting
  model FLOPs, 6N, as MFU does). Backward (with recompute) is ``W_b`` = 3/4 of it (2/3 without checkpointing),
  the forward ``W_f`` the rest. Ulysses over P GPUs: one rank does F / P (its tokens; 1/P of the heads in
  attention; 8B at 256k on 2 H200: 92 s predicted, 95.9 measured), and the P ranks of the host split its CPU
  Adam rate and memory bandwidth. A tiled MLP adds one MLP forward, ``2 x 3 h f L T``.
* link: e = 2 B/param each way (CPU cast) or 4 (GPU cast); ``d2h_s = e H / d2h``, ``h2d_s = e H / h2d`` for
  the H host parameters.
* CPU: the Adam rate R shares host memory with the gradient DMA landing during backward:
  ``R_eff = R (1 - (e H / W_b) / host_memory_gbps)`` (``host_memory_gbps`` defaults to 28 B x R: the kernel
  is bandwidth bound); ``cpu_s = H / R_eff``. Buckets are stepped speculatively as they land, so by the
  verdict ``spec = min(cpu_s, W_b - one bucket)`` is done (that share of snapshot pages gets written);
  ``rem = cpu_s - spec`` is left.
* exposed: D2H beyond backward, ``max(0, d2h_s - W_b)``; the remainder and the uploads beyond the next
  forward, ``max(0, max(rem, h2d_s) - W_f)`` plus one bucket's latency when ``rem > 0``; the device tail's
  AdamW, 28 B/param at ``device_memory_gbps``, runs after validation and is fully exposed.
* weight flow: the streamed weights cross the link twice per step, 2 B/param before their forward and again
  before their backward. ``h2d_s`` is then the forward's fetch (the step's uploads are gone: staging is the
  weights' home), and the backward's fetch shares the backward window with the gradients' D2H, each at the
  concurrent rate: ``max(0, max(d2h_s', fetch_s') - W_b)`` replaces the D2H term.
* ``step_s = gpu_s + tail_s + exposed``. While clipping fires on every step, speculation pauses: nothing is
  stepped in the backward, and the whole pass (``H / R``, no DMA contention; 20/28 of it with deferred moment
  stores) is ``rem``, overlapping only the next forward (3.6B all-host, batch 8: 1.30 s predicted, 1.274
  measured).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
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
from .planning.planner import PlanError, Workload, make_plan

__all__ = ["StepTime", "add_plan_parser", "arrival_numels", "load_model_config", "main", "main_plan",
           "predict_step_time"]

EXIT_FITS, EXIT_DOES_NOT_FIT, EXIT_BAD_INPUT = 0, 1, 2
GEMM_EFFICIENCY = 0.68  # [Note: step-time roofline]: the default plans' measured share of the GEMM rate
ATTENTION_EFFICIENCY = 0.6  # ... and of the causal attention term (fitted where it dominates: 8B at 256k tokens)
MAX_LAYERS = 2048  # the search limit of largest_model_that_fits
MAX_SEQ = 1 << 24  # the search limit of the longest sequence (16M tokens)
_PROFILE_ALIASES = {"gh200": "gh200", "h200": "h200_pcie", "rtx4090": "rtx4090_24gb"}


class InputError(ValueError):
    """The model or profile given on the command line cannot be used."""


# ---------------------------------------------------------------------------------------------- inputs
def load_model_config(spec: str) -> Any:
    """A transformers config from a preset name, a ``config.json`` file, a local folder or a hub model id."""
    from transformers import AutoConfig

    from .presets import PRESETS, llama_config

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
                     workload: Workload) -> tuple[int, MemoryEstimate] | None:
    """The most layers of this width for which the planner's own search finds a plan that fits: the same search,
    and the same check, as the verdict (so a model below the frontier always fits)."""
    run = workload.estimate_kwargs()

    def est_for(layers: int) -> MemoryEstimate | None:
        s = shape.with_layers(layers)
        try:
            plan = make_plan(layered(layers), element_size=2, config=cfg, profile=profile,
                             workload=dataclasses.replace(workload, model=s))
        except PlanError:
            return None
        est = estimate(s, plan_like=PlanLike.from_plan(plan), **run)
        return est if fits(est, profile) else None

    best = bisect_largest(1, MAX_LAYERS, lambda layers: est_for(layers) is not None)
    if best is None:
        return None
    est = est_for(best)
    assert est is not None
    return best, est


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


# ---------------------------------------------------------------------------------------------- step time
@dataclass(frozen=True, slots=True)
class StepTime:
    """Predicted seconds of one optimizer step (see [Note: step-time roofline])."""

    gpu_s: float
    backward_window_s: float
    forward_window_s: float
    cpu_s: float
    d2h_s: float
    h2d_s: float
    tail_s: float
    exposed_s: float
    step_s: float
    speculated_fraction: float


def predict_step_time(shape: ModelShape, plan_like: PlanLike, profile: HardwareProfile, *, batch_size: int,
                      seq_len: int, grad_ckpt: bool, sequence_parallel: int = 1,
                      mlp_tile_tokens: int | None = None, keep_attention: bool = False,
                      clipping_every_step: bool = False) -> StepTime | None:
    """The roofline of [Note: step-time roofline] for one rank; ``None`` when the profile lacks a rate it needs.

    ``sequence_parallel`` P: each of the P ranks on this host computes 1/P of every layer (its tokens outside
    attention, 1/P of the heads inside), and they share the host's cores and memory bandwidth; ``plan_like`` is
    one rank's plan (its shard of the optimizer state). ``mlp_tile_tokens`` below the tokens per rank: the tiled
    MLP's backward runs one more MLP forward (2 FLOPs per MLP weight and token). ``keep_attention``: checkpointing
    keeps attention's outputs, so attention runs forward once (6 instead of 8 FLOPs per attention "parameter").
    ``clipping_every_step``: speculation pauses (every verdict is a redo), so the whole CPU pass starts at the
    verdict, free of the backward's DMA, and with deferred moment stores moves 20 of 28 B/param."""
    p, host = profile, plan_like.host_numel
    need = (p.matmul_tflops, p.cpu_adam_gparams, p.h2d_gbps, p.d2h_gbps, p.device_memory_gbps)
    if any(x is None for x in need):
        return None
    tokens = batch_size * seq_len
    k = 8 if grad_ckpt else 6
    k_attn = 6 if keep_attention else k
    gemm = k * shape.numel * tokens
    attention = k_attn * shape.num_layers * shape.num_heads * shape.head_dim * seq_len * tokens
    if mlp_tile_tokens is not None and mlp_tile_tokens < -(-tokens // sequence_parallel):
        gemm += 2 * 3 * shape.hidden_size * shape.intermediate_size * shape.num_layers * tokens
    rate_flops = p.matmul_tflops * 1e12 * sequence_parallel
    gpu_s = gemm / (rate_flops * GEMM_EFFICIENCY) + attention / (rate_flops * ATTENTION_EFFICIENCY)
    w_b = gpu_s * (0.75 if grad_ckpt else 2 / 3)
    w_f = gpu_s - w_b
    e = 4 if plan_like.cast_side == "gpu" else 2  # bytes per parameter up (the fp32 master or bf16); down: always 2
    rate = p.cpu_adam_gparams * 1e9 / sequence_parallel
    host_bw = (p.host_memory_gbps or 28 * p.cpu_adam_gparams) * 1e9 / sequence_parallel
    rate_eff = rate * max(0.2, 1 - (e * host / w_b) / host_bw)
    cpu_s = host / rate_eff
    d2h_s, h2d_s = 2 * host / (p.d2h_gbps * 1e9), e * host / (p.h2d_gbps * 1e9)
    bucket = plan_like.bucket_bytes / e
    latency = bucket / rate_eff + plan_like.bucket_bytes / (p.h2d_gbps * 1e9) if host else 0.0
    spec = min(cpu_s, max(0.0, w_b - latency))
    rem = cpu_s - spec
    if clipping_every_step:
        spec = 0.0
        rem = host / rate * (20 / 28 if plan_like.deferred_landing_bytes else 1.0)
    backward_link = max(0.0, d2h_s - w_b)
    if plan_like.weight_mode == "flow":
        h2d_s = 2 * host / (p.h2d_gbps * 1e9)  # the forward's fetch
        d2h_c, h2d_c = (p.d2h_concurrent_gbps or p.d2h_gbps) * 1e9, (p.h2d_concurrent_gbps or p.h2d_gbps) * 1e9
        backward_link = max(0.0, max(2 * host / d2h_c, 2 * host / h2d_c) - w_b)
    exposed = backward_link + max(0.0, max(rem, h2d_s) - w_f) + (latency if rem > 0 else 0.0)
    tail_s = 28 * plan_like.device_numel / (p.device_memory_gbps * 1e9)
    return StepTime(gpu_s, w_b, w_f, cpu_s, d2h_s, h2d_s, tail_s, exposed, gpu_s + tail_s + exposed,
                    spec / cpu_s if cpu_s > 0 else 1.0)


# ---------------------------------------------------------------------------------------------- command
def add_plan_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``plan`` on an ``argparse`` subparsers object (``hf-superoffload plan ...``)."""
    p = subparsers.add_parser("plan", help="predict the offload plan, memory and step time of a run; exit 1 if it "
                              "cannot fit", description=__doc__.splitlines()[0])
    from .presets import PRESETS

    memory = float_in(0.0, 1e6, lo_open=True, hint=" GiB")
    p.add_argument("--model", required=True, type=model_spec(tuple(PRESETS)),
                   help="config.json, local model folder, hub model id or preset")
    p.add_argument("--batch-size", type=int_in(1, 1 << 16), required=True)
    p.add_argument("--seq-len", type=int_in(1, MAX_SEQ), required=True)
    p.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing")
    p.add_argument("--gpu-mem", type=memory, default=None, help="free GPU memory in GiB (overrides the profile)")
    p.add_argument("--host-mem", type=memory, default=None, help="available host RAM in GiB (overrides the profile)")
    p.add_argument("--profile", default="measure", help="measure (this machine), gh200, h200, rtx4090 or a JSON "
                   "file written by HardwareProfile.save")
    p.add_argument("--offload-config", default=None, type=offload_config, help="SuperOffloadConfig fields as JSON")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--sequence-parallel", type=int_in(1, 4096), default=1, metavar="P",
                   help="Ulysses ranks per sequence (one GPU each): activations per GPU are 1/P, the loss is chunked, "
                        "the optimizer state is sharded over the P ranks; also prints the longest sequence that fits")
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


def _mem(d: dict[str, int]) -> dict[str, float]:
    return {k: round(v / GiB, 2) for k, v in d.items()}


def _items(d: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.1f}" for k, v in d.items() if v)


def main_plan(args: argparse.Namespace) -> int:
    """Run ``plan``; 0 fits, 1 does not fit (reason printed), 2 bad input."""
    try:
        if args.batch_size < 1 or args.seq_len < 1:
            raise InputError("--batch-size and --seq-len must be >= 1")
        if args.sequence_parallel < 1 or (args.loss_chunk is not None and args.loss_chunk < 1):
            raise InputError("--sequence-parallel and --loss-chunk must be >= 1")
        if args.tiled_mlp < 0:
            raise InputError("--tiled-mlp must be >= 0 (0: untiled)")
        if args.keep_attention and not args.grad_ckpt:
            raise InputError("--keep-attention is a form of gradient checkpointing: add --grad-ckpt")
        config = load_model_config(args.model)
        shape = ModelShape.from_config(config)
        profile = resolve_profile(args.profile, gpu_mem_gb=args.gpu_mem, host_mem_gb=args.host_mem)
        cfg = SuperOffloadConfig(**json.loads(args.offload_config)) if args.offload_config else SuperOffloadConfig()
        numels = arrival_numels(config)
    except (InputError, ValueError, TypeError) as e:
        print(f"hf-superoffload plan: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    run = dict(batch_size=args.batch_size, seq_len=args.seq_len, grad_ckpt=args.grad_ckpt)
    sp = args.sequence_parallel
    chunk = args.loss_chunk if args.loss_chunk is not None else (4096 if sp > 1 else None)
    sp_kw = dict(sequence_parallel=sp, loss_chunk_tokens=chunk, mlp_tile_tokens=args.tiled_mlp or None,
                 keep_attention=args.keep_attention)
    workload = Workload(shape, **run, **sp_kw)
    ranks: dict[str, Any] = {}
    if sp > 1:  # one rank per GPU of this host; the profile's cores are split between them
        cores = list(range(profile.cpu_cores)) if profile.cpu_cores else None
        ranks = dict(world_size=sp, rank=0, local_world_size=sp, local_rank=0, cores=cores)
    notes: list[str] = []
    reasons: list[str] = []
    plan: OffloadPlan | None = None
    try:
        plan = make_plan(numels, element_size=2, config=cfg, profile=profile, workload=workload, **ranks)
        plan_like = PlanLike.from_plan(plan)  # the planner already sized the tail for this workload's activations
        host_est = estimate(shape, plan_like=plan_like, **run, **sp_kw)
        over = profile.host_available_bytes is not None and host_est.host_peak_bytes > profile.host_available_bytes
        if over and cfg.rollback == "auto" and plan.rollback.value != "inverse":
            plan = make_plan(numels, element_size=2, config=cfg.replace(rollback="inverse"), profile=profile,
                             workload=workload, **ranks)
            plan_like = PlanLike.from_plan(plan)
            notes.append("rollback: inverse, because the second state copy does not fit with the runtime's own RSS")
    except PlanError as e:  # show the numbers of the leanest plan: every state on the host, inverse rollback
        reasons.append(f"the planner refuses: {e}")
        plan, plan_like = None, PlanLike.all_host(sum(numels))
    step = predict_step_time(shape, plan_like, profile, **run, sequence_parallel=sp,
                             mlp_tile_tokens=args.tiled_mlp or None, keep_attention=args.keep_attention)
    clipped = predict_step_time(shape, plan_like, profile, **run, sequence_parallel=sp,
                                mlp_tile_tokens=args.tiled_mlp or None, keep_attention=args.keep_attention,
                                clipping_every_step=True)
    if step is not None and plan is not None and plan.rollback.value == "snapshot":
        plan_like = dataclasses.replace(plan_like, speculated_fraction=step.speculated_fraction)
    est = estimate(shape, plan_like=plan_like, **run, **sp_kw)
    try:
        check_fits(est, profile)
    except PlanError as e:
        reasons.append(str(e))
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
            largest = _largest_by_plan(shape, layered, cfg, profile, workload)
        else:  # not a plain stack of identical layers (or several ranks): the memory model's own search
            largest = largest_model_that_fits(shape, profile=profile, host_bytes_per_param=plan_like.host_bytes_per_param,
                                              max_layers=MAX_LAYERS, weight_mode=plan_like.weight_mode,
                                              bucket_bytes=plan_like.bucket_bytes, **run)
    longest = None
    if profile.device_free_bytes is not None:
        free = profile.device_free_bytes

        def seq_fits(n: int) -> bool:
            e = estimate(shape, plan_like=plan_like, batch_size=args.batch_size, seq_len=n * sp,
                         grad_ckpt=args.grad_ckpt, **sp_kw)
            return e.gpu_required_bytes <= free

        per_rank = bisect_largest(1, MAX_SEQ // sp, seq_fits)
        longest = None if per_rank is None else per_rank * sp
    if sp > 1:
        notes.append(f"sequence parallel: {sp} ranks per sequence, {-(-args.seq_len // sp)} tokens of each sequence "
                     f"per GPU; loss over chunks of {chunk} tokens; optimizer state sharded over the {sp} ranks "
                     "(the step time is one rank's; the largest-model search assumes one rank)")
    out = {
        "fits": reason is None, "reason": reason,
        "longest_sequence": None if longest is None else {"tokens": longest, "sequence_parallel": sp,
                                                          "at_search_limit": longest >= MAX_SEQ - sp},
        "model": {"source": args.model, "numel": sum(numels), **dataclasses.asdict(shape)},
        "run": run, "profile": profile.to_dict(),
        "plan": None if plan is None else {
            "buckets": len(plan.buckets), "host_buckets": len(plan.host_buckets),
            "device_buckets": len(plan.device_buckets), "host_numel": plan.host_numel,
            "device_numel": plan.device_numel, "weight_mode": plan.weight_mode.value,
            "cast_side": plan.cast_side.value, "rollback": plan.rollback.value, "speculation": plan.speculation,
            "cpu_threads": plan.cpu_threads, "notes": list(plan.notes)},
        "memory_gib": {
            "gpu_peak_phase": est.gpu_peak_phase, "gpu": _mem(est.gpu), "gpu_peak": round(est.gpu_peak_bytes / GiB, 2),
            "gpu_required": round(est.gpu_required_bytes / GiB, 2), "host": _mem(est.host),
            "host_peak": round(est.host_peak_bytes / GiB, 2), "host_expected": round(est.host_expected_bytes / GiB, 2)},
        "step_time_s": None if step is None else {k: round(v, 4) for k, v in dataclasses.asdict(step).items()},
        "step_time_clipping_every_step_s": None if clipped is None else round(clipped.step_s, 4),
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
        lines.append(f"predicted step: {st['step_s']:.3f} s (GPU {st['gpu_s']:.3f}, CPU Adam {st['cpu_s']:.3f} "
                     f"against a {st['backward_window_s']:.3f} s backward, exposed {st['exposed_s']:.3f}, device tail "
                     f"{st['tail_s']:.3f}; {st['speculated_fraction']:.0%} of host buckets speculated); "
                     f"{out['step_time_clipping_every_step_s']:.3f} s while clipping fires every step")
    b = out["gpu_adamw_baseline_gib"]
    lines.append(f"plain GPU AdamW would need {b['gpu_required']:.1f} GiB ({'fits' if b['fits'] else 'does not fit'})")
    lg = out["largest_fitting"]
    lines.append("largest model of this width that fits: " + (
        "unknown (free GPU memory unknown: pass --gpu-mem or --profile)" if profile.device_free_bytes is None else
        "none" if lg is None else f"{'at least ' if lg['at_search_limit'] else ''}{lg['num_layers']} layers, "
        f"{lg['numel'] / 1e9:.2f}B parameters"))
    ls = out["longest_sequence"]
    if ls is not None:
        lines.append(f"longest sequence that fits at batch {run['batch_size']}: "
                     f"{'at least ' if ls['at_search_limit'] else ''}{ls['tokens']:,} tokens "
                     f"({ls['sequence_parallel']} GPU(s) per sequence)")
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
