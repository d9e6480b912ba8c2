"""User-facing configuration of the offload engine, declared once.

:class:`SuperOffloadConfig` is the one source of the offload options: each field carries its default, its
one-line help (``field(metadata={"help": ...})``, shown by ``--help``) and its validation (``metadata["valid"]``
with the fix in ``metadata["fix"]``), and a docstring under it with the full semantics. The adapters read these
fields instead of restating them: ``SuperOffloadArguments`` generates its ``--superoffload_<name>`` flags from
them, ``SuperOffloadPlugin`` its fields and ``HF_SUPEROFFLOAD_<NAME>`` variables, and every text form (command
line, environment, YAML, JSON) goes through :meth:`SuperOffloadConfig.from_dict`, which parses a string by the
field's type.

Every field is a *request*; the planner turns requests plus the measured hardware into a frozen
:class:`~hf_superoffload.planning.plan.OffloadPlan` that the runtime executes. Switches of the planner's schedule
(those that exist to measure one mechanism against another, and the memory/speed trade-offs the planner decides
from the hardware) live in :class:`PlannerOverrides` (``config.overrides``): an explicit override for experts and
tests, with no flag, plugin field or environment variable.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = [
    "USER_OPTIONS",
    "InvalidConfigValue",
    "PlannerOverrides",
    "SuperOffloadConfig",
    "field_alternatives",
    "load_config_mapping",
    "value_from_text",
]

Rollback = Literal["auto", "double_buffer", "inverse"]
CastSide = Literal["auto", "cpu", "gpu"]
WeightPlacement = Literal["auto", "stationary", "flow"]
AccumulationDtype = Literal["auto", "fp32", "landing"]

BOOL_WORDS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}
"""How a boolean is spelled in text (environment variables, YAML strings, command-line arguments)."""


class InvalidConfigValue(ValueError):
    """A field's value is out of its domain. ``str()`` is one line naming the field, the value and the fix;
    adapters re-label it with the spelling the user wrote (a flag, an environment variable) by :meth:`labelled`."""

    def __init__(self, owner: str, name: str, value: Any, fix: str) -> None:
        self.owner, self.name, self.value, self.fix = owner, name, value, fix
        super().__init__(self.labelled(f"{owner}.{name}"))

    def labelled(self, label: str) -> str:
        return f"{label}={self.value!r} is invalid: {self.fix}"


# ---- field declaration: default + help + validation in one place -----------------------------------------------
def _meta(help: str, *, valid: Callable[[Any], bool], fix: str) -> dict[str, Any]:
    """A field's metadata: its ``--help`` line, its check, and the fix its error names."""
    return {"help": help, "valid": valid, "fix": fix}


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int_at_least(lo: int) -> Callable[[Any], bool]:
    return lambda v: _is_int(v) and v >= lo


def _number_in(lo: float, hi: float) -> Callable[[Any], bool]:
    return lambda v: _is_number(v) and lo <= v <= hi


def _one_of(choices: Any) -> Callable[[Any], bool]:
    allowed = typing.get_args(choices)
    return lambda v: isinstance(v, str) and v in allowed


