"""The benchmark suite: every system on the same model and batch, one process per system, one call.

    python benchmarks/suite.py --workload 3.6b --out benchmarks/results [--systems gpu ours ...] \
        [--warmup 2] [--steps 3] [--timeout 600] [--budget 1500] [--profile] [--commit SHA]

Each system runs in its own subprocess (``suite.py --worker``) and appends one JSON line to
``<out>/suite_<workload>_<run_id>.jsonl`` (or to ``--out`` itself when it ends in ``.jsonl``). A system that cannot
run here (DeepSpeed not importable, a planner option not implemented yet) is recorded with ``status: "absent"``
and the reason; an out-of-memory run with ``status: "oom"`` and its peak; a crash with ``"failed"`` and the tail of
its log; the suite always goes on. Render the records with ``python benchmarks/report.py --suite FILE``.

Systems:
  gpu              fp32 master weights + torch AdamW(fused=True) on the device, bf16 autocast (the anchor)
  ours             SuperOffloadOptimizer(model, lr=1e-5, max_grad_norm=1.0), model in bf16, default plan
  ours_host        every optimizer state on the host (gpu_resident_buckets=0)
  ours_nospec      ours_host with speculation=False
  ours_castflip    ours_host with cast_side flipped relative to the planner's choice
  ours_noclip      ours_host with max_grad_norm=None (speculation commits every step)
  ours_host_nodefer ours_host with defer_moments=False (ablation of deferred moment stores, on in ours_host by
                   the planner's auto choice when host RAM allows a second landing arena)
  ours_host_lead4 / ours_host_lead8   ours_host with d2h_lead_buckets=4 / 8 ([Note: D2H lead] in docs/design.md)
  ours_host_latep  ours_host with defer_master=True (the master stored by the commit too) and d2h_lead_buckets=4
  ours_host_latep8 the same with d2h_lead_buckets=8
  ours_host_latep_noup  ours_host_latep with upload_thread=False (the worker issues the uploads, as before the upload thread)
  ours_host_latep_nogate  ours_host_latep with d2h_gate=False (the worker blocks on each copy, as before the D2H gate)
  ours_host_inv / ours_host_latep_inv  with rollback="inverse": the state updated in place (one copy of p/m/v)
                   instead of the double buffer's out-of-place writes
  ours_host_latep_t16  ours_host_latep with cpu_threads=16 (the default leaves a core to the training thread)
  ours_host_oop    ours_host with nonspeculative_in_place=False: steps that speculate nothing write the double
                   buffer's other copy too (the schedule before 8ad7b7a)
  ours_host_m25 / _m50 / _m75  ours_host with defer_master=0.25 / 0.5 / 0.75: a fixed master share instead of the
                   adaptive one (maps the step time against the share)
  ours_host_static ours_host with the CPU Adam's threads on static slices (HF_SUPEROFFLOAD_CPU_ADAM_SCHEDULE=static,
                   the partition before 61912b2) instead of dynamic chunks
  ours_host_gcfreeze  ours_host with gc.freeze() after the build: the model's objects leave the collector's view, so
                   a full collection no longer walks them (tests whether GC pauses cause the slow early steps)
  ours_flow        weight_placement="flow" (absent while the planner raises PlanError for it)
  ds_zero2 / ds_zero3 / ds_superoffload   DeepSpeed 0.19.8, the team's anchor configs (ZeRO-2/3 CPU offload, SuperOffload)
  fsdp2_offload    FSDP2 fully_shard + CPUOffloadPolicy, one rank (the anchor config)

MFU convention (docs/benchmarks.md, "Conventions"): model FLOPs per token = 6N + 6*L*d*s (all
parameters, causal attention, recompute not counted), divided by the dense bf16 peak (989 TFLOP/s on H200).

The module body imports only the standard library: DeepSpeed's SuperOffload worker is a spawned process that
re-imports this file.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import gzip
import json
import os
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

__all__ = ["ALL_SYSTEMS", "WORKLOADS", "Workload", "main"]

SCHEMA = "hf_superoffload.suite/1"
OURS = ("ours", "ours_host", "ours_nospec", "ours_castflip", "ours_noclip", "ours_flow", "ours_host_nodefer",
        "ours_host_lead4", "ours_host_lead8", "ours_host_latep", "ours_host_latep8",
        "ours_host_latep_noup", "ours_host_latep_nogate", "ours_host_inv", "ours_host_latep_inv",
        "ours_host_latep_t16", "ours_host_oop", "ours_host_m25", "ours_host_m50", "ours_host_m75",
        "ours_host_static", "ours_host_gcfreeze")
DEEPSPEED = ("ds_zero2", "ds_zero3", "ds_superoffload")
ALL_SYSTEMS = ("gpu", *OURS, *DEEPSPEED, "fsdp2_offload")
LABELS = {
    "gpu": "GPU-only (fp32 master, fused AdamW on GPU)",
    "ours": "hf_superoffload, default plan",
    "ours_host": "hf_superoffload, all optimizer state on host",
    "ours_nospec": "hf_superoffload, host, speculation off",
    "ours_castflip": "hf_superoffload, host, casts flipped",
    "ours_noclip": "hf_superoffload, host, no clipping",
    "ours_flow": "hf_superoffload, weight flow",
    "ours_host_nodefer": "hf_superoffload, host, moments stored in the critical pass",
    "ours_host_lead4": "hf_superoffload, host, D2H lead 4 buckets",
    "ours_host_lead8": "hf_superoffload, host, D2H lead 8 buckets",
    "ours_host_latep": "hf_superoffload, host, D2H lead 4, master stored late",
    "ours_host_latep8": "hf_superoffload, host, D2H lead 8, master stored late",
    "ours_host_latep_noup": "hf_superoffload, host, D2H lead 4, master stored late, worker uploads",
    "ours_host_latep_nogate": "hf_superoffload, host, D2H lead 4, master stored late, worker waits on copies",
    "ours_host_inv": "hf_superoffload, host, in-place state (inverse rollback)",
    "ours_host_latep_inv": "hf_superoffload, host, D2H lead 4, master stored late, in-place state",
    "ours_host_latep_t16": "hf_superoffload, host, D2H lead 4, master stored late, 16 CPU Adam threads",
    "ours_host_oop": "hf_superoffload, host, every step writes the other state copy",
    "ours_host_m25": "hf_superoffload, host, master stored late for a fixed 25% of the buckets",
    "ours_host_m50": "hf_superoffload, host, master stored late for a fixed 50% of the buckets",
    "ours_host_m75": "hf_superoffload, host, master stored late for a fixed 75% of the buckets",
    "ours_host_static": "hf_superoffload, host, CPU Adam threads on static slices (not dynamic chunks)",
    "ours_host_gcfreeze": "hf_superoffload, host, gc.freeze() after the build",
    "ds_zero2": "DeepSpeed ZeRO-2 offload",
    "ds_zero3": "DeepSpeed ZeRO-3 offload",
    "ds_superoffload": "DeepSpeed SuperOffload",
    "fsdp2_offload": "FSDP2 CPU offload",
}
# system-name suffixes of the ours_host* ablations and the config each sets (stripped in this order)
MODIFIERS: dict[str, dict[str, Any]] = {
    "_t16": {"cpu_threads": 16},
    "_inv": {"rollback": "inverse"},
    "_nogate": {"d2h_gate": False},
    "_noup": {"upload_thread": False},
    "_oop": {"nonspeculative_in_place": False},
    "_m25": {"defer_master": 0.25},
    "_m50": {"defer_master": 0.5},
    "_m75": {"defer_master": 0.75},
    # not config fields: "env" goes to the worker process's environment, "worker" to run_worker (via the record)
    "_static": {"env": {"HF_SUPEROFFLOAD_CPU_ADAM_SCHEDULE": "static"}},
    "_gcfreeze": {"worker": {"gc_freeze": True}},
}
MFU_CONVENTION = "6N + 6*L*d*s per token (all params, causal attention, no recompute) / peak dense bf16"
LR = 1e-5
CLIP = 1.0


@dataclasses.dataclass(frozen=True)
class Workload:
    """A Llama-style model shape and a batch."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    batch_size: int
    seq_len: int
    gradient_checkpointing: bool = True

    @property
    def tokens(self) -> int:
        return self.batch_size * self.seq_len

    def params(self) -> int:
        """Parameter count of the untied Llama (embeddings, LM head, RMSNorms included)."""
        h, i, layers, v = self.hidden_size, self.intermediate_size, self.num_hidden_layers, self.vocab_size
        head = h // self.num_attention_heads
        attn = h * h * 2 + 2 * h * head * self.num_key_value_heads
        return 2 * v * h + layers * (attn + 3 * h * i + 2 * h) + h

    def flops_per_token(self) -> int:
        head = self.hidden_size // self.num_attention_heads
        return 6 * self.params() + 6 * self.num_hidden_layers * self.num_attention_heads * head * self.seq_len


