"""What the defaults do: the README snippet against the fastest GPU-only baseline, side by side in one call.

    python benchmarks/defaults.py --rows 3.6b:8 8b:4 --out $OUT/defaults.jsonl [--warmup 10] [--steps 5]

Every row runs in its own process (a fresh CUDA context and host RSS) on a random-init Llama-style model of the
preset's shape, batch x 2048 tokens, activation checkpointing, clipping at 1.0 (it fires on random data: the
worst case for speculation). Systems per row:

  gpu_fp32   fp32 weights, bf16 autocast, torch AdamW(fused=True), clip_grad_norm_ (baseline 1)
  gpu_bf16   bf16 weights, fp32 masters, torch AdamW(fused=True) on the masters, clip_grad_norm_ (baseline 2)
  gpu_bf16_kept  gpu_bf16 with as many decoder layers left unchecked (activations kept, no recompute) as the
             memory model says the device holds beside it: the planner's kept layers given to the baseline too
             ([Note: kept layers]), so a speed-up is the offload's and not only the recompute's
  snippet    ``SuperOffloadOptimizer(model, lr=..., betas=..., weight_decay=..., max_grad_norm=1.0)``: nothing
             else, the README's own snippet (its plan is made at the first batch); accumulation through ``no_sync``
  host0      the snippet with ``SuperOffloadConfig(gpu_resident_buckets=0)``: every optimizer state on the host
  host0_inverse  host0 with ``rollback="inverse"`` (one state copy: 12 B/param less host RAM than the double buffer)
  trainer    ``SuperOffloadTrainer(args=SuperOffloadArguments(bf16=True, max_grad_norm=1.0,
             gradient_accumulation_steps=ACCUM, ...))``, no offload settings: the README's Trainer snippet on the
             same random tokens (timed between optimizer steps by a callback that waits for the GPU)

A row spec is ``PRESET:BATCH[:ACCUM[:LAYERS]]`` (LAYERS overrides the preset's depth, e.g. ``14b:4:8:49`` is 15.0B).
Each record: median/min/max seconds per optimizer step over the timed steps, tokens/s, MFU (6N + 6 L d s per token
over 989 TFLOP/s), peak GPU memory (``max_memory_allocated``), peak host RSS, what lives on the host (parameters
and GB of optimizer state), and the planner's own predictions for the plan it made (step time, peak GPU, host) so
predicted and measured sit side by side. A baseline that runs out of memory is recorded as ``oom``. On a GPU, ours
then run one more step phase by phase: the forward, backward and step seconds (``phases``) and each phase's peak
GPU memory (``phase_peak_gpu_gb``: forward through the loss; loss, which ends when the gradient reaches the final
norm's output; backward; step) beside the memory model's (``predicted.gpu_phases_gb``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

PEAK_TFLOPS = 989.0
LR = 1e-5
CLIP = float(os.environ.get("DEFAULTS_CLIP", "1.0"))
"""The clipping threshold of every system (``--clip``; the worker reads it from the environment)."""
SYSTEMS = ("gpu_fp32", "gpu_bf16", "gpu_bf16_kept", "snippet", "host0", "host0_inverse", "trainer")
OURS = ("snippet", "host0", "host0_inverse", "trainer")


def _model(preset: str, layers: int | None, device: Any, dtype: Any) -> Any:
    from hf_superoffload.demo.presets import build_on
    from hf_superoffload.plan_cli import load_model_config

    cfg = load_model_config(preset)
    if layers:
        cfg.num_hidden_layers = layers
    cfg.max_position_embeddings = 4096
    cfg._attn_implementation = "sdpa" if device.type == "cuda" else "eager"
    model = build_on(cfg, device=device, dtype=dtype, seed=0)
    model.config.use_cache = False
    model.activation_checkpointing_enable() if hasattr(model, "activation_checkpointing_enable") \
        else model.gradient_checkpointing_enable()
    model.train()
    return model


def settings_config(settings: dict[str, Any], base: Any = None) -> Any:
    """A ``SuperOffloadConfig`` from ``--set`` pairs (``PlannerOverrides`` fields go to its ``overrides``)."""
    import dataclasses

    from hf_superoffload import SuperOffloadConfig
    from hf_superoffload.config import PlannerOverrides

    top = {f.name for f in dataclasses.fields(SuperOffloadConfig)}
    over = {f.name for f in dataclasses.fields(PlannerOverrides)}
    unknown = sorted(set(settings) - top - over)
    if unknown:
        raise SystemExit(f"--set {unknown[0]}: not a SuperOffloadConfig or PlannerOverrides field")
    base = base or SuperOffloadConfig()
    ov = dataclasses.replace(base.overrides, **{k: v for k, v in settings.items() if k in over})
    return dataclasses.replace(base, overrides=ov, **{k: v for k, v in settings.items() if k in top})


class Timing:
    """Which steps are timed, one rule for the snippet's loop and the Trainer's callback: past the warm-up, once the
    optimizer has settled ([Note: the thread trial]: a trial that compared nothing runs again) and the iteration
    after it, which may hold a pass at the trial count, is past; never later than ``most_steps - steps``. A step
    timed during the trial runs at another thread count."""

    def __init__(self, warmup: int, steps: int) -> None:
        from hf_superoffload.planning.thread_trial import ATTEMPTS, TRIAL_STEPS

        self.warmup, self.steps = warmup, steps
        self.last_warmup = warmup + (ATTEMPTS - 1) * TRIAL_STEPS
        self.most_steps = self.last_warmup + steps
        self.settled_at: int | None = None
        self.times: list[float] = []
        self.per_step: list[dict[str, Any]] = []

    def record(self, k: int, wall: float, opt: Any) -> bool:
        """Step ``k`` (from 0) took ``wall`` seconds, GPU drained; ``opt`` is ours (else a baseline's ``None``).
        Returns whether the timed steps are complete."""
        if self.settled_at is None and (opt is None or opt.settled):
            self.settled_at = k
        if k >= self.warmup and ((self.settled_at is not None and k >= self.settled_at + 2) or k >= self.last_warmup):
            self.times.append(wall)
        if opt is not None and (st := opt.last_step_stats) is not None:
            self.per_step.append({"wall_s": wall, **{f: getattr(st, f) for f in (
                "cpu_s", "wait_s", "gpu_idle_s", "pass_s", "commit_s", "iteration_s", "wasted_buckets", "verdict",
                "master_deferred_buckets", "moment_deferred_buckets")},
                "pass_adam_s": st.host_pass.adam_s if st.host_pass is not None else 0.0,
                "pass_threads": st.host_pass.threads if st.host_pass is not None else None,
                "settled": opt.settled})
        return len(self.times) == self.steps


def run_one(system: str, preset: str, batch: int, accum: int, layers: int | None, seq: int, warmup: int,
            steps: int, device_name: str, gpu_cap_gib: float | None = None, settings: dict[str, Any] | None = None,
            profile_dir: str | None = None) -> dict[str, Any]:
    import torch

    device = torch.device(device_name)
    cuda = device.type == "cuda"
    dtype = torch.float32 if system == "gpu_fp32" else torch.bfloat16
    rec: dict[str, Any] = {"system": system, "preset": preset, "batch": batch, "accum": accum, "seq": seq,
                           "clip": CLIP, "warmup": warmup, "steps": steps}
    if gpu_cap_gib is not None and cuda:  # a smaller GPU, as the caching allocator sees it
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, gpu_cap_gib * 1024**3 / total),
                                                   device.index if device.index is not None else 0)
        rec["gpu_cap_gib"] = gpu_cap_gib
    model = _model(preset, layers, device, dtype)
    params = [p for p in model.parameters() if p.requires_grad]
    n = sum(p.numel() for p in params)
    cfg = model.config
    rec.update(params=n, layers=cfg.num_hidden_layers)
    gen = torch.Generator().manual_seed(1234)
    batches = [torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen).to(device) for _ in range(accum)]

    if system == "trainer":
        if settings:
            raise SystemExit("--set applies to the optimizer systems, not to the trainer")
        return _run_trainer(rec, model, batches, batch, accum, seq, n, warmup, steps, device)
    opt: Any
    if system == "gpu_fp32":
        opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), weight_decay=0.1, fused=cuda)

        def update() -> None:
            torch.nn.utils.clip_grad_norm_(params, CLIP)
            opt.step()
            opt.zero_grad(set_to_none=True)
    elif system in ("gpu_bf16", "gpu_bf16_kept"):
        if system == "gpu_bf16_kept":
            rec["kept_layers"] = _keep_layers_for_baseline(model, batch, seq, device)
        masters = [p.detach().float().requires_grad_(True) for p in params]
        opt = torch.optim.AdamW(masters, lr=LR, betas=(0.9, 0.95), weight_decay=0.1, fused=cuda)

        def update() -> None:
            for p, m in zip(params, masters, strict=True):
                m.grad = p.grad.float()
                p.grad = None
            torch.nn.utils.clip_grad_norm_(masters, CLIP)
            opt.step()
            opt.zero_grad(set_to_none=True)
            with torch.no_grad():
                torch._foreach_copy_(params, masters)
    else:
        from hf_superoffload import SuperOffloadConfig, SuperOffloadOptimizer

        config = {"host0": SuperOffloadConfig(gpu_resident_buckets=0),
                  "host0_inverse": SuperOffloadConfig(gpu_resident_buckets=0, rollback="inverse")}.get(system)
        if settings:  # a row that names its settings (not the defaults)
            config = settings_config(settings, config)
            rec["settings"] = settings
        # the README snippet, as written: no workload, no settings
        opt = SuperOffloadOptimizer(model, lr=LR, betas=(0.9, 0.95), weight_decay=0.1, max_grad_norm=CLIP,
                                    config=config)

        def update() -> None:
            opt.step()
            opt.zero_grad()

    def loss_of(ids: Any) -> Any:
        if system == "gpu_fp32":  # fp32 weights compute in bf16 under autocast, as mixed-precision training does
            with torch.autocast(device.type, dtype=torch.bfloat16):
                return model(input_ids=ids, labels=ids).loss / accum
        return model(input_ids=ids, labels=ids).loss / accum

    def step() -> None:
        for k, ids in enumerate(batches):
            if system in OURS and k < accum - 1:
                with opt.no_sync():
                    loss_of(ids).backward()
            else:
                loss_of(ids).backward()
        update()

    def sync() -> None:
        # the GPU's queue only, as a training loop does: the CPU pass of a step overlaps the next forward (each
        # layer waits for its own bucket), so a step's carry-over is paid inside the next step's interval
        if cuda:
            torch.cuda.synchronize(device)

    timing = Timing(warmup, steps)
    rec["per_step"] = timing.per_step  # every step's own stats, warm-up included: what the calibration saw
    k = 0
    try:
        for k in range(timing.most_steps):
            t = time.perf_counter()
            step()
            sync()
            if timing.record(k, time.perf_counter() - t, opt if system in OURS else None):
                rec["warmup_steps"] = k + 1 - steps
                rec["settled_step"] = timing.settled_at
                break
    except torch.OutOfMemoryError as e:
        _record_oom(rec, e, device, opt if system in OURS else None)
        rec["oom_step"] = k
        return rec
    _finish(rec, timing.times, batch, accum, seq, n, cfg, device)
    if system in OURS:
        _describe(rec, opt, model, batch, seq, accum)
        if cuda:  # one more step, phase by phase (each phase waits for the GPU): where the time and memory go
            phases: dict[str, float] = {}
            peaks: dict[str, float] = {}  # each phase's max_memory_allocated, beside the memory model's phases
            torch.cuda.reset_peak_memory_stats(device)

            def _loss_done(grad: Any) -> None:
                # the gradient reached the final norm's output: the loss's backward (its logits and their
                # gradient) is over, the model's "loss" phase ends here and its "backward" phase begins
                peaks["loss"] = max(peaks["forward"], torch.cuda.max_memory_allocated(device) / 1e9)
                torch.cuda.reset_peak_memory_stats(device)

            def _watch(_module: Any, _args: Any, out: Any) -> None:
                out.register_hook(_loss_done)

            handle = model.model.norm.register_forward_hook(_watch)
            t = time.perf_counter()
            loss = loss_of(batches[-1])
            torch.cuda.synchronize(device)
            phases["forward_s"] = time.perf_counter() - t
            peaks["forward"] = torch.cuda.max_memory_allocated(device) / 1e9
            torch.cuda.reset_peak_memory_stats(device)
            t = time.perf_counter()
            loss.backward()
            torch.cuda.synchronize(device)
            phases["backward_s"] = time.perf_counter() - t
            handle.remove()
            peaks["backward"] = torch.cuda.max_memory_allocated(device) / 1e9
            torch.cuda.reset_peak_memory_stats(device)
            t = time.perf_counter()
            update()
            opt.synchronize()  # here the whole CPU pass, with nothing to overlap it
            torch.cuda.synchronize(device)
            phases["step_and_pass_s"] = time.perf_counter() - t
            peaks["step"] = torch.cuda.max_memory_allocated(device) / 1e9
            rec["phases"] = phases
            rec["phase_peak_gpu_gb"] = peaks
        if profile_dir:  # one more step under torch.profiler, every thread: where the time goes
            sys.path.insert(0, str(Path(__file__).parent))
            import suite  # its module body imports only the standard library

            tag = f"{system}_{preset}_b{batch}_a{accum}"
            rec["profile"] = suite._profile(system, step, sync, device, 1, Path(profile_dir), tag)
    return rec


def _keep_layers_for_baseline(model: Any, batch: int, seq: int, device: Any) -> int:
    """Leave the last k decoder layers of the GPU-only baseline unchecked, k the most the memory model says fit
    (every optimizer state on the device: the same bytes as bf16 weights + fp32 masters + AdamW; transformers' loss
    over all logits, as the baseline runs it; the planner's 4% margin). Returns k."""
    import torch

    from hf_superoffload.planning.hardware import available_host_bytes
    from hf_superoffload.planning.memory_model import PlanLike, estimate
    from hf_superoffload.planning.planner import bisect_largest_int
    from hf_superoffload.runtime.kept_layers import KeptLayers, checkpointed_layers

    n = sum(p.numel() for p in model.parameters())
    if device.type == "cuda":
        budget = 0.96 * (torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_allocated(device))
    else:  # the CPU smoke test: the host's RAM is the device's
        budget = 0.96 * (available_host_bytes() or 0)

    def fits(k: int) -> bool:
        est = estimate(model.config, batch_size=batch, seq_len=seq, grad_ckpt=True,
                       plan_like=PlanLike(device_numel=n, kept_layers=k))
        return est.gpu_required_bytes <= budget

    layers = checkpointed_layers(model)
    kept = bisect_largest_int(0, len(layers), fits) if fits(0) else 0
    KeptLayers(layers, kept)
    return kept


def _describe(rec: dict[str, Any], opt: Any, model: Any, batch: int, seq: int, accum: int) -> None:
    plan = opt.plan
    rec["plan"] = {"host_params": plan.host_numel, "device_params": plan.device_numel, "kept_layers": plan.kept_layers,
                   "host_state_gb": plan.host_bytes() / 1e9, "weight_mode": plan.weight_mode.value,
                   "cast_side": plan.cast_side.value, "rollback": plan.rollback.value,
                   "host_accumulation": plan.host_accumulation.value, "defer_moments": plan.defer_moments,
                   "d2h_lead": plan.d2h_lead_buckets, "cpu_threads": plan.cpu_threads,
                   "bucket_size_mb": plan.bucket_size_mb, "host_buckets": len(plan.host_buckets),
                   "workload_inferred": opt.workload is not None, "summary": plan.summary()}
    st = opt.last_step_stats
    rec["last_step"] = {k: getattr(st, k) for k in ("cpu_s", "wait_s", "gpu_idle_s", "pass_s", "commit_s", "iteration_s",
                                                    "speculated_buckets", "wasted_buckets", "verdict")}
    rec["clipped_steps"] = opt.clipped_steps
    # clipping that fired in the timed steps pauses speculation: predict the schedule the timed steps had (on some
    # rows clipping stops firing in the warm-up and the timed steps commit)
    n_timed = rec.get("step_s", {}).get("n", 0)  # the timed steps are the last ones of the per-step record
    timed = [p.get("verdict") for p in rec.get("per_step", [])[-n_timed:]] if n_timed else []
    redos = sum(v == "redo" for v in timed)
    rec["timed_redo_steps"] = redos
    rec["predicted"] = _predicted(opt, model, batch, seq, accum, clipped=2 * redos >= len(timed) if timed
                                  else opt.clipped_steps > 0)
    rec["calibration"] = opt.calibration
    rec["pinned_gb"] = opt.engine.pinned_bytes / 1e9


def _run_trainer(rec: dict[str, Any], model: Any, batches: list[Any], batch: int, accum: int, seq: int, n: int,
                 warmup: int, steps: int, device: Any) -> dict[str, Any]:
    """The README's Trainer snippet on the row's random tokens; seconds between optimizer steps, GPU drained. Logging
    at the Trainer's default interval, as the README's snippet does (a log line every step reads the loss and the
    norm back each step)."""
    import tempfile

    import torch
    from transformers import TrainerCallback

    from hf_superoffload import SuperOffloadArguments, SuperOffloadTrainer

    rows = [{"input_ids": ids[i].cpu(), "labels": ids[i].cpu()} for ids in batches for i in range(ids.shape[0])]
    timing = Timing(warmup, steps)
    rec["per_step"] = timing.per_step
    built: list[Any] = []  # the trainer, once made: its optimizer's state per step
    stamps: list[float] = []

    def stamp() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        stamps.append(time.perf_counter())
        return stamps[-1] - stamps[-2] if len(stamps) > 1 else 0.0

    class Stamp(TrainerCallback):  # type: ignore[misc]
        def on_train_begin(self, *_: Any, **__: Any) -> None:
            stamp()

        def on_step_end(self, _args: Any, state: Any, control: Any, **__: Any) -> Any:
            # the wall time since the last optimizer step, the Trainer's own work between steps included
            if timing.record(state.global_step - 1, stamp(), built[0].superoffload_optimizer):
                rec["warmup_steps"] = state.global_step - steps
                rec["settled_step"] = timing.settled_at
                control.should_training_stop = True
            return control

    with tempfile.TemporaryDirectory() as out:
        args = SuperOffloadArguments(output_dir=out, bf16=True, max_grad_norm=CLIP, learning_rate=LR,
                                     weight_decay=0.1, adam_beta2=0.95, per_device_train_batch_size=batch,
                                     gradient_accumulation_steps=accum, max_steps=timing.most_steps,
                                     lr_scheduler_type="constant", save_strategy="no",
                                     report_to=[], dataloader_drop_last=True, disable_tqdm=True,
                                     use_cpu=device.type != "cuda")
        trainer = SuperOffloadTrainer(model=model, args=args, train_dataset=rows * (timing.most_steps + 1),
                                      callbacks=[Stamp()])
        built.append(trainer)
        try:
            trainer.train()
        except torch.OutOfMemoryError as e:
            _record_oom(rec, e, device, trainer.superoffload_optimizer)
            rec["oom_step"] = len(timing.per_step)
            return rec
        _finish(rec, timing.times, batch, accum, seq, n, model.config, device)
        _describe(rec, trainer.superoffload_optimizer, model, batch, seq, accum)
        trainer.superoffload_optimizer.close()
    return rec


def _record_oom(rec: dict[str, Any], e: BaseException, device: Any, opt: Any) -> None:
    """Where a run ran out of GPU memory, what the allocator held then, and the plan it had reached."""
    import torch

    where = [f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}" for f in traceback.extract_tb(e.__traceback__)]
    rec.update(status="oom", error=str(e).splitlines()[0][:300], oom_at=where[-8:])
    if device.type == "cuda":  # fragmentation shows as reserved but unallocated bytes
        stats = torch.cuda.memory_stats(device)
        rec["oom_memory_gb"] = {key: stats.get(f"{key}_bytes.all.{kind}", 0) / 1e9
                                for key in ("allocated", "reserved") for kind in ("current", "peak")}
        rec["oom_memory_gb"]["alloc_retries"] = stats.get("num_alloc_retries", 0)
    if opt is not None and opt.planned:  # the plan the run had reached, and what the calibration changed
        rec["plan_summary"] = opt.plan.summary()
        rec["calibration"] = opt.calibration


def _finish(rec: dict[str, Any], times: list[float], batch: int, accum: int, seq: int, n: int, cfg: Any,
            device: Any) -> None:
    import torch

    tokens = batch * seq * accum
    med = statistics.median(times)
    flops = 6 * n + 6 * cfg.num_hidden_layers * cfg.hidden_size * seq
    rec.update(status="ok", step_s={"median": med, "min": min(times), "max": max(times), "n": len(times)},
               tokens_per_s=tokens / med, mfu=flops * tokens / med / (PEAK_TFLOPS * 1e12),
               peak_gpu_gb=(torch.cuda.max_memory_allocated(device) / 1e9) if device.type == "cuda" else None,
               host_rss_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9)
    if device.type == "cuda":  # the allocator freeing its cache to satisfy a request: a device near full
        stats = torch.cuda.memory_stats(device)
        rec.update(peak_reserved_gb=stats.get("reserved_bytes.all.peak", 0) / 1e9,
                   alloc_retries=stats.get("num_alloc_retries", 0))


def _predicted(opt: Any, model: Any, batch: int, seq: int, accum: int, *, clipped: bool = True) -> dict[str, Any]:
    """The planner's predictions for the plan it made, priced with the rates the optimizer planned with on this GPU
    (this host's cached measurement, else the shipped profile of the same GPU model: [Note: known rates]), before
    its calibration restated them; without either (the CPU, an unknown GPU) the H200 box's. ``step_s_calibrated_rates``
    prices the same plan with the restated rates, where the calibration ran."""
    from hf_superoffload.planning.hardware import HardwareProfile
    from hf_superoffload.planning.memory_model import PlanLike
    from hf_superoffload.planning.planner import Workload

    # the optimizer's own workload (inferred at the first batch, or the Trainer's), else the row's shape
    workload = opt.workload or Workload(model.config, batch, seq, grad_ckpt=True)
    plan_like = PlanLike.from_plan(opt.plan)
    est = workload.estimate(plan_like)
    # after a move to the device the host arenas keep their size ([Note: the host arenas keep their size])
    arenas = max(plan_like.host_numel, opt.engine.host_arena_numel)
    host = workload.estimate(dataclasses.replace(plan_like, host_numel=arenas))
    rates = opt.profile
    if rates.cpu_adam_gparams is None:
        rates = HardwareProfile.h200_pcie()
    step = workload.step_time(plan_like, rates, clipping_every_step=clipped, micro_batches=accum)
    # the same plan priced with the rates its calibration restated (this instance's GEMM and CPU Adam): a plan the
    # calibration chose under them is judged by what it was chosen with, beside the shipped rates' figure
    timing = (opt.calibration or {}).get("timing") or {}
    restated = (dataclasses.replace(rates, matmul_tflops=timing["matmul_tflops"],
                                    cpu_adam_gparams=timing["cpu_adam_gparams"])
                if timing.get("matmul_tflops") and timing.get("cpu_adam_gparams") else None)
    step_cal = (None if restated is None else
                workload.step_time(plan_like, restated, clipping_every_step=clipped, micro_batches=accum))
    return {"rates": rates.name,
            "step_s_calibrated_rates": None if step_cal is None else step_cal.step_s, "gpu_peak_gb": est.gpu_peak_bytes / 1e9, "host_rss_gb": host.host_expected_bytes / 1e9,
            "gpu_phases_gb": {phase: {k: round(v / 1e9, 3) for k, v in parts.items()}
                              for phase, parts in est.gpu_phases.items()},
            "step_s": None if step is None else step.step_s, "gpu_s": None if step is None else step.gpu_s,
            "micro_batch_s": None if step is None else step.micro_batch_s,
            "optimizer_step_s": None if step is None else step.step_s}


def _setting(kv: str) -> tuple[str, Any]:
    key, sep, value = kv.partition("=")
    if not sep:
        raise SystemExit(f"--set {kv!r}: use KEY=VALUE")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def parse_row(spec: str) -> tuple[str, int, int, int | None]:
    parts = spec.split(":")
    if not 2 <= len(parts) <= 4:
        raise SystemExit(f"--rows {spec!r}: use PRESET:BATCH[:ACCUM[:LAYERS]]")
    return parts[0], int(parts[1]), int(parts[2]) if len(parts) > 2 else 1, int(parts[3]) if len(parts) > 3 else None


def main(argv: list[str] | None = None) -> int:
    from hf_superoffload.planning.planner import CALIBRATION_STEPS
    from hf_superoffload.planning.thread_trial import TRIAL_STEPS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", nargs="+", default=["3.6b:8", "8b:4"])
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=CALIBRATION_STEPS + TRIAL_STEPS,
                    help="untimed steps (default: past the calibration, the move it may make, which the record "
                         "reports as calibration.move_s, and the thread trial, calibration.threads)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per system")
    ap.add_argument("--gpu-cap-gib", type=float, default=None,
                    help="cap the GPU memory every row may use (torch.cuda.set_per_process_memory_fraction)")
    ap.add_argument("--clip", type=float, default=None,
                    help="max_grad_norm of every system (default 1.0, which fires on every step of this random "
                         "data; e.g. 1e9: clipping that never fires, so speculation commits)")
    ap.add_argument("--out", required=True, help="a .jsonl file; one record per system and row")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="SuperOffloadConfig / PlannerOverrides fields for our systems (VALUE read as JSON, else a "
                         "string); the record names them (a row with settings is not the defaults)")
    ap.add_argument("--profile-dir", default=None,
                    help="profile one more step of our systems into this directory (Chrome trace + breakdown)")
    ap.add_argument("--worker", nargs=5, metavar=("SYSTEM", "PRESET", "BATCH", "ACCUM", "LAYERS"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    settings = dict(_setting(kv) for kv in args.set)
    if args.clip is not None:  # the workers read it at import
        os.environ["DEFAULTS_CLIP"] = repr(args.clip)
    if args.worker:
        system, preset, batch, accum, layers = args.worker
        rec = run_one(system, preset, int(batch), int(accum), int(layers) or None, args.seq, args.warmup,
                      args.steps, args.device, args.gpu_cap_gib, settings if system in OURS else None,
                      args.profile_dir if system in OURS else None)
        with open(args.out, "a") as f:
            f.write(json.dumps(rec) + "\n")
        return 0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for spec in args.rows:
        preset, batch, accum, layers = parse_row(spec)
        for system in args.systems:
            t = time.perf_counter()
            cmd = [sys.executable, __file__, "--worker", system, preset, str(batch), str(accum), str(layers or 0),
                   "--seq", str(args.seq), "--warmup", str(args.warmup), "--steps", str(args.steps),
                   "--device", args.device, "--out", str(out)]
            if args.gpu_cap_gib is not None:
                cmd += ["--gpu-cap-gib", str(args.gpu_cap_gib)]
            if args.set:
                cmd += ["--set", *args.set]
            if args.profile_dir:
                cmd += ["--profile-dir", args.profile_dir]
            try:
                proc = subprocess.run(cmd, timeout=args.timeout, capture_output=True, text=True, env=os.environ)
                status = f"rc={proc.returncode}"
                if proc.returncode:
                    with open(out, "a") as f:
                        f.write(json.dumps({"system": system, "preset": preset, "batch": batch, "accum": accum,
                                            "status": "failed", "tail": (proc.stderr or proc.stdout)[-2000:]}) + "\n")
            except subprocess.TimeoutExpired:
                status = "timeout"
                with open(out, "a") as f:
                    f.write(json.dumps({"system": system, "preset": preset, "batch": batch, "accum": accum,
                                        "status": "timeout"}) + "\n")
            print(f"{spec} {system}: {status} in {time.perf_counter() - t:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
