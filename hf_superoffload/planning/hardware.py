"""What the planner knows about the machine: cheap reads, short measurements, and shipped profiles.

[Note: hardware profile]
``HardwareProfile.read`` takes only what costs nothing (free device memory, ``MemAvailable``, cores).
``HardwareProfile.measure`` adds rates measured in a few seconds: pinned H2D/D2H alone and concurrent,
bf16 GEMM TFLOP/s, device copy bandwidth (CUDA only), the CPU AdamW rate of the real fused kernel
(``ops.cpu_adamw_step_``, bf16 gradient in, bf16 weights out, at ``cpu_threads``) and the host memory rate of
the in-place stream that kernel and the host gradient sums make (``a += s * b``, at ``cpu_threads``). Rates do not change
between runs, so they are cached as JSON under ``~/.cache/hf_superoffload`` (``HF_SUPEROFFLOAD_CACHE``
overrides the folder); the free-memory fields are re-read on every call.

Shipped profiles (``profiles/*.json``, package data) describe machines we plan for but may not have:
``gh200()`` from published figures, ``h200_pcie()`` from the team's measured box, ``shipped("h100_sxm")`` from
the team's measured H100 box, ``rtx4090_24gb()`` from assumed datasheet figures. Each says where its numbers come
from in ``source`` and ``notes``. Any field can be overridden with ``dataclasses.replace``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import socket
import statistics
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "CACHE_ENV", "RATE_FIELDS", "HardwareProfile", "available_host_bytes", "cache_path", "cuda_free_bytes",
    "default_cpu_threads", "shipped_profile_names", "with_known_rates",
]

CACHE_ENV = "HF_SUPEROFFLOAD_CACHE"
"""Folder of the cached measured profiles (default ``~/.cache/hf_superoffload``)."""
_SCHEMA = 1
GB = 1e9


def default_cpu_threads() -> int:
    """Cores in this process's affinity mask, minus one for the Python thread that feeds the GPU.

    Deliberately independent of ``OMP_NUM_THREADS``: ``accelerate launch`` exports 1 there. The rule lives
    with the kernel (:func:`hf_superoffload.ops.default_num_threads`); the planner only reports it.
    """
    from .. import ops

    return ops.default_num_threads()


def _meminfo(key: str) -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def available_host_bytes() -> int | None:
    """``MemAvailable`` from /proc/meminfo, or ``None`` where it cannot be read."""
    return _meminfo("MemAvailable")


def cuda_free_bytes(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of a CUDA device as this process may use them: the driver's free memory, capped by
    ``torch.cuda.set_per_process_memory_fraction`` (the caching allocator refuses to reserve past fraction x
    total, so a plan sized by the driver's figure alone would run out of memory under the cap). ``cuda`` without an
    index is the current device (``get_per_process_memory_fraction`` refuses a device without one)."""
    device = torch.device(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    free, total = torch.cuda.mem_get_info(device)
    fraction = torch.cuda.get_per_process_memory_fraction(device)
    if fraction < 1.0:
        free = min(free, max(0, int(fraction * total) - torch.cuda.memory_reserved(device)))
    return int(free), int(total)


def cache_path(device: torch.device | str) -> Path:
    """``<cache>/profile-<hostname>-<gpu name or cpu>.json`` for ``device``."""
    device = torch.device(device)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    host, gpu = (re.sub(r"[^A-Za-z0-9.-]+", "_", x).strip("_") or "unknown" for x in (socket.gethostname(), gpu))
    folder = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "hf_superoffload")
    return folder / f"profile-{host}-{gpu}.json"