WORKLOADS: dict[str, Workload] = {
    "tiny": Workload("tiny", 64, 128, 2, 4, 2, 256, 2, 64),
    "3.6b": Workload("3.6b", 3072, 8192, 28, 24, 8, 128256, 8, 2048),
    "8b": Workload("8b", 4096, 14336, 32, 32, 8, 128256, 4, 2048),
    "8b_big": Workload("8b_big", 4096, 14336, 32, 32, 8, 128256, 16, 2048),
}
_DIMS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
         "vocab_size")


def resolve_workload(name: str, *, config_json: str | None, preset: str | None, batch: int | None,
                     seq: int | None) -> Workload:
    """The named workload; ``largest`` takes its shape from ``--config-json`` or ``--preset``."""
    if name == "largest":
        if config_json:
            data = json.loads(Path(config_json).read_text())
            model = data.get("model_config", data.get("model", data))
            dims = {k: int(model[k]) for k in _DIMS if k in model}
            missing = [k for k in _DIMS if k not in dims]
            if missing:
                raise SystemExit(f"--config-json {config_json}: missing {missing}")
            base = Workload("largest", **dims, batch_size=int(data.get("batch_size", 4)),
                            seq_len=int(data.get("seq_len", 2048)))
        elif preset:
            if preset in WORKLOADS:
                base = dataclasses.replace(WORKLOADS[preset], name="largest")
            else:
                from hf_superoffload.demo.presets import PRESETS

                if preset not in PRESETS or PRESETS[preset].get("vocab_size") is None:
                    raise SystemExit(f"--preset {preset!r}: use one of {sorted(WORKLOADS)} or a preset of "
                                     "hf_superoffload.demo.presets with a fixed vocabulary")
                dims = {k: int(PRESETS[preset][k]) for k in _DIMS}
                base = Workload("largest", **dims, batch_size=4, seq_len=2048)
        else:
            raise SystemExit("--workload largest needs --config-json PATH or --preset NAME")
    elif name in WORKLOADS:
        base = WORKLOADS[name]
    else:
        raise SystemExit(f"unknown workload {name!r}; choose one of {[*WORKLOADS, 'largest']}")
    if batch:
        base = dataclasses.replace(base, batch_size=batch)
    if seq:
        base = dataclasses.replace(base, seq_len=seq)
    return base


# ------------------------------------------------------------------------------------------------------------
# facts about the machine and the software


