"""SuperOffload in custom Accelerate loops: :class:`SuperOffloadPlugin` and :func:`prepare_superoffload`.

Usage (``accelerate launch --config_file configs/single_gpu.yaml train.py``)::

    accelerator = Accelerator(gradient_accumulation_steps=4)
    model, optimizer = prepare_superoffload(accelerator, model, dict(lr=2e-5, weight_decay=0.1, max_grad_norm=1.0))
    scheduler = accelerator.prepare(get_linear_schedule_with_warmup(optimizer, 100, total_steps))
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch).loss)
            if accelerator.sync_gradients:
                grad_norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)  # filled at step()
            optimizer.step(); scheduler.step(); optimizer.zero_grad()
    accelerator.save_state("ckpt")  # model + optimizer (host state) + scheduler + RNG; load_state resumes

**Preemption.** Outside ``SuperOffloadTrainer`` nothing handles SIGTERM unless the loop asks: wrap it in ``with
Preemption() as preemption:`` and, after every optimizer step on every rank, ``if accelerator.sync_gradients and
preemption.should_stop(): accelerator.save_state(folder); break``. A SIGTERM (to any rank) then finishes the step
in flight, every rank stops after that same step and saves it, and the script exits 0; a second SIGTERM ends the
process at once. The handler exists only inside the ``with`` block ([Note: preemption agreement] in
``_preemption.py`` says why ``prepare_superoffload`` installs none); ``examples/train_with_accelerate.py`` shows the
whole loop.

**Where the offload settings go.** Accelerate's config YAML rejects unknown top-level keys and has no plugin
registry, so the accelerate YAML (``configs/single_gpu.yaml``, also packaged: :func:`accelerate_config_path`)
holds only accelerate's own keys. Offload settings come, highest priority first, from: the fields given to
``SuperOffloadPlugin(...)`` (e.g. parsed from your script's arguments); environment variables
``HF_SUPEROFFLOAD_<FIELD>`` (``HF_SUPEROFFLOAD_BUCKET_SIZE_MB=64``; ``accelerate launch`` forwards the environment to
every process); ``config_file=`` or ``HF_SUPEROFFLOAD_CONFIG``: a YAML/JSON file, a JSON string or (``config_file``
only) a dict of ``SuperOffloadConfig`` options, optionally under a top-level ``superoffload:`` key, read exactly as
``SuperOffloadArguments.superoffload_config``; ``SuperOffloadConfig``'s defaults. The plugin's fields and variables
are generated from the config's user options; the planner's expert switches go under ``overrides:`` in the file.

**What ``prepare_superoffload`` does** (accelerate 1.15, no DeepSpeed/FSDP):

- the model goes through ``accelerator.prepare_model`` first (device placement, bf16 autocast if configured; never
  a DDP wrapper: with several processes the optimizer does the data parallelism itself, ZeRO-style, and each rank
  checkpoints its own shard, ``optimizer_rank{r}.pt``, through a ``save_state`` hook), so the optimizer is built
  on the device-resident parameters;
- the optimizer (built from keyword arguments, taken as a ready ``SuperOffloadOptimizer``, or converted from a
  fresh ``torch.optim.AdamW``) is wrapped in ``SuperOffloadAcceleratedOptimizer`` with ``device_placement=False``
  and registered pre-marked, so its host state never moves to the GPU, ``save_state``/``load_state`` checkpoint
  it (``optimizer.bin``; loading copies into the existing host buffers) and the scheduler sees
  ``step_was_skipped`` on a non-finite step;
- checkpoints take little host RAM beside the plan's ([Note: bounded model shards]): ``save_state`` and
  ``save_model`` write the model's safetensors files 64 MiB at a time (accelerate's writer would copy a whole file
  to the host first); ``save_state`` writes a model larger than 5 GB as ``superoffload_model*.safetensors`` shards,
  which ``load_state`` reads back mapped; ``load_state`` maps the optimizer file (``load_kwargs={"mmap": True}``
  unless given);
- weights: each layer's next forward waits for its own updated weights, and ``model.state_dict()`` (so
  ``save_state``/``save_pretrained``) waits for all of them; code that reads ``param.data`` directly right after
  ``optimizer.step()`` must call ``optimizer.superoffload.synchronize()`` first;
- the optimizer's sync predicate is ``accelerator.sync_gradients``: gradients are offloaded during backward only
  on the accumulation boundary;
- ``accelerator.clip_grad_norm_`` is replaced **on this accelerator instance only** (accelerate itself is not
  patched) for our parameters: it never touches ``.grad`` (the optimizer clips inside ``step()``, exactly
  ``clip_grad_norm_``, so clipping never happens twice), a finite ``max_norm`` becomes the optimizer's clip
  threshold for the coming step, and it returns a 0-d tensor that holds the global norm (before clipping) once
  ``optimizer.step()`` has run. Calls for other parameters go to accelerate's implementation.

**Long sequences.** ``prepare_superoffload(..., sequence_parallel_size=P)`` switches the model to Ulysses
attention over groups of P ranks and makes the optimizer average over the data-parallel replicas only; the loop
trains each batch with ``sp.causal_lm_loss(model, sp.shard_batch(batch, groups), groups)``
(``groups = hf_superoffload.sequence_parallel.active_groups()``). ``tiled_mlp_tokens=N`` runs every decoder
layer's MLP N tokens at a time (docs/long_context.md).

**Threads.** ``accelerate launch`` exports ``OMP_NUM_THREADS=1`` on GPU runs. The compiled CPU Adam sizes its pool
from the process's affinity mask and ignores it, so nothing is changed; only when the torch fallback of CPU Adam
is in use (it runs on torch's intra-op threads) we warn once with the fix (``--num_cpu_threads_per_process``).
We never call ``torch.set_num_threads``: the thread count of other CPU work stays the launcher's/user's choice.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, make_dataclass
from importlib import resources
from typing import Any

import torch
from accelerate.logging import get_logger
from accelerate.utils import DistributedType

from ..causal_lm_loss import loss_inside_the_model
from ..config import (
    USER_OPTIONS,
    InvalidConfigValue,
    PlannerOverrides,
    SuperOffloadConfig,
    load_config_mapping,
)
from ..optimizer import SuperOffloadOptimizer
from ..planning.plan import OffloadPlan
from ._common import (
    MODEL_SHARD_SIZE,
    SuperOffloadAcceleratedOptimizer,
    find_superoffload_optimizer,
    last_complete_checkpoint,
    mark_checkpoint_complete,
    read_optimizer_state,
    refuse_other_model,
    remove_stale_temp_files,
    save_optimizer_state,
    show_plan,
    training_outputs_in_model_dtype,
    warn_if_threads_throttled,
)
from ._preemption import Preemption
from ._streamed_save import streamed_model_files

# re-exported for custom loops: the checkpoint helpers (mark a save_state folder complete, resume the newest one)
# and SIGTERM handling (Preemption)
__all__ = ["ENV_CONFIG", "ENV_PREFIX", "Preemption", "SuperOffloadPlugin", "accelerate_config_path",
           "last_complete_checkpoint", "mark_checkpoint_complete", "prepare_superoffload", "remove_stale_temp_files"]

logger = get_logger(__name__)

ENV_PREFIX = "HF_SUPEROFFLOAD_"
ENV_CONFIG = "HF_SUPEROFFLOAD_CONFIG"
_EXPERT = tuple(f.name for f in dataclasses.fields(PlannerOverrides))

# One plugin field per SuperOffloadConfig user option, generated (None: not set here)
_SuperOffloadPluginOptions = make_dataclass(
    "_SuperOffloadPluginOptions", [(n, Any, field(default=None)) for n in USER_OPTIONS],
    namespace={"__module__": __name__})


@dataclass
class SuperOffloadPlugin(_SuperOffloadPluginOptions):
    """Offload settings for Accelerate loops, shaped like accelerate's plugins (``None`` = not set here).

    One field per user option of :class:`SuperOffloadConfig` (generated from its fields: ``bucket_size_mb``,
    ``gpu_resident_buckets``, ``speculation``...), the same name and meaning; a string is parsed by the option's type
    (``"auto"``, ``"true"``, ``"8"``). An unset field falls back to ``HF_SUPEROFFLOAD_<OPTION>``, then to
    ``config_file``, then to the default. :meth:`to_config` gives the validated config (``ValueError`` naming the
    source and the fix). ``cpu_threads="auto"`` forces the automatic thread count even when the environment or
    file sets one.

    Attributes:
        config_file: The options as a YAML/JSON file path, a JSON string or a dict, like
            ``SuperOffloadArguments.superoffload_config`` (default: ``$HF_SUPEROFFLOAD_CONFIG``). Expert planner
            switches (:class:`~hf_superoffload.config.PlannerOverrides`) go under ``overrides``.
    """

    config_file: str | Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.config_file is None:
            self.config_file = os.environ.get(ENV_CONFIG) or None
        self.to_config()  # fail at construction, with the source of the bad value

    def to_config(self) -> SuperOffloadConfig:
        """Resolve every option (explicit > environment > file > default) into a ``SuperOffloadConfig``."""
        where = self.config_file if isinstance(self.config_file, str) and os.path.isfile(self.config_file) \
            else "SuperOffloadPlugin.config_file"
        values = load_config_mapping(self.config_file, what=where)
        labels = {k: f"{where}: {k}" for k in values}
        for k in _EXPERT:
            if os.environ.get(ENV_PREFIX + k.upper()):
                raise ValueError(f"{ENV_PREFIX}{k.upper()} was removed: {k} is a planner override for experts; set "
                                 f"it under 'overrides:' in the config file ({ENV_CONFIG}) or as "
                                 f"SuperOffloadConfig(overrides=PlannerOverrides({k}=...))")
        for k in USER_OPTIONS:
            env = os.environ.get(ENV_PREFIX + k.upper())
            if env is not None and env != "":
                values[k], labels[k] = env, ENV_PREFIX + k.upper()
            mine = getattr(self, k)
            if mine is not None:
                values[k], labels[k] = mine, f"SuperOffloadPlugin.{k}"
        try:
            return SuperOffloadConfig.from_dict(values)
        except InvalidConfigValue as e:
            label = labels.get(e.name) if e.owner == "SuperOffloadConfig" else labels.get("overrides")
            raise ValueError(f"{e} (set by {label})" if label else str(e)) from None
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: {e}") from None


def accelerate_config_path(name: str = "single_gpu") -> str:
    """Path of a packaged accelerate YAML (``single_gpu``, ``multi_gpu`` or ``single_cpu``) for ``accelerate launch --config_file``."""
    stem = name[:-5] if name.endswith(".yaml") else name
    path = resources.files("hf_superoffload").joinpath("accelerate_configs", f"{stem}.yaml")
    if not path.is_file():
        raise ValueError(f"no packaged accelerate config {name!r}; choose 'single_gpu', 'multi_gpu' or 'single_cpu'")
    return str(path)


def prepare_superoffload(
    accelerator: Any,
    model: torch.nn.Module,
    optimizer_or_kwargs: SuperOffloadOptimizer | torch.optim.Optimizer | Mapping[str, Any] | None = None,
    *,
    plugin: SuperOffloadPlugin | None = None,
    sequence_parallel_size: int = 1,
    tiled_mlp_tokens: int = 0,
) -> tuple[torch.nn.Module, SuperOffloadAcceleratedOptimizer]:
    """Prepare ``model`` and its SuperOffload optimizer on ``accelerator`` (see the module docstring).

    Args:
        accelerator: an ``accelerate.Accelerator`` of one process (``distributed_type`` NO), bf16 or no mixed
            precision.
        model: the model to train (bf16 or fp32; fp32 trainable weights become bf16 with fp32 masters).
        optimizer_or_kwargs: ``SuperOffloadOptimizer`` keyword arguments (``lr``, ``betas``, ``eps``,
            ``weight_decay``, ``max_grad_norm``, optionally ``params`` for param groups); or a built
            ``SuperOffloadOptimizer`` (its model must already be on ``accelerator.device``); or a fresh
            ``torch.optim.AdamW`` whose groups and hyper-parameters are taken over. ``None``: defaults.
        plugin: offload settings (default: ``SuperOffloadPlugin()``, i.e. environment, file, defaults). Ignored
            when a built ``SuperOffloadOptimizer`` is passed.
        sequence_parallel_size: Ulysses ranks per sequence (1: off). Switches the model to Ulysses attention
            and sets the optimizer's gradient divisor to the data-parallel size; the loop then trains each batch
            with ``sp.causal_lm_loss(model, sp.shard_batch(batch, groups), groups)`` where
            ``groups = hf_superoffload.sequence_parallel.active_groups()`` (docs/sequence_parallel.md).
        tiled_mlp_tokens: run each decoder layer's MLP this many tokens at a time (0: off;
            ``sequence_parallel.enable_tiled_mlp``, docs/long_context.md).

    Returns:
        ``(model, optimizer)``: the prepared model and the registered ``SuperOffloadAcceleratedOptimizer``.
    """
    _check_accelerator(accelerator)
    if isinstance(sequence_parallel_size, bool) or not isinstance(sequence_parallel_size, int) \
            or sequence_parallel_size < 1:
        raise ValueError(f"sequence_parallel_size={sequence_parallel_size!r} is invalid: use an integer >= 1")
    if isinstance(tiled_mlp_tokens, bool) or not isinstance(tiled_mlp_tokens, int) or tiled_mlp_tokens < 0:
        raise ValueError(f"tiled_mlp_tokens={tiled_mlp_tokens!r} is invalid: use the tokens per MLP tile (e.g. 8192), "
                         "or 0 to leave the MLP untiled")
    if isinstance(optimizer_or_kwargs, SuperOffloadOptimizer):  # before the model is placed: nothing changed yet
        refuse_other_model(optimizer_or_kwargs, model, "prepare_superoffload")
    if not getattr(model, "_is_accelerate_prepared", False):
        # several processes: the optimizer reduces gradients itself (sharded offload), so no DDP wrapper;
        # evaluation_mode is accelerate's switch for "device placement and autocast only". A built optimizer in
        # weight-flow mode holds the weights on the host: the model must not be moved again.
        flow = (isinstance(optimizer_or_kwargs, SuperOffloadOptimizer) and optimizer_or_kwargs.planned
                and optimizer_or_kwargs.plan.weight_mode.value == "flow")
        model = accelerator.prepare_model(model, device_placement=False if flow else None, evaluation_mode=True)
        # [Note: no fp32 copy of the logits] in _common.py: a training forward given labels computes its own loss
        training_outputs_in_model_dtype(model, loss_inside_the_model)
    base = accelerator.unwrap_model(model)
    if tiled_mlp_tokens:
        from ..sequence_parallel import enable_tiled_mlp

        enable_tiled_mlp(base, tile_tokens=tiled_mlp_tokens)
    if isinstance(optimizer_or_kwargs, SuperOffloadOptimizer):
        opt = optimizer_or_kwargs
        if opt.device != _param_device(base):
            raise ValueError(
                f"the SuperOffloadOptimizer was built on {opt.device} but the model is on "
                f"{_param_device(base)}: pass keyword arguments instead (prepare_superoffload builds it after "
                "placing the model), or move the model to accelerator.device before building it."
            )
        if sequence_parallel_size > 1:
            from ._sequence_parallel import setup_sequence_parallel

            groups = setup_sequence_parallel(base, sequence_parallel_size)
            comm = opt.comm
            if comm is None or comm.grad_divisor != groups.dp_size:
                raise ValueError(f"with sequence_parallel_size={sequence_parallel_size} the optimizer must average over "
                                 f"the {groups.dp_size} data-parallel replica(s) only: build it with "
                                 f"gradient_divisor={groups.dp_size}, or pass keyword arguments instead")
    else:
        kwargs = _optimizer_kwargs(optimizer_or_kwargs)
        config = (plugin or SuperOffloadPlugin()).to_config()
        if sequence_parallel_size > 1:
            from ._sequence_parallel import setup_sequence_parallel

            groups = setup_sequence_parallel(base, sequence_parallel_size)
            kwargs.setdefault("gradient_divisor", groups.dp_size)  # SP ranks' partial gradients are summed
        opt = SuperOffloadOptimizer(base, config=config, log_plan=False, **kwargs)
    opt.set_sync_predicate(lambda: accelerator.sync_gradients, micro_batches=accelerator.gradient_accumulation_steps)
    warn_if_threads_throttled(opt)
    wrapped = SuperOffloadAcceleratedOptimizer(opt)
    accelerator.prepare_optimizer(wrapped)  # pre-marked: registered for save_state/load_state, not moved
    _route_clipping(accelerator, wrapped)
    _bounded_checkpoints(accelerator, base)
    if opt.comm is not None:
        _checkpoint_shards(accelerator, opt)
    from .. import ops

    def log_plan(plan: OffloadPlan) -> None:
        if accelerator.is_main_process:  # shown without logging set up, as the Trainer shows it
            show_plan(f"{plan.summary()}\n  CPU Adam backend: {ops.backend()}")

    if opt.planned:
        log_plan(opt.plan)
    else:  # [Note: workload from the first batch]: planned at the first training forward
        opt.plan_listeners.append(log_plan)
    if accelerator.is_main_process:  # [Note: calibration from the measured peak]: once, where the plan was shown
        opt.calibration_listeners.append(show_plan)
    return model, wrapped


def _check_accelerator(accelerator: Any) -> None:
    dt = accelerator.distributed_type
    if dt in (DistributedType.DEEPSPEED, DistributedType.FSDP, DistributedType.MEGATRON_LM):
        raise ValueError(f"prepare_superoffload: distributed_type={dt.value} owns the optimizer and gradients; use an "
                         "accelerate config with distributed_type: NO (e.g. hf_superoffload's configs/single_gpu.yaml)")
    if accelerator.mixed_precision == "fp16":
        raise ValueError("prepare_superoffload: mixed_precision fp16 needs loss scaling, which SuperOffload does not do; "
                         "use mixed_precision bf16 (or no) in the accelerate config")


def _param_device(model: torch.nn.Module) -> torch.device:
    p = next((p for p in model.parameters() if p.requires_grad), None)
    return p.device if p is not None else torch.device("cpu")


def _optimizer_kwargs(spec: Any) -> dict[str, Any]:
    if spec is None:
        return {}
    if isinstance(spec, Mapping):
        return dict(spec)
    if type(spec) is torch.optim.AdamW:
        if spec.state:
            raise ValueError("prepare_superoffload: the torch AdamW has already stepped; its state cannot seed the "
                             "offloaded optimizer. Pass it before training, or pass keyword arguments.")
        d = spec.defaults
        for flag in ("amsgrad", "maximize"):
            if d.get(flag) or any(g.get(flag) for g in spec.param_groups):
                raise ValueError(f"prepare_superoffload: AdamW({flag}=True) is not supported by SuperOffloadOptimizer")
        keep = ("params", "lr", "betas", "eps", "weight_decay")
        groups = [{k: v for k, v in g.items() if k in keep} for g in spec.param_groups]
        lr = d["lr"].item() if isinstance(d["lr"], torch.Tensor) else d["lr"]
        return {"params": groups, "lr": lr, "betas": tuple(d["betas"]), "eps": d["eps"],
                "weight_decay": d["weight_decay"]}
    if find_superoffload_optimizer(spec) is not None:
        raise TypeError("prepare_superoffload: pass the SuperOffloadOptimizer itself, not an accelerate-wrapped one")
    raise TypeError(f"prepare_superoffload: cannot use a {type(spec).__name__}; pass SuperOffloadOptimizer keyword "
                    "arguments (dict), a SuperOffloadOptimizer, or a fresh torch.optim.AdamW")


def _checkpoint_shards(accelerator: Any, opt: SuperOffloadOptimizer) -> None:
    """Data parallel: ``save_state`` writes every rank's optimizer shard (``optimizer_rank{r}.pt``) through a save
    hook (accelerate itself writes ``optimizer.bin`` on the main process only); ``load_state`` reads this rank's back
    when the plan already has their layout, else merges them (``read_optimizer_state``: another number of ranks,
    another layout, or a plan that waits for the first batch)."""

    def save_hook(models: Any, weights: Any, output_dir: str) -> None:
        save_optimizer_state(opt, output_dir, "superoffload_optimizer.pt")

    def load_hook(models: Any, input_dir: str) -> None:
        remove_stale_temp_files(input_dir)  # partial shards of a save into this folder that was interrupted
        path, state = read_optimizer_state(opt, input_dir, "superoffload_optimizer.pt")
        if state is None:
            raise ValueError(f"{input_dir} holds no SuperOffload optimizer shards ({path}); it was not saved by a "
                             "data-parallel SuperOffload run")
        try:
            opt.load_state_dict(state)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from e

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)


MODEL_FILES = "superoffload_model{suffix}.safetensors"
"""``save_state``'s model shards when the model is larger than one ([Note: bounded model shards]); a smaller model
stays accelerate's own ``model.safetensors``. Another name than accelerate's: it numbers its models' files by
position, and a second prepared model would take ``model.safetensors``."""


def _model_files_mismatch(base: torch.nn.Module, input_dir: str) -> str | None:
    """Why the ``MODEL_FILES`` shards in ``input_dir`` cannot load into ``base`` (names and shapes from the files'
    headers, nothing read or copied), or ``None``. A name the files lack is fine when it shares its tensor with one
    they hold (tied weights are written once)."""
    import json

    from safetensors import safe_open

    stem = MODEL_FILES.format(suffix="")
    try:
        index = os.path.join(input_dir, stem + ".index.json")
        if os.path.isfile(index):
            with open(index, encoding="utf-8") as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        else:
            files = [stem]
        shapes: dict[str, list[int]] = {}
        for name in files:
            with safe_open(os.path.join(input_dir, name), framework="pt") as f:
                for k in f.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                    shapes[k] = list(f.get_slice(k).get_shape())
    except Exception as e:  # a missing or damaged shard, an index that is not one
        return f"its model files cannot be read ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    held = base.state_dict()
    unexpected = [k for k in shapes if k not in held]
    wrong = [f"{k} is {shapes[k]} there and {list(held[k].shape)} here" for k in shapes
             if k in held and shapes[k] != list(held[k].shape)]
    present = {held[k].data_ptr() for k in shapes if k in held}
    missing = [k for k in held if k not in shapes and held[k].data_ptr() not in present]
    if wrong:
        return f"it holds the weights of another model ({wrong[0]})"
    if unexpected or missing:
        return f"it holds the weights of another model (missing {missing[:3]}, unexpected {unexpected[:3]})"
    return None


def _bounded_checkpoints(accelerator: Any, base: torch.nn.Module) -> None:
    """[Note: bounded model shards] for a custom loop, on this accelerator instance only: ``save_state`` and
    ``save_model`` stream their safetensors files (``streamed_model_files``); ``save_state`` writes a model larger
    than ``MODEL_SHARD_SIZE`` in shards of at most that (accelerate writes one file, which its ``load_state`` reads
    into RAM whole) and ``load_state`` reads them back mapped; ``save_model`` defaults to that shard size
    (accelerate's is 10 GB); ``load_state`` maps the files it reads (``load_kwargs={"mmap": True}``, unless
    given) instead of reading the optimizer state into RAM beside the live host arenas. A folder saved before
    (``model.safetensors``) still loads through accelerate. One model per accelerator: a second
    ``prepare_superoffload`` on it leaves that model to accelerate's own files."""
    if getattr(accelerator, "_superoffload_bounded", False):
        return
    accelerator._superoffload_bounded = True

    def ours(models: list[Any]) -> int | None:
        return next((i for i, m in enumerate(models) if accelerator.unwrap_model(m) is base), None)

    def save_hook(models: list[Any], weights: list[Any], output_dir: str) -> None:
        from huggingface_hub import save_torch_state_dict
        from huggingface_hub.serialization._base import parse_size_to_int

        i = ours(models)
        if i is None or len(weights) != len(models):  # another hook took some: positions no longer match
            return
        state = base.state_dict()  # once, on every rank (its pre-hook synchronizes the optimizer)
        held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in state.values()}
        if sum(held.values()) <= parse_size_to_int(MODEL_SHARD_SIZE):
            return  # one shard's worth: accelerate's own file, as it always writes it
        each_node = getattr(accelerator.project_configuration, "save_on_each_node", False)
        if accelerator.is_local_main_process if each_node else accelerator.is_main_process:
            save_torch_state_dict(state, output_dir, filename_pattern=MODEL_FILES, max_shard_size=MODEL_SHARD_SIZE)
        del weights[i]  # accelerate writes the other models (and none of this one)

    def load_hook(models: list[Any], input_dir: str) -> None:
        i = ours(models)
        names = (MODEL_FILES.format(suffix=""), MODEL_FILES.format(suffix="") + ".index.json")
        if i is None or not any(os.path.isfile(os.path.join(input_dir, n)) for n in names):
            return
        from huggingface_hub import load_torch_model

        why = _model_files_mismatch(base, input_dir)  # before anything is copied: a refusal leaves the model as it was
        if why is not None:
            raise ValueError(f"{input_dir} cannot be loaded into this model: {why}. Load it into the model that "
                             "saved it")
        load_torch_model(base, input_dir, strict=False, filename_pattern=MODEL_FILES, mmap=True)
        del models[i]  # loaded: accelerate loads the others

    save_model, save_state, load_state = accelerator.save_model, accelerator.save_state, accelerator.load_state

    def bounded_save_model(model: torch.nn.Module, save_directory: Any, max_shard_size: int | str = MODEL_SHARD_SIZE,
                           **kwargs: Any) -> Any:
        with streamed_model_files():
            return save_model(model, save_directory, max_shard_size=max_shard_size, **kwargs)

    def streamed_save_state(*args: Any, **kwargs: Any) -> Any:
        with streamed_model_files():
            return save_state(*args, **kwargs)

    def mapped_load_state(input_dir: str | None = None, load_kwargs: dict[str, Any] | None = None,
                          **load_model_func_kwargs: Any) -> Any:
        return load_state(input_dir, load_kwargs={"mmap": True, **(load_kwargs or {})}, **load_model_func_kwargs)

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)
    accelerator.save_model = bounded_save_model
    accelerator.save_state = streamed_save_state
    accelerator.load_state = mapped_load_state


def _route_clipping(accelerator: Any, wrapped: SuperOffloadAcceleratedOptimizer) -> None:
    """Make ``accelerator.clip_grad_norm_`` report (not apply) clipping for our parameters (instance only)."""
    original = accelerator.clip_grad_norm_
    ours = {id(p) for g in wrapped.superoffload.param_groups for p in g["params"]}
    warned = [False]

    def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2) -> torch.Tensor:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if not any(id(p) in ours for p in params):
            return original(params, max_norm, norm_type=norm_type)
        if float(norm_type) != 2.0:
            raise ValueError("SuperOffloadOptimizer clips by the global L2 norm only (norm_type=2)")
        opt = wrapped.superoffload
        if max_norm is not None and math.isfinite(max_norm) and max_norm > 0:
            if opt.max_grad_norm not in (None, max_norm) and not warned[0]:
                warned[0] = True
                logger.warning("accelerator.clip_grad_norm_(max_norm=%s) replaces the optimizer's max_grad_norm=%s",
                               max_norm, opt.max_grad_norm, main_process_only=True)
            opt.max_grad_norm = float(max_norm)
        return wrapped.deferred_grad_norm()

    accelerator.clip_grad_norm_ = clip_grad_norm_