@dataclass(frozen=True, slots=True)
class HardwareProfile:
    """Facts about the machine. Every field can be overridden for tests or to simulate another machine.

    Rates are per direction in GB/s (1e9 bytes), TFLOP/s and Gparam/s; ``None`` means unknown.

    Attributes:
        device_type: ``"cuda"`` or ``"cpu"`` (the model's device).
        device_free_bytes: free device memory; ``None`` when unknown (CPU).
        host_available_bytes: host RAM available to this process; ``None`` when unknown.
        cpu_threads: threads the CPU Adam may use.
        name: what machine this is (GPU name, or the shipped profile's name).
        source: ``"read"``, ``"measured"``, ``"measured-quick"``, ``"published"`` or ``"assumed"``.
        device_total_bytes: total device memory.
        host_total_bytes: installed host RAM (``MemTotal``).
        cpu_cores: cores in this process's affinity mask.
        h2d_gbps / d2h_gbps: pinned host-to-device / device-to-host copy rate, one direction alone.
        h2d_concurrent_gbps / d2h_concurrent_gbps: the same while both directions run at once.
        cpu_adam_gparams: fused CPU AdamW (bf16 grad in, bf16 weights out) at ``cpu_threads``.
        host_memory_gbps: host memory bandwidth for in-place streaming (the CPU Adam's roofline).
        matmul_tflops: dense bf16 GEMM rate actually reached (not the datasheet peak).
        device_memory_gbps: device memory bandwidth (the GPU-tail AdamW's roofline).
        peer_gbps: NCCL bus bandwidth of a reduce-scatter or all-gather between this host's GPUs (NVLink; PCIe
            peer-to-peer where they have none): the data-parallel collectives' rate. Not measured (one GPU cannot);
            ``None``: the step-time roofline assumes NVLink 4 (``step_time.PEER_GBPS_ASSUMED``).
        notes: where the numbers come from.
    """

    device_type: str
    device_free_bytes: int | None
    host_available_bytes: int | None
    cpu_threads: int
    name: str | None = None
    source: str | None = None
    device_total_bytes: int | None = None
    host_total_bytes: int | None = None
    cpu_cores: int | None = None
    h2d_gbps: float | None = None
    d2h_gbps: float | None = None
    h2d_concurrent_gbps: float | None = None
    d2h_concurrent_gbps: float | None = None
    cpu_adam_gparams: float | None = None
    host_memory_gbps: float | None = None
    matmul_tflops: float | None = None
    device_memory_gbps: float | None = None
    peer_gbps: float | None = None
    notes: tuple[str, ...] = ()

    # ---------------------------------------------------------------------------------------------
    # cheap reads and measurements
    @classmethod
    def read(cls, device: torch.device) -> HardwareProfile:
        """Free memory and cores only: costs nothing, measures nothing."""
        from .. import ops

        device = torch.device(device)
        free = total = None
        name = None
        if device.type == "cuda":
            free, total = cuda_free_bytes(device)
            name = torch.cuda.get_device_name(device)
        return cls(
            device_type=device.type,
            device_free_bytes=free,
            host_available_bytes=available_host_bytes(),
            cpu_threads=default_cpu_threads(),
            name=name,
            source="read",
            device_total_bytes=total,
            host_total_bytes=_meminfo("MemTotal"),
            cpu_cores=ops.affinity_cores(),
        )

    @classmethod
    def measure(
        cls, device: torch.device | str, *, quick: bool = False, use_cache: bool = True, refresh: bool = False
    ) -> HardwareProfile:
        """:meth:`read` plus measured rates, cached per host and GPU (see [Note: hardware profile]).

        Args:
            quick: smaller sizes and fewer repetitions (well under a second on CPU); a quick cached
                profile does not satisfy a later full measurement.
            use_cache: read and write the JSON cache at :func:`cache_path`.
            refresh: measure again even when a cached profile exists.

        The first call may also build the CPU Adam op library (``cpu_ext``, about 30 s, cached).
        """
        device = torch.device(device)
        base = cls.read(device)
        path = cache_path(device)
        if use_cache and not refresh and path.is_file():
            try:
                cached = cls.load(path)
            except (OSError, ValueError):
                cached = None
            usable = cached is not None and cached.device_type == base.device_type
            usable = usable and cached.cpu_threads == base.cpu_threads
            if usable and (quick or cached.source == "measured"):
                return dataclasses.replace(
                    cached, device_free_bytes=base.device_free_bytes, host_available_bytes=base.host_available_bytes
                )
        rates: dict[str, Any] = {"cpu_adam_gparams": _measure_cpu_adam(base.cpu_threads, quick=quick),
                                 "host_memory_gbps": _measure_host_memory(base.cpu_threads, quick=quick)}
        if device.type == "cuda":
            rates.update(_measure_cuda(device, quick=quick))
            torch.cuda.empty_cache()  # hand the benchmark buffers back: leave the device as read() found it
        prof = dataclasses.replace(
            base, source="measured-quick" if quick else "measured", notes=(f"measured {time.strftime('%Y-%m-%d')}",),
            **rates,
        )
        if use_cache:
            with contextlib.suppress(OSError):  # a read-only home must not stop planning
                prof.save(path)
        return prof

    # ---------------------------------------------------------------------------------------------
    # JSON
    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["notes"] = list(self.notes)
        return {"schema": _SCHEMA, **d}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HardwareProfile:
        data = dict(data)
        schema = data.pop("schema", _SCHEMA)
        if schema != _SCHEMA:
            raise ValueError(f"hardware profile schema {schema!r} is not supported (expected {_SCHEMA})")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown hardware profile field(s) {unknown}; known: {sorted(known)}")
        missing = [k for k in ("device_type", "cpu_threads") if k not in data]
        if missing:
            raise ValueError(f"hardware profile lacks required field(s) {missing}")
        data.setdefault("device_free_bytes", None)
        data.setdefault("host_available_bytes", None)
        data["notes"] = tuple(data.get("notes") or ())
        return cls(**data)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the profile as JSON (atomically: a concurrent reader never sees half a file)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> HardwareProfile:
        """Read a profile written by :meth:`save` (or a hand-written one with the same fields)."""
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not a JSON hardware profile ({e})") from e
        if not isinstance(data, dict):
            raise ValueError(f"{path}: a hardware profile is a JSON object")
        return cls.from_dict(data)

    # ---------------------------------------------------------------------------------------------
    # shipped profiles
    @classmethod
    def shipped(cls, name: str) -> HardwareProfile:
        """A profile shipped in ``hf_superoffload/planning/profiles/<name>.json``."""
        res = resources.files("hf_superoffload.planning").joinpath("profiles").joinpath(f"{name}.json")
        if not res.is_file():
            raise ValueError(f"no shipped hardware profile {name!r}; shipped: {shipped_profile_names()}")
        return cls.from_dict(json.loads(res.read_text()))

    @classmethod
    def gh200(cls) -> HardwareProfile:
        """NVIDIA GH200 Grace Hopper (96 GB HBM3, 480 GB LPDDR5X, NVLink-C2C), published figures."""
        return cls.shipped("gh200")

    @classmethod
    def h200_pcie(cls) -> HardwareProfile:
        """The team's H200 SXM box on PCIe Gen5 (16 cores, 128 GiB), measured 2026-11-30."""
        return cls.shipped("h200_pcie")

    @classmethod
    def rtx4090_24gb(cls) -> HardwareProfile:
        """A 24 GB workstation card on PCIe Gen4 with 16 cores and 64 GiB: assumed datasheet figures."""
        return cls.shipped("rtx4090_24gb")