def _meminfo_gb(key: str) -> float | None:
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(key + ":"):
                return round(int(line.split()[1]) * 1024 / 1e9, 1)
    return None


def host_facts() -> dict[str, Any]:
    cpu, flags = None, []
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if cpu is None and line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
            if not flags and line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                flags = sorted(f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16") if f in have)
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = None
    return {"cpu": cpu, "cpu_flags": flags, "cores": os.cpu_count(), "affinity_cores": affinity,
            "ram_gb": _meminfo_gb("MemTotal"), "ram_available_gb": _meminfo_gb("MemAvailable"),
            "hostname": socket.gethostname()}


def versions() -> dict[str, str | None]:
    from importlib import metadata

    out: dict[str, str | None] = {"python": sys.version.split()[0]}
    for dist in ("torch", "transformers", "accelerate", "triton", "deepspeed", "hf-superoffload"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


# ------------------------------------------------------------------------------------------------------------
# host memory of a process tree, sampled from outside (the DeepSpeed SuperOffload worker is a child process)


def _tree_rss_bytes(root: int) -> int:
    try:
        import psutil  # type: ignore[import-untyped]

        proc = psutil.Process(root)
        total = proc.memory_info().rss
        for child in proc.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                total += child.memory_info().rss
        return total
    except ImportError:
        pass
    except Exception:
        return 0
    parent: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = (entry / "stat").read_text()
                parent[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    tree, frontier = {root}, [root]
    while frontier:
        p = frontier.pop()
        for pid, ppid in parent.items():
            if ppid == p and pid not in tree:
                tree.add(pid)
                frontier.append(pid)
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for pid in tree:
        with contextlib.suppress(OSError, IndexError, ValueError):
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * page
    return total


class TreeRssSampler(threading.Thread):
    def __init__(self, pid: int, period_s: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.pid, self.period_s, self.peak = pid, period_s, 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.peak = max(self.peak, _tree_rss_bytes(self.pid))
            self._stop_event.wait(self.period_s)

    def stop(self) -> int:
        self._stop_event.set()
        self.join(timeout=5)
        return self.peak


# ------------------------------------------------------------------------------------------------------------
# the worker: one system, one process


def _build_model(wl: Workload, dev: Any, dtype: Any) -> tuple[Any, str]:
    """Random weights built on ``dev``: in fp32 then cast (as the anchor) when fp32 fits, else directly in bf16."""
    import torch
    from transformers import LlamaConfig

    from hf_superoffload.demo.presets import build_on

    cfg = LlamaConfig(**{k: getattr(wl, k) for k in _DIMS}, max_position_embeddings=wl.seq_len,
                      tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    init_dtype = torch.float32
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        if wl.params() * 4 > 0.8 * free:
            init_dtype = dtype
    model = build_on(cfg, device=dev, dtype=init_dtype, seed=0)
    model = model.to(dtype)
    if wl.gradient_checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable()
        else:
            model.gradient_checkpointing_enable()
    model.config.use_cache = False
    return model, str(init_dtype).removeprefix("torch.")


def _config_from_settings(settings: dict[str, Any]) -> Any:
    """The ``SuperOffloadConfig`` of a row's flat settings: a name that is a ``PlannerOverrides`` field goes into
    ``overrides`` (over an ``overrides`` mapping given too, as a record's ``ours_config`` holds it), any other
    name to the config itself, where an unknown one is refused naming the valid keys."""
    from hf_superoffload.config import PlannerOverrides, SuperOffloadConfig

    planner = {f.name for f in dataclasses.fields(PlannerOverrides)}
    options = {k: v for k, v in settings.items() if k not in planner}
    overrides = {**options.pop("overrides", {}), **{k: v for k, v in settings.items() if k in planner}}
    return SuperOffloadConfig.from_dict({**options, "overrides": overrides})


def _ours_config(system: str, extra: dict[str, Any], numels: list[int], dev: Any) -> tuple[Any, dict[str, Any]]:
    kw = dict(extra)
    info: dict[str, Any] = {}
    if system.startswith("ours_host") or system in ("ours_nospec", "ours_castflip", "ours_noclip"):
        kw["gpu_resident_buckets"] = 0  # every optimizer state on the host
    if system == "ours_host_nodefer":
        kw["defer_moments"] = False
    if system.startswith("ours_host_lead"):
        kw["d2h_lead_buckets"] = int(system.removeprefix("ours_host_lead"))
    base = system
    for suffix, setting in MODIFIERS.items():
        if base.endswith(suffix):
            setting = dict(setting)
            env = setting.pop("env", {})
            os.environ.update(env)  # read by the CPU Adam op on every call (this process only)
            info.update({f"env:{k}": v for k, v in env.items()})
            info.update(setting.pop("worker", {}))
            kw.update(setting)
            base = base.removesuffix(suffix)
    if base.startswith("ours_host_latep"):
        lead = int(base.removeprefix("ours_host_latep") or 4)
        kw.update(defer_master=True, defer_moments=True, cast_side="cpu", d2h_lead_buckets=lead)
    if system == "ours_nospec":
        kw["speculation"] = False
    if system == "ours_flow":
        kw["weight_placement"] = "flow"
    if system == "ours_castflip":
        picked = "cpu"
        try:
            from hf_superoffload.planning.hardware import HardwareProfile
            from hf_superoffload.planning.planner import make_plan

            plan = make_plan(numels, element_size=2, config=_config_from_settings(kw),
                             profile=HardwareProfile.read(dev))
            picked = plan.cast_side.value
        except Exception as exc:  # the flip is still defined; say what it was based on
            info["cast_side_note"] = f"planner not consulted ({type(exc).__name__}: {exc}); assumed 'cpu'"
        kw["cast_side"] = "gpu" if picked == "cpu" else "cpu"
        info["cast_side_planner"] = picked
        info["cast_side_used"] = kw["cast_side"]
    return _config_from_settings(kw), info


def _plan_facts(plan: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with contextlib.suppress(Exception):
        out["summary"] = plan.summary()
    for key in ("host_numel", "device_numel", "cpu_threads", "speculation", "pin_memory", "defer_moments"):
        if hasattr(plan, key):
            out[key] = getattr(plan, key)
    for key in ("weight_mode", "cast_side", "rollback"):
        value = getattr(plan, key, None)
        if value is not None:
            out[key] = getattr(value, "value", str(value))
    with contextlib.suppress(Exception):
        out["buckets"] = len(plan.buckets)
        out["host_buckets"] = len(plan.host_buckets)
        out["device_buckets"] = len(plan.device_buckets)
    return out


def _step_stats(st: Any) -> dict[str, Any]:
    out = {"cpu_adam_s": round(float(st.cpu_s), 4), "gpu_wait_s": round(float(st.wait_s), 4),
           "verdict": st.verdict, "grad_norm": round(float(st.grad_norm), 4)}
    with contextlib.suppress(Exception):
        out["overlap"] = round(float(st.overlap), 4)
    for key in ("speculative", "speculated_buckets", "wasted_buckets", "d2h_bytes", "h2d_bytes", "clip_coef",
                "commit_s", "master_deferred_buckets", "pass_s"):
        if hasattr(st, key):
            value = getattr(st, key)
            out[key] = round(value, 4) if isinstance(value, float) else value
    return out


class _GcClock:
    """Python's garbage-collection pauses (``gc.callbacks``): seconds and full (generation 2) collections since the
    last :meth:`take`. A collection holds the interpreter lock, so it also stalls the CPU worker between buckets."""

    def __init__(self) -> None:
        self.seconds, self.full, self._t0 = 0.0, 0, None
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.seconds += time.perf_counter() - self._t0
            self.full += info.get("generation") == 2
            self._t0 = None

    def take(self) -> dict[str, Any]:
        out = {"gc_s": round(self.seconds, 4), "gc_gen2": self.full}
        self.seconds, self.full = 0.0, 0
        return out


class Absent(Exception):
    """The system cannot run here; the row is recorded as absent with this reason."""


def _not_implemented(exc: BaseException) -> bool:
    """Weight flow not implemented yet (as opposed to a flow plan that does not fit, which is a failure)."""
    name = type(exc).__name__
    return name == "NotImplementedError" or (name == "PlanError" and "not available" in str(exc))


def _precheck_plan(system: str, wl: Workload, dev: Any, spec: dict[str, Any]) -> None:
    """Ask the planner on a meta-device model before building the real one: an option the planner does not
    implement yet (``PlanError``) makes the row absent without spending device time on a model build."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{k: getattr(wl, k) for k in _DIMS}, max_position_embeddings=wl.seq_len,
                      tie_word_embeddings=False)
    with torch.device("meta"):
        meta = LlamaForCausalLM(cfg)
    numels = [p.numel() for p in meta.parameters()][::-1]
    config, _ = _ours_config(system, spec.get("ours_config", {}), numels, dev)
    try:
        from hf_superoffload.planning.hardware import HardwareProfile
        from hf_superoffload.planning.planner import make_plan

        make_plan(numels, element_size=2, config=config, profile=HardwareProfile.read(dev))
    except ImportError:
        return
    except Exception as exc:
        if _not_implemented(exc):
            raise Absent(f"{type(exc).__name__}: {exc}") from exc
        raise


def _make_system(system: str, wl: Workload, dev: Any, spec: dict[str, Any]) -> tuple[Any, Any, dict[str, Any]]:
    """(model, step function, extra record fields) for ``system``. Raises :class:`Absent`."""
    import torch

    extra: dict[str, Any] = {}
    cuda = dev.type == "cuda"
    if (system in DEEPSPEED or system == "fsdp2_offload") and not cuda:
        raise Absent(f"{system} needs --device cuda")
    if system in DEEPSPEED:
        try:
            import deepspeed
        except Exception as exc:
            raise Absent(f"deepspeed not importable: {type(exc).__name__}: {exc}") from exc
    if system == "ours_flow":
        _precheck_plan(system, wl, dev, spec)
    dtype = torch.float32 if system in ("gpu", "fsdp2_offload") else torch.bfloat16
    model, init_dtype = _build_model(wl, dev, dtype)
    extra["init_dtype"] = init_dtype
    extra["model_dtype"] = str(dtype).removeprefix("torch.")
    gen = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, wl.vocab_size, (wl.batch_size, wl.seq_len), generator=gen).to(dev)

    if system == "gpu":
        opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
        extra["hyper"] = {"lr": LR, "weight_decay": 0.01, "max_grad_norm": CLIP, "optimizer": "torch AdamW fused"}

        def step() -> Any:
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        return model, step, extra

    if system in OURS:
        from hf_superoffload import SuperOffloadOptimizer, ops

        numels = [p.numel() for p in model.parameters() if p.requires_grad][::-1]
        config, info = _ours_config(system, spec.get("ours_config", {}), numels, dev)
        extra.update(info)
        clip = None if system == "ours_noclip" else CLIP
        extra["hyper"] = {"lr": LR, "weight_decay": 0.01, "max_grad_norm": clip,
                          "optimizer": "SuperOffloadOptimizer"}
        extra["ours_config"] = config.to_dict()
        try:
            from hf_superoffload.planning.planner import Workload as StepShape

            shape = StepShape(model.config, wl.batch_size, wl.seq_len, grad_ckpt=True)  # sizes the auto GPU tail
            opt = SuperOffloadOptimizer(model, lr=LR, max_grad_norm=clip, config=config, log_plan=False,
                                        workload=shape)
        except Exception as exc:
            if system == "ours_flow" and _not_implemented(exc):
                raise Absent(f"{type(exc).__name__}: {exc}") from exc
            raise
        extra["plan"] = _plan_facts(opt.plan)
        with contextlib.suppress(Exception):
            extra["cpu_adam_backend"] = ops.backend()

        def step() -> Any:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        step.opt = opt  # type: ignore[attr-defined]
        return model, step, extra

    if system in DEEPSPEED:
        import deepspeed

        stage = 2 if system == "ds_zero2" else 3
        off: dict[str, Any] = {"device": "cpu", "pin_memory": True}
        if system == "ds_superoffload":
            off.update({"super_offload": True, "cpuadam_cores_perc": 0.9})
        ds_cfg: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": wl.batch_size, "gradient_accumulation_steps": 1,
            "gradient_clipping": CLIP, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8,
                                                      "weight_decay": 0.0}},
            "zero_optimization": {"stage": stage, "offload_optimizer": off, "overlap_comm": True,
                                  "contiguous_gradients": True, "reduce_bucket_size": 5e8},
            "wall_clock_breakdown": False, "steps_per_print": 1000,
        }
        if stage == 3:
            ds_cfg["zero_optimization"].update({"sub_group_size": int(1e8), "stage3_param_persistence_threshold": 1e9,
                                                "stage3_max_live_parameters": 1e10,
                                                "stage3_prefetch_bucket_size": 5e8})
        extra["ds_config"] = ds_cfg
        extra["hyper"] = {"lr": LR, "weight_decay": 0.0, "max_grad_norm": CLIP, "optimizer": "DeepSpeed CPUAdam"}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_cfg)

        def step() -> Any:
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            return loss

        return model, step, extra

    if system == "fsdp2_offload":
        import torch.distributed as dist
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        dist.init_process_group("cpu:gloo,cuda:nccl")
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, offload_policy=CPUOffloadPolicy(), mp_policy=mp)
        fully_shard(model, offload_policy=CPUOffloadPolicy(), mp_policy=mp)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        extra["hyper"] = {"lr": LR, "weight_decay": 0.01, "max_grad_norm": CLIP, "optimizer": "torch AdamW (CPU)"}

        def step() -> Any:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        return model, step, extra
    raise SystemExit(f"unknown system {system!r}")


def _profile(system: str, step: Any, sync: Any, dev: Any, n_steps: int, trace_dir: Path, tag: str) -> dict[str, Any]:
    """Run ``n_steps`` more steps under torch.profiler; gzip the Chrome trace, write a top-ops summary."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    trace_dir.mkdir(parents=True, exist_ok=True)
    try:  # the CPU worker's record_function ranges live on another thread; torch < 2.7 has no such option
        experimental = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except (AttributeError, TypeError):
        experimental = None
    step()  # the timed window ended with a drained pipeline: refill it, so each profiled step's forward overlaps
    sync()  # the previous step's CPU pass as in the timed steps
    with profile(activities=activities, experimental_config=experimental) as prof:
        for i in range(n_steps):
            with torch.profiler.record_function(f"ProfilerStep#{i}"):  # one range per step, for trace_summary
                step()
                sync()
    raw = trace_dir / f"{tag}.json"
    prof.export_chrome_trace(str(raw))
    timeline = _timeline(raw)
    with raw.open("rb") as src, gzip.open(str(raw) + ".gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()
    key = "self_device_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    events = prof.key_averages()
    try:
        text = events.table(sort_by=key, row_limit=30)
    except Exception:
        key = "self_cpu_time_total"
        text = events.table(sort_by=key, row_limit=30)
    (trace_dir / f"{tag}_top_ops.txt").write_text(text)
    rows = sorted(events, key=lambda e: getattr(e, key, 0) or 0, reverse=True)[:12]
    top = [{"name": e.key, "calls": e.count,
            "self_device_ms": round((getattr(e, "self_device_time_total", 0) or 0) / 1e3 / n_steps, 2),
            "self_cpu_ms": round(e.self_cpu_time_total / 1e3 / n_steps, 2)} for e in rows]
    return {"steps": n_steps, "trace": f"traces/{tag}.json.gz", "summary": f"traces/{tag}_top_ops.txt",
            "sorted_by": key, "top_ops_per_step": top, "timeline": timeline}


def _timeline(raw: Path) -> dict[str, Any] | str:
    """``trace_summary.summarize`` of an exported trace (an error string if it cannot be read)."""
    import importlib.util

    try:
        spec = importlib.util.spec_from_file_location("trace_summary", Path(__file__).with_name("trace_summary.py"))
        mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        spec.loader.exec_module(mod)  # type: ignore[union-attr]
        return mod.summarize(mod.load_events(raw))
    except Exception as e:  # a summary is a convenience: the trace itself is kept either way
        return f"trace_summary failed: {type(e).__name__}: {e}"


def run_worker(system: str, spec: dict[str, Any]) -> dict[str, Any]:
    """Build, warm up, time. Always returns a record (status ok / absent / oom / failed)."""
    import resource

    wl = Workload(**spec["workload"])
    rec: dict[str, Any] = {"status": "failed"}
    t0 = time.perf_counter()
    step_fn = None
    try:
        import torch

        dev = torch.device(spec["device"])
        cuda = dev.type == "cuda"
        if cuda:
            if dev.index is None:  # torch 2.11's set_device wants an index
                dev = torch.device("cuda", 0)
            torch.cuda.set_device(dev)
            if spec.get("gpu_mem_cap_gib"):
                total = torch.cuda.get_device_properties(dev).total_memory
                torch.cuda.set_per_process_memory_fraction(min(1.0, spec["gpu_mem_cap_gib"] * 2**30 / total), dev)
            rec["gpu"] = {"name": torch.cuda.get_device_name(dev),
                          "memory_gb": round(torch.cuda.get_device_properties(dev).total_memory / 1e9, 1),
                          "cuda": torch.version.cuda}

        def sync() -> None:
            if cuda:
                torch.cuda.synchronize(dev)

        rec["threads"] = {"torch": torch.get_num_threads(), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")}
        model, step_fn, extra = _make_system(system, wl, dev, spec)
        rec.update(extra)
        rec["params_counted"] = sum(p.numel() for p in model.parameters())
        sync()
        rec["init_s"] = round(time.perf_counter() - t0, 2)
        opt = getattr(step_fn, "opt", None)
        if rec.get("gc_freeze"):  # the _gcfreeze modifier
            gc.collect()
            gc.freeze()  # everything built so far is long-lived: out of every later collection's walk
        gc_clock = _GcClock()
        gc_steps: list[dict[str, Any]] = []
        times: list[float] = []
        losses: list[float] = []
        telemetry: list[dict[str, Any]] = []
        phase, done = "warmup", 0
        try:
            for _ in range(spec["warmup"]):
                step_fn()
                done += 1
            sync()
            phase, done = "timed", 0
            gc_clock.take()
            t_window = time.perf_counter()
            for _ in range(spec["steps"]):
                t = time.perf_counter()
                loss = step_fn()
                sync()
                times.append(time.perf_counter() - t)
                gc_steps.append(gc_clock.take())
                done += 1
                losses.append(round(float(loss.detach()), 4))
                if opt is not None:
                    telemetry.append(_step_stats(opt.last_step_stats))
            if opt is not None:
                opt.synchronize()
            sync()
            rec["step_s_window_mean"] = round((time.perf_counter() - t_window) / spec["steps"], 4)
            if spec.get("profile"):
                phase = "profile"
                rec["profile"] = _profile(system, step_fn, sync, dev, spec["profile_steps"],
                                          Path(spec["out_dir"]) / "traces",
                                          spec.get("stem", f"{spec['run_id']}_{wl.name}_{system}"))
            rec["status"] = "ok"
        except torch.OutOfMemoryError as exc:
            rec["status"] = "oom"
            rec["reason"] = f"out of GPU memory in {phase} step {done + 1}: {str(exc).splitlines()[0]}"
        rec["step_s_all"] = [round(x, 4) for x in times]
        rec["gc_per_step"] = gc_steps  # Python GC pauses inside each timed step (any thread)
        rec["losses"] = losses
        if times:
            med = statistics.median(times)
            rec["step_s_median"] = round(med, 4)
            rec["tokens_per_s"] = round(wl.tokens / med, 1)
            rec["loss"] = losses[-1]
        if telemetry:
            rec["telemetry"] = {
                "per_step": telemetry,
                "cpu_adam_s": round(statistics.median(t["cpu_adam_s"] for t in telemetry), 4),
                "gpu_wait_s": round(statistics.median(t["gpu_wait_s"] for t in telemetry), 4),
                "commit_s": round(statistics.median(t.get("commit_s", 0.0) for t in telemetry), 4),
                "pass_s": round(statistics.median(t.get("pass_s", 0.0) for t in telemetry), 4),
                "master_share": [t.get("master_deferred_buckets", 0) for t in telemetry],
                "overlap": round(statistics.median(t.get("overlap", float("nan")) for t in telemetry), 4),
                "verdicts": [t["verdict"] for t in telemetry],
            }
            with contextlib.suppress(Exception):  # launch-plan caches of the Triton bucket kernels (whole run)
                from hf_superoffload.triton_kernels import _kernels as tk

                rec["telemetry"]["plan_cache"] = {name: {"hits": c.hits, "misses": c.misses}
                                                  for name, c in (("flatten", tk._flatten_plans),
                                                                  ("scatter", tk._scatter_plans))}
        if cuda:
            rec["peak_gpu_gb"] = round(torch.cuda.max_memory_allocated(dev) / 1e9, 2)
            rec["peak_gpu_reserved_gb"] = round(torch.cuda.max_memory_reserved(dev) / 1e9, 2)
    except Absent as exc:
        rec["status"], rec["reason"] = "absent", str(exc)
    except Exception as exc:
        is_oom = type(exc).__name__ == "OutOfMemoryError"
        rec["status"] = "oom" if is_oom else "failed"
        rec["reason"] = f"{type(exc).__name__}: {str(exc)[:2000]}"
        rec["traceback_tail"] = traceback.format_exc()[-4000:]
        with contextlib.suppress(Exception):
            import torch

            if torch.cuda.is_available() and spec["device"].startswith("cuda"):
                rec["peak_gpu_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 2)
    rec["peak_host_rss_self_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9, 2)
    rec["versions"] = versions()
    return rec


def worker_main(argv: list[str]) -> int:
    system, spec_path, result_path = argv
    spec = json.loads(Path(spec_path).read_text())
    rec = run_worker(system, spec)
    Path(result_path).write_text(json.dumps(rec))
    sys.stdout.flush()
    sys.stderr.flush()
    # The record is written. Leave without teardown (optimizer close, NCCL/gloo destroy, DeepSpeed's worker): a
    # hang there must not cost device time; the driver ends the process group, the OS frees pinned memory.
    os._exit(0)


# ------------------------------------------------------------------------------------------------------------
# the driver


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _commit(arg: str | None) -> str:
    if arg:
        return arg
    for key in ("SUITE_COMMIT", "GIT_COMMIT"):
        if os.environ.get(key):
            return os.environ[key]
    with contextlib.suppress(Exception):
        out = subprocess.run(["git", "-C", str(Path(__file__).resolve().parent), "rev-parse", "HEAD"],
                             capture_output=True, text=True, timeout=10)
        if out.returncode == 0:
            return out.stdout.strip()
    return "unknown"


def _kill_tree(proc: subprocess.Popen) -> None:
    """End the worker's process group (it was started in its own session: DeepSpeed's worker goes with it)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(path: Path, n: int = 3000) -> str:
    with contextlib.suppress(OSError):
        return path.read_text(errors="replace")[-n:]
    return ""


def _deepspeed_findable() -> str | None:
    import importlib.util

    try:
        return None if importlib.util.find_spec("deepspeed") is not None else "deepspeed not importable (not installed)"
    except Exception as exc:
        return f"deepspeed not importable: {exc}"


def _timeouts(default: float, overrides: list[str]) -> dict[str, float]:
    out = {s: default for s in ALL_SYSTEMS}
    for item in overrides:
        name, _, value = item.partition("=")
        if name not in out or not value:
            raise SystemExit(f"--timeout-for {item!r}: use SYSTEM=SECONDS with SYSTEM in {ALL_SYSTEMS}")
        out[name] = float(value)
    return out


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="3.6b", help=f"one of {[*WORKLOADS, 'largest']}")
    ap.add_argument("--config-json", help="largest: a JSON of LlamaConfig dims (+ optional batch_size, seq_len)")
    ap.add_argument("--preset", help="largest: a workload name or an hf_superoffload preset (e.g. 14b)")
    ap.add_argument("--batch", type=int, help="override the workload's batch size")
    ap.add_argument("--seq", type=int, help="override the workload's sequence length")
    ap.add_argument("--systems", nargs="+", default=list(ALL_SYSTEMS), choices=ALL_SYSTEMS, metavar="SYSTEM",
                    help=f"in run order; default all: {' '.join(ALL_SYSTEMS)}")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=420.0, help="seconds per system (default 420)")
    ap.add_argument("--timeout-for", nargs="*", default=[], metavar="SYSTEM=S", help="per-system timeouts")
    ap.add_argument("--budget", type=float, default=None, help="total seconds; later systems are skipped when spent")
    ap.add_argument("--min-left", type=float, default=45.0,
                    help="skip a system when less than this many seconds of --budget are left")
    ap.add_argument("--profile", action="store_true", help="torch.profiler trace of extra steps for our rows")
    ap.add_argument("--profile-steps", type=int, default=2)
    ap.add_argument("--profile-systems", nargs="*", default=None, metavar="SYSTEM",
                    help="systems to profile (default: every ours* row)")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu for the tiny rehearsal")
    ap.add_argument("--ours-config-json", default=None,
                    help="extra SuperOffloadConfig or PlannerOverrides fields (one flat JSON object) for every ours* row")
    ap.add_argument("--gpu-mem-cap-gib", type=float, default=None,
                    help="cap every worker's GPU memory (torch.cuda.set_per_process_memory_fraction)")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak for MFU (H200 SXM: 989)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"),
                    help="results directory (or a .jsonl file to append to)")
    ap.add_argument("--commit", default=None, help="git commit of the code (the GPU box has no .git)")
    ap.add_argument("--tag", default="", help="free text stored in every record (e.g. 'h200 2026-11-30')")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from_cli = argv is None
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        return worker_main(argv[1:])
    args = parse_args(argv)
    wl = resolve_workload(args.workload, config_json=args.config_json, preset=args.preset, batch=args.batch,
                          seq=args.seq)
    run_id = datetime.datetime.now().strftime("%Y%m%dT%H%M%S")
    out = Path(args.out)
    if out.suffix == ".jsonl":
        out_dir, out_file = out.parent, out
    else:
        out_dir, out_file = out, out / f"suite_{wl.name}_{run_id}.jsonl"
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    commit = _commit(args.commit)
    hardware = host_facts()
    timeouts = _timeouts(args.timeout, args.timeout_for)
    profile_systems = set(args.profile_systems) if args.profile_systems is not None else set(OURS)
    ours_config = json.loads(args.ours_config_json) if args.ours_config_json else {}
    command = shlex.join([sys.executable, *sys.argv] if from_cli else [sys.executable, str(Path(__file__)), *argv])
    ds_missing = _deepspeed_findable()
    flops_token = wl.flops_per_token()
    started = time.monotonic()
    gpu_tokens: float | None = None
    print(f"[suite] run {run_id}: workload {wl.name} ({wl.params() / 1e9:.3f}B params, batch {wl.batch_size} x "
          f"{wl.seq_len}), {len(args.systems)} systems -> {out_file}", flush=True)
    seen: dict[str, int] = {}
    for system in args.systems:
        seen[system] = repeat = seen.get(system, 0) + 1  # a system listed twice runs twice: its own logs each time
        base: dict[str, Any] = {
            "schema": SCHEMA, "run_id": run_id, "tag": args.tag, "system": system, "repeat": repeat,
            "label": LABELS[system], "workload": wl.name, "model": {k: getattr(wl, k) for k in _DIMS},
            "batch_size": wl.batch_size, "seq_len": wl.seq_len, "tokens_per_step": wl.tokens,
            "gradient_checkpointing": wl.gradient_checkpointing, "params": wl.params(),
            "warmup": args.warmup, "steps": args.steps, "device": args.device, "commit": commit,
            "hardware": hardware, "suite_command": command, "flops_per_token": flops_token,
            "peak_tflops": args.peak_tflops, "mfu_convention": MFU_CONVENTION,
            "gpu_mem_cap_gib": args.gpu_mem_cap_gib,
        }
        left = None if args.budget is None else args.budget - (time.monotonic() - started)
        t_sys = time.monotonic()
        rec: dict[str, Any]
        if left is not None and left < args.min_left:
            rec = {"status": "skipped", "reason": f"total budget {args.budget:.0f} s spent ({left:.0f} s left)"}
        elif system in DEEPSPEED and ds_missing:
            rec = {"status": "absent", "reason": ds_missing}
        elif system in (*DEEPSPEED, "fsdp2_offload") and not args.device.startswith("cuda"):
            rec = {"status": "absent", "reason": f"{system} needs --device cuda"}
        else:
            rec = _spawn(system, wl, args, run_id, out_dir, ours_config, profile_systems, timeouts, left, repeat)
        rec = {**base, **rec, "wall_s": round(time.monotonic() - t_sys, 1)}
        rec.setdefault("versions", versions())
        if rec.get("tokens_per_s"):
            tflops = flops_token * rec["tokens_per_s"] / 1e12
            rec["model_tflops"] = round(tflops, 2)
            rec["mfu"] = round(tflops / args.peak_tflops, 4)
            if system == "gpu" and rec["status"] == "ok":
                gpu_tokens = rec["tokens_per_s"]
            if gpu_tokens:
                rec["x_gpu"] = round(rec["tokens_per_s"] / gpu_tokens, 3)
        rec["peak_host_rss_gb"] = max(rec.get("peak_host_rss_tree_gb") or 0.0, rec.get("peak_host_rss_self_gb") or 0.0)
        with out_file.open("a") as fh:
            fh.write(json.dumps(rec) + "\n")
        _print_row(rec)
    print(f"[suite] done in {time.monotonic() - started:.0f} s -> {out_file}", flush=True)
    return 0


def _spawn(system: str, wl: Workload, args: argparse.Namespace, run_id: str, out_dir: Path,
           ours_config: dict[str, Any], profile_systems: set[str], timeouts: dict[str, float],
           left: float | None, repeat: int = 1) -> dict[str, Any]:
    stem = f"{run_id}_{wl.name}_{system}" + (f"_{repeat}" if repeat > 1 else "")
    spec = {"stem": stem, "workload": dataclasses.asdict(wl), "device": args.device, "warmup": args.warmup, "steps": args.steps,
            "profile": bool(args.profile and system in profile_systems), "profile_steps": args.profile_steps,
            "out_dir": str(out_dir), "run_id": run_id, "ours_config": ours_config,
            "gpu_mem_cap_gib": args.gpu_mem_cap_gib}
    spec_path = out_dir / "logs" / f"{stem}.spec.json"
    result_path = out_dir / "logs" / f"{stem}.result.json"
    log_path = out_dir / "logs" / f"{stem}.log"
    spec_path.write_text(json.dumps(spec))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", system, str(spec_path), str(result_path)]
    env = dict(os.environ)
    env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "RANK": "0", "WORLD_SIZE": "1",
                "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "PYTHONUNBUFFERED": "1"})
    env.setdefault("HF_HUB_OFFLINE", "1")
    timeout = timeouts[system] if left is None else min(timeouts[system], left)
    rec: dict[str, Any] = {"command": shlex.join(cmd), "timeout_s": round(timeout, 1), "log": str(log_path)}
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        sampler = TreeRssSampler(proc.pid)
        sampler.start()
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
            _kill_tree(proc)
        peak = sampler.stop()
    # the worker leaves with os._exit(0); a DeepSpeed worker it spawned may still linger in its group
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    rec["peak_host_rss_tree_gb"] = round(peak / 1e9, 2)
    if result_path.exists():
        rec.update(json.loads(result_path.read_text()))
    elif rc is None:
        rec.update({"status": "timeout", "reason": f"no result after {timeout:.0f} s; killed"})
    else:
        why = f"worker exited with {rc}"
        if rc < 0:
            why += f" (signal {-rc}{': host out of memory?' if -rc == signal.SIGKILL else ''})"
        rec.update({"status": "failed", "reason": why})
    if rec.get("status") in ("failed", "timeout", "oom") or rc not in (0, None):
        rec["log_tail"] = _tail(log_path)
    rec["exit_code"] = rc
    return rec


def _print_row(rec: dict[str, Any]) -> None:
    head = f"[suite] {rec['system']:<16} {rec['status']:<7}"
    if rec.get("step_s_median") is not None and rec["status"] == "ok":
        head += (f" {rec['step_s_median']:.3f} s/step  {rec['tokens_per_s']:,.0f} tok/s"
                 f"  x{rec.get('x_gpu', float('nan')):.2f} GPU-only  MFU {rec.get('mfu', 0):.1%}")
        tel = rec.get("telemetry")
        if tel:
            head += f"  cpu {tel['cpu_adam_s']:.2f} s pass {tel.get('pass_s', 0.0):.2f} s wait {tel['gpu_wait_s']:.2f} s"
            if any(tel.get("master_share") or ()):
                head += f" share {'/'.join(map(str, tel['master_share']))}"
        gcs = rec.get("gc_per_step") or []
        if any(g["gc_gen2"] for g in gcs):
            pauses = [f"{g['gc_s']:.2f}" if g["gc_gen2"] else "-" for g in gcs]
            head += f"  full GC {'/'.join(pauses)} s"
    elif rec.get("reason"):
        head += f" {rec['reason'][:160]}"
    gpu = rec.get("peak_gpu_gb")
    head += (f"  | peak GPU {gpu if gpu is not None else '-'} GB host {rec.get('peak_host_rss_gb', 0):.1f} GB"
             f"  | wall {rec['wall_s']:.0f} s (init {rec.get('init_s', '-')} s)")
    print(head, flush=True)


if __name__ == "__main__":
    sys.exit(main())