def _auto_or(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v == "auto" or check(v)


def _positive(v: Any) -> bool:
    return _is_number(v) and v > 0


def _fraction_or_bool_or_auto(v: Any) -> bool:
    return _is_bool(v) or v == "auto" or (isinstance(v, float) and 0.0 < v < 1.0)


def _validate(obj: Any) -> None:
    """Run every field's ``metadata["valid"]``; raise :class:`InvalidConfigValue` with its ``metadata["fix"]``."""
    for f in dataclasses.fields(obj):
        check = f.metadata.get("valid")
        if check is not None and not check(getattr(obj, f.name)):
            raise InvalidConfigValue(type(obj).__name__, f.name, getattr(obj, f.name), f.metadata["fix"])


@dataclass(frozen=True, kw_only=True, slots=True)
class PlannerOverrides:
    """Switches of the planner's schedule, for experts and tests: each pins a choice the planner otherwise makes
    (the defaults are the measured best, or ``"auto"``: the planner decides from the hardware), so one mechanism can
    be measured against another. They are not user options: no ``--superoffload_*`` flag, plugin field or
    environment variable sets them; pass them as ``SuperOffloadConfig(overrides=PlannerOverrides(...))`` (or
    ``{"overrides": {...}}`` in a config mapping).
    """

    gpu_resident_fraction: float = field(default=0.15, metadata=_meta(
        "With gpu_resident_buckets='auto' and no device memory reading (CPU runs): share of the trainable "
        "parameters kept in the GPU-resident tail.", valid=_number_in(0.0, 1.0), fix="use a fraction in [0, 1]"))
    """Used by ``gpu_resident_buckets="auto"`` when the device's free memory is unknown (CPU runs): the fraction of
    trainable parameters (counted from the last bucket backwards) kept on the device."""
    device_memory_fraction: float = field(default=0.4, metadata=_meta(
        "With gpu_resident_buckets='auto' on a GPU and no workload: share of the free device memory the "
        "GPU-resident tail may fill.", valid=_number_in(0.0, 0.9), fix="use a fraction in [0, 0.9]"))
    """Used by ``gpu_resident_buckets="auto"`` on a GPU when the planner has no workload to size the tail with the
    memory model: the share of the device memory free at construction that the GPU-resident tail may fill
    (16 B/param: fp32 master, m, v and the bf16 gradient); the rest is left to activations."""
    nonspeculative_in_place: bool = field(default=True, metadata=_meta(
        "With the double buffer, a step that speculates nothing updates the committed copy in place.",
        valid=_is_bool, fix="use True or False"))
    """With the double buffer, a step that speculates nothing (speculation off or paused because clipping keeps
    firing) updates the committed state copy in place: it can never be undone, and in place its passes move less
    host memory (measured 3% faster on a 3.6B all-host step). ``False`` writes the other copy on every step, so a
    deferred moment commit that fails can be run again exactly instead of marking the engine inconsistent.
    [Note: speculation and rollback]."""
    max_redo_rate: float = field(default=0.5, metadata=_meta(
        "Speculation pauses while more than this share of the last redo_window steps needed a redo.",
        valid=_number_in(0.0, 1.0), fix="use a fraction in [0, 1]"))
    """Speculation pauses while more than this fraction of the last ``redo_window`` steps needed a redo (clipping
    fired): a redo costs a second, exposed CPU pass. It resumes by itself once clipping becomes rarer (every step's
    verdict is known, speculative or not). ``1.0`` never pauses."""
    redo_window: int = field(default=8, metadata=_meta(
        "Window, in optimizer steps, for max_redo_rate.", valid=_int_at_least(1),
                               fix="use an integer >= 1"))
    """Window (in optimizer steps) for ``max_redo_rate``."""
    d2h_lead_buckets: int | Literal["auto"] = field(default="auto", metadata=_meta(
        "How many host buckets' gradient copies may still be in flight when the backward hands over the next.",
        valid=_auto_or(_int_at_least(0)), fix="use 'auto' or an integer >= 0 (0: no lead)"))
    """How many host buckets' gradient copies may still be in flight when the backward hands over the next one (a
    rate limiter, like FSDP's ``limit_all_gathers``). ``0``: each bucket's hook waits for its own copy, so the
    worker always finds its gradients on the host, but the GPU queue drains at every bucket (measured: GPU 78% busy
    in the 3.6B all-host backward). ``k > 0``: the backward runs ahead by up to ``k`` copies (k flattened gradient
    buckets of device memory in flight) and the worker takes its tasks in arrival order until the verdict.
    ``"auto"``: 4 when the host holds most of the optimizer state (measured: 3.6B all-host 1.53 -> 1.46 s/step,
    8B 2.74 -> 2.24 s), 0 when most of it is on the GPU. [Note: D2H lead] in docs/design.md."""
    upload_thread: bool = field(default=True, metadata=_meta(
        "Issue the host buckets' H2D weight uploads from a thread of their own (CUDA, one process).",
        valid=_is_bool, fix="use True or False"))
    """Issue the host buckets' H2D weight uploads (a copy, the scatter into the parameters, an event) from a thread
    of their own, so the CPU worker starts the next bucket's Adam at once instead of spending ~0.5 ms of Python and
    launches per bucket between Adam calls on the critical path. Single process with stationary weights on CUDA
    (elsewhere the worker uploads). ``False``: the worker uploads. [Note: upload thread] in docs/design.md."""
    d2h_gate: bool = field(default=True, metadata=_meta(
        "With a D2H lead, queue a host bucket's first CPU task only once its gradient copy has landed.",
        valid=_is_bool, fix="use True or False"))
    """With a D2H lead, queue a host bucket's first CPU task only once its gradient copy has landed (a gate thread
    waits for the copies in arrival order), so the CPU worker spends the wait on deferred commits instead of
    blocking on the copy. Single process. ``False``: the worker waits on the copy itself. [Note: D2H gate] in
    docs/design.md."""
    defer_moments: bool | Literal["auto"] = field(default="auto", metadata=_meta(
        "'auto', true or false: a CPU Adam pass whose verdict is known stores the Adam moments later, off "
        "the critical path (+2 B/param pinned host RAM); 'auto': the planner decides.",
        valid=_auto_or(_is_bool), fix="use 'auto', true or false"))
    """Deferred moment stores. A host bucket stepped once the verdict is known (speculation off or paused, clipping
    certain, a redo) writes only p and the bf16 weights on the critical path (20 instead of 28 B/param of host
    traffic) and stores ``exp_avg``/``exp_avg_sq`` later, off the critical path (when the worker is idle, during
    the rest of the forward and the backward), bit for bit as the fused step would. Costs a second gradient
    landing arena (+2 B/param pinned). ``"auto"``: on for a single process with stationary weights and no host
    accumulation when host RAM allows it; ``True`` where it would not be is refused. [Note: deferred moments] in
    docs/design.md."""
    deferred_speculation: bool | Literal["auto"] = field(default="auto", metadata=_meta(
        "'auto', true or false: with the inverse rollback and deferred moments, a speculative CPU pass writes "
        "the bf16 weights only and its commit comes later, so skip and redo are exact; 'auto': wherever it "
        "applies and its commits are predicted to cost under 1% of the step.", valid=_auto_or(_is_bool),
        fix="use 'auto', true or false"))
    """With the inverse rollback, speculation, deferred moment stores and the CPU cast: a speculative pass writes
    only the bf16 weights (16 instead of 28 B/param) and each committed speculative step owes a whole-step commit
    (26 B/param, off the critical path while it fits the worker's idle time), so a skip or redo undoes nothing
    and the state is exact instead of within fp32 rounding. ``"auto"``: on wherever it applies and the step-time
    roofline prices the commits within 1% of the algebraic undo's step (every state on the host is where they do
    not fit the idle time); ``False``: the algebraic undo; ``True``: exact at any price, refused where it does not
    apply. [Note: deferred speculation] in docs/design.md."""
    defer_master: bool | float | Literal["auto"] = field(default="auto", metadata=_meta(
        "'auto', true, false or a fraction such as 0.4: with deferred moments and the CPU cast, also store "
        "the fp32 master later, for all, none, an adaptive or a fixed share of the host buckets.",
        valid=_fraction_or_bool_or_auto,
        fix="use 'auto', true, false or a fraction strictly between 0 and 1 (e.g. 0.5)"))
    """With deferred moment stores and the CPU cast, also leave the fp32 master unstored in the verdict-known pass:
    it writes only the bf16 weights (16 instead of 20 B/param on the critical path) and the commit later runs the
    whole step again from the pre-step state (26 instead of 18 B/param, off the critical path), bit for bit. Pays
    off only while the commits fit in the worker's idle time (the backward). ``True``: every host bucket;
    ``False``: none; ``"auto"`` (where deferred moments and the CPU cast are on): the engine starts with none and
    moves the share each step from what it measures, more while the commits finish early, fewer once they spill
    into the next pass ([Note: adaptive master deferral] in docs/design.md). A fraction in (0, 1): a fixed share,
    the host buckets holding about that fraction of the host parameters (in gradient-arrival order)."""

    def __post_init__(self) -> None:
        _validate(self)

    def replace(self, **changes: Any) -> PlannerOverrides:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> PlannerOverrides:
        """Build from a mapping of field names; strings are parsed by the field's type (:func:`value_from_text`)."""
        _refuse_unknown(cls, values, "overrides")
        return cls(**{k: value_from_text(cls, k, v) if isinstance(v, str) else v for k, v in values.items()})


@dataclass(frozen=True, kw_only=True, slots=True)
class SuperOffloadConfig:
    """How the optimizer is split between the GPU and the host.

    Each field below is one user option (``--superoffload_<name>``, ``SuperOffloadPlugin(<name>=...)``,
    ``HF_SUPEROFFLOAD_<NAME>``); ``overrides`` holds the planner's expert switches (:class:`PlannerOverrides`).
    """

    bucket_size_mb: float | Literal["auto"] = field(default="auto", metadata=_meta(
        "'auto' or gradient MB per bucket, the unit of device->host copy, CPU Adam work and host->device copy "
        "('auto': the plan search picks 32, 64 or 128).",
        valid=_auto_or(_positive), fix="use 'auto' or a positive size such as 32"))
    """Gradient megabytes (in the model dtype) per bucket. A bucket is the unit of device-to-host copy, CPU Adam work
    and host-to-device copy. A parameter larger than one bucket gets a bucket of its own. ``"auto"``: the plan search
    weighs 32, 64 and 128 MB (each bucket costs the CPU worker a fixed time, a larger one more device memory in
    flight) and takes 32 MB where nothing is priced. [Note: bucket size] in docs/design.md."""
    gpu_resident_buckets: int | Literal["auto"] = field(default="auto", metadata=_meta(
        "'auto' or an integer >= 0: how many of the last buckets to arrive in backward (the first layers) "
        "keep fp32 master and Adam state on the GPU (0: all on the host).",
        valid=_auto_or(_int_at_least(0)), fix="use 'auto' or an integer >= 0"))
    """How many of the *last* buckets to arrive in backward (the first layers, which the next forward needs first)
    keep fp32 master and Adam state on the device and step there after validation. ``"auto"`` lets the planner
    choose from the measured hardware (and the workload, when known); ``0`` puts every optimizer state on the
    host."""
    speculation: bool = field(default=True, metadata=_meta(
        "Start each bucket's CPU Adam before the global gradient norm is known and validate afterwards.",
        valid=_is_bool, fix="use True or False"))
    """Start each bucket's CPU Adam as soon as its gradients are on the host, before the global gradient norm is
    known, and validate afterwards (speculation-then-validation)."""
    rollback: Rollback = field(default="auto", metadata=_meta(
        "How a speculative step is undone: 'double_buffer' (bit-exact, +12 B/param host RAM), 'inverse' "
        "(one copy: bit-exact with deferred speculation, else fp32 rounding) or 'auto' (the double buffer when "
        "host RAM allows).",
        valid=_one_of(Rollback), fix="use 'auto', 'double_buffer' or 'inverse'"))
    """How a speculative step is undone when validation says clip-and-redo or skip. ``"double_buffer"`` keeps two
    copies of the host state and steps from one into the other, so undo is free and bit-exact (+12 B/param host
    RAM, no extra memory traffic); ``"inverse"`` keeps one copy: with deferred speculation (deferred moment stores,
    and ``PlannerOverrides.deferred_speculation`` priced or set on) a speculative step writes only the bf16 weights
    and its commit comes later, so undo is a bf16 cast and bit-exact ([Note: deferred speculation]); otherwise it
    inverts the AdamW update algebraically (exact to fp32 rounding); ``"auto"`` takes ``"double_buffer"`` when host RAM allows it (one copy when speculation is
    off: nothing is ever undone). [Note: speculation and rollback]."""
    cast_side: CastSide = field(default="auto", metadata=_meta(
        "Where the fp32 master becomes bf16 weights: 'cpu' (fused into CPU Adam, right for PCIe), 'gpu' "
        "(fp32 over the link, no host staging arena) or 'auto'.",
        valid=_one_of(CastSide), fix="use 'auto', 'cpu' or 'gpu'"))
    """Where the fp32 master becomes bf16 weights (gradients cross in bf16 either way). ``"cpu"``: the cast is
    fused into the CPU Adam pass and bf16 weights cross the link (right for PCIe). ``"gpu"``: the fp32 master
    crosses the link and the GPU casts; no host staging arena (2 B/param less host RAM; right for a fast
    chip-to-chip link). ``"auto"``: the planner decides from the measured link and, when only the GPU cast fits the
    host RAM, picks it."""
    weight_placement: WeightPlacement = field(default="auto", metadata=_meta(
        "'stationary' keeps bf16 weights on the GPU, 'flow' streams them from the host per layer, 'auto' "
        "decides from the memory budget.", valid=_one_of(WeightPlacement), fix="use 'auto', 'stationary' or 'flow'"))
    """``"stationary"`` keeps bf16 weights on the GPU; ``"flow"`` streams them from the host per layer; ``"auto"``
    lets the planner decide from the memory budget."""
    cpu_threads: int | None = field(default=None, metadata=_meta(
        "CPU Adam threads (default: the cores of this process's affinity mask minus one, independent of "
        "OMP_NUM_THREADS).", valid=lambda v: v is None or _int_at_least(1)(v),
        fix="use None (automatic) or an integer >= 1"))
    """Threads of the CPU Adam. ``None``: the cores of this process's affinity mask minus one, independent of
    ``OMP_NUM_THREADS`` (which ``accelerate launch`` sets to 1). In text, ``auto`` or ``none`` means ``None``."""
    pin_memory: bool = field(default=True, metadata=_meta(
        "Page-lock the host buffers that DMA touches (exact size).", valid=_is_bool,
                               fix="use True or False"))
    """Page-lock the host buffers that DMA touches (exact-size, never rounded up)."""
    worker_timeout_s: float = field(default=600.0, metadata=_meta(
        "Longest wait, in seconds, for one bucket before raising an error that names it.",
        valid=_positive, fix="use a positive number of seconds"))
    """Longest time the training loop waits for one bucket before raising an error that names it. The worker
    itself never polls."""
    check_finite: bool = field(default=True, metadata=_meta(
        "Skip the whole step, bit-exactly, when any gradient is non-finite (the LR schedule does not advance "
        "either).", valid=_is_bool, fix="use True or False"))
    """Skip the whole step (bit-exact) when any gradient is non-finite."""
    max_consecutive_skips: int = field(default=8, metadata=_meta(
        "After this many consecutive skipped (non-finite) steps, stop with an error naming the last gradient "
        "norms instead of training nothing (0: never).",
        valid=_int_at_least(0), fix="use an integer >= 0 such as 8 (0: never raise on skipped steps)"))
    """After this many consecutive skipped (non-finite) steps, ``step()`` raises a ``RuntimeError`` naming the count
    and the last gradient norms (the optimizer state is left as it was before the skips): a run whose every step is
    skipped trains nothing while looking alive. ``0``: never raise."""
    chunked_loss: bool = field(default=True, metadata=_meta(
        "Give transformers causal-LM models a chunked loss with the same value and a third of the logits' memory.",
        valid=_is_bool, fix="use True or False"))
    """Replace transformers' default ``ForCausalLMLoss`` (all logits upcast to fp32, 12 B per logit element at its
    peak) by :func:`~hf_superoffload.causal_lm_loss.chunked_causal_lm_loss` (the same loss value, logit gradients
    equal to bf16 rounding, 4 B per element) on the models inside the optimized module that use the default loss and
    set none of their own, until the optimizer's ``close()`` gives them HF's default back. The planner counts the
    memory it saves as room for optimizer state on the GPU. ``False``: leave the model's loss as it is. [Note: chunked causal-LM loss] in hf_superoffload/causal_lm_loss.py."""
    accumulate_on_host: bool | Literal["auto"] = field(default="auto", metadata=_meta(
        "'auto', true or false: sum gradient-accumulation micro-batches on the host (each micro-batch's "
        "gradients are offloaded) instead of on the device; 'auto': on in weight-flow mode.",
        valid=_auto_or(_is_bool), fix="use 'auto', true or false"))
    """Gradient accumulation (micro-batches run inside ``no_sync()``, or an integration's sync predicate says "not a
    boundary"): ``True`` offloads every micro-batch's host-bucket gradients as they complete and sums them on the
    host (the CPU worker adds; the device keeps no accumulated gradient between micro-batches); ``False``
    accumulates in ``param.grad`` on the device and offloads the boundary micro-batch only; ``"auto"``: on in
    weight-flow mode (where device memory is the constraint), off otherwise. Single process only: refused with data
    parallelism. [Note: host accumulation] in docs/weight_flow.md."""
    host_accumulation_dtype: AccumulationDtype = field(default="auto", metadata=_meta(
        "With host accumulation: 'fp32' (a separate fp32 sum, +4 B/param host RAM), 'landing' (the sum lives "
        "in the landing buffer) or 'auto' (fp32 when host RAM allows).",
        valid=_one_of(AccumulationDtype), fix="use 'auto', 'fp32' or 'landing'"))
    """With host accumulation, where the sum lives. ``"fp32"``: a separate fp32 arena (+4 B/param host RAM, the CPU
    Adam steps from fp32); ``"landing"``: in the gradient landing buffer, in its dtype (the model's, rounded like
    torch's bf16 ``.grad`` accumulation; no per-parameter RAM); ``"auto"``: fp32 when host RAM allows it, else
    landing."""
    overrides: PlannerOverrides = field(
        default_factory=PlannerOverrides,
        metadata={"help": "Expert switches of the planner's schedule (PlannerOverrides); not a user option."})
    """Expert switches of the planner's schedule (:class:`PlannerOverrides`), for measurements and tests. A mapping
    is accepted and converted (so ``SuperOffloadConfig(**config.to_dict())`` round-trips)."""

    def __post_init__(self) -> None:
        if isinstance(self.overrides, Mapping):  # from to_dict(), JSON or YAML
            object.__setattr__(self, "overrides", PlannerOverrides.from_dict(self.overrides))
        if not isinstance(self.overrides, PlannerOverrides):
            raise InvalidConfigValue("SuperOffloadConfig", "overrides", self.overrides,
                                     "use a PlannerOverrides (or a mapping of its fields)")
        _validate(self)

    def replace(self, **changes: Any) -> SuperOffloadConfig:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    def with_overrides(self, **changes: Any) -> SuperOffloadConfig:
        """A copy whose :class:`PlannerOverrides` has ``changes`` applied (for experts and tests)."""
        return self.replace(overrides=self.overrides.replace(**changes))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> SuperOffloadConfig:
        """Build from a mapping of option names (a parsed JSON/YAML file, environment variables, flags).

        Strings are parsed by the field's type (:func:`value_from_text`: ``"auto"``, ``"true"``, ``"8"``...);
        ``overrides`` may be a nested mapping of :class:`PlannerOverrides` fields. An unknown key is refused in one
        line naming the valid ones; a planner switch at the top level is refused naming its new spelling.
        """
        _refuse_unknown(cls, values, "")
        kw = {k: value_from_text(cls, k, v) if isinstance(v, str) else v for k, v in values.items()}
        return cls(**kw)


USER_OPTIONS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(SuperOffloadConfig) if f.name != "overrides")
"""The user-facing options: the fields of :class:`SuperOffloadConfig` that adapters expose as flags, plugin fields
and environment variables (everything but ``overrides``)."""
_OVERRIDES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(PlannerOverrides))