# [Note: known rates] The bare optimizer plans with ``HardwareProfile.read`` (it measures nothing), but the tail
# search weighs host buckets, the device tail and kept layers by the roofline, which needs rates; without them it
# takes the largest tail, which on an H200 left 8B at 9 kept layers where the roofline's choice keeps 20. So the
# read profile borrows rates, in this order: this host's cached measurement (``hf-superoffload plan`` or
# ``HardwareProfile.measure`` wrote it), else the shipped profile of the same GPU model, its CPU Adam rate and host
# memory bandwidth scaled by this host's cores against the profiled host's (at most 1.5x). The notes say which.
# the SXM H100's name: an H100 PCIe or NVL has another GEMM rate and link
_SHIPPED_BY_GPU = (("GH200", "gh200"), ("H200", "h200_pcie"), ("H100 80GB HBM3", "h100_sxm"), ("4090", "rtx4090_24gb"))
RATE_FIELDS = ("h2d_gbps", "d2h_gbps", "h2d_concurrent_gbps", "d2h_concurrent_gbps", "cpu_adam_gparams",
               "host_memory_gbps", "matmul_tflops", "device_memory_gbps", "peer_gbps")


def with_known_rates(profile: HardwareProfile, device: torch.device | str) -> HardwareProfile:
    """``profile`` with the rates it lacks borrowed from a cached measurement or a shipped profile of the same GPU
    ([Note: known rates]); unchanged when it has rates, is not CUDA, or no source matches."""
    if profile.device_type != "cuda" or profile.cpu_adam_gparams is not None:
        return profile
    source: HardwareProfile | None = None
    note, shipped = "", False
    try:
        path: Path | None = cache_path(device)
    except (RuntimeError, AssertionError):  # no CUDA here: nothing was measured on it
        path = None
    if path is not None and path.is_file():
        with contextlib.suppress(OSError, ValueError, TypeError):
            source = HardwareProfile.load(path)
            note = f"rates: this host's measured profile ({path})"
    if source is None and profile.name:
        match = next((shipped for key, shipped in _SHIPPED_BY_GPU if key in profile.name), None)
        if match is not None:
            source, shipped = HardwareProfile.shipped(match), True
            note = f"rates: the shipped {match} profile's (same GPU model, not measured on this host)"
    if source is None or source.cpu_adam_gparams is None:
        return profile
    rates = {k: getattr(source, k) for k in RATE_FIELDS}
    if shipped and profile.cpu_cores and source.cpu_cores:
        scale = min(1.5, profile.cpu_cores / source.cpu_cores)
        for k in ("cpu_adam_gparams", "host_memory_gbps"):
            if rates[k] is not None:
                rates[k] *= scale
        if scale != 1.0:
            note += f"; CPU rates scaled by {scale:.2f} for {profile.cpu_cores} cores"
    return dataclasses.replace(profile, **rates, notes=(*profile.notes, note))


