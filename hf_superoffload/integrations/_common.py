"""Pieces shared by the Trainer and the Accelerate adapters. No algorithm lives here: only translation.

- :class:`SuperOffloadAcceleratedOptimizer`: the ``AcceleratedOptimizer`` our optimizer is registered as.
  Built with ``device_placement=False`` and pre-marked as prepared, so ``Accelerator.prepare`` never
  round-trips the host-resident state through the GPU; ``step_was_skipped`` is forwarded (the stock wrapper
  only reports GradScaler overflows), so ``AcceleratedScheduler`` and Trainer do not advance the LR on a
  skipped step; and it hands out *deferred* gradient norms (see :meth:`deferred_grad_norm`).
- :func:`atomic_torch_save`: ``torch.save`` to a temporary file, fsync, ``os.replace``; it first removes the
  stale temporary files an interrupted save left in that folder (:func:`remove_stale_temp_files`).
- :func:`last_complete_checkpoint`: the newest checkpoint folder a resume can trust (Trainer and the Accelerate
  example).
- :class:`TelemetryWindow`: averages :class:`~hf_superoffload.runtime.engine.StepStats` over a logging window.
- :func:`warn_if_threads_throttled`: the one thread-count warning (see below).

Threads: ``accelerate launch`` exports ``OMP_NUM_THREADS=1`` for GPU runs. The compiled CPU Adam sizes its own
pool from the process's affinity mask (``SuperOffloadConfig.cpu_threads``), so it is not affected and we
leave torch's intra-op thread count alone (it is the user's and the launcher's choice, and changing it is a
process-wide side effect). Only the torch fallback of CPU Adam runs on torch's intra-op threads; when that
fallback is in use and torch has fewer threads than the plan asks for, we warn once with the fix.
"""

from __future__ import annotations

import logging
import math
import os
import re
import tempfile
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import fields
from typing import Any

import torch
from accelerate.optimizer import AcceleratedOptimizer

from ..optimizer import SuperOffloadOptimizer
from ..runtime.engine import StepStats

__all__ = [
    "COMPLETE_MARKER",
    "MODEL_SHARD_SIZE",
    "SuperOffloadAcceleratedOptimizer",
    "TelemetryWindow",
    "atomic_torch_save",
    "find_superoffload_optimizer",
    "is_our_temp_file",
    "last_complete_checkpoint",
    "mark_checkpoint_complete",
    "progress_postfix",
    "refuse_other_model",
    "remove_stale_temp_files",
    "show_plan",
    "training_outputs_in_model_dtype",
    "warn_if_threads_throttled",
]

logger = logging.getLogger("hf_superoffload")