def _refuse_unknown(cls: type, values: Mapping[str, Any], where: str) -> None:
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in values if k not in names]
    if not unknown:
        return
    moved = [k for k in unknown if k in _OVERRIDES and not where]
    if moved:
        k = moved[0]
        raise ValueError(f"{k!r} is a planner override, not a SuperOffload option: write it as "
                         f"{{\"overrides\": {{\"{k}\": ...}}}} (Python: SuperOffloadConfig(overrides="
                         f"PlannerOverrides({k}=...)))")
    raise ValueError(f"unknown SuperOffload setting(s) {sorted(unknown)}{' in ' + where if where else ''}; "
                     f"valid keys: {names}")


@functools.cache
def field_alternatives(cls: type, name: str) -> tuple[Any, ...]:
    """The types and literal values ``cls.<name>`` admits, flattened: ``int | Literal["auto"]`` -> (int, "auto")."""
    out: list[Any] = []

    def walk(t: Any) -> None:
        origin = typing.get_origin(t)
        if origin is Literal:
            out.extend(typing.get_args(t))
        elif origin is typing.Union or origin is types.UnionType:
            for a in typing.get_args(t):
                walk(a)
        else:
            out.append(t)

    walk(typing.get_type_hints(cls)[name])
    return tuple(out)


def value_from_text(cls: type, name: str, text: str) -> Any:
    """Parse ``text`` (a flag, an environment variable, a YAML string) as a value of ``cls.<name>`` from its type:
    a literal choice (``auto``), ``none``/``auto`` for an optional field, a boolean word of :data:`BOOL_WORDS`, an
    integer, then a float. Raises :class:`InvalidConfigValue` with the field's fix when none fits."""
    alts = field_alternatives(cls, name)
    v = text.strip()
    low = v.lower()
    if low in [a for a in alts if isinstance(a, str)]:
        return low
    if type(None) in alts and low in ("none", "null", "auto", ""):
        return None
    if bool in alts and low in BOOL_WORDS:
        return BOOL_WORDS[low]
    for kind in (int, float):
        if kind in alts:
            try:
                return kind(v)
            except ValueError:
                pass
    fix = next(f.metadata["fix"] for f in dataclasses.fields(cls) if f.name == name)
    raise InvalidConfigValue(cls.__name__, name, text, fix)


