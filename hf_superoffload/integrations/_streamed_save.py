"""Model files written a piece at a time ([Note: bounded model shards] in ``_common.py``).

safetensors' ``save_file`` copies every GPU tensor of a file to the host before it writes any: a whole shard, and
a tensor larger than the shard (an 8B embedding, 1.05 GB; a 14B LM head, 1.56 GB) whole. ``save_file_streamed``
writes the same format (an 8-byte header length, the JSON header padded with spaces to 8 bytes, the tensors'
bytes back to back, larger elements first so that each stays aligned, then by name), copying ``CHUNK_BYTES`` of a
tensor to the host at a time. ``streamed_model_files`` routes the writers our model saves go through to it:
transformers' ``save_pretrained`` (``modeling_utils.safe_save_file``), huggingface_hub's ``save_torch_state_dict``
(``safetensors.torch.save_file``, imported at each call) and accelerate's ``save`` (``utils.other.safe_save_file``);
where a library no longer has that name, its saves stay safetensors' own, bounded by the shard size alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from collections.abc import Iterator
from typing import Any

import torch

from ..runtime.host_memory import CHECKPOINT_PIECE_BYTES

__all__ = ["CHUNK_BYTES", "save_file_streamed", "streamed_model_files"]

CHUNK_BYTES = CHECKPOINT_PIECE_BYTES
"""Bytes of a tensor copied to the host at a time."""

_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


def save_file_streamed(tensors: dict[str, torch.Tensor], filename: str | os.PathLike[str],
                       metadata: dict[str, str] | None = None) -> None:
    """``safetensors.torch.save_file(tensors, filename, metadata)``, holding at most ``CHUNK_BYTES`` of a GPU tensor
    on the host at a time."""
    order = sorted(tensors.items(), key=lambda kv: (-kv[1].element_size(), kv[0]))
    header: dict[str, Any] = {}
    offset = 0
    for name, t in order:
        if t.dtype not in _DTYPES:
            raise ValueError(f"cannot write {name}: dtype {t.dtype} has no safetensors name here")
        if not t.is_contiguous():
            raise ValueError(f"cannot write {name}: it is not contiguous (call .contiguous() on it before saving)")
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    if metadata:
        header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(filename, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, t in order:
            flat = t.detach().reshape(-1).view(torch.uint8)
            for at in range(0, flat.numel(), CHUNK_BYTES):
                f.write(memoryview(flat[at : at + CHUNK_BYTES].cpu().numpy()))


def _route(*args: Any, **kwargs: Any) -> None:
    save_file_streamed(*args, **kwargs)


@contextlib.contextmanager
def streamed_model_files() -> Iterator[None]:
    """While it lasts, the safetensors writers of ``save_pretrained`` (transformers), ``save_torch_state_dict``
    (huggingface_hub) and ``save_state``/``save_model`` (accelerate) are :func:`save_file_streamed` (saves run on
    the training thread; a writer a library no longer has is left alone)."""
    import importlib

    targets = [("safetensors.torch", "save_file"), ("transformers.modeling_utils", "safe_save_file"),
               ("accelerate.utils.other", "safe_save_file")]
    saved = []
    for module_name, attr in targets:
        module = importlib.import_module(module_name)
        if hasattr(module, attr):
            saved.append((module, attr, getattr(module, attr)))
    try:
        for module, attr, _ in saved:
            setattr(module, attr, _route)
        yield
    finally:
        for module, attr, original in saved:
            setattr(module, attr, original)