class SuperOffloadAcceleratedOptimizer(AcceleratedOptimizer):
    """``AcceleratedOptimizer`` for a :class:`SuperOffloadOptimizer`.

    - never moves optimizer state to the device (``device_placement=False``) and is pre-marked prepared, so
      ``accelerator.prepare(...)`` registers it untouched (it still appears in ``accelerator._optimizers``, so
      ``save_state``/``load_state`` checkpoint it; loading copies into the existing host buffers);
    - ``step()`` and ``zero_grad()`` act only on accumulation boundaries, like the stock wrapper;
    - ``step_was_skipped`` is true when the inner optimizer skipped a non-finite step.
    """

    def __init__(self, optimizer: SuperOffloadOptimizer) -> None:
        if not isinstance(optimizer, SuperOffloadOptimizer):
            raise TypeError(f"expected a SuperOffloadOptimizer, got {type(optimizer).__name__}")
        super().__init__(optimizer, device_placement=False, scaler=None)
        self._is_accelerate_prepared = True
        self._pending_norms: list[torch.Tensor] = []

    @property
    def superoffload(self) -> SuperOffloadOptimizer:
        """The wrapped optimizer."""
        return self.optimizer  # type: ignore[no-any-return]

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        stepping = self.gradient_state.sync_gradients
        super().step(closure)
        if stepping:
            norm = self.optimizer.last_grad_norm
            for t in self._pending_norms:
                t.fill_(norm)
            self._pending_norms.clear()

    @property
    def step_was_skipped(self) -> bool:
        return bool(self.optimizer.step_was_skipped) or self._is_overflow

    def deferred_grad_norm(self) -> torch.Tensor:
        """A 0-d CPU tensor that receives the global gradient norm (before clipping) at the next ``step()``.

        Callers that need the norm before ``step()`` (Trainer, ``accelerator.clip_grad_norm_``) get this
        handle; the norm is only known once the optimizer has validated the step. Read it with ``.item()``
        after ``step()``; before that it holds NaN.
        """
        t = torch.full((), math.nan, dtype=torch.float32)
        self._pending_norms.append(t)
        return t


    # data parallel: the state lives in per-rank shard files written by the save hook, never in optimizer.bin
    def state_dict(self) -> dict[str, Any]:
        if self.optimizer.comm is None:
            return super().state_dict()
        return {"superoffload_shard_files": SHARD_PATTERN, "param_groups": self.optimizer.state_dict()["param_groups"]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "superoffload_shard_files" in state_dict:
            return  # loaded from the shard files by the load hook, before this call
        super().load_state_dict(state_dict)


SHARD_PATTERN = "optimizer_rank{rank}.pt"


def save_optimizer_state(opt: SuperOffloadOptimizer, folder: str, single_name: str) -> None:
    """Write ``opt``'s state atomically into ``folder``: one file per rank when data parallel (each rank writes its
    own; call it on every rank), else ``single_name``."""
    os.makedirs(folder, exist_ok=True)
    name = SHARD_PATTERN.format(rank=opt.plan.rank) if opt.engine.comm is not None else single_name
    atomic_torch_save(opt.state_dict(), os.path.join(folder, name))


def read_optimizer_state(opt: SuperOffloadOptimizer, folder: str, single_name: str) -> tuple[str, dict[str, Any] | None]:
    """This rank's optimizer state in ``folder`` (``None`` if it has none): ``single_name`` of a single-process run
    (it loads into any number of ranks); this rank's own shard when as many ranks wrote the checkpoint with the
    bucket layout this run's plan has; else every rank's shards merged (views of the mapped files: no copy), which
    load into any plan and any number of ranks. A plan still waiting for the first batch ([Note: a state loaded
    before the first batch]) has no layout yet, and after a calibration the saved layout is rarely the first plan's,
    so such a resume merges."""
    import re

    shards = sorted(f for f in os.listdir(folder) if re.fullmatch(r"optimizer_rank\d+\.pt", f))
    if not shards:
        path = os.path.join(folder, single_name)
        return path, (_load_state_file(path) if os.path.isfile(path) else None)
    world = opt.plan.world_size
    loaded: dict[str, dict[str, Any]] = {}  # shards already mapped: the merge reads each file once
    if len(shards) == world and opt.comm is not None and opt.planned:
        from ..state import is_own_shard

        name = SHARD_PATTERN.format(rank=opt.plan.rank)
        path = os.path.join(folder, name)
        loaded[name] = own = _load_state_file(path)
        if is_own_shard(opt.engine, own.get("superoffload", {})):
            return path, own
    from ..state import consolidate_state_dicts

    why = (f"this run has {world} rank(s)" if len(shards) != world or opt.comm is None else
           "this run's plan lays the buckets out otherwise" if opt.planned else "this run plans at its first batch")
    logger.warning("hf_superoffload: %s holds %d optimizer shards and %s: merging them (every rank reads all of "
                   "them, mapped)", folder, len(shards), why)
    states = [loaded.get(f) or _load_state_file(os.path.join(folder, f)) for f in shards]
    # each shard's checksums are verified here; the merged state is loaded at once (no manifest of its own to write)
    merged = {**states[0], "superoffload": consolidate_state_dicts([s["superoffload"] for s in states],
                                                                    manifest=False)}
    return os.path.join(folder, SHARD_PATTERN.format(rank="*")), merged


def _load_state_file(path: str) -> dict[str, Any]:
    """The saved state, its tensors mapped from the file (``mmap=True``), not read into anonymous memory: a resume
    holds the live host arenas already, and a second copy of the state in RAM (96 GB at 8B) would not fit beside
    them; mapped pages are the page cache's, which the kernel can drop (and ranks reading the same shards share)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise ValueError(f"cannot read the optimizer checkpoint {path}: the file is truncated or damaged "
                         f"({type(e).__name__}). Resume from an earlier checkpoint.") from e


def find_superoffload_optimizer(optimizer: Any) -> SuperOffloadOptimizer | None:
    """The :class:`SuperOffloadOptimizer` inside ``optimizer`` (possibly wrapped), else ``None``."""
    seen = 0
    while optimizer is not None and seen < 8:
        if isinstance(optimizer, SuperOffloadOptimizer):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)
        seen += 1
    return None


def refuse_other_model(optimizer: SuperOffloadOptimizer, model: torch.nn.Module, where: str) -> None:
    """``ValueError`` when ``optimizer`` steps parameters that are not ``model``'s (it was built for another model):
    that model would never change, and this one would never train."""
    ours = {id(p) for g in optimizer.param_groups for p in g["params"]}
    foreign = len(ours - {id(p) for p in model.parameters()})
    if foreign:
        raise ValueError(f"{where}: the SuperOffloadOptimizer was built for another model ({foreign} of its {len(ours)} "
                         "parameters are not parameters of the model given here): build it on this model, "
                         "SuperOffloadOptimizer(model, ...)")


# Temporary files of atomic saves: ".<final name>.<8 random characters>.superoffload.tmp". Before the tag existed
# they were ".<final name>.<random>.tmp"; those count as ours only for the file names we write.
_TEMP_TAG = ".superoffload.tmp"
_TEMP_NAME = re.compile(r"\.(?P<target>.+)\.[A-Za-z0-9_]{8}(?P<tag>\.superoffload)?\.tmp")
_OWN_TARGETS = re.compile(r"optimizer\.pt|optimizer\.bin|scheduler\.pt|optimizer_rank\d+\.pt|superoffload_optimizer\.pt|"
                          r"checkpoint_complete\.json")
# A temp file last written before this process started cannot be one a rank of this run is writing now (every rank
# imports this module before it trains), so it was left by a run that died while saving.
_PROCESS_START = time.time()
_IN_FLIGHT: set[str] = set()  # this process's own temp files, never removed while being written
COMPLETE_MARKER = "checkpoint_complete.json"
"""Written last into a checkpoint folder (:func:`mark_checkpoint_complete`): a folder without it was interrupted."""


def is_our_temp_file(name: str) -> bool:
    """Whether ``name`` (a file name) is a temporary file of :func:`atomic_torch_save`."""
    m = _TEMP_NAME.fullmatch(name)
    return m is not None and (m.group("tag") is not None or _OWN_TARGETS.fullmatch(m.group("target")) is not None)


def remove_stale_temp_files(folder: str | os.PathLike[str]) -> list[str]:
    """Remove the temporary files of atomic saves that a killed run left in ``folder`` (ours only, by name, and only
    those last written before this process started: another rank may be writing its own right now); returns their
    names. A crash mid-save leaves a partial file of checkpoint size under a hidden name."""
    folder = os.fspath(folder)
    try:
        names = os.listdir(folder)
    except (FileNotFoundError, NotADirectoryError):
        return []
    removed = []
    for name in names:
        path = os.path.abspath(os.path.join(folder, name))
        if not is_our_temp_file(name) or path in _IN_FLIGHT:
            continue
        try:
            if os.stat(path).st_mtime >= _PROCESS_START:
                continue
            os.unlink(path)
        except FileNotFoundError:  # another rank removed it first
            continue
        removed.append(name)
    if removed:
        logger.warning("hf_superoffload: removed %d stale temporary file(s) left in %s by an interrupted save: %s",
                       len(removed), folder, ", ".join(sorted(removed)))
    return removed


def last_complete_checkpoint(folder: str, *, prefix: str = "checkpoint", marker: str = COMPLETE_MARKER) -> str:
    """The highest-numbered ``<prefix>-N`` folder in ``folder`` that holds ``marker`` (written last: Trainer's
    ``trainer_state.json``, or :data:`COMPLETE_MARKER` of :func:`mark_checkpoint_complete`; so a folder
    without it was interrupted while being saved) and no temporary file of ours (a save into it was interrupted:
    its files may come from two different steps). Skipped folders are named in a warning. ``ValueError`` if none."""
    found = []
    for name in os.listdir(folder):
        m = re.fullmatch(rf"{re.escape(prefix)}-(\d+)", name)
        if m and os.path.isdir(os.path.join(folder, name)):
            found.append((int(m.group(1)), os.path.join(folder, name)))
    skipped = []
    for _, path in sorted(found, reverse=True):
        files = os.listdir(path)
        temps = sorted(f for f in files if is_our_temp_file(f))
        if marker in files and not temps:
            if skipped:
                logger.warning("hf_superoffload: skipping incomplete checkpoint(s) %s (the run stopped while saving); "
                               "resuming from %s", "; ".join(skipped), path)
            return path
        skipped.append(f"{path}: " + (f"no {marker}" if marker not in files else f"an interrupted save left {temps[0]}"))
    raise ValueError(f"No valid checkpoint found in output directory ({folder})"
                     + (f": every {prefix}-N folder is incomplete ({'; '.join(skipped)})" if skipped else ""))


def mark_checkpoint_complete(folder: str | os.PathLike[str], **info: Any) -> None:
    """Write :data:`COMPLETE_MARKER` (``info`` as JSON) into ``folder``, atomically: call it once every file of the
    checkpoint is written, on one process."""
    import json

    _atomic_write(os.path.join(os.fspath(folder), COMPLETE_MARKER),
                  lambda f: f.write(json.dumps(info).encode("utf-8")))


def atomic_torch_save(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save(obj, path)`` that never leaves a partial file (see :func:`_atomic_write`). Stale temp files of
    earlier, interrupted saves into the folder are removed first."""
    remove_stale_temp_files(os.path.dirname(os.path.abspath(os.fspath(path))))
    _atomic_write(os.fspath(path), lambda f: torch.save(obj, f))


def _atomic_write(path: str, write: Callable[[Any], Any]) -> None:
    """``write(binary file)`` into ``path`` without ever leaving a partial file there: a temp file in the same
    folder (named so :func:`remove_stale_temp_files` knows it), flush, fsync, ``os.replace``, then fsync the folder
    so the rename itself is durable."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=_TEMP_TAG, dir=folder)
    _IN_FLIGHT.add(os.path.abspath(tmp))
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    finally:
        _IN_FLIGHT.discard(os.path.abspath(tmp))
    try:
        dir_fd = os.open(folder, os.O_RDONLY)
    except OSError:  # some platforms cannot open folders; the data itself is synced
        return
    try:
        with suppress(OSError):
            os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


# [Note: bounded model shards]
# A checkpoint must fit beside the plan, which fills the host: ``plan`` predicts a 119.0 GiB peak of 120.0 available
# for 14B on the H200 box. ``save_pretrained`` writes shards of up to 50 GB, and safetensors copies every GPU tensor
# of a file to the host before it writes any: the whole model at once (16 GB in bf16 at 8B, 29.5 GB at 14B), so the
# first checkpoint would end the run, and the final save would lose the trained model. Our model saves (the
# Trainer's checkpoints and ``save_model``, ``hf-superoffload train``'s output, ``prepare_superoffload``'s
# ``save_state`` and ``save_model``) write their files with ``_streamed_save.save_file_streamed`` (64 MiB of a
# tensor on the host at a time, the 1.56 GB LM head of a 14B model included), in shards of at most
# ``MODEL_SHARD_SIZE`` (the Hub's usual size; the bound where a library's writer could not be routed), and the
# optimizer state's device arenas go out in 64 MiB pieces (``state._PIECE_ELEMS``): a checkpoint holds about
# 0.1 GiB more on the host than training does. A resume reads them mapped (``load_state``: a ``save_state`` model
# larger than one shard is read back by our hook with ``mmap``).
MODEL_SHARD_SIZE = "5GB"


class TelemetryWindow:
    """Averages per-step offload telemetry over the steps since the last log line.

    Every numeric counter of :class:`StepStats` is summed by one loop (a counter added there is averaged here
    without an edit); the gradient norm and the clip coefficient are not plain sums, ``speculative`` becomes a
    share."""

    _SUMMED: tuple[str, ...] = tuple(f.name for f in fields(StepStats)
                                     if f.type in ("float", "int", float, int) and f.name not in ("grad_norm", "clip_coef"))
    _COUNTS: frozenset[str] = frozenset(f.name for f in fields(StepStats) if f.type in ("int", int))

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._sums = dict.fromkeys(self._SUMMED, 0.0)
        self._spec = 0
        self._clip = 0.0
        self.steps = 0

    def add(self, st: StepStats) -> None:
        for name in self._SUMMED:
            self._sums[name] += getattr(st, name)
        self._spec += int(st.speculative)
        self._clip += st.clip_coef if math.isfinite(st.clip_coef) else 1.0
        self.steps += 1

    def as_log(self, optimizer: SuperOffloadOptimizer, prefix: str = "superoffload/") -> dict[str, float]:
        """Window means of ``StepStats.as_log()`` (``speculative`` becomes the share of speculative steps)
        plus run totals: skipped and clipped steps and the redo rate. Resets the window."""
        n = max(self.steps, 1)
        means = {name: total / n for name, total in self._sums.items()}
        mean = StepStats(**{name: round(v) if name in self._COUNTS else v for name, v in means.items()},
                         clip_coef=self._clip / n if self.steps else 1.0)
        logs = mean.as_log(prefix)
        logs[f"{prefix}speculative"] = round(self._spec / n, 4)
        logs[f"{prefix}iteration_s"] = round(means["iteration_s"], 4)
        logs[f"{prefix}wasted_buckets"] = round(means["wasted_buckets"], 3)
        logs[f"{prefix}skipped_steps"] = float(optimizer.skipped_steps)
        logs[f"{prefix}clipped_steps"] = float(optimizer.clipped_steps)
        logs[f"{prefix}redo_rate"] = round(float(optimizer.engine.governor.redo_rate), 4)
        self.reset()
        return logs


_warned_threads = False


def warn_if_threads_throttled(optimizer: SuperOffloadOptimizer) -> None:
    """Warn once when the torch fallback of CPU Adam would run on fewer threads than the plan wants."""
    global _warned_threads
    if _warned_threads:
        return
    from .. import ops

    try:
        backend = ops.backend()
    except Exception:  # a broken build reports itself on first use; not our concern here
        return
    want, have = optimizer.plan.cpu_threads, torch.get_num_threads()
    if backend == "torch-fallback" and have < want:
        _warned_threads = True
        logger.warning(
            "hf_superoffload: CPU Adam runs on the torch fallback, which uses torch's intra-op threads: %d "
            "thread(s) (OMP_NUM_THREADS=%s; `accelerate launch` sets 1) instead of the planned %d. Build the "
            "native op (see cpu_ext/_build.py), or launch with `accelerate launch --num_cpu_threads_per_process %d` "
            "(or export OMP_NUM_THREADS=%d).", have, os.environ.get("OMP_NUM_THREADS", "unset"), want, want, want,
        )


def progress_postfix(loss: float, tokens_per_s: float, gpu_wait_s: float | None) -> str:
    """The numbers a progress bar shows beside the step count: the loss, the throughput and how long the step
    waited for the CPU (the first thing to read when a run is slower than planned)."""
    text = f"loss {loss:.4f}  tok/s {tokens_per_s:,.0f}"
    return text if gpu_wait_s is None else f"{text}  gpu_wait {float(gpu_wait_s) * 1e3:.1f} ms"


def show_plan(text: str) -> None:
    """Show the plan summary where the user looks: through the ``hf_superoffload`` logger when logging is set up
    to show its INFO records, else on stdout (above any progress bar). Silent when the level of the
    ``hf_superoffload`` logger was explicitly raised above INFO (e.g. ``log_level="warning"``).

    Trainer users rarely configure logging: transformers configures only its own logger, so an INFO record of
    ``hf_superoffload`` would reach no handler and the plan, the first thing to check in a slow run, would be
    lost."""
    root = logging.getLogger("hf_superoffload")
    if root.isEnabledFor(logging.INFO) and root.hasHandlers():
        logger.info("%s", text)
    elif root.level == logging.NOTSET or root.level <= logging.INFO:
        from tqdm.auto import tqdm

        tqdm.write(text)


# [Note: no fp32 copy of the logits]
# With bf16 mixed precision accelerate wraps the model's forward in autocast and converts every bf16 output to
# fp32 (``convert_outputs_to_fp32``), the logits included: 4 B per logit (4.2 GB at 8B with batch 4 x 2048, 5.0 GB
# at 15B), allocated at the end of the forward beside the bf16 logits the loss saved for its backward, and kept
# through the backward by a loop that holds ``outputs``. The memory model does not count it. On an H100 the 8B
# batch-4 Trainer row reserved 83.9 GB at its peak where the README snippet's identical first plan reserved 79.6
# (0.9 GB more allocated at the peak, the rest reserved and not allocated), so its calibration moved state back to
# the host. Where the loss is the model's own (computed inside the forward, in fp32, by the chunked loss) the copy
# is never read: a training forward then keeps autocast and returns the model's dtype, as DeepSpeed's and FSDP2's
# bf16 training do. ``SuperOffloadTrainer`` does so when its ``compute_loss`` is Trainer's own with no label
# smoother and no ``compute_loss_func`` (a Trainer that reads the logits, like TRL's SFTTrainer for its entropy,
# keeps fp32); ``prepare_superoffload`` when the forward is given ``labels``. Evaluation and prediction (no grad,
# or eval mode) keep accelerate's fp32 outputs.
def training_outputs_in_model_dtype(model: Any, when: Callable[[dict[str, Any]], bool] | None = None) -> bool:
    """[Note: no fp32 copy of the logits]: route a training forward of ``model`` (``when(kwargs)`` too, if given)
    around accelerate's fp32 output conversion, autocast kept; ``False`` when its forward is not accelerate's
    wrapper as expected (left as it is)."""
    from types import MethodType

    from accelerate.utils.operations import ConvertOutputsToFp32

    convert = getattr(getattr(model.__dict__.get("forward"), "__func__", None), "__wrapped__", None)
    if not isinstance(convert, ConvertOutputsToFp32):
        return False
    autocast_forward = convert.model_forward

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self.training and torch.is_grad_enabled() and (when is None or when(kwargs)):
            return autocast_forward(self, *args, **kwargs)
        return convert(self, *args, **kwargs)

    forward.__wrapped__ = convert  # type: ignore[attr-defined]  # accelerate's unwrap_model walks this chain
    model.forward = MethodType(forward, model)
    return True
