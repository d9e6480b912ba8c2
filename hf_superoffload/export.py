"""Export the fp32 master weights of a checkpoint as a ``from_pretrained``-loadable model.

The model files a checkpoint holds are the bf16 weights the GPU computes with; the exact fp32 values live in the
optimizer state (the host masters, and the GPU-resident tail's, saved in pieces). This rebuilds every trained
parameter from those masters by its model name and writes safetensors next to the checkpoint's ``config.json``
(and tokenizer files), so ``AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)`` gives the masters bit
for bit (DeepSpeed users know this as ``zero_to_fp32``).

Sources read from ``checkpoint_dir``: the optimizer state (``optimizer.pt`` of ``SuperOffloadTrainer``, every
``optimizer_rank{r}.pt`` of a data-parallel run, merged; or ``optimizer.bin`` of ``accelerator.save_state``); the
model config (``config.json``, or ``config=`` for folders without one, such as ``save_state``'s); the model weights
file, only for parameters the optimizer did not train (frozen ones). Tied parameters (``tie_word_embeddings``) are
written once and tied again by ``from_pretrained``.

Usage: ``hf-superoffload export CHECKPOINT OUT [--dtype fp32|bf16]`` or :func:`export_checkpoint`.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
from typing import Any

import torch

__all__ = ["ExportError", "add_export_parser", "export_checkpoint"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# files copied next to the exported weights when the checkpoint (or the config source) has them
_COPIED = re.compile(r"(tokenizer.*|special_tokens_map\.json|added_tokens\.json|vocab\..*|merges\.txt|.*\.model|"
                     r"chat_template\..*|generation_config\.json)")


class ExportError(ValueError):
    """A checkpoint that cannot be exported, with what to do instead (one line)."""


def export_checkpoint(checkpoint_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], *,
                      dtype: str | torch.dtype = "fp32", config: str | None = None,
                      max_shard_size: str | int = "5GB") -> str:
    """Write the fp32 masters of ``checkpoint_dir`` (a ``checkpoint-N`` folder) to ``out_dir`` as a model that
    ``AutoModelForCausalLM.from_pretrained(out_dir)`` loads; returns ``out_dir``.

    Args:
        checkpoint_dir: a folder holding SuperOffload optimizer state (see the module docstring).
        out_dir: where the model goes (created; existing model files in it are replaced).
        dtype: ``"fp32"`` (the masters, exact) or ``"bf16"`` (each master rounded to bf16, as the training step does).
        config: a model folder or hub id whose ``config.json`` (and tokenizer) describe the model, for checkpoint
            folders that have none (``accelerator.save_state``); default: ``checkpoint_dir``.
        max_shard_size: largest safetensors file before the weights are split into shards with an index.

    Raises:
        ExportError: no such folder, no optimizer state in it, no config, or a state that does not match the model.
    """
    from huggingface_hub import save_torch_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM

    ckpt, out = os.fspath(checkpoint_dir), os.fspath(out_dir)
    want = _DTYPES.get(dtype) if isinstance(dtype, str) else dtype
    if want not in _DTYPES.values():
        raise ExportError(f"dtype={dtype!r} is not supported: use 'fp32' or 'bf16'")
    if not os.path.isdir(ckpt):
        raise ExportError(f"{ckpt} is not a folder: give a checkpoint folder such as output_dir/checkpoint-500")
    if os.path.abspath(out) == os.path.abspath(ckpt):
        raise ExportError(f"the output folder is the checkpoint folder ({ckpt}): give another folder")
    sd = _read_state(ckpt)
    config_src = config or ckpt
    try:
        model_config = AutoConfig.from_pretrained(config_src)
    except (OSError, ValueError) as e:
        where = "pass config= (--config) naming the model folder or hub id it was trained from" if config is None \
            else "give a model folder or hub id that holds config.json"
        raise ExportError(f"no model config in {config_src} ({type(e).__name__}): {where}") from None
    with torch.device("meta"):  # only the names, shapes and ties: nothing is allocated
        skeleton = AutoModelForCausalLM.from_config(model_config)
    expected = skeleton.state_dict()
    ties: dict[int, list[str]] = {}
    for name, p in skeleton.named_parameters(remove_duplicate=False):
        ties.setdefault(id(p), []).append(name)
    tied_to = {n: names for names in ties.values() for n in names}

    state = _masters(sd, want)
    unknown = [n for n in state if n not in expected]
    if unknown:
        raise ExportError(f"the checkpoint trained parameter {unknown[0]} ({len(unknown)} in all), which the model "
                          f"built from {config_src}/config.json does not have: export covers full models trained "
                          "directly (merge PEFT adapters with merge_and_unload and save_pretrained instead)")
    for n, t in list(state.items()):
        if list(t.shape) != list(expected[n].shape):
            raise ExportError(f"parameter {n} has shape {list(t.shape)} in the checkpoint and {list(expected[n].shape)} "
                              f"in {config_src}/config.json: give the config of the model that was trained")
        for other in tied_to.get(n, [n]):
            state[other] = t  # one tensor under every tied name: written once, tied again on load
    rest = [n for n in expected if n not in state]
    if rest:  # parameters the optimizer did not train (frozen), and persistent buffers: from the model files
        weights = _read_weights(ckpt, rest)
        missing = [n for n in rest if n not in weights]
        if missing:
            raise ExportError(f"{missing[0]} ({len(missing)} in all) is neither trained by the optimizer nor in the "
                              f"model files of {ckpt}: export a checkpoint saved with its model weights")
        state.update({n: (t.to(want) if t.is_floating_point() else t) for n, t in weights.items()})

    os.makedirs(out, exist_ok=True)
    for f in os.listdir(out):  # stale weights of an earlier export would be loaded alongside the new ones
        if re.fullmatch(r"model(-\d+-of-\d+)?\.safetensors(\.index\.json)?|pytorch_model.*\.bin(\.index\.json)?", f):
            os.remove(os.path.join(out, f))
    # each tie group is written under its first name (what save_pretrained keeps); from_pretrained ties the others
    discard = [n for names in ties.values() if len(names) > 1 for n in names[1:] if n in state]
    save_torch_state_dict(state, out, max_shard_size=max_shard_size, metadata={"format": "pt"},
                          shared_tensors_to_discard=discard or None)
    model_config.torch_dtype = want  # what from_pretrained(dtype="auto") gives
    model_config.save_pretrained(out)
    for src in dict.fromkeys((ckpt, config_src)):
        if os.path.isdir(src):
            for f in os.listdir(src):
                if _COPIED.fullmatch(f) and not os.path.exists(os.path.join(out, f)):
                    shutil.copy2(os.path.join(src, f), os.path.join(out, f))
    return out


def _read_state(folder: str) -> dict[str, Any]:
    """The single-process SuperOffload state of ``folder``: its ``optimizer.pt``/``optimizer.bin``, or every rank's
    shard merged."""
    from .integrations._common import _load_state_file
    from .state import consolidate_state_dicts

    shards = sorted(f for f in os.listdir(folder) if re.fullmatch(r"optimizer_rank\d+\.pt", f))
    if shards:
        states = [_load_state_file(os.path.join(folder, f)) for f in shards]
        parts = [s.get("superoffload") if isinstance(s, dict) else None for s in states]
        if any(p is None for p in parts):
            raise ExportError(f"{folder}: an optimizer_rank*.pt holds no SuperOffload state; the checkpoint is damaged")
        try:
            return consolidate_state_dicts(parts)  # type: ignore[arg-type]
        except ValueError as e:
            raise ExportError(f"{folder}: cannot merge the {len(shards)} optimizer shards: {e}") from None
    for name in ("optimizer.pt", "optimizer.bin", "superoffload_optimizer.pt"):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            try:
                state = _load_state_file(path)
            except ValueError as e:
                raise ExportError(str(e)) from None
            if not isinstance(state, dict) or "superoffload" not in state:
                raise ExportError(f"{path} was not written by SuperOffloadOptimizer (no 'superoffload' entry): "
                                  "its masters are not there to export")
            sd = state["superoffload"]
            if sd.get("sharding"):
                raise ExportError(f"{path} is the shard of one data-parallel rank: put every rank's "
                                  "optimizer_rank*.pt in the folder and export that")
            return sd  # type: ignore[no-any-return]
    raise ExportError(f"{folder} holds no SuperOffload optimizer state (optimizer.pt, optimizer_rank*.pt or "
                      "optimizer.bin): export a checkpoint-N folder saved with the optimizer (not save_only_model)")


def _masters(sd: dict[str, Any], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every trained parameter's master by model name, checked against the arenas' checksums first."""
    from .planning.plan import Placement
    from .state import _READABLE, _check_flat, _check_integrity, _read

    if sd.get("format") not in _READABLE:
        raise ExportError(f"unknown optimizer state format {sd.get('format')!r} (this version reads "
                          f"{' and '.join(_READABLE)}): export it with the hf_superoffload version that wrote it")
    names = sd.get("names")
    if not names:
        raise ExportError("this optimizer state was written before parameter names were saved: resume it with this "
                          "version and save a new checkpoint, then export that")
    manifest = sd.get("manifest") or {}
    for side in ("host", "device"):
        t = sd[side]["master"]
        try:
            _check_flat(side, "master", t)
            _check_integrity(side, "master", t, manifest.get(f"{side}/master"), sd, list(names))
        except ValueError as e:
            raise ExportError(str(e)) from None
    out: dict[str, torch.Tensor] = {}
    for name, numel, shape, (pl, off) in zip(names, sd["numels"], sd["shapes"], sd["locations"]):
        side = "host" if Placement(pl) is Placement.HOST else "device"
        flat = _read(sd[side]["master"], off, off + numel)
        # a clone: the exported tensor must not keep the whole arena alive (safetensors writes each one's storage)
        out[name] = flat.view(shape).to(dtype, copy=True)
    return out