def load_config_mapping(spec: Mapping[str, Any] | str | None, *, what: str) -> dict[str, Any]:
    """Read a config source: a mapping, a JSON object as text, or the path of a ``.json``/``.yaml``/``.yml`` file
    (the shapes ``TrainingArguments.deepspeed`` takes). The options may sit under a top-level ``superoffload:``
    key. ``what`` names the source in errors (``SuperOffloadArguments.superoffload_config``)."""
    if spec is None:
        return {}
    if isinstance(spec, Mapping):
        data: Any = spec
    elif isinstance(spec, str) and spec.lstrip().startswith("{"):
        try:
            data = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"{what}: not valid JSON ({e.msg} at character {e.pos}); use e.g. "
                             "'{\"gpu_resident_buckets\": 0}' or the path of a .json/.yaml file") from None
    elif isinstance(spec, str) and os.path.isfile(spec):
        with open(spec, encoding="utf-8") as f:
            text = f.read()
        if spec.endswith(".json"):
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    else:
        raise ValueError(f"{what}={spec!r} is neither a mapping, a JSON object nor an existing .json/.yaml file")
    data = data or {}
    if isinstance(data, Mapping) and set(data) == {"superoffload"}:
        data = data["superoffload"] or {}
    if not isinstance(data, Mapping):
        raise ValueError(f"{what}: expected a mapping of SuperOffloadConfig options, got {type(data).__name__}")
    return dict(data)
