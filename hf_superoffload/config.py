"""User-facing configuration of the offload engine.

One frozen, validated dataclass. Every field is a *request*; the planner turns requests plus the
measured hardware into a frozen :class:`~hf_superoffload.planning.plan.OffloadPlan` that the runtime executes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["SuperOffloadConfig"]

Rollback = Literal["auto", "double_buffer", "inverse"]
CastSide = Literal["auto", "cpu", "gpu"]
WeightPlacement = Literal["auto", "stationary", "flow"]
AccumulationDtype = Literal["auto", "fp32", "landing"]

TRI_STATE_FIELDS = ("accumulate_on_host", "defer_moments", "defer_master")
"""Fields that take ``"auto"``, ``True`` or ``False`` (``defer_master`` also a fraction)."""
BOOL_WORDS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}
"""How a boolean is spelled in text (environment variables, YAML strings, command-line arguments)."""


def tri_state_from_text(name: str, text: str) -> bool | float | str:
    """Parse the text form of a :data:`TRI_STATE_FIELDS` field: ``auto``, a word of :data:`BOOL_WORDS`, or for
    ``defer_master`` a number (a fixed share; its range is checked by the config). Raises ``ValueError`` naming the
    spellings; the adapters prefix the argument or variable that carried the text."""
    v = text.strip().lower()
    if v == "auto":
        return "auto"
    if v in BOOL_WORDS:
        return BOOL_WORDS[v]
    if name != "defer_master":
        raise ValueError("use 'auto', 'true' or 'false'")
    try:
        return float(v)
    except ValueError:
        raise ValueError("use 'auto', 'true', 'false' or a fraction strictly between 0 and 1 (e.g. 0.5)") from None


@dataclass(frozen=True, kw_only=True, slots=True)
class SuperOffloadConfig:
    """How the optimizer is split between the GPU and the host.

    Attributes:
        bucket_size_mb: Gradient bytes (in the model dtype) per bucket. A bucket is the unit of
            device-to-host copy, CPU Adam work and host-to-device copy. A parameter larger than one bucket
            gets a bucket of its own. [Note: bucket size] in docs/design.md.
        gpu_resident_buckets: How many of the *last* buckets to arrive in backward (the first layers, which
            the next forward needs first) keep fp32 master and Adam state on the device and step there after
            validation. ``"auto"`` lets the planner choose from the measured hardware; ``0`` puts every
            optimizer state on the host.
        gpu_resident_fraction: Used by ``"auto"`` when the device's free memory is unknown (CPU runs): the
            fraction of trainable parameters (counted from the last bucket backwards) kept on the device.
        device_memory_fraction: Used by ``"auto"`` on a GPU: the share of the device memory free at
            construction that the GPU-resident tail may fill (16 B/param: fp32 master, m, v and the bf16
            gradient). Spare HBM holds optimizer state; the rest of the free memory is left to activations.
        speculation: Start each bucket's CPU Adam as soon as its gradients are on the host, before the
            global gradient norm is known, and validate afterwards (speculation-then-validation).
        rollback: How a speculative step is undone when validation says clip-and-redo or skip.
            ``"double_buffer"`` keeps two copies of the host state and steps from one into the other, so undo
            is free and bit-exact (+12 B/param host RAM, no extra memory traffic); ``"inverse"`` inverts the
            AdamW update algebraically (no extra memory; exact to fp32 rounding); ``"auto"`` takes
            ``"double_buffer"`` when host RAM allows it (one copy when speculation is off: nothing is ever
            undone). [Note: speculation and rollback].
        nonspeculative_in_place: With the double buffer, a step that speculates nothing (speculation off or
            paused because clipping keeps firing) updates the committed state copy in place: it can never be
            undone, and in place its passes move less host memory (measured 3% faster on a 3.6B all-host step).
            ``False`` writes the other copy on every step, so a deferred moment commit that fails can be run again
            exactly instead of marking the engine inconsistent. [Note: speculation and rollback].
        max_redo_rate: Speculation pauses while more than this fraction of the last ``redo_window`` steps
            needed a redo (clipping fired): a redo costs a second, exposed CPU pass. It resumes by itself once
            clipping becomes rarer (every step's verdict is known, speculative or not).
        redo_window: Window (in optimizer steps) for ``max_redo_rate``.
        cast_side: Where the fp32 master becomes bf16 weights (gradients cross in bf16 either way). ``"cpu"``:
            the cast is fused into the CPU Adam pass and bf16 weights cross the link (right for PCIe). ``"gpu"``:
            the fp32 master crosses the link and the GPU casts; no host staging arena (2 B/param less host RAM;
            right for a fast chip-to-chip link). ``"auto"``: the planner decides from the measured link and, when
            only the GPU cast fits the host RAM, picks it.
        weight_placement: ``"stationary"`` keeps bf16 weights on the GPU; ``"flow"`` streams them from the
            host per layer; ``"auto"`` lets the planner decide from the memory budget.
        cpu_threads: Threads of the CPU Adam. ``None``: the cores of this process's affinity mask minus one,
            independent of ``OMP_NUM_THREADS`` (which ``accelerate launch`` sets to 1).
        pin_memory: Page-lock the host buffers that DMA touches (exact-size, never rounded up).
        worker_timeout_s: Longest time the training loop waits for one bucket before raising an error that
            names it. The worker itself never polls.
        check_finite: Skip the whole step (bit-exact) when any gradient is non-finite.
        max_consecutive_skips: After this many consecutive skipped (non-finite) steps, ``step()`` raises a
            ``RuntimeError`` naming the count and the last gradient norms (the optimizer state is left as it was
            before the skips): a run whose every step is skipped trains nothing while looking alive. ``0``: never
            raise.
        accumulate_on_host: Gradient accumulation (micro-batches run inside ``no_sync()``, or an integration's
            sync predicate says "not a boundary"): ``True`` offloads every micro-batch's host-bucket gradients as
            they complete and sums them on the host (the CPU worker adds; the device keeps no accumulated
            gradient between micro-batches); ``False`` accumulates in ``param.grad`` on the device and offloads
            the boundary micro-batch only; ``"auto"``: on in weight-flow mode (where device memory is the
            constraint), off otherwise. Single process only: refused with data parallelism.
            [Note: host accumulation] in docs/weight_flow.md.
        host_accumulation_dtype: With host accumulation, where the sum lives. ``"fp32"``: a separate fp32 arena
            (+4 B/param host RAM, the CPU Adam steps from fp32); ``"landing"``: in the gradient landing buffer,
            in its dtype (the model's, rounded like torch's bf16 ``.grad`` accumulation; no per-parameter
            RAM); ``"auto"``: fp32 when host RAM allows it, else landing.
        defer_moments: Deferred moment stores. A host bucket stepped once the verdict is known (speculation off or
            paused, clipping certain, a redo) writes only p and the bf16 weights on the critical path (20 instead
            of 28 B/param of host traffic) and stores ``exp_avg``/``exp_avg_sq`` later, off the critical path (when
            the worker is idle, during the rest of the forward and the backward), bit for bit as the fused step
            would. Costs a second gradient landing arena (+2 B/param pinned). ``"auto"``: on for a single process
            with stationary weights and no host accumulation when host RAM allows it.
            [Note: deferred moments] in docs/design.md.
        defer_master: With deferred moment stores and the CPU cast, also leave the fp32 master unstored in the
            verdict-known pass: it writes only the bf16 weights (16 instead of 20 B/param on the critical path)
            and the commit later runs the whole step again from the pre-step state (26 instead of 18 B/param,
            off the critical path), bit for bit. Pays off only while the commits fit in the worker's idle time
            (the backward). ``True``: every host bucket; ``False``: none; ``"auto"`` (default, where deferred
            moments and the CPU cast are on): the engine starts with none and moves the share each step from
            what it measures, more while the commits finish early, fewer once they spill into the next pass
            ([Note: adaptive master deferral] in docs/design.md). A fraction in (0, 1): a fixed share, the host
            buckets holding about that fraction of the host parameters (in gradient-arrival order).
        d2h_lead_buckets: How many host buckets' gradient copies may still be in flight when the backward hands
            over the next one (a rate limiter, like FSDP's ``limit_all_gathers``). ``0``: each bucket's hook waits
            for its own copy, so the worker always finds its gradients on the host, but the GPU queue drains at
            every bucket (measured: GPU 78% busy in the 3.6B all-host backward). ``k > 0``: the backward runs
            ahead by up to ``k`` copies (k flattened gradient buckets of device memory in flight) and the worker
            takes its tasks in arrival order until the verdict. ``"auto"`` (default): 4 when the host holds most
            of the optimizer state (measured in one run: 3.6B all-host 1.53 -> 1.46 s/step, 8B 2.74 -> 2.24 s),
            0 when most of it is on the GPU (the measured default plans). [Note: D2H lead] in docs/design.md.
        upload_thread: Issue the host buckets' H2D weight uploads (a copy, the scatter into the parameters, an
            event) from a thread of their own, so the CPU worker starts the next bucket's Adam at once instead of
            spending ~0.5 ms of Python and launches per bucket between Adam calls on the critical path. Single
            process with stationary weights on CUDA (elsewhere the worker uploads). ``False``: the worker uploads
            (the schedule of every measurement before session 7). [Note: upload thread] in docs/design.md.
        d2h_gate: With a D2H lead, queue a host bucket's first CPU task only once its gradient copy has landed (a
            gate thread waits for the copies in arrival order), so the CPU worker spends the wait on deferred
            commits instead of blocking on the copy. Single process. ``False``: the worker waits on the copy
            itself (the schedule before session 8). [Note: D2H gate] in docs/design.md.
    """

    bucket_size_mb: float = 32.0
    gpu_resident_buckets: int | Literal["auto"] = "auto"
    gpu_resident_fraction: float = 0.15
    device_memory_fraction: float = 0.4
    speculation: bool = True
    rollback: Rollback = "auto"
    nonspeculative_in_place: bool = True
    max_redo_rate: float = 0.5
    redo_window: int = 8
    cast_side: CastSide = "auto"
    weight_placement: WeightPlacement = "auto"
    cpu_threads: int | None = None
    pin_memory: bool = True
    worker_timeout_s: float = 600.0
    check_finite: bool = True
    max_consecutive_skips: int = 8
    accumulate_on_host: bool | Literal["auto"] = "auto"
    host_accumulation_dtype: AccumulationDtype = "auto"
    defer_moments: bool | Literal["auto"] = "auto"
    defer_master: bool | float | Literal["auto"] = "auto"
    d2h_lead_buckets: int | Literal["auto"] = "auto"
    upload_thread: bool = True
    d2h_gate: bool = True

    def __post_init__(self) -> None:
        def bad(field: str, value: Any, fix: str) -> ValueError:
            return ValueError(f"SuperOffloadConfig.{field}={value!r} is invalid: {fix}")

        if not (self.bucket_size_mb > 0):
            raise bad("bucket_size_mb", self.bucket_size_mb, "use a positive size such as 32")
        if self.gpu_resident_buckets != "auto" and (
            not isinstance(self.gpu_resident_buckets, int) or self.gpu_resident_buckets < 0
        ):
            raise bad("gpu_resident_buckets", self.gpu_resident_buckets, "use 'auto' or an integer >= 0")
        if not (0.0 <= self.gpu_resident_fraction <= 1.0):
            raise bad("gpu_resident_fraction", self.gpu_resident_fraction, "use a fraction in [0, 1]")
        if not (0.0 <= self.device_memory_fraction <= 0.9):
            raise bad("device_memory_fraction", self.device_memory_fraction, "use a fraction in [0, 0.9]")
        if self.rollback not in ("auto", "double_buffer", "inverse"):
            raise bad("rollback", self.rollback, "use 'auto', 'double_buffer' or 'inverse'")
        if not isinstance(self.nonspeculative_in_place, bool):
            raise bad("nonspeculative_in_place", self.nonspeculative_in_place, "use True or False")
        if not (0.0 <= self.max_redo_rate <= 1.0):
            raise bad("max_redo_rate", self.max_redo_rate, "use a fraction in [0, 1]")
        if self.redo_window < 1:
            raise bad("redo_window", self.redo_window, "use an integer >= 1")
        if self.cast_side not in ("auto", "cpu", "gpu"):
            raise bad("cast_side", self.cast_side, "use 'auto', 'cpu' or 'gpu'")
        if self.weight_placement not in ("auto", "stationary", "flow"):
            raise bad("weight_placement", self.weight_placement, "use 'auto', 'stationary' or 'flow'")
        if self.cpu_threads is not None and (not isinstance(self.cpu_threads, int) or self.cpu_threads < 1):
            raise bad("cpu_threads", self.cpu_threads, "use None (automatic) or an integer >= 1")
        if not (self.worker_timeout_s > 0):
            raise bad("worker_timeout_s", self.worker_timeout_s, "use a positive number of seconds")
        mcs = self.max_consecutive_skips
        if isinstance(mcs, bool) or not isinstance(mcs, int) or mcs < 0:
            raise bad("max_consecutive_skips", mcs, "use an integer >= 0 such as 8 (0: never raise on skipped steps)")
        if not (isinstance(self.accumulate_on_host, bool) or self.accumulate_on_host == "auto"):
            raise bad("accumulate_on_host", self.accumulate_on_host, "use True, False or 'auto'")
        if self.host_accumulation_dtype not in ("auto", "fp32", "landing"):
            raise bad("host_accumulation_dtype", self.host_accumulation_dtype, "use 'auto', 'fp32' or 'landing'")
        if not (isinstance(self.defer_moments, bool) or self.defer_moments == "auto"):
            raise bad("defer_moments", self.defer_moments, "use True, False or 'auto'")
        dm = self.defer_master
        if not (isinstance(dm, bool) or dm == "auto" or (isinstance(dm, float) and 0.0 < dm < 1.0)):
            raise bad("defer_master", dm, "use True, False, 'auto' or a fraction strictly between 0 and 1 (e.g. 0.5)")
        lead = self.d2h_lead_buckets
        if lead != "auto" and (isinstance(lead, bool) or not isinstance(lead, int) or lead < 0):
            raise bad("d2h_lead_buckets", lead, "use 'auto' or an integer >= 0 (0: no lead)")
        if not isinstance(self.upload_thread, bool):
            raise bad("upload_thread", self.upload_thread, "use True or False")
        if not isinstance(self.d2h_gate, bool):
            raise bad("d2h_gate", self.d2h_gate, "use True or False")

    def replace(self, **changes: Any) -> SuperOffloadConfig:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