def _read_weights(folder: str, names: list[str]) -> dict[str, torch.Tensor]:
    """``names`` from the model files of ``folder`` (safetensors, single or sharded; those absent are left out)."""
    import json

    from safetensors import safe_open

    files: dict[str, list[str]] = {}
    for stem in ("superoffload_model", "model"):  # prepare_superoffload's save_state's (its model.safetensors may
        # then hold another model of that accelerator); save_pretrained's
        index = os.path.join(folder, f"{stem}.safetensors.index.json")
        if os.path.isfile(index):
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            for n in names:
                if n in weight_map:
                    files.setdefault(weight_map[n], []).append(n)
            break
        if os.path.isfile(os.path.join(folder, f"{stem}.safetensors")):
            files[f"{stem}.safetensors"] = names
            break
    found: dict[str, torch.Tensor] = {}
    for file, wanted in files.items():
        with safe_open(os.path.join(folder, file), framework="pt") as f:
            keys = set(f.keys())
            found.update({n: f.get_tensor(n) for n in wanted if n in keys})
    return found


# ---- command line -----------------------------------------------------------------------------------------
def add_export_parser(sub: Any) -> None:
    """Register ``hf-superoffload export`` on the CLI's subparsers."""
    from ._cli_args import existing_folder

    e = sub.add_parser("export", help="write a from_pretrained-loadable model from a checkpoint's fp32 masters")
    e.add_argument("checkpoint", type=existing_folder, metavar="CHECKPOINT",
                   help="a checkpoint folder (checkpoint-N) holding SuperOffload optimizer state")
    e.add_argument("out", metavar="OUT", help="output folder (created)")
    e.add_argument("--dtype", choices=tuple(_DTYPES), default="fp32", help="fp32: the masters exactly; bf16: rounded")
    e.add_argument("--config", default=None, help="model folder or hub id with config.json, for checkpoint folders "
                   "without one (accelerate save_state)")
    e.set_defaults(func=_export_command)


def _export_command(args: argparse.Namespace) -> int:
    try:
        out = export_checkpoint(args.checkpoint, args.out, dtype=args.dtype, config=args.config)
    except ExportError as e:
        print(f"hf-superoffload export: error: argument CHECKPOINT: {e}", file=sys.stderr)
        return 2
    print(f"exported the {args.dtype} masters of {args.checkpoint} to {out}")
    return 0