def shipped_profile_names() -> list[str]:
    """Names accepted by :meth:`HardwareProfile.shipped`."""
    folder = resources.files("hf_superoffload.planning").joinpath("profiles")
    return sorted(p.name[: -len(".json")] for p in folder.iterdir() if p.name.endswith(".json"))


# -------------------------------------------------------------------------------------------------
# measurements
def _median_seconds(fn: Any, reps: int) -> float:
    fn()  # warm-up (and, for the CPU Adam, the one-time library load)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _measure_cpu_adam(threads: int, *, quick: bool) -> float:
    """Gparam/s of ``ops.cpu_adamw_step_`` on fp32 p/m/v with a bf16 gradient and a bf16 weight copy out.

    Sizes exceed the last-level cache (8M params = 128 MB of traffic per pass), so the rate is the
    memory-bound one that training sees.
    """
    from .. import ops

    n = (8 if quick else 32) * 1024 * 1024
    p = torch.randn(n)
    m, v = torch.zeros(n), torch.zeros(n)
    g = torch.randn(n).to(torch.bfloat16)
    out = torch.empty(n, dtype=torch.bfloat16)
    step = [0]
    hyper = ops.AdamWHyper(lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)

    def run() -> None:
        step[0] += 1
        ops.cpu_adamw_step_(p, g, m, v, step=step[0], hyper=hyper, param_bf16_out=out, num_threads=threads)

    return n / _median_seconds(run, 3 if quick else 5) / 1e9


def _measure_host_memory(threads: int, *, quick: bool) -> float:
    """GB/s of the in-place streaming pattern the CPU Adam and the host gradient sums run: ``a += s * b`` over fp32
    arrays far past the last-level cache (8 B read and 4 B written per element), at ``threads`` threads. The
    step-time roofline prices host memory with it (without it: 28 B x the CPU Adam rate)."""
    n = (8 if quick else 64) * 1024 * 1024
    a, b = torch.ones(n), torch.ones(n)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        seconds = _median_seconds(lambda: a.add_(b, alpha=1e-3), 3 if quick else 7)
    finally:
        torch.set_num_threads(before)
    return 12 * n / seconds / 1e9


def _measure_cuda(device: torch.device, *, quick: bool) -> dict[str, float]:  # pragma: no cover - needs a GPU
    """Pinned copy rates (alone and concurrent), device copy bandwidth and bf16 GEMM rate."""
    nbytes = (64 if quick else 256) * 1024 * 1024
    reps = 4 if quick else 10
    host_a = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host_b = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev_a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev_b = torch.empty(nbytes, dtype=torch.uint8, device=device)
    s1, s2 = torch.cuda.Stream(device), torch.cuda.Stream(device)

    def timed(fn: Any) -> float:
        fn()
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize(device)
        return (time.perf_counter() - t0) / reps

    def h2d() -> None:
        with torch.cuda.stream(s1):
            dev_a.copy_(host_a, non_blocking=True)

    def d2h() -> None:
        with torch.cuda.stream(s2):
            host_b.copy_(dev_b, non_blocking=True)

    def both() -> None:
        h2d()
        d2h()

    t_h2d, t_d2h, t_both = timed(h2d), timed(d2h), timed(both)
    t_dev = timed(lambda: dev_b.copy_(dev_a))
    k = 4096 if quick else 8192
    a = torch.randn(k, k, device=device, dtype=torch.bfloat16)
    b = torch.randn(k, k, device=device, dtype=torch.bfloat16)
    t_mm = timed(lambda: torch.mm(a, b))
    both_gbps = nbytes / t_both / GB  # each direction moved nbytes in t_both
    return {
        "h2d_gbps": nbytes / t_h2d / GB,
        "d2h_gbps": nbytes / t_d2h / GB,
        "h2d_concurrent_gbps": both_gbps,
        "d2h_concurrent_gbps": both_gbps,
        "device_memory_gbps": 2 * nbytes / t_dev / GB,
        "matmul_tflops": 2 * k**3 / t_mm / 1e12,
    }
